"""Activation recomputation: full recompute of depth-attention layers from the depth state
that entered them, megatron-core's own for the standard residual, selective core-attention
recompute. Gradients equal the no-recompute run (fp32, one process here; TP=2 and PP=2 on
CPU/gloo in the slow test), full recompute saves only each recomputed group's inputs, and
the flags' checks."""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import build_gpt, model_parallel_1x1, rel_rms, tiny_batch, tiny_config

GRAD_RTOL = 1e-6  # relative RMS error of each gradient tensor
MODES = {
    "standard": ("standard", {}),
    "attnres": ("attnres", {}),
    "lr_sliced": ("lr_attnres", {"key_type": "sliced"}),
    "lr_projected": ("lr_attnres", {"key_type": "projected"}),
}
# L = 4, N = 3: block ends 3, 6, 8 fall inside layers 2 and 3, so a recomputed group's
# state holds a partial sum and (two-phase) phase-1 reads cached for sites of later layers.
RECOMPUTE = {
    "none": {},
    "uniform1": dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1),
    "uniform2": dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=2),
    "block1": dict(recompute_granularity="full", recompute_method="block",
                   recompute_num_layers=1),
    "block3": dict(recompute_granularity="full", recompute_method="block",
                   recompute_num_layers=3),
    "selective": dict(recompute_granularity="selective"),
}


@pytest.fixture(scope="module")
def mp():
    with model_parallel_1x1():
        yield


def _config(mode: str, schedule: str, recompute: str, dropout: float = 0.0):
    residual, depth = MODES[mode]
    if residual != "standard":
        depth = dict(depth, num_blocks=3, depth_schedule=schedule, depth_backend="torch")
    return tiny_config(residual, num_layers=4, dropout=dropout, **depth, **RECOMPUTE[recompute])


def _grads(mode: str, schedule: str, recompute: str, dropout: float = 0.0):
    """Loss and every parameter's gradient of one forward-backward from random queries."""
    model = build_gpt(_config(mode, schedule, recompute, dropout), seed=5)
    if mode != "standard":
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for q in model.decoder.depth_queries.values():
                q.weight.copy_(torch.randn(q.weight.shape, generator=g))
    model.train()
    tokens, pos, labels = tiny_batch(1)
    torch.manual_seed(9)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(9)
    loss = model(tokens, pos, None, labels=labels).mean()
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _max_err(run, ref):
    (loss, grads), (ref_loss, ref_grads) = run, ref
    assert grads.keys() == ref_grads.keys()
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    return max((rel_rms(grads[n], ref_grads[n], floor=1e-12), n) for n in grads)


@pytest.mark.parametrize("schedule", ["per_site", "two_phase"])
@pytest.mark.parametrize("mode", list(MODES))
def test_recompute_gradients_equal_no_recompute(mp, mode, schedule):
    """Every recompute setting gives the no-recompute loss and gradients (fp32)."""
    if mode == "standard" and schedule == "two_phase":
        pytest.skip("the standard residual has no depth schedule")
    ref = _grads(mode, schedule, "none")
    for recompute in ("uniform1", "uniform2", "block3", "selective"):
        err, name = _max_err(_grads(mode, schedule, recompute), ref)
        print(mode, schedule, recompute, "max grad rel RMS", f"{err:.2e}", name)
        assert err <= GRAD_RTOL, (recompute, name, err)


def test_full_recompute_repeats_dropout(mp):
    """With dropout the backward's rerun draws the same masks (megatron's checkpoint
    restores the RNG states), so gradients still equal the no-recompute run."""
    ref = _grads("lr_sliced", "per_site", "none", dropout=0.2)
    err, name = _max_err(_grads("lr_sliced", "per_site", "uniform1", dropout=0.2), ref)
    assert err <= GRAD_RTOL, (name, err)


