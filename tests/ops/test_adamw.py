"""The multi-tensor AdamW kernel (``megatron_lrattn.ops.adamw``) against ``torch.optim.AdamW``
over several steps: two parameter groups (with and without weight decay), tensors of one
element, under one block and over several, the clipping scale folded in, the bf16 model
copy equal to the rounded fp32 weight, and a table that follows moments replaced between
steps (a checkpoint load). On CPU the kernel runs under the Triton interpreter."""
from __future__ import annotations

import pytest
import torch

from megatron_lrattn.ops import adamw
from op_checks import DEVICE

SIZES = (1, 7, adamw.BLOCK + 3, 2 * adamw.BLOCK)


def _setup(seed=0, lr=3e-3):
    gen = torch.Generator().manual_seed(seed)
    ref = [torch.randn(n, generator=gen).to(DEVICE).requires_grad_() for n in SIZES]
    groups = [dict(params=ref[:2], weight_decay=0.1), dict(params=ref[2:], weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    ours = []
    for i, p in enumerate(ref):
        q = p.detach().clone()
        ours.append(adamw.AdamWTensors(
            param=q, grad=torch.zeros_like(q), exp_avg=torch.zeros_like(q),
            exp_avg_sq=torch.zeros_like(q), step=torch.zeros((), device=DEVICE),
            model=q.to(torch.bfloat16) if i % 2 == 0 else None, group=0 if i < 2 else 1))
    return gen, ref, opt, ours


def _step(gen, ref, opt, ours, table, scale):
    for p, t in zip(ref, ours):
        g = torch.randn(p.shape, generator=gen).to(DEVICE)
        t.grad.copy_(g)
        p.grad = g * torch.tensor(scale, dtype=torch.float32)  # megatron's in-place clipping
    opt.step()
    adamw.multi_tensor_adamw(ours, adamw.hyper_table(opt.param_groups, scale, DEVICE), table)


def _compare(ref, opt, ours):
    for i, (p, t) in enumerate(zip(ref, ours)):
        st = opt.state[p]
        assert float(t.step) == float(st["step"]), i
        for name, a, b in (("param", t.param, p.detach()), ("exp_avg", t.exp_avg, st["exp_avg"]),
                           ("exp_avg_sq", t.exp_avg_sq, st["exp_avg_sq"])):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7, msg=f"tensor {i} {name}")
        if t.model is not None:
            assert torch.equal(t.model, t.param.to(torch.bfloat16)), f"tensor {i} bf16 copy"


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_matches_torch_adamw(scale):
    gen, ref, opt, ours = _setup()
    table = adamw.AdamWTable()
    for _ in range(4):
        _step(gen, ref, opt, ours, table, scale)
        _compare(ref, opt, ours)
    assert table.programs == sum(-(-n // adamw.BLOCK) for n in SIZES)


def test_lr_change_and_replaced_moments():
    gen, ref, opt, ours = _setup(seed=1)
    table = adamw.AdamWTable()
    _step(gen, ref, opt, ours, table, 1.0)
    before = table._tables
    for t, p in zip(ours, ref):   # a checkpoint load: new moment tensors, same values
        t.exp_avg = t.exp_avg.clone()
        t.exp_avg_sq = t.exp_avg_sq.clone()
    for g in opt.param_groups:    # the LR schedule moves
        g["lr"] *= 0.5
    _step(gen, ref, opt, ours, table, 1.0)
    assert table._tables is not before
    _compare(ref, opt, ours)


def test_a_tensor_on_another_device_is_refused():
    t = adamw.AdamWTensors(param=torch.zeros(3), grad=torch.zeros(3), exp_avg=torch.zeros(3),
                           exp_avg_sq=torch.zeros(3), step=torch.zeros(()), model=None, group=0)
    with pytest.raises(ValueError, match="tensor 0 param: on cpu, the kernel runs on meta"):
        adamw.AdamWTable().tables([t], torch.device("meta"))


@pytest.mark.parametrize("field,bad", [("grad", torch.zeros(3, dtype=torch.bfloat16)),
                                       ("exp_avg", torch.zeros(4)),
                                       ("model", torch.zeros(3)),
                                       ("step", torch.zeros(2))])
def test_bad_tensors_name_the_field(field, bad):
    z = lambda *shape: torch.zeros(*shape, device=DEVICE)  # noqa: E731
    t = adamw.AdamWTensors(param=z(3), grad=z(3), exp_avg=z(3), exp_avg_sq=z(3), step=z(()),
                           model=None, group=0)
    setattr(t, field, bad.to(DEVICE))
    with pytest.raises(ValueError, match=f"tensor 0 {field}"):
        adamw.AdamWTable().tables([t], torch.device(DEVICE))


def test_unaligned_and_partial_blocks_take_the_masked_path():
    """Views 4 bytes past an aligned address and a tensor's last partial block are updated
    through the masked path; whole blocks of aligned tensors through the unmasked one."""
    gen = torch.Generator().manual_seed(2)
    n = 2 * adamw.BLOCK + 5
    ref = [torch.randn(n, generator=gen).to(DEVICE).requires_grad_() for _ in range(2)]
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = []
    for i, p in enumerate(ref):
        def place(x, shift=i):  # tensor 1 lives one element into a larger buffer
            buf = torch.zeros(n + shift, device=DEVICE)
            buf[shift:].copy_(x)
            return buf[shift:]
        q = place(p.detach())
        ours.append(adamw.AdamWTensors(param=q, grad=place(torch.zeros(n)),
                                       exp_avg=place(torch.zeros(n)),
                                       exp_avg_sq=place(torch.zeros(n)),
                                       step=torch.zeros((), device=DEVICE),
                                       model=q.to(torch.bfloat16), group=0))
    table = adamw.AdamWTable()
    for _ in range(3):
        _step(gen, ref, opt, ours, table, 0.5)
        _compare(ref, opt, ours)
    assert (table.programs, table.whole) == (6, 2)


def test_a_zero_step_column_leaves_everything_as_it_was():
    """Step column 0 (a non-finite step decided on the device): weights, moments, the bf16
    copies and the step counts stay as they are, then the next step is the reference's."""
    gen, ref, opt, ours = _setup()
    table = adamw.AdamWTable()
    _step(gen, ref, opt, ours, table, 1.0)
    before = [[x.clone() for x in (t.param, t.exp_avg, t.exp_avg_sq, t.step)]
              + [None if t.model is None else t.model.clone()] for t in ours]
    for t in ours:
        t.grad.fill_(float("nan"))
    hyper = adamw.hyper_table(opt.param_groups, float("nan"), DEVICE)
    hyper[:, adamw.HYPER_COLUMNS - 1] = 0.0
    adamw.multi_tensor_adamw(ours, hyper, table)
    for i, (t, b) in enumerate(zip(ours, before)):
        for x, y in zip((t.param, t.exp_avg, t.exp_avg_sq, t.step, t.model), b):
            assert y is None or torch.equal(x, y), i
    _step(gen, ref, opt, ours, table, 1.0)
    _compare(ref, opt, ours)
