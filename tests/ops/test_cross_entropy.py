"""The Triton vocabulary-parallel cross entropy (``megatron_lrattn.ops.cross_entropy``)
against torch's and megatron-core's: loss and logits gradient, fp32 and bf16, vocabularies
of one and several blocks, large logits, targets at the shard edges; and under tensor
parallelism (two gloo processes, each with its vocabulary shard) against one process with
the whole vocabulary. On CPU the kernels run under the Triton interpreter."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from megatron_lrattn.ops import cross_entropy as ce
from op_checks import DEVICE, gpu, rel_rms


def _inputs(shape, vocab, dtype, scale=4.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(*shape, vocab, generator=g)).to(DEVICE, dtype)
    target = torch.randint(0, vocab, shape, generator=g).to(DEVICE)
    target.view(-1)[0], target.view(-1)[-1] = 0, vocab - 1  # both ends of the vocabulary
    grad = torch.rand(*shape, generator=g).to(DEVICE) + 0.5
    return logits, target, grad


def _loss_and_grad(fn, logits, target, grad):
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x, target)
    loss.backward(grad)
    return loss.detach(), x.grad


def _torch_ce(x, target):
    return F.cross_entropy(x.float().reshape(-1, x.shape[-1]), target.reshape(-1),
                           reduction="none").view(target.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,vocab", [((3, 2), 1000), ((2, 3), 9000), ((5,), 4096)],
                         ids=["one_block", "three_blocks_ragged", "exact_block"])
def test_loss_and_gradient_match_torch(shape, vocab, dtype):
    logits, target, grad = _inputs(shape, vocab, dtype)
    loss, dx = _loss_and_grad(ce.vocab_parallel_cross_entropy, logits, target, grad)
    ref_loss, ref_dx = _loss_and_grad(_torch_ce, logits, target, grad)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    assert dx.dtype == dtype and dx.shape == logits.shape
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(dx.float(), ref_dx.float(), **tol)
    # the reference of the module agrees as well (what the parallel test uses)
    torch.testing.assert_close(ce.cross_entropy_reference(logits, target), ref_loss,
                               rtol=1e-6, atol=1e-6)


def test_large_logits_stay_finite():
    """Logits of +-1e4 (an online maximum that grows by orders of magnitude along a row)."""
    logits, target, grad = _inputs((4,), 5000, torch.float32, scale=1.0)
    logits[0, 4500] = 1e4
    logits[1] = torch.linspace(-1e4, 1e4, 5000)
    logits[2, :] = -1e4
    loss, dx = _loss_and_grad(ce.vocab_parallel_cross_entropy, logits, target, grad)
    ref_loss, ref_dx = _loss_and_grad(_torch_ce, logits, target, grad)
    assert torch.isfinite(loss).all() and torch.isfinite(dx).all()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-7)


def test_matches_megatron_cross_entropy():
    """megatron-core's unfused vocab-parallel cross entropy (one rank), fp32."""
    from megatron.core import tensor_parallel

    from helpers import model_parallel_1x1

    logits, target, grad = _inputs((6, 2), 3000, torch.float32)
    with model_parallel_1x1():
        ref_loss, ref_dx = _loss_and_grad(tensor_parallel.vocab_parallel_cross_entropy,
                                          logits, target, grad)
    loss, dx = _loss_and_grad(ce.vocab_parallel_cross_entropy, logits, target, grad)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-7)


def test_no_tokens():
    logits = torch.zeros(0, 2, 100, device=DEVICE, requires_grad=True)
    target = torch.zeros(0, 2, dtype=torch.long, device=DEVICE)
    loss = ce.vocab_parallel_cross_entropy(logits, target)
    loss.sum().backward()
    assert loss.shape == (0, 2) and logits.grad.shape == logits.shape


