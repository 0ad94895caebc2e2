"""Two-phase block schedule in the model: same losses and gradients as the per-site reads
over several training steps (one process), and under pipeline parallelism (CPU/gloo) where a
depth block starts on an earlier stage; config field and CLI flag."""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import build_gpt, model_parallel_1x1, rel_rms, tiny_batch, tiny_config

STEPS = 3
# (loss, gradient) relative tolerances of the float64 comparisons (float64 so that rounding
# differences are not amplified by the training steps)
LOSS_RTOL, GRAD_RTOL = 1e-12, 1e-9


@pytest.fixture(scope="module")
def mp():
    with model_parallel_1x1():
        yield


def _train(schedule: str, backend: str, mode: str, key: str = "sliced", seed: int = 3,
           dtype=torch.float64, lr: float = 0.1, fuse_norm: bool = True):
    residual = "attnres" if mode == "attnres" else "lr_attnres"
    depth = dict(num_blocks=2, depth_schedule=schedule, depth_backend=backend,
                 fuse_depth_norm=fuse_norm)
    if residual == "lr_attnres":
        depth["key_type"] = key
    model = build_gpt(tiny_config(residual, num_layers=3, **depth), seed=seed).to(dtype)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for q in model.decoder.depth_queries.values():
            q.weight.copy_(torch.randn(q.weight.shape, generator=g) * 2.0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for step in range(STEPS):
        tokens, pos, labels = tiny_batch(step)
        opt.zero_grad()
        loss = model(tokens, pos, None, labels=labels).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads


def _compare(a, b):
    (la, ga), (lb, gb) = a, b
    for x, y in zip(la, lb):
        assert abs(x - y) <= LOSS_RTOL * abs(y), (la, lb)
    for step, (sa, sb) in enumerate(zip(ga, gb)):
        assert sa.keys() == sb.keys()
        for n in sa:
            err = rel_rms(sa[n], sb[n])
            assert err <= GRAD_RTOL, (step, n, err)


@pytest.mark.parametrize("mode,key", [("attnres", "sliced"), ("lr", "sliced"),
                                      ("lr", "projected")])
def test_two_phase_matches_per_site_over_training_steps(mp, mode, key, monkeypatch):
    """L=3, N=2 (block ends 3, 6): phase 1 serves sites 1-2, 3-5 and 6; sites 1, 2, 4 and 5
    merge a partial sum, and sites 2 and 5 form it from the last output in their merge. Every
    merge applies the next sub-layer's RMSNorm itself (the layer's norm module is skipped
    there); with fuse_depth_norm off the norm modules run on the merged reads instead."""
    import megatron_lrattn.depth.state as ds

    calls = {"depth_merge": [], "depth_merge_update": []}
    for name in calls:
        def counted(*args, _op=getattr(ds, name), _log=calls[name], **kwargs):
            _log.append(kwargs.get("norm_weight") is not None)
            return _op(*args, **kwargs)
        monkeypatch.setattr(ds, name, counted)
    per_site = _train("per_site", "torch", mode, key)
    assert not any(calls.values())
    two_phase = _train("two_phase", "torch", mode, key)
    assert calls["depth_merge_update"] == [True] * 2 * STEPS, calls
    assert calls["depth_merge"] == [True] * 2 * STEPS, calls
    _compare(two_phase, per_site)
    calls["depth_merge"].clear()
    unfused = _train("two_phase", "torch", mode, key, fuse_norm=False)
    assert calls["depth_merge"] == [False] * 2 * STEPS, calls
    _compare(unfused, per_site)


def _errors(run, ref):
    """Per step and parameter: relative RMS error of ``run``'s gradient against ``ref``'s."""
    return [{n: rel_rms(g[n], r[n]) for n in r} for g, r in zip(run[1], ref[1])]


def _check_fused_fp32(schedule: str, key: str):
    """``schedule`` through the fused kernels (interpreter on CPU, fp32) against the float64
    per-site reference: losses to 1e-6, and every gradient at every step within 5x (+2e-5)
    of the error the fp32 per-site reference path itself has (training steps amplify fp32
    rounding of small gradients in both paths alike)."""
    f32 = dict(dtype=torch.float32, lr=0.01)
    truth = _train("per_site", "torch", "lr", key, dtype=torch.float64, lr=0.01)
    fused = _train(schedule, "triton", "lr", key, **f32)
    base = _train("per_site", "torch", "lr", key, **f32)
    for x, y in zip(fused[0], truth[0]):
        assert abs(x - y) <= 1e-6 * abs(y), (fused[0], truth[0])
    for step, (ef, eb) in enumerate(zip(_errors(fused, truth), _errors(base, truth))):
        for n in ef:
            assert ef[n] <= 5 * eb[n] + 2e-5, (step, n, ef[n], eb[n])


@pytest.mark.slow
@pytest.mark.parametrize("key", ["sliced", "projected"])
def test_two_phase_triton_kernels_match_per_site_reference(mp, key):
    """The fused phase-1/phase-2 kernels against the float64 per-site reference."""
    pytest.importorskip("triton")
    _check_fused_fp32("two_phase", key)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["token", "source"], ids=["token_tiled", "source_tiled"])
