"""Vocabulary-parallel cross entropy that keeps the logits for the backward, not their softmax.

megatron-core's cross entropy (its compiled ``native`` fusion and the unfused one) upcasts
the [tokens, vocab] logits to fp32, writes their exponentials and then the softmax, and saves
that fp32 softmax for the backward: at the 1b benchmark shape (16384 tokens, vocabulary
32768) 2 GiB kept from the loss to the backward and several fp32 passes over [tokens, vocab].
Here one Triton pass over the logits computes, per token, the running maximum m, the sum
s = sum_v exp(l_v - m) (an online softmax: the sum is rescaled whenever the maximum grows)
and the target's logit; the backward recomputes the softmax from the logits in the same
pass that writes their gradient. What the backward keeps is the logits themselves (bf16 in
training, 1 GiB at that shape) and two fp32 numbers per token.

Under tensor parallelism each rank holds a vocabulary shard [V/tp] of every token's logits;
the shard statistics are combined with two all-reduces (the maximum, then the rescaled sums
and the target logit, which lies in one shard), as megatron-core does.

The loss is megatron's, ``log(sum_v exp(l_v - M)) - (l_target - M)`` with M the maximum over
the whole vocabulary, per token, fp32; the gradient is ``(softmax - onehot) * grad_output``
in the logits' dtype. ``cross_entropy_reference`` is the same math in torch ops (the tests'
reference besides megatron's own function).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch import Tensor

from megatron_lrattn.ops import triton_utils as tu

BLOCK = 4096
"""Vocabulary entries a program loads at a time (8 steps over a 32768 vocabulary)."""
WARPS = 8


@triton.jit
def cross_entropy_stats_kernel(logits, row_stride, target, vocab_start, vocab, out_max,
                               out_sum, out_picked, BLOCK: tl.constexpr):
    # one token per program: running max, rescaled sum of exponentials, the target's logit
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # lanes that have seen only padding keep m = -inf: rescale by 0 there, not NaN
        scale = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
        s = s * scale + tl.where(idx < vocab, tl.exp(x - m_new), 0.0)
        m = m_new
    row_max = tl.max(m, 0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max)), 0)
    t = tl.load(target + row) - vocab_start
    inside = (t >= 0) & (t < vocab)
    picked = tl.load(base + tl.where(inside, t, 0)).to(tl.float32)
    tl.store(out_max + row, row_max)
    tl.store(out_sum + row, total)
    tl.store(out_picked + row, tl.where(inside, picked, 0.0))


@triton.jit
def cross_entropy_grad_kernel(logits, row_stride, target, vocab_start, vocab, row_max,
                              row_sum, grad_loss, grad_logits, BLOCK: tl.constexpr):
    # (softmax - onehot(target)) * grad_loss, one token per program, in the logits' dtype
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    out = grad_logits + row * vocab
    g = tl.load(grad_loss + row)
    m = tl.load(row_max + row)
    scale = g / tl.load(row_sum + row)
    t = tl.load(target + row) - vocab_start
    cols = tl.arange(0, BLOCK)
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < vocab, other=0.0).to(tl.float32)
        p = tl.exp(x - m) * scale
        p = tl.where(idx == t, p - g, p)
        tl.store(out + idx, p.to(grad_logits.dtype.element_ty), mask=idx < vocab)


def _rows(logits: Tensor) -> Tensor:
    x = logits.reshape(-1, logits.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _block(vocab: int) -> int:
    return min(BLOCK, tu.pow2(vocab))


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group) -> Tensor:
        x, t = _rows(logits), target.reshape(-1).contiguous()
        n, vocab = x.shape
        rank, world = (group.rank(), group.size()) if group is not None else (0, 1)
        start = rank * vocab
        row_max, row_sum, picked = (tu.empty((n,), torch.float32, x.device) for _ in range(3))
        if n:
            cross_entropy_stats_kernel[(n,)](x, x.stride(0), t, start, vocab, row_max, row_sum,
                                             picked, BLOCK=_block(vocab), num_warps=WARPS)
        # a target outside this shard (or outside the vocabulary) contributes no logit
        inside = (t >= start) & (t < start + vocab)
        if world > 1:
            local_max = row_max
            row_max = local_max.clone()
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            both = torch.stack([row_sum * torch.exp(local_max - row_max),
                                torch.where(inside, picked - row_max, 0.0)])
            dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
            row_sum, shifted = both[0], both[1]
        else:
            shifted = torch.where(inside, picked - row_max, 0.0)
        ctx.save_for_backward(x, t, row_max, row_sum)
        ctx.shape, ctx.start = logits.shape, start
        return (torch.log(row_sum) - shifted).view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        x, t, row_max, row_sum = ctx.saved_tensors
        n, vocab = x.shape
        g = grad_loss.reshape(-1).float().contiguous()
        grad = tu.empty((n, vocab), x.dtype, x.device)
        if n:
            cross_entropy_grad_kernel[(n,)](x, x.stride(0), t, ctx.start, vocab, row_max,
                                            row_sum, g, grad, BLOCK=_block(vocab),
                                            num_warps=WARPS)
        return grad.view(ctx.shape), None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, group=None) -> Tensor:
    """Per-token cross entropy of vocabulary-sharded logits (Triton; CUDA, or the CPU under
    ``TRITON_INTERPRET=1``).

    Args:
        logits: [..., V/tp] this rank's vocabulary shard (rank k holds entries
            [k V/tp, (k+1) V/tp)), any float dtype; its gradient has the same dtype.
        target: [...] int64 token ids of the whole vocabulary.
        group: the tensor-parallel process group (None: one rank).

    Returns:
        [...] fp32 loss per token.
    """
    return _CrossEntropy.apply(logits, target, group)


def cross_entropy_reference(logits: Tensor, target: Tensor,
                            group: Optional[object] = None) -> Tensor:
    """The same loss in torch ops, fp32 (differentiable; what the kernels are tested
    against)."""
    x = logits.float()
    vocab = x.shape[-1]
    rank, world = (group.rank(), group.size()) if group is not None else (0, 1)
    start = rank * vocab
    row_max = x.detach().amax(-1)
    if world > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = x - row_max.unsqueeze(-1)
    inside = (target >= start) & (target < start + vocab)
    local = torch.where(inside, target - start, 0)
    picked = torch.where(inside, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
    total = shifted.exp().sum(-1)
    if world > 1:
        total, picked = _SumOverRanks.apply(total, group), _SumOverRanks.apply(picked, group)
    return torch.log(total) - picked


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward passes the gradient through: every rank computes the
    same loss, and a shard's gradient is that one loss's derivative (megatron's
    convention), not the sum of every rank's copy of it."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None