def _tp_worker(rank, world, store, vocab, dtype_name, out):
    import torch.distributed as dist

    from megatron_lrattn.ops import cross_entropy as cem

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dtype = getattr(torch, dtype_name)
        logits, target, grad = _inputs((4, 3), vocab, dtype, seed=3)
        logits, target, grad = logits.cpu(), target.cpu(), grad.cpu()
        shard = vocab // world
        part = logits[..., rank * shard:(rank + 1) * shard]
        group = dist.group.WORLD
        loss, dx = _loss_and_grad(lambda x, t: cem.vocab_parallel_cross_entropy(x, t, group),
                                  part, target, grad)
        rloss, rdx = _loss_and_grad(lambda x, t: cem.cross_entropy_reference(x, t, group),
                                    part, target, grad)
        torch.save({"loss": loss, "dx": dx, "ref_loss": rloss, "ref_dx": rdx},
                   os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world,vocab,dtype", [(2, 6000, "float32"), (4, 1024, "bfloat16")],
                         ids=["tp2_fp32", "tp4_bf16"])
def test_tensor_parallel_shards_match_the_whole_vocabulary(world, vocab, dtype, tmp_path):
    """Each rank's loss equals the whole-vocabulary loss; its logits gradient equals that
    gradient's slice of the rank's shard (and the torch reference under the same group)."""
    if torch.cuda.is_available():
        pytest.skip("the gloo processes run the kernels under the Triton interpreter (CPU)")
    import torch.multiprocessing as mp

    mp.spawn(_tp_worker, args=(world, str(tmp_path / "rendezvous"), vocab, dtype,
                               str(tmp_path)), nprocs=world)
    logits, target, grad = _inputs((4, 3), vocab, getattr(torch, dtype), seed=3)
    full_loss, full_dx = _loss_and_grad(_torch_ce, logits, target, grad)
    shard = vocab // world
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == "float32" else dict(rtol=1.6e-2, atol=1e-5)
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["loss"], full_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["ref_loss"], full_loss, rtol=1e-6, atol=1e-6)
        want = full_dx[..., rank * shard:(rank + 1) * shard]
        torch.testing.assert_close(got["dx"].float(), want.float(), **tol)
        torch.testing.assert_close(got["ref_dx"].float(), want.float(), **tol)


@pytest.mark.parametrize("residual", ["standard", "lr_attnres"])
def test_model_loss_and_every_gradient_match_megatrons_cross_entropy(residual):
    """``LRAttnResGPTModel`` with ``triton_cross_entropy``: the per-token loss and every
    parameter gradient equal those of the same model with megatron-core's cross entropy."""
    from helpers import build_gpt, model_parallel_1x1, tiny_batch, tiny_config

    def run(triton_ce):
        depth = {} if residual == "standard" else {"num_blocks": 2}
        config = tiny_config(residual, cross_entropy_loss_fusion=triton_ce,
                             triton_cross_entropy=triton_ce, **depth)
        model = build_gpt(config).to(DEVICE)
        tokens, pos, labels = (t.to(DEVICE) for t in tiny_batch())
        loss = model(tokens, pos, None, labels=labels)
        loss.sum().backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    with model_parallel_1x1():
        ref_loss, ref_grads = run(False)
        loss, grads = run(True)
    assert loss.shape == ref_loss.shape
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    errors = {name: rel_rms(g, ref_grads[name]) for name, g in grads.items()}
    # fp32: the online and the two-pass sums of exponentials differ in the last bits only
    assert max(errors.values()) < 1e-6, errors


@gpu
def test_benchmark_shape_bf16_on_the_gpu():
    """The 1b benchmark's loss: 16384 tokens x vocabulary 32768, bf16 logits, against torch's
    cross entropy of the same logits in fp32."""
    logits, target, grad = _inputs((2048, 8), 32768, torch.bfloat16, scale=3.0, seed=7)
    loss, dx = _loss_and_grad(ce.vocab_parallel_cross_entropy, logits, target, grad)
    ref_loss, ref_dx = _loss_and_grad(_torch_ce, logits, target, grad)
    assert rel_rms(loss, ref_loss) < 1e-6
    assert rel_rms(dx, ref_dx) < 1e-2