@pytest.mark.parametrize("key", ["sliced", "projected"])
def test_per_site_triton_kernels_match_reference_over_training_steps(mp, key, family):
    """Per-site reads through each fused kernel family in the model over three SGD steps,
    against the float64 reference path."""
    pytest.importorskip("triton")
    from megatron_lrattn.ops import tuning

    with tuning.override(family=family):
        _check_fused_fp32("per_site", key)


def test_auto_schedule_resolution_and_config_errors(mp):
    from megatron_lrattn.model.config import ConfigError
    from megatron_lrattn.depth.state import uses_two_phase

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    # auto: two-phase where the reads run on the fused kernels (CUDA, backend auto/triton)
    # and a block has several read sites (tiny_config: 2 layers, 4 sub-layers)
    assert not uses_two_phase(tiny_config(num_blocks=4), cuda)  # one site per block
    assert uses_two_phase(tiny_config(num_blocks=3), cuda)
    assert not uses_two_phase(tiny_config(num_blocks=2))
    assert not uses_two_phase(tiny_config(num_blocks=2), cpu)
    assert uses_two_phase(tiny_config(num_blocks=2), cuda)
    assert uses_two_phase(tiny_config(num_blocks=2, depth_backend="triton"), cuda)
    assert not uses_two_phase(tiny_config(num_blocks=2, depth_backend="torch"), cuda)
    for dev in (None, cpu, cuda):
        assert uses_two_phase(tiny_config(num_blocks=2, depth_schedule="two_phase"), dev)
        assert not uses_two_phase(tiny_config(num_blocks=2, depth_schedule="per_site"), dev)
    with pytest.raises(ConfigError, match="depth_schedule='blocked' is not allowed: one of "
                                          "auto, per_site, two_phase"):
        tiny_config(num_blocks=2, depth_schedule="blocked")


def test_fusable_norms(mp):
    """Only the local spec's weighted RMSNorm is applied inside the merge; the layer's own
    norm modules are such norms."""
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_lrattn.model.norms import RMSNorm, fusable_rmsnorm

    norm = RMSNorm(8, eps=1e-5)
    weight, eps = fusable_rmsnorm(norm)
    assert weight is norm.weight and eps == 1e-5
    assert fusable_rmsnorm(RMSNorm(8))[1] is None
    assert fusable_rmsnorm(RMSNorm(8, elementwise_affine=False)) is None
    assert fusable_rmsnorm(RMSNorm((2, 4))) is None
    # a plain torch norm would be read past its hooks
    assert fusable_rmsnorm(torch.nn.RMSNorm(8)) is None
    assert fusable_rmsnorm(torch.nn.LayerNorm(8)) is None
    assert fusable_rmsnorm(IdentityOp()) is None
    model = build_gpt(tiny_config(num_blocks=2, depth_schedule="two_phase"))
    layer = model.decoder.layers[0]
    assert fusable_rmsnorm(layer.input_layernorm) is not None
    assert fusable_rmsnorm(layer.pre_mlp_layernorm) is not None
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (8,), norm.weight, 1e-5))


@pytest.mark.parametrize("schedule", ["per_site", "two_phase"])
def test_every_parameter_is_read_after_its_modules_pre_hook(schedule, mp):
    """Each parameter the forward reads is first announced by a forward pre-hook of the
    module that owns it: megatron's DDP waits there for an overlapped parameter all-gather
    (``--overlap-param-gather``), so a parameter read past its module (a depth query, a
    norm gain fused into a merge) could see the previous step's values. The pre-hook here
    replaces the module's parameters with poisoned copies until it runs."""
    torch.manual_seed(0)
    model = build_gpt(tiny_config(num_blocks=2, depth_schedule=schedule))
    for q in model.decoder.depth_queries.values():
        with torch.no_grad():
            q.weight.normal_()
    tokens, position_ids, _ = tiny_batch()
    ref = model(tokens, position_ids, None)
    saved = {}
    handles = []
    for module in model.modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        for name, p in own:
            saved[(id(module), name)] = p.detach().clone()
            with torch.no_grad():
                p.fill_(float("nan"))

        def restore(mod, args, *, names=[n for n, _ in own]):
            with torch.no_grad():
                for n in names:
                    getattr(mod, n).copy_(saved[(id(mod), n)])

        handles.append(module.register_forward_pre_hook(restore))
    out = model(tokens, position_ids, None)
    for h in handles:
        h.remove()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_pretrain_flag():
    from megatron_lrattn.training.arguments import build_parser

    p = build_parser()
    assert p.parse_args([]).fuse_depth_norm is True
    assert p.parse_args(["--no-fuse-depth-norm"]).fuse_depth_norm is False
    assert p.parse_args([]).depth_schedule == "auto"
    assert p.parse_args(["--depth-schedule", "two_phase"]).depth_schedule == "two_phase"
    with pytest.raises(SystemExit):
        p.parse_args(["--depth-schedule", "fast"])


