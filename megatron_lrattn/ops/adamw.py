"""AdamW over many tensors in one Triton kernel that also clips the gradients and writes the
bf16 model weights.

megatron-core's mixed-precision optimizer step without Apex or TE is three passes over the
parameters after the gradient norm: the clipping scales every fp32 gradient in place (read
and write, 8 bytes a parameter), torch's fused AdamW updates the fp32 main weights and the
two moments (28 bytes), and the main weights are copied into the bf16 model weights (6
bytes): 42 bytes a parameter. Here one kernel reads the gradient, the weight and the two
moments, scales the gradient by the clipping factor in registers, and writes the weight, the
moments and the bf16 copy: 30 bytes a parameter.

The update is torch's AdamW (decoupled weight decay, no amsgrad), with the step count read
from each tensor's ``state["step"]`` (a device scalar, as torch's fused AdamW keeps it) and
the bias corrections computed from it in fp64 in the kernel, so nothing is read back to the
host. Tensors of any sizes and places are walked through a table of their addresses: one
program per ``BLOCK`` elements of one tensor.

``multi_tensor_adamw`` is the launcher (the tests compare it against ``torch.optim.AdamW``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 4096
"""Elements per program."""
WARPS = 4
"""32 elements a thread. On an H100 over a 1b model's tensors (0.96 B parameters) this took
9.9 ms, 2.9 TB/s against a measured 3.0 TB/s copy; 2048 or 8192 elements, or 8 or 16 warps,
took 10.3-11.4 ms, and 8192 x 4 or 16384 elements spilled registers (25-74 ms)."""

HYPER_COLUMNS = 7
"""Per parameter group, fp64: lr, weight decay, beta1, beta2, eps, gradient scale, and
whether to step (1.0; 0.0 leaves weights, moments, model weights and step counts as they
are: a step whose gradient norm or loss is not finite, decided on the device when the step
runs inside a CUDA graph)."""


@triton.jit
def adamw_kernel(chunk_tensor, chunk_start, chunk_whole, numels, groups, param_addr, grad_addr,
                 exp_avg_addr, exp_avg_sq_addr, step_addr, model_addr, hyper,
                 BLOCK: tl.constexpr, HYPER_COLUMNS: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor + pid)
    start = tl.load(chunk_start + pid)
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    n = tl.load(numels + t)
    h = hyper + tl.load(groups + t) * HYPER_COLUMNS
    lr = tl.load(h)
    weight_decay = tl.load(h + 1)
    beta1 = tl.load(h + 2)
    beta2 = tl.load(h + 3)
    eps = tl.load(h + 4).to(tl.float32)
    scale = tl.load(h + 5).to(tl.float32)
    apply = tl.load(h + 6) != 0.0
    step = tl.load(tl.load(step_addr + t).to(tl.pointer_type(tl.float32))).to(tl.float64)
    # bias corrections in fp64, as torch's fused AdamW computes them
    bias1 = 1.0 - tl.exp(step * tl.log(beta1))
    bias2_sqrt = tl.sqrt(1.0 - tl.exp(step * tl.log(beta2))).to(tl.float32)
    step_size = (lr / bias1).to(tl.float32)
    decay = (lr * weight_decay).to(tl.float32)
    b1 = beta1.to(tl.float32)
    b2 = beta2.to(tl.float32)
    c1 = (1.0 - beta1).to(tl.float32)
    c2 = (1.0 - beta2).to(tl.float32)

    p_ptr = tl.load(param_addr + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(grad_addr + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(exp_avg_addr + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(exp_avg_sq_addr + t).to(tl.pointer_type(tl.float32))
    out = tl.load(model_addr + t)
    o_ptr = out.to(tl.pointer_type(tl.uint16))
    has_model = out != 0
    if apply:
        if tl.load(chunk_whole + pid) != 0:
            # BLOCK elements from every address, each 16-byte aligned (the table checked): no
            # mask and alignment hints, so that the accesses are 128 bits wide
            _update(tl.multiple_of(p_ptr, 16), tl.multiple_of(g_ptr, 16), tl.multiple_of(m_ptr, 16),
                    tl.multiple_of(v_ptr, 16), tl.multiple_of(o_ptr, 16), has_model,
                    tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK), None, scale, decay, b1,
                    b2, c1, c2, step_size, bias2_sqrt, eps)
        else:
            _update(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, has_model, offs, offs < n, scale, decay, b1,
                    b2, c1, c2, step_size, bias2_sqrt, eps)


@triton.jit
def _update(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, has_model, offs, mask, scale, decay, b1, b2, c1,
            c2, step_size, bias2_sqrt, eps):
    g = tl.load(g_ptr + offs, mask=mask) * scale
    p = tl.load(p_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    p = p - decay * p
    m = b1 * m + c1 * g
    v = b2 * v + c2 * g * g
    p = p - step_size * (m / (tl.sqrt(v) / bias2_sqrt + eps))
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if has_model:
        tl.store(o_ptr + offs, _bf16_bits(p), mask=mask)


@triton.jit
def _bf16_bits(x):
    # fp32 -> bf16 rounded to nearest even, as torch rounds, spelled out in integer ops (the
    # Triton interpreter truncates in its own conversion); NaN stays a quiet NaN
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)


@dataclass
class AdamWTensors:
    """One parameter's tensors: fp32 weight, gradient and moments, the step scalar, and the
    bf16 model weight to write (None: the weight itself is the model's)."""

    param: Tensor
    grad: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: Tensor
    model: Optional[Tensor]
    group: int


def _on(x: Tensor, device: torch.device) -> bool:
    # "cuda" names the current device: cuda:0 tensors are on it when it is cuda:0
    if device.type == "cuda" and device.index is None:
        return x.device.type == "cuda" and x.device.index == torch.cuda.current_device()
    return x.device == device


def _check(t: AdamWTensors, i: int, device: torch.device) -> None:
    device = torch.device(device)
    for name in ("param", "grad", "exp_avg", "exp_avg_sq", "step", "model"):
        x = getattr(t, name)
        if x is not None and not _on(x, device):
            raise ValueError(f"multi_tensor_adamw: tensor {i} {name}: on {x.device}, the "
                             f"kernel runs on {device}")
    for name in ("param", "grad", "exp_avg", "exp_avg_sq"):
        x = getattr(t, name)
        if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() != t.param.numel():
            raise ValueError(f"multi_tensor_adamw: tensor {i} {name}: needs a contiguous fp32 "
                             f"tensor of {t.param.numel()} elements, got {x.dtype} "
                             f"{tuple(x.shape)} contiguous={x.is_contiguous()}")
    if t.step.dtype != torch.float32 or t.step.numel() != 1:
        raise ValueError(f"multi_tensor_adamw: tensor {i} step: needs one fp32 element, got "
                         f"{t.step.dtype} {tuple(t.step.shape)}")
    if t.model is not None and (t.model.dtype != torch.bfloat16 or not t.model.is_contiguous()
                                or t.model.numel() != t.param.numel()):
        raise ValueError(f"multi_tensor_adamw: tensor {i} model: needs a contiguous bf16 tensor "
                         f"of {t.param.numel()} elements, got {t.model.dtype} "
                         f"{tuple(t.model.shape)}")


class AdamWTable:
    """The launch table of a list of ``AdamWTensors``: rebuilt only when an address changes
    (a checkpoint load replaces the moments, for example)."""

    def __init__(self) -> None:
        self._key: Optional[Tuple] = None
        self._tables: Tuple[Tensor, ...] = ()
        self.programs = 0
        self.whole = 0
        """Programs over a whole block of 16-byte aligned tensors (128-bit accesses)."""

    def tables(self, tensors: Sequence[AdamWTensors], device: torch.device) -> Tuple[Tensor, ...]:
        key = tuple((t.param.data_ptr(), t.grad.data_ptr(), t.exp_avg.data_ptr(),
                     t.exp_avg_sq.data_ptr(), t.step.data_ptr(),
                     0 if t.model is None else t.model.data_ptr(), t.param.numel(), t.group)
                    for t in tensors)
        if key != self._key:
            for i, t in enumerate(tensors):
                _check(t, i, device)
            chunk_tensor: List[int] = []
            chunk_start: List[int] = []
            chunk_whole: List[int] = []
            for i, t in enumerate(tensors):
                n = t.param.numel()
                aligned = all(x % 16 == 0 for x in key[i][:4] + key[i][5:6])
                starts = range(0, n, BLOCK)
                chunk_tensor += [i] * len(starts)
                chunk_start += list(starts)
                chunk_whole += [int(aligned and s + BLOCK <= n) for s in starts]
            cols = list(zip(*key)) if key else [()] * 8
            as_i64 = lambda xs: torch.tensor(list(xs), dtype=torch.int64, device=device)
            self._tables = (
                torch.tensor(chunk_tensor, dtype=torch.int32, device=device),
                as_i64(chunk_start), torch.tensor(chunk_whole, dtype=torch.int8, device=device),
                as_i64(cols[6]), as_i64(cols[7]), *(as_i64(c) for c in cols[:6]))
            self.whole = sum(chunk_whole)
            self._key = key
            self.programs = len(chunk_tensor)
        return self._tables


def hyper_rows(groups: Sequence[dict]) -> List[List[float]]:
    """Each torch parameter group's lr, weight decay, beta1, beta2 and eps (the first five
    columns of ``hyper_table``)."""
    return [[float(g["lr"]), float(g["weight_decay"]), float(g["betas"][0]),
             float(g["betas"][1]), float(g["eps"])] for g in groups]


def hyper_table(groups: Sequence[dict], grad_scale: float, device: torch.device) -> Tensor:
    """[groups, HYPER_COLUMNS] fp64 on ``device``: each torch parameter group's lr, weight
    decay, betas and eps, the gradient scale (the clipping factor, 1.0 without), and 1.0
    (step)."""
    rows = [r + [float(grad_scale), 1.0] for r in hyper_rows(groups)]
    return torch.tensor(rows, dtype=torch.float64).to(device, non_blocking=True)


def multi_tensor_adamw(tensors: Sequence[AdamWTensors], hyper: Tensor,
                       table: Optional[AdamWTable] = None,
                       tables: Optional[Tuple[Tensor, ...]] = None) -> None:
    """One AdamW step of every tensor in place (the step scalars are incremented first, as
    torch does), writing the bf16 model weights where given; nothing changes where the
    table's step column is 0.

    Args:
        tensors: the parameters; ``group`` indexes a row of ``hyper``.
        hyper: ``hyper_table(...)``.
        table: a table kept between steps (built here when None).
        tables: ``table.tables(tensors, device)`` already computed for these tensors (the
            optimizer step computes them before it waits for the gradient norm).
    """
    if not tensors:
        return
    table = table or AdamWTable()
    if tables is None:
        tables = table.tables(tensors, tensors[0].param.device)
    # the step column (1.0 or 0.0, the same in every row) read on the device: no host read
    # (the list form: torch's overload with one tensor scalar reads it on the host)
    steps = [t.step for t in tensors]
    torch._foreach_add_(steps, [hyper[0, HYPER_COLUMNS - 1].float()] * len(steps))
    adamw_kernel[(table.programs,)](*tables, hyper, BLOCK=BLOCK, HYPER_COLUMNS=HYPER_COLUMNS,
                                    num_warps=WARPS)

