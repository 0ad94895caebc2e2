"""``lrattn-analyze``: the CLI on a freshly trained checkpoint, one-line errors, and the
statistics against direct computations (zero queries give uniform reads; a hand-set query
matches the softmax written out from the recorded sub-layer outputs)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from helpers import (BATCH, SEQ, build_gpt, cli_env, finish, model_parallel_1x1, tiny_batch,
                     tiny_config)

SMALL = [
    "--seq-length", "32", "--hidden-size", "64", "--num-layers", "2", "--num-blocks", "3",
    "--ffn-hidden-size", "128", "--global-batch-size", "4", "--micro-batch-size", "2",
    "--eval-interval", "2", "--eval-iters", "1", "--lr-warmup-iters", "1", "--no-progress",
    "--train-iters", "2",
]


def _start(module, args, cache_dir, cwd):
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=cli_env(cache_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


BAD = {
    "no-such-dir": (["{tmp}/nowhere"], "is not a directory"),
    "no-checkpoint": (["{tmp}"], "latest"),
    "zero-batches": (["{tmp}", "--num-batches", "0"], "--num-batches 0"),
    "bad-split": (["{tmp}", "--split", "dev"], "--split"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, new_cache):
    """Bad-input runs (started first, they need no data), then a 2-step training run and
    the analysis of its checkpoint."""
    work = tmp_path_factory.mktemp("analyze")
    cache = new_cache(work / "cache")
    (work / "empty").mkdir()
    bad = {}
    for name, (args, _) in BAD.items():
        args = [a.replace("{tmp}", str(work / "empty")) for a in args]
        bad[name] = _start("megatron_lrattn.cli.analyze", [*args, "--out", str(work / name)],
                           cache, work)
    ckpt = work / "ckpt"
    rc, out, err = finish(_start("megatron_lrattn.cli.pretrain",
                                  [*SMALL, "--save", str(ckpt), "--cache-dir", str(cache)],
                                  cache, work))
    assert rc == 0, err[-4000:]
    good = _start("megatron_lrattn.cli.analyze",
                  [str(ckpt), "--out", str(work / "out"), "--num-batches", "2"], cache, work)
    return work, {k: finish(p) for k, p in bad.items()}, finish(good)


@pytest.mark.slow
def test_cli_writes_json_and_plots(runs):
    work, _, (rc, out, err) = runs
    assert rc == 0, err[-4000:]
    assert "Traceback" not in out + err
    assert "effective sources per site" in out
    report = json.loads((work / "out" / "analysis.json").read_text())
    assert report["iteration"] == 2 and report["num_batches"] == 2
    assert report["data"] == {"split": "valid", "num_batches": 2, "micro_batch_size": 2,
                              "seq_length": 32}
    assert report["tokens"] == 2 * 2 * 32 and math.isfinite(report["loss"])
    routing = report["routing"]
    # L=2, N=3: block ends 2, 3, 4 (ceil(4k/3)).
    assert routing["sites"] == [1, 2, 3, 4] and routing["block_ends"] == [2, 3, 4]
    assert routing["num_sources"] == [2, 2, 3, 4]
    assert routing["source_labels"] == [["v0", "P[1:1]"], ["v0", "B1"], ["v0", "B1", "B2"],
                                        ["v0", "B1", "B2", "B3"]]
    assert len(routing["mean_weights"]) == 4
    for row, s, eff in zip(routing["mean_weights"], routing["num_sources"],
                           routing["effective_sources"]):
        assert len(row) == 4 and row[s:] == [None] * (4 - s)
        assert sum(row[:s]) == pytest.approx(1.0, abs=1e-9)
        assert 1.0 <= eff <= s + 1e-9
    sub = report["sublayers"]
    assert sub["index"] == [1, 2, 3, 4] and sub["kind"] == ["attention", "mlp"] * 2
    for key in ("output_rms", "output_grad_norm", "param_grad_norm"):
        assert len(sub[key]) == 4 and all(v > 0 and math.isfinite(v) for v in sub[key]), key
    assert len(report["layers"]["param_grad_norm"]) == 2
    assert len(report["query_grad_norm"]) == 4
    assert {"embedding", "output_layer", "final_layernorm"} <= set(report["other_param_grad_norm"])
    for name in ("depth_weights", "effective_sources", "output_rms", "grad_norms"):
        png = work / "out" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_one_line_error(runs, name):
    _, bad, _ = runs
    rc, out, err = bad[name]
    assert rc == 2, err[-3000:]
    assert "Traceback" not in out + err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lrattn-analyze: error: ") and BAD[name][1] in last, last


@pytest.fixture(scope="module")
def mp():
    with model_parallel_1x1():
        yield


def _batches(n=2):
    out = []
    for seed in range(n):
        tokens, pos, labels = tiny_batch(seed)
        out.append({"tokens": tokens, "labels": labels, "position_ids": pos,
                    "loss_mask": torch.ones(BATCH, SEQ)})
    return out


DEPTH_CASES = {
    "sliced": dict(residual="lr_attnres", key_type="sliced", key_rank=8, num_blocks=3),
    "projected": dict(residual="lr_attnres", key_type="projected", key_rank=8, num_blocks=3),
    "attnres-full": dict(residual="attnres", num_blocks=4),
}


@pytest.mark.parametrize("case", sorted(DEPTH_CASES))
def test_zero_queries_read_uniformly(mp, case):
    from megatron_lrattn.analysis.routing import analyze_model

    config = tiny_config(**DEPTH_CASES[case])
    model = build_gpt(config)
    report = analyze_model(model, config, _batches())
    routing = report["routing"]
    for s, eff, row in zip(routing["num_sources"], routing["effective_sources"],
                           routing["mean_weights"]):
        assert eff == pytest.approx(s, rel=1e-12, abs=0)
        assert row[:s] == pytest.approx([1.0 / s] * s, rel=1e-12, abs=0)
        assert all(v is None for v in row[s:])


def _direct(records, config, sites_query, eps, scale):
    """Mean weights and mean exp(entropy) per site, written out from the sub-layer outputs
    (float64) with the schedule's block structure."""
    from megatron_lrattn.depth.schedule import schedule_from_config

    sched = schedule_from_config(config)
    r = config.key_rank
    weights, eff = {}, {}
    for emb, emb_key, outs in records:
        for j in range(1, sched.num_sites + 1):
            site = sched.site(j)
            members = [list(range(sched.block_start(k), sched.block_ends[k - 1] + 1))
                       for k in range(1, site.num_completed + 1)]
            if site.partial:
                members.append(list(range(site.partial[0], site.partial[1] + 1)))
            vals = [emb] + [sum(outs[m - 1][0] for m in ms) for ms in members]
            if config.projected_keys:
                keys = [emb_key] + [sum(outs[m - 1][1] for m in ms) for ms in members]
            else:
                keys = [v[..., -r:] for v in vals]
            k = torch.stack(keys).double().reshape(len(keys), -1, r)
            khat = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
            a = torch.softmax(scale * khat @ sites_query[j].double(), dim=0)  # [S, T]
            h = -(a * a.log()).sum(0)
            weights.setdefault(j, []).append(a)
            eff.setdefault(j, []).append(h.exp())
    return ({j: torch.cat(w, 1).mean(1).tolist() for j, w in weights.items()},
            {j: float(torch.cat(e).mean()) for j, e in eff.items()})