def test_block_sites_of_the_paper_schedule():
    from megatron_lrattn.depth.schedule import depth_schedule

    s = depth_schedule(24, 8)
    assert s.block_sites(0) == (1, 2, 3, 4, 5)
    assert s.block_sites(1) == tuple(range(6, 12))
    assert s.block_sites(8) == (48,)
    for j in range(1, 49):
        assert j in s.block_sites(s.site(j).num_completed)
    with pytest.raises(ValueError, match="num_completed=9"):
        s.block_sites(9)


def _pp_worker(rank: int, world: int, out_dir: str) -> None:
    import test_parallel as tp

    import megatron_lrattn.training.builder as builder

    real = builder.build_config

    def two_phase_config(*a, **kw):
        config = real(*a, **kw)
        config.depth_schedule = os.environ["LRATTN_TEST_SCHEDULE"]
        return config

    builder.build_config = two_phase_config
    tp.MODES = {m: tp.MODES[m] for m in ("lr_sliced", "lr_projected")}
    real_run = tp._run_layout

    def run(mode, t, p, ref, **kw):
        os.environ["LRATTN_TEST_SCHEDULE"] = "per_site" if ref is None else "two_phase"
        return real_run(mode, t, p, ref, **kw)

    tp._run_layout = run
    import megatron_lrattn.depth.state as ds

    calls = {"depth_read_multi": 0, "depth_merge": 0}
    for name in calls:
        def counted(*a, _f=getattr(ds, name), _n=name, **kw):
            calls[_n] += 1
            return _f(*a, **kw)
        setattr(ds, name, counted)
    tp._worker(rank, world, os.path.join(out_dir, "rendezvous"), [(1, 2), (1, 2, "vp2")],
               out_dir)
    with open(os.path.join(out_dir, f"calls{rank}.json"), "w") as f:
        json.dump(calls, f)


@pytest.mark.slow
def test_two_phase_under_pipeline_parallelism_matches_per_site_tp1pp1(tmp_path, monkeypatch):
    """PP=2 (the stage boundary after sub-layer 4 falls inside block 2: the second stage's
    phase 1 covers its own sites of that block only) and PP=2 x 2 virtual stages, both on the
    two-phase path, against the per-site TP1PP1 run: losses and every gradient."""
    import torch.multiprocessing as mproc

    import test_parallel as tp

    mproc.spawn(_pp_worker, args=(2, str(tmp_path)), nprocs=2)
    reports = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}
    print(json.dumps(reports, indent=1))
    for r in range(2):
        calls = json.loads((tmp_path / f"calls{r}.json").read_text())
        assert calls["depth_read_multi"] > 0 and calls["depth_merge"] > 0, (r, calls)
    monkeypatch.setattr(tp, "MODES", {m: tp.MODES[m] for m in ("lr_sliced", "lr_projected")})
    # Two algorithms (per-site reads against phase 1 + merges), each with its own fp32
    # summation order, besides the layout: twice the layout-only bound (measured 1.03e-6).
    monkeypatch.setattr(tp, "GRAD_RTOL", 2 * tp.GRAD_RTOL)
    tp._check(reports, [(1, 2), (1, 2, "vp2")])


# --- bf16 model through megatron's Float16Module and DDP (the training configuration) -----

VOCAB_BF16 = 256


