"""``MixedPrecisionAdamW`` (``megatron_lrattn.training.optimizer_step``) against megatron-core's
own mixed-precision step: the tiny preset in bf16 under Float16Module and megatron's DDP,
trained the same way on both paths, with the clipping active and not; losses, gradient
norms, fp32 main weights, moments, step counts and the bf16 model weights after every step,
and a state dict of the same layout. Where it does not apply the reasons are named. On CPU
the kernel runs under the Triton interpreter."""
from __future__ import annotations

from functools import partial

import pytest
import torch

from helpers import model_parallel_1x1

VOCAB = 256


@pytest.fixture(scope="module")
def mp():
    with model_parallel_1x1():
        yield


def _build(extra=(), bf16=True):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_lrattn.training.arguments import parse_args
    from megatron_lrattn.training.builder import (build_config, build_model, build_optimizer,
                                                  wrap_model)

    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    argv = ["--preset", "tiny", "--residual", "lr_attnres", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--lr-warmup-iters", "0",
            "--lr", "3e-3", "--weight-decay", "0.1", *extra] + (["--bf16"] if bf16 else [])
    args = parse_args(argv)
    config = build_config(args, bf16=bf16)
    ddp = wrap_model(build_model(config, args, VOCAB), config, args)
    optimizer, scheduler = build_optimizer([ddp], config, args)
    inner = getattr(optimizer, "chained_optimizers", [optimizer])[0].optimizer
    if bf16 and type(inner) is not torch.optim.AdamW:
        pytest.skip(f"megatron-core uses {type(inner).__name__} here (TE or Apex installed): "
                    "the fused step applies to torch's AdamW")
    return ddp, optimizer, scheduler


def _inner(optimizer):
    return optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") \
        else optimizer


def _snapshot(optimizer, grad_norm):
    inner = _inner(optimizer)
    if hasattr(inner, "shard_fp32_from_float16_groups"):  # distributed (one rank: whole shards)
        mains = [p for g in inner.shard_fp32_from_float16_groups for p in g]
        models = [p.detach().reshape(-1).clone() for g in inner.model_float16_groups for p in g]
    else:
        mains = [p for g in inner.fp32_from_float16_groups for p in g]
        models = [p.detach().clone() for g in inner.float16_groups for p in g]
    return dict(
        grad_norm=float(grad_norm),
        model=models,
        main=[p.detach().clone() for p in mains],
        state={k: [inner.optimizer.state[p][k].detach().clone() for p in mains]
               for k in ("exp_avg", "exp_avg_sq", "step")})


def _train_pair(clip: float, steps: int = 3, extra=(), captured: bool = False):
    """Both paths from the same weights; each step, ours gets the reference's gradients
    (the bf16 forward would otherwise amplify last-bit differences of the weights).
    ``captured``: after the first step, ours runs as recorded into the step's CUDA graph
    (``prepare_capture`` once, then ``load_hyperparameters`` and ``captured_update`` with
    the loss as a device scalar; here without a graph, the same device work)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_lrattn.training.optimizer_step import MixedPrecisionAdamW
    from megatron_lrattn.training.step import loss_func

    pairs = [_build(["--clip-grad", str(clip), *extra]) for _ in range(2)]
    (ddp_ours, opt_ours, sched_ours), (ddp_ref, opt_ref, sched_ref) = pairs
    ours_step = MixedPrecisionAdamW(opt_ours)
    gb = torch.Generator().manual_seed(11)
    dev = next(ddp_ref.parameters()).device

    def step_fn(it, m):
        b = next(it)
        pos = torch.arange(32, device=dev).expand(2, 32).contiguous()
        return m(b[0], pos, None, labels=b[1]), partial(loss_func, torch.ones(2, 32, device=dev))

    history = []
    for _ in range(steps):
        batch = [torch.randint(0, VOCAB, (2, 32), generator=gb).to(dev) for _ in range(2)]
        losses = []
        for ddp, opt in ((ddp_ref, opt_ref), (ddp_ours, opt_ours)):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            out = get_forward_backward_func()(
                forward_step_func=step_fn, data_iterator=iter([batch]), model=[ddp],
                forward_only=False, num_microbatches=1, seq_length=32, micro_batch_size=2,
                decoder_seq_length=32)
            losses.append(float(out[0]["lm loss"]))
        for a, b in zip(ddp_ours.buffers, ddp_ref.buffers):
            a.grad_data.copy_(b.grad_data)
        ok_ref, norm_ref, _ = opt_ref.step()
        if captured and history:
            if len(history) == 1:
                ours_step.prepare_capture()
            ours_step.load_hyperparameters()
            stats = ours_step.captured_update(torch.tensor(losses[1], dtype=torch.float64,
                                                           device=dev))
            loss_ours, norm_ours, stepped = stats.tolist()
            assert loss_ours == losses[1] and stepped == 1.0
            ok_ours = True
        else:
            # every other step as the training step calls it: the norm first (for the
            # finiteness check), then the update
            first = ours_step.grad_norm() if len(history) % 2 else None
            ok_ours, norm_ours, _ = ours_step()
            assert first is None or first == norm_ours
        assert ok_ref and ok_ours
        sched_ref.step(increment=1)
        sched_ours.step(increment=1)
        history.append((losses, _snapshot(opt_ours, norm_ours), _snapshot(opt_ref, norm_ref)))
    return history, opt_ours, opt_ref


DISTRIBUTED = ["--use-distributed-optimizer"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], DISTRIBUTED], ids=["float16", "distributed"])
@pytest.mark.parametrize("clip", [1e-3, 1.0e6], ids=["clipped", "unclipped"])
def test_matches_megatrons_step(mp, clip, extra):
    _check_against_megatron(clip, extra)


@pytest.mark.slow
@pytest.mark.parametrize("clip", [1e-3, 1.0e6], ids=["clipped", "unclipped"])
def test_the_captured_update_matches_megatrons_step(mp, clip):
    """The device-only update of the step's CUDA graph (norm, clipping factor and the
    decision to step computed on the device) gives megatron's step."""
    _check_against_megatron(clip, captured=True)


