"""Host-side helpers shared by the Triton launchers of every depth op: pointer tables, row
views, buffer allocation, persistent program counts."""

from __future__ import annotations

import contextlib
import functools
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): ``triton.next_power_of_2`` without
    its per-call wrapper cost (it is a constexpr function in Triton 3.6, several
    microseconds a call, a dozen calls per fwd+bwd)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def key_tile(r: int, warps: int) -> int:
    """Padded width of a kernel's [rows, r] key tile beside [rows, BD] value rows: at least
    one column per thread of the program. A narrower key tile gets a layout of its own, and
    Triton then moves every per-row weight derived from it (key norm, logit, softmax
    weights) to the rows' layout through shared memory at each use: the merge at d=3072,
    r=32 compiled to 9 layout conversions and 66 barriers per program and ran 28x slower
    than at r=768 (1.084 against 0.038 ms forward at 4096 tokens, H200,
    ``benchmarks/results/merge_key_tile_2026-12-03.log``). Masked columns cost no memory
    traffic."""
    return max(16, pow2(r), 32 * warps)


def empty(shape, dtype: torch.dtype, device) -> Tensor:
    """Every buffer a launcher hands to a kernel comes from here (the kernel tests replace it
    with a NaN-poisoning allocator, ``tests/ops/conftest.py``)."""
    return torch.empty(shape, dtype=dtype, device=device)


@functools.lru_cache(maxsize=None)
def sm_count(index: Optional[int]) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (None: the current device)."""
    return torch.cuda.get_device_properties(
        index if index is not None else torch.cuda.current_device()).multi_processor_count


def programs(n: int, device: torch.device, per_sm: int, cpu: int = 2) -> int:
    """Programs of a persistent grid over ``n`` work items: ``per_sm`` per SM on CUDA, ``cpu``
    under the interpreter; at least one, at most ``n`` (each writes one partial)."""
    if device.type == "cuda":
        return max(1, min(n, sm_count(device.index) * per_sm))
    return max(1, min(n, cpu))


_capture_host_buffers: Optional[List[Tensor]] = None


@contextlib.contextmanager
def hold_host_buffers(store: List[Tensor]):
    """While a CUDA graph is captured, put the pinned host tables that :func:`tables` copies
    to the device into ``store``: a replay copies from them again, so the caller keeps
    ``store`` as long as the graph."""
    global _capture_host_buffers
    previous, _capture_host_buffers = _capture_host_buffers, store
    try:
        yield store
    finally:
        _capture_host_buffers = previous


def tables(*groups: Sequence[Tensor]) -> List[Tuple[Tensor, Tensor]]:
    """Device int64 tables of data pointers and row strides, one (pointers, strides) pair per
    group of tensors, all staged in one pinned buffer and copied in one transfer without a
    host sync (PyTorch's host allocator keeps the buffer until the copy is done). Each
    group starts on a 16-byte boundary, so a table's alignment (which Triton specialises
    on) does not depend on the sizes of the groups before it."""
    dev = next(t.device for g in groups for t in g)
    ptrs: List[int] = []
    strides: List[int] = []
    starts = []
    for g in groups:
        pad = len(ptrs) % 2
        ptrs += [0] * pad
        strides += [0] * pad
        starts.append(len(ptrs))
        ptrs += [t.data_ptr() for t in g]
        strides += [t.stride(0) for t in g]
    if dev.type == "cuda":
        host = torch.tensor([ptrs, strides], dtype=torch.int64, pin_memory=True)
        if torch.cuda.is_current_stream_capturing():
            # A CUDA graph's replay copies from this host buffer again.
            if _capture_host_buffers is None:
                raise RuntimeError("a CUDA graph capture that launches depth kernels must "
                                   "run inside ops.triton_utils.hold_host_buffers()")
            _capture_host_buffers.append(host)
        tab = host.to(dev, non_blocking=True)
    else:
        tab = torch.tensor([ptrs, strides], dtype=torch.int64)
    return [(tab[0, a:a + len(g)], tab[1, a:a + len(g)]) for a, g in zip(starts, groups)]


def rows(t: Tensor, width: int) -> Tensor:
    """[T, width] view with unit column stride (copies only when that is impossible)."""
    t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()


def vector_rows(groups: Sequence[Sequence[Tensor]], width: int) -> bool:
    """Whether every row of every tensor starts on 16 bytes and holds whole 16-byte vectors
    of ``width`` elements (then a kernel may move rows in 16-byte vectors)."""
    ts = [t for g in groups for t in g]
    vec = 16 // ts[0].element_size()
    return (width % vec == 0
            and all(t.data_ptr() % 16 == 0 and t.stride(0) % vec == 0 for t in ts)
            and all(t.element_size() == ts[0].element_size() for t in ts))