def _bf16_ddp_run(schedule: str, backend: str, residual: str, seq: int, mbs: int,
                  steps: int = 3, nmicro: int = 2, key: str = "sliced"):
    """Train ``steps`` optimizer steps of the tiny preset in bf16 (Float16Module, megatron
    DDP with fp32 main grads, megatron's mixed-precision Adam) from random (non-zero)
    queries; return the losses and every parameter's main_grad of the first step."""
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_lrattn.training.arguments import parse_args
    from megatron_lrattn.training.builder import (build_config, build_model, build_optimizer,
                                                  wrap_model)
    from megatron_lrattn.training.step import loss_func

    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    argv = ["--preset", "tiny", "--residual", residual, "--depth-schedule", schedule,
            "--depth-backend", backend, "--seq-length", str(seq), "--micro-batch-size",
            str(mbs), "--global-batch-size", str(mbs * nmicro), "--bf16",
            "--lr-warmup-iters", "0", "--lr", "3e-3"]
    if residual == "lr_attnres":
        argv += ["--key", key]
    args = parse_args(argv)
    config = build_config(args, bf16=True)
    model = build_model(config, args, VOCAB_BF16)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for q in model.decoder.depth_queries.values():
            q.weight.copy_(torch.randn(q.weight.shape, generator=g) * 0.5)
    params = list(model.named_parameters())
    ddp = wrap_model(model, config, False)
    assert all(p.dtype == torch.bfloat16 for _, p in params)  # Float16Module cast them
    optimizer, scheduler = build_optimizer([ddp], config, args)
    dev = next(ddp.parameters()).device
    gb = torch.Generator().manual_seed(11)

    def batch():
        return {"tokens": torch.randint(0, VOCAB_BF16, (mbs, seq), generator=gb).to(dev),
                "labels": torch.randint(0, VOCAB_BF16, (mbs, seq), generator=gb).to(dev),
                "position_ids": torch.arange(seq).expand(mbs, seq).contiguous().to(dev),
                "loss_mask": torch.ones(mbs, seq, device=dev)}

    def step_fn(it, m):
        b = next(it)
        return m(b["tokens"], b["position_ids"], None, labels=b["labels"]), partial(
            loss_func, b["loss_mask"])

    losses, first_grads = [], None
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=step_fn, data_iterator=iter([batch() for _ in range(nmicro)]),
            model=[ddp], forward_only=False, num_microbatches=nmicro, seq_length=seq,
            micro_batch_size=mbs, decoder_seq_length=seq)
        losses.append(sum(float(x["lm loss"]) for x in out) / nmicro)
        if first_grads is None:
            first_grads = {n: p.main_grad.detach().float().cpu().clone() for n, p in params}
        optimizer.step()
        scheduler.step(increment=1)
    return losses, first_grads


def _compare_bf16(two, per, grad_tol: float, loss_tol: float):
    (lt, gt), (lp, gp) = two, per
    assert gt.keys() == gp.keys()
    queries = [n for n in gp if "depth_queries" in n]
    # bf16 rounding adds about the same absolute error to every query's gradient, so a query
    # whose gradient is small (0.3x the others' with seed 7's weights, model/init.py) is
    # measured against the RMS of all query gradients instead of its own.
    q_rms = torch.cat([gp[n].reshape(-1) for n in queries]).double().pow(2).mean().sqrt()
    errs = {n: rel_rms(gt[n], gp[n], floor=float(q_rms) if n in queries else 1e-30)
            for n in gp}
    assert queries and all(gt[n].abs().sum() > 0 for n in queries), "a query got no gradient"
    bad = {n: e for n, e in errs.items() if not e <= grad_tol}
    assert not bad, f"main_grad relative errors over {grad_tol}: {bad}"
    for a, b in zip(lt, lp):
        assert abs(a - b) <= loss_tol * abs(b), (lt, lp)


# attnres in the full suite only: the same Float16Module and DDP path as lr_attnres, and
# test_two_phase_matches_per_site_over_training_steps reads its blocks in the fast tier
@pytest.mark.parametrize("residual", [pytest.param("attnres", marks=pytest.mark.slow),
                                      "lr_attnres"])
def test_two_phase_bf16_float16module_ddp_matches_per_site(mp, residual):
    """bf16 parameters (queries included) under Float16Module and megatron DDP: the main_grad
    of every parameter after one step (two micro-batches) and the losses over three Adam
    steps, two-phase against per-site reads (torch backend; bf16 rounding allows ~3%)."""
    run = lambda s: _bf16_ddp_run(s, "torch", residual, seq=32, mbs=2)  # noqa: E731
    _compare_bf16(run("two_phase"), run("per_site"), grad_tol=0.1, loss_tol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused kernels at the tiny "
                    "preset's shape run on the GPU box")
@pytest.mark.parametrize("residual,key", [("attnres", "sliced"), ("lr_attnres", "sliced"),
                                          ("lr_attnres", "projected")])
def test_two_phase_bf16_ddp_triton_tiny_preset_shape_gpu(mp, residual, key):
    """The training A/B that went wrong on an H200 (tiny preset: 1024 tokens per micro-batch,
    d=128), fused kernels on both paths."""
    run = lambda s: _bf16_ddp_run(s, "triton", residual, seq=128, mbs=8, key=key)  # noqa: E731
    _compare_bf16(run("two_phase"), run("per_site"), grad_tol=0.1, loss_tol=1e-2)