@pytest.mark.parametrize("case", ["sliced", "projected"])
def test_hand_set_queries_match_direct_computation(mp, case, monkeypatch):
    from megatron_lrattn.analysis.routing import analyze_model
    from megatron_lrattn.depth.state import DepthState

    config = tiny_config(**DEPTH_CASES[case], depth_scale=1.5)
    model = build_gpt(config)
    g = torch.Generator().manual_seed(7)
    queries = {}
    with torch.no_grad():
        for name, q in model.decoder.depth_queries.items():
            q.weight.copy_(0.3 * torch.randn(config.key_rank, generator=g))
            q.weight[int(name) % config.key_rank] += 4.0  # one-hot-ish
            queries[int(name)] = q.weight.detach().clone()
    batches = _batches()
    plain_loss = []
    with torch.no_grad():
        for b in batches:  # the loss without any capture
            out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            plain_loss.append(float(out.float().mean()))

    records = []
    original_add = DepthState.add

    def add(self, output, key, closes_block):
        if self.num_sublayers_done == 0:
            records.append((self.embedding.detach(), None if self.embedding_key is None
                            else self.embedding_key.detach(), []))
        records[-1][2].append((output.detach(), None if key is None else key.detach()))
        return original_add(self, output, key, closes_block)

    monkeypatch.setattr(DepthState, "add", add)
    report = analyze_model(model, config, batches)
    assert report["loss"] == pytest.approx(sum(plain_loss) / len(plain_loss), rel=1e-6)
    weights, eff = _direct(records, config, queries, config.key_norm_eps, config.depth_scale)
    routing = report["routing"]
    assert max(routing["effective_sources"]) > 1.0
    for j, s, row, e in zip(routing["sites"], routing["num_sources"], routing["mean_weights"],
                            routing["effective_sources"]):
        assert row[:s] == pytest.approx(weights[j], rel=1e-5, abs=1e-7), j
        assert e == pytest.approx(eff[j], rel=1e-5), j
        assert e < s - 0.05, j  # the query concentrates the read


def test_standard_reports_rms_and_grad_norms_only(mp):
    from megatron_lrattn.analysis.routing import STANDARD_NOTE, analyze_model

    config = tiny_config("standard")
    model = build_gpt(config)
    report = analyze_model(model, config, _batches(1))
    assert report["routing"] is None and report["query_grad_norm"] is None
    assert report["note"] == STANDARD_NOTE
    sub = report["sublayers"]
    for key in ("output_rms", "output_grad_norm", "param_grad_norm"):
        assert len(sub[key]) == 4 and all(v > 0 for v in sub[key]), key
    assert all(p.grad is not None for p in model.decoder.layers[0].mlp.parameters())


def test_plots_for_standard_skip_routing(tmp_path, mp):
    from megatron_lrattn.analysis.plots import write_plots
    from megatron_lrattn.analysis.routing import analyze_model

    config = tiny_config("standard")
    report = analyze_model(build_gpt(config), config, _batches(1))
    paths = write_plots(report, str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["grad_norms.png", "output_rms.png"]


def test_heatmap_columns_align_blocks_and_partial():
    from megatron_lrattn.analysis.plots import aligned_weights

    routing = {"num_blocks": 2, "sites": [1, 2],
               "source_labels": [["v0", "P[1:1]"], ["v0", "B1"]],
               "mean_weights": [[0.25, 0.75], [0.5, 0.5]]}
    rows, cols, labels = aligned_weights(routing)
    assert cols == ["v0", "B1", "B2", "P"]
    assert rows[0][0] == 0.25 and rows[0][3] == 0.75 and math.isnan(rows[0][1])
    assert rows[1][:2] == [0.5, 0.5] and math.isnan(rows[1][3])
    assert labels == ["1 P[1:1]", "2"]