def _saved_in_decoder(mode: str, schedule: str, recompute: str):
    """Tensors saved for backward from the first layer to the end of the decoder's forward,
    on a first pipeline stage (no final read), as (data_ptr, shape) -> bytes, parameters left out; and the tensors of
    the depth states that entered the layers."""
    from helpers import seed_all
    from megatron_lrattn.model.gpt import LRAttnResGPTModel
    from megatron_lrattn.model.spec import get_lr_attnres_layer_spec

    config = _config(mode, schedule, recompute)
    seed_all(5)
    model = LRAttnResGPTModel(config, get_lr_attnres_layer_spec(config, core_attention="local"),
                              vocab_size=128, max_sequence_length=16,
                              position_embedding_type="rope", post_process=False)
    model.train()
    params = {p.data_ptr() for p in model.parameters()}
    saved, entered, active = {}, {}, [False]

    def pack(t):
        if active[0] and t.data_ptr() not in params:
            saved[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    def layer_input(module, args, kwargs):
        if active[0] or module is model.decoder.layers[0]:
            flat, _ = args[0].tensors()
            flat += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
            entered.update({(t.data_ptr(), tuple(t.shape)): t.numel() * t.element_size()
                            for t in flat if t is not None})

    def on(*_):
        active[0] = True

    def off(*_):
        active[0] = False

    model.decoder.layers[0].register_forward_pre_hook(on)
    model.decoder.register_forward_hook(off)
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(layer_input, with_kwargs=True)
    tokens, pos, _ = tiny_batch(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens, pos, None)
    out.float().pow(2).mean().backward()
    return saved, entered


@pytest.mark.parametrize("schedule", ["per_site", "two_phase"])
@pytest.mark.parametrize("mode", ["attnres", "lr_sliced", "lr_projected"])
def test_full_recompute_saves_only_the_layer_inputs(mp, mode, schedule):
    """With every layer recomputed (uniform, 1 layer) the decoder saves for backward exactly
    the tensors of the depth states entering its layers (sources, keys, cached phase-1
    reads) and the rotary embedding, several times fewer bytes than without recompute; block 1 recomputes only the
    first layer and saves in between."""
    none, _ = _saved_in_decoder(mode, schedule, "none")
    full, entered = _saved_in_decoder(mode, schedule, "uniform1")
    assert full and set(full) <= set(entered), set(full) - set(entered)
    assert set(full) == set(entered)
    block, _ = _saved_in_decoder(mode, schedule, "block1")
    print(mode, schedule, "saved bytes: none", sum(none.values()), "block1",
          sum(block.values()), "uniform1", sum(full.values()))
    assert 3 * sum(full.values()) < sum(none.values())
    assert sum(full.values()) < sum(block.values()) < sum(none.values())


def test_selective_recomputes_megatrons_core_and_skips_the_sdpa_core(mp):
    """Selective: megatron's DotProductAttention (stores its [b * heads, s, s]
    probabilities) is rerun in the backward; the SDPA core (stores none) is not."""
    from megatron_lrattn.model.spec import get_lr_attnres_layer_spec

    for mode in ("standard", "lr_sliced"):
        config = _config(mode, "per_site", "selective")
        local = build_gpt(config)
        assert all(l.self_attention.checkpoint_core_attention for l in local.decoder.layers)
        sdpa = build_gpt(config, spec=get_lr_attnres_layer_spec(config, core_attention="sdpa"))
        assert not any(l.self_attention.checkpoint_core_attention
                       for l in sdpa.decoder.layers)


def _parse(*flags):
    from megatron_lrattn.training.arguments import parse_args

    return parse_args(["--num-layers", "4", "--pipeline-model-parallel-size", "2", *flags])


def test_recompute_flags_follow_megatron_lm():
    a = _parse("--recompute-activations")
    assert a.recompute_granularity == "selective" and a.recompute_method is None
    a = _parse("--recompute-granularity", "full", "--recompute-method", "block",
               "--recompute-num-layers", "2")
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == (
        "full", "block", 2)
    from megatron_lrattn.training.builder import build_config

    with model_parallel_1x1():
        config = build_config(a, bf16=False)
    assert (config.recompute_granularity, config.recompute_method,
            config.recompute_num_layers) == ("full", "block", 2)
    assert _parse().recompute_granularity is None


@pytest.mark.parametrize("flags,needle", [
    (["--recompute-granularity", "full"], "needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"],
     "needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "3"], "must be in [1, 2]"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "3", "--pipeline-model-parallel-size", "1"],
     "must divide the 4 layers"),
    (["--recompute-method", "block"], "applies to --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
     "applies to --recompute-granularity full"),
    (["--recompute-activations", "--recompute-granularity", "full"], "contradicts"),
])
def test_recompute_flag_errors(flags, needle):
    from megatron_lrattn.training.arg_types import ArgumentError

    with pytest.raises(ArgumentError) as e:
        _parse(*flags)
    assert needle in str(e.value) and "\n" not in str(e.value)