def test_the_captured_update_leaves_a_nonfinite_step_untouched(mp):
    """A non-finite loss or gradient norm: [loss, norm, 0] comes back and weights, moments,
    bf16 weights and step counts are as they were; the next finite step steps. One layer:
    every kind of tensor of the model, fewer programs of the interpreted kernel."""
    from megatron_lrattn.training.optimizer_step import MixedPrecisionAdamW

    ddp, opt, _ = _build(["--clip-grad", "1.0", "--num-layers", "1", "--num-blocks", "2"])
    step = MixedPrecisionAdamW(opt)
    gen = torch.Generator().manual_seed(3)
    for b in ddp.buffers:
        b.grad_data.copy_(torch.randn(b.grad_data.shape, generator=gen) * 1e-2)
    assert step()[0]  # an eager first step creates the moments
    step.prepare_capture()
    for bad in ("loss", "grad"):
        before = _snapshot(opt, 0.0)
        loss = torch.tensor(float("nan") if bad == "loss" else 2.0, dtype=torch.float64)
        if bad == "grad":
            ddp.buffers[0].grad_data[5] = float("inf")
        step.load_hyperparameters()
        loss_out, norm, stepped = step.captured_update(loss).tolist()
        assert stepped == 0.0 and (bad == "grad") == (norm == float("inf")), (bad, norm)
        after = _snapshot(opt, 0.0)
        for key in ("model", "main"):
            assert all(torch.equal(x, y) for x, y in zip(after[key], before[key])), (bad, key)
        for key, xs in after["state"].items():
            assert all(torch.equal(x, y) for x, y in zip(xs, before["state"][key])), (bad, key)
    ddp.buffers[0].grad_data[5] = 0.0
    step.load_hyperparameters()
    assert step.captured_update(torch.tensor(2.0, dtype=torch.float64)).tolist()[2] == 1.0
    assert all(float(x) == 2.0 for x in _snapshot(opt, 0.0)["state"]["step"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a CUDA device "
                    "(on CPU the same device work runs without a graph above)")
def test_the_update_recorded_in_a_cuda_graph_skips_a_nonfinite_replay(mp):
    """The update recorded once into a CUDA graph and replayed: a replay with an infinite
    gradient leaves weights, moments, bf16 weights and step counts as they were and reports
    [loss, inf, 0]; the next finite replay steps, with the learning rate written before it."""
    from megatron_lrattn.training.optimizer_step import MixedPrecisionAdamW

    ddp, opt, sched = _build(["--clip-grad", "1.0"])
    step = MixedPrecisionAdamW(opt)
    gen = torch.Generator(device="cuda").manual_seed(3)
    grads = [b.grad_data for b in ddp.buffers]
    for g in grads:
        g.copy_(torch.randn(g.shape, generator=gen, device="cuda") * 1e-2)
    assert step()[0]  # an eager first step creates the moments
    sched.step(increment=1)
    loss = torch.tensor(2.0, dtype=torch.float64, device="cuda")
    step.prepare_capture()
    step.load_hyperparameters()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    before = _snapshot(opt, 0.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        stats = step.captured_update(loss)
    torch.cuda.synchronize()
    # recording ran nothing: the weights are untouched until the first replay
    assert all(torch.equal(x, y) for x, y in zip(_snapshot(opt, 0.0)["main"], before["main"]))
    grads[0][5] = float("inf")
    step.load_hyperparameters()
    graph.replay()
    loss_out, norm, stepped = stats.tolist()
    assert (loss_out, norm, stepped) == (2.0, float("inf"), 0.0)
    after = _snapshot(opt, 0.0)
    for key in ("model", "main"):
        assert all(torch.equal(x, y) for x, y in zip(after[key], before[key])), key
    for key, xs in after["state"].items():
        assert all(torch.equal(x, y) for x, y in zip(xs, before["state"][key])), key
    grads[0][5] = 0.0
    step.load_hyperparameters()
    graph.replay()
    assert stats.tolist()[2] == 1.0
    after = _snapshot(opt, 0.0)
    assert all(float(x) == 2.0 for x in after["state"]["step"])
    assert any(not torch.equal(x, y) for x, y in zip(after["main"], before["main"]))
    assert all(torch.equal(m, w.to(torch.bfloat16)) for m, w in zip(after["model"], after["main"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel on CUDA tensors "
                    "(GPU box; on CPU the interpreter runs the same comparison above)")
@pytest.mark.parametrize("extra", [[], DISTRIBUTED], ids=["float16", "distributed"])
def test_matches_megatrons_step_on_the_gpu(mp, extra):
    from megatron_lrattn.training.optimizer_step import obstacles

    assert obstacles(_build(extra)[1]) == []
    _check_against_megatron(1e-3, extra)


def _check_against_megatron(clip: float, extra=(), captured: bool = False):
    history, opt_ours, opt_ref = _train_pair(clip, extra=extra, captured=captured)
    for i, (losses, a, b) in enumerate(history):
        assert losses[0] == pytest.approx(losses[1], rel=1e-3), (i, losses)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), i
        for x, y in zip(a["main"], b["main"]):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
        for k in ("exp_avg", "exp_avg_sq"):
            for j, (x, y) in enumerate(zip(a["state"][k], b["state"][k])):
                # relative to the tensor's largest value: a moment near zero after
                # cancelling updates keeps only the rounding of the larger terms
                err = float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
                assert err <= 1e-5, (i, k, j, err)
        assert all(float(x) == float(y) == i + 1
                   for x, y in zip(a["state"]["step"], b["state"]["step"]))
        if all(m.shape == w.shape for m, w in zip(a["model"], a["main"])):
            # the bf16 model weights are the main weights rounded, as megatron's copy makes them
            assert all(torch.equal(m, w.to(torch.bfloat16))
                       for m, w in zip(a["model"], a["main"]))
        # every rank's model weights, the other ranks' shards included (the all-gather), are
        # the reference's up to the rounding of main weights within 1e-5 of each other
        for m, r in zip(a["model"], b["model"]):
            off = m != r
            assert off.float().mean() <= 1e-3, (i, float(off.float().mean()))
            torch.testing.assert_close(m.float(), r.float(), rtol=2 ** -7, atol=1e-6)
    if clip < 1.0:  # the clipping acted
        assert history[0][1]["grad_norm"] > 10 * clip
    sd_ours, sd_ref = opt_ours.state_dict(), opt_ref.state_dict()

    def layout(sd):
        if isinstance(sd, dict):
            return {k: layout(v) for k, v in sd.items() if k != "param_groups"}
        if isinstance(sd, (list, tuple)):
            return [layout(v) for v in sd]
        return (tuple(sd.shape), sd.dtype, str(sd.device)) if torch.is_tensor(sd) else type(sd)

    assert layout(sd_ours) == layout(sd_ref)


def test_where_it_does_not_apply_the_reasons_are_named(mp):
    from megatron_lrattn.training.optimizer_step import mixed_precision_adamw, obstacles

    _, optimizer, _ = _build()
    why = obstacles(optimizer)
    if torch.cuda.is_available():  # the training configuration on a GPU: it applies
        assert why == [], why
    else:
        assert why == ["main weights that are not fp32 CUDA tensors"]
        assert mixed_precision_adamw(optimizer) is None
    assert mixed_precision_adamw(optimizer, enabled=False) is None
    inner = getattr(optimizer, "chained_optimizers", [optimizer])[0]
    inner.float16_groups[0][0].grad_norm_group = "mtp"
    assert "parameters in a separately clipped gradient-norm group" in obstacles(optimizer)
    _, fp32_opt, _ = _build(bf16=False)
    assert any("is neither megatron's Float16OptimizerWithFloat16Params nor its "
               "DistributedOptimizer" in w for w in obstacles(fp32_opt))


@pytest.mark.slow
def test_continues_from_a_loaded_state_dict(mp):
    """Two steps, the optimizer's state dict loaded into a fresh model and optimizer, one
    more step on each with the same gradients: the loaded one continues exactly."""
    import copy

    from megatron_lrattn.training.optimizer_step import MixedPrecisionAdamW

    (ddp_a, opt_a, _), (ddp_b, opt_b, _) = _build(), _build(["--seed", "99"])
    step_a = MixedPrecisionAdamW(opt_a)
    gen = torch.Generator().manual_seed(3)

    def fill(ddp, grads=None):
        ddp.zero_grad_buffer()
        for i, buf in enumerate(ddp.buffers):
            buf.grad_data.copy_(grads[i] if grads else torch.randn(
                buf.grad_data.shape, generator=gen).to(buf.grad_data.device) * 1e-2)
        return [buf.grad_data.clone() for buf in ddp.buffers]

    for _ in range(2):
        opt_a.zero_grad()
        fill(ddp_a)
        assert step_a()[0]
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    step_b = MixedPrecisionAdamW(opt_b)  # what the loop builds after a load
    grads = fill(ddp_a)
    fill(ddp_b, grads)
    assert step_a()[0] and step_b()[0]
    a, b = _inner(opt_a), _inner(opt_b)
    for ga, gb in zip(a.fp32_from_float16_groups, b.fp32_from_float16_groups):
        for x, y in zip(ga, gb):
            assert torch.equal(x, y)
    for ma, mb in zip(a.float16_groups, b.float16_groups):
        for x, y in zip(ma, mb):
            assert torch.equal(x, y)
    for p, q in zip([p for g in a.fp32_from_float16_groups for p in g],
                    [p for g in b.fp32_from_float16_groups for p in g]):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.optimizer.state[p][k], b.optimizer.state[q][k]), k


def test_takes_the_step_count_of_a_fused_adam_state(mp):
    """A state written by TE's or Apex's FusedAdam (moments per parameter, the step count in
    each parameter group) continues with that count, not from step 0."""
    from megatron_lrattn.training.optimizer_step import MixedPrecisionAdamW

    _, optimizer, _ = _build()
    inner = _inner(optimizer).optimizer
    for g in inner.param_groups:
        g["step"] = 7
        for p in g["params"]:
            inner.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    MixedPrecisionAdamW(optimizer)
    steps = {float(inner.state[p]["step"]) for g in inner.param_groups for p in g["params"]}
    assert steps == {7.0}
    assert all(inner.state[p]["step"].dtype == torch.float32
               for g in inner.param_groups for p in g["params"])


def test_the_flag():
    from megatron_lrattn.training.arguments import parse_args
    from megatron_lrattn.training.fusions import fused_optimizer_step

    base = ["--preset", "tiny"]
    assert fused_optimizer_step(parse_args(base))
    assert not fused_optimizer_step(parse_args(base + ["--no-fused-optimizer-step"]))
    assert not fused_optimizer_step(parse_args(base + ["--no-fused-adamw"]))


def _sharded_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    import json
    import os
    import traceback
    from pathlib import Path

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_lrattn.compat.cpu import apply_cpu_compat

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    apply_cpu_compat()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result = "ok"
    try:
        ps.initialize_model_parallel(1, 1)
        _check_against_megatron(1e-3, DISTRIBUTED)
        shards = [p.numel() for g in _inner(_build(DISTRIBUTED)[1]).shard_fp32_from_float16_groups
                  for p in g]
        models = sum(p.numel() for g in _inner(_build(DISTRIBUTED)[1]).model_float16_groups
                     for p in g)
        assert sum(shards) < models, (sum(shards), models)  # each rank holds a part
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = traceback.format_exc()
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_distributed_optimizer_shards_match_megatrons_step(tmp_path):
    """Two data-parallel ranks (gloo): each rank's kernel updates its shard of the main
    weights and writes it into the parameter buffer, megatron's all-gather brings the other
    rank's; weights, moments, step counts and every rank's full bf16 weights match
    megatron's own distributed step."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_sharded_worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == "ok", rank


def test_the_update_joins_the_graph_except_with_the_distributed_optimizer(mp):
    from megatron_lrattn.training.optimizer_step import MixedPrecisionAdamW

    assert MixedPrecisionAdamW(_build()[1]).capture_obstacles() == []
    why = MixedPrecisionAdamW(_build(DISTRIBUTED)[1]).capture_obstacles()
    assert len(why) == 1 and "--use-distributed-optimizer" in why[0]
    opt = _build()[1]
    _inner(opt).config.log_num_zeros_in_grad = True  # megatron's option, set in code
    assert MixedPrecisionAdamW(opt).capture_obstacles() == ["log_num_zeros_in_grad"]