# --- TP = 2 and PP = 2 on CPU/gloo ---------------------------------------------------------

LAYOUTS = {  # layout -> recompute flags (the TP1PP1 reference runs without)
    (2, 1): ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"],
    (1, 2): ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "2"],
    (1, 2, "block"): ["--recompute-granularity", "full", "--recompute-method", "block",
                      "--recompute-num-layers", "1"],
}


def _parallel_worker(rank: int, world: int, out_dir: str) -> None:
    import test_parallel as tp

    import megatron_lrattn.training.builder as builder

    real_config, real_run, base = builder.build_config, tp._run_layout, list(tp.BASE)

    def config_with_schedule(*a, **kw):
        config = real_config(*a, **kw)
        config.depth_schedule = os.environ["LRATTN_TEST_SCHEDULE"]
        return config

    def run(mode, t, p, ref, **kw):
        layout = os.environ.get("LRATTN_TEST_LAYOUT")
        tp.BASE = base + (LAYOUTS[tuple(json.loads(layout))] if ref is not None else [])
        try:
            return real_run(mode, t, p, ref, **kw)
        finally:
            tp.BASE = base

    real_wrap = builder.wrap_model

    def wrap(model, config, args):
        # test_parallel's layouts may pass the distributed-optimizer switch alone
        if isinstance(args, bool):
            import argparse

            args = argparse.Namespace(use_distributed_optimizer=args)
        return real_wrap(model, config, args)

    builder.build_config, builder.wrap_model = config_with_schedule, wrap
    tp._run_layout = run
    runs = [(s, layout) for s in ("per_site", "two_phase") for layout in LAYOUTS]
    for i, (schedule, layout) in enumerate(runs):
        os.environ["LRATTN_TEST_SCHEDULE"] = schedule
        os.environ["LRATTN_TEST_LAYOUT"] = json.dumps(list(layout))
        sub = os.path.join(out_dir, f"{schedule}-{'-'.join(map(str, layout))}")
        os.makedirs(sub, exist_ok=True)
        # a new process group each, with its own rendezvous file
        tp._worker(rank, world, os.path.join(sub, "rendezvous"), [layout[:2]], sub)


@pytest.mark.slow
def test_full_recompute_under_tp2_and_pp2_matches_tp1pp1(tmp_path):
    """TP=2 (uniform, 1 layer) and PP=2 (uniform 2 = the whole stage, and block 1) with full
    recompute, both depth schedules, every residual mode and key type, through megatron's
    schedules (1F1B with the packed depth state under PP) against the TP1PP1 run without
    recompute: per-micro-batch losses and every gradient within 1e-6 relative."""
    import torch.multiprocessing as mproc

    import test_parallel as tp

    mproc.spawn(_parallel_worker, args=(2, str(tmp_path)), nprocs=2)
    worst = {}
    for schedule in ("per_site", "two_phase"):
        for layout in LAYOUTS:
            sub = tmp_path / f"{schedule}-{'-'.join(map(str, layout))}"
            reports = {r: json.loads((sub / f"rank{r}.json").read_text()) for r in range(2)}
            tp._check(reports, [layout[:2]])
            worst[sub.name] = max(row["grad_rel_rms_max"] for rep in reports.values()
                                  for row in rep.values())
    print(json.dumps(worst, indent=1))
