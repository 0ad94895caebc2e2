"""Where the copies and the saved activations of a training step come from.

The kernel table names copy kernels (``direct_copy_kernel_cuda``, ``CatArrayBatchedCopy``,
``bfloat16_copy_kernel``) but not who launches them. ``CopySources`` records every
copy-like aten op of an eager step (``copy_``, ``clone``, ``_to_copy``, ``cat``): its dtype,
the bytes it moves (read + write of its output) and its source. In the forward the source
is the innermost frames of the Python stack outside torch; in the backward it is the
autograd node that runs (``CatBackward0``, ...) and, with anomaly mode on (recorded for this
step only), the forward line that created that node.

``KernelLaunchers`` profiles a step (``torch.profiler`` with Python stacks and shapes) and
names, for every GPU kernel, the op chain that launched it: the innermost aten op, the ops
around it, and the nearest Python frames outside torch (in the backward, the autograd node
instead). It sees what the dispatch mode above cannot: copies made inside an op's own C++
code (an attention kernel making its inputs contiguous) and inside compiled regions.

``SavedTensors`` records what autograd keeps for the backward (every tensor packed by
``save_for_backward`` or a built-in node, counted once per storage): bytes by dtype and the
forward line that saved it. Parameters and other tensors that outlive the step are listed
apart (``kind``: ``activation`` or ``kept``: a tensor whose storage existed before the step
began is not the step's memory). Tensors a custom autograd function keeps as attributes of
its context instead of saving them are not seen.

    with CopySources() as copies, SavedTensors() as saved:
        step()
    for row in copies.table() + saved.table(): ...

    with KernelLaunchers() as launchers:
        step()
    for row in launchers.table(): ...
"""

from __future__ import annotations

import collections
import os
import re
import traceback
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

OPS = frozenset({"copy_", "clone", "_to_copy", "cat"})
_SKIP = (os.sep + "torch" + os.sep, os.path.abspath(__file__), "_python_dispatch",
         os.sep + "contextlib.py")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def _short(path: str) -> str:
    # from the package folder on (megatron/core/..., megatron_lrattn/...), wherever installed
    for marker in ("megatron_lrattn", "megatron", "benchmarks", "tests"):
        i = path.rfind(os.sep + marker + os.sep)
        if i >= 0:
            return path[i + 1:]
    i = path.rfind("site-packages" + os.sep)
    return path[i + len("site-packages") + 1:] if i >= 0 else os.path.basename(path)


def _keep(path: str, func: str) -> bool:
    # torch's own frames, this file's, and function-mode hooks (the CPU compatibility mode)
    return func != "__torch_function__" and not any(s in path for s in _SKIP)


def _forward_source(depth: int) -> str:
    frames = [f for f in traceback.extract_stack() if _keep(f.filename, f.name)]
    return " <- ".join(f"{_short(f.filename)}:{f.lineno} {f.name}"
                       for f in reversed(frames[-depth:])) or "?"


def _node_source(node, depth: int) -> str:
    name = node.name()
    lines = (node.metadata or {}).get("traceback_") if hasattr(node, "metadata") else None
    if not lines:
        return f"backward: {name}"
    frames = []
    for chunk in lines:
        m = _FRAME.search(chunk)
        if m and _keep(m["file"], m["func"]):
            frames.append(f"{_short(m['file'])}:{m['line']} {m['func']}")
    where = " <- ".join(reversed(frames[-depth:]))
    return f"backward: {name} of {where}" if where else f"backward: {name}"


class CopySources(TorchDispatchMode):
    """Counts and bytes of copy-like ops by (op, dtype, source) while active.

    Args:
        depth: Python frames per source (innermost first).
        anomaly: record the forward traceback of every autograd node (anomaly mode) so
            that a backward copy names the forward line it belongs to.
    """

    def __init__(self, depth: int = 3, anomaly: bool = True):
        super().__init__()
        self.depth = depth
        self.anomaly = anomaly
        self.rows: Dict[Tuple[str, str, str], List[int]] = collections.defaultdict(
            lambda: [0, 0])
        self._anomaly_ctx = None

    def __enter__(self):
        if self.anomaly:
            self._anomaly_ctx = torch.autograd.detect_anomaly(check_nan=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled"
                self._anomaly_ctx.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self._anomaly_ctx is not None:
            self._anomaly_ctx.__exit__(*exc)
            self._anomaly_ctx = None
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in OPS:
            res = out if isinstance(out, torch.Tensor) else args[0]
            node: Optional[object] = torch._C._current_autograd_node()
            src = (_node_source(node, self.depth) if node is not None
                   else _forward_source(self.depth))
            dtype = str(res.dtype).replace("torch.", "")
            if name in ("copy_", "_to_copy") and isinstance(args[0], torch.Tensor) \
                    and args[0].dtype != res.dtype:
                dtype = f"{str(args[0].dtype).replace('torch.', '')}->{dtype}"
            row = self.rows[(name, dtype, src)]
            row[0] += 1
            row[1] += 2 * res.numel() * res.element_size()
        return out

    def table(self) -> List[Dict[str, object]]:
        """Rows ``op, dtype, source, calls, bytes``, the most bytes first."""
        rows = [dict(op=op, dtype=dt, source=src, calls=n, bytes=b)
                for (op, dt, src), (n, b) in self.rows.items()]
        return sorted(rows, key=lambda r: -r["bytes"])


class SavedTensors:
    """Bytes autograd saves for the backward, by (dtype, source, kind), each storage once.

    Args:
        depth: Python frames per source (innermost first).
        before: tensors alive before the step (parameters, buffers); storages they share
            are reported as ``kept``, not as the step's activations.
    """

    def __init__(self, depth: int = 3, before=()):
        self.depth = depth
        self._known = {t.untyped_storage().data_ptr() for t in before}
        self._seen = set()
        self.rows: Dict[Tuple[str, str, str], List[int]] = collections.defaultdict(
            lambda: [0, 0])
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self._seen:
                self._seen.add(ptr)
                kind = "kept" if ptr in self._known else "activation"
                row = self.rows[(str(t.dtype).replace("torch.", ""),
                                 _forward_source(self.depth), kind)]
                row[0] += 1
                row[1] += storage.nbytes()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    def table(self) -> List[Dict[str, object]]:
        """Rows ``op`` (``saved``), ``dtype``, ``source``, ``kind``, ``calls`` (storages),
        ``bytes``; the most bytes first."""
        rows = [dict(op="saved", dtype=dt, source=src, kind=kind, calls=n, bytes=b)
                for (dt, src, kind), (n, b) in self.rows.items()]
        return sorted(rows, key=lambda r: -r["bytes"])


_TORCH_FRAME = re.compile(r"(^|/)torch/|^<built-in |^<frozen |contextlib\.py|"
                          r"/_python_dispatch|threading\.py")


def _launcher(event, frames: int) -> "tuple[str, str]":
    """(op chain, shapes) of the CPU event that launched a kernel: the ops from the
    innermost out, then up to ``frames`` Python frames outside torch (short paths)."""
    ops: List[str] = []
    where: List[str] = []
    p = event
    while p is not None and len(where) < frames:
        name = p.name
        if getattr(p, "is_python_function", False) or re.search(r"\.py\(\d+\): ", name):
            path, _, rest = name.partition("(")
            if not _TORCH_FRAME.search(path) and not name.startswith("<"):
                where.append(f"{_short(path)}({rest}")
        elif not name.startswith("<built-in"):
            if name.startswith("autograd::engine::evaluate_function: "):
                node = name.split(": ", 1)[1]
                if ops and ops[-1] == node:
                    ops.pop()
                ops.append("backward: " + node)
                break  # the frames above are the caller of backward(), not the source
            if name.startswith(("aten::", "cuda", "triton", "Torch-Compiled", "CompiledFunction",
                                  "##")) or "Backward" in name or "::" in name:
                ops.append(name)
        p = p.cpu_parent
    shapes = getattr(event, "input_shapes", None) or []
    shape = ";".join("x".join(str(d) for d in s) for s in shapes if s)
    return " < ".join(ops[:6] + where), shape


class KernelLaunchers:
    """Device time of every GPU kernel by (kernel, launching op chain, input shapes).

    A ``torch.profiler`` run (CPU + CUDA activities, Python stacks, shapes) around the
    block; each kernel is charged to the CPU op that launched it (the profiler's
    correlation of launch and kernel). On CPU there are no kernels and the table is empty.

    Args:
        frames: Python frames outside torch named per chain (innermost first).
    """

    def __init__(self, frames: int = 3):
        self.frames = frames
        self.rows: Dict[Tuple[str, str, str], List[float]] = collections.defaultdict(
            lambda: [0, 0.0])
        self._prof = None

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=acts, with_stack=True, record_shapes=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out = self._prof.__exit__(*exc)
        if exc[0] is None:
            self.add(self._prof.events())
        return out

    def add(self, events) -> None:
        """Charge the kernels of finished profiler ``events`` to their launchers."""
        from torch.autograd import DeviceType

        device: Dict[str, List[float]] = collections.defaultdict(lambda: [0, 0.0])
        for e in events:
            if e.device_type != DeviceType.CPU:
                if not getattr(e, "is_user_annotation", False):
                    d = device[e.name]
                    d[0] += 1
                    d[1] += e.time_range.elapsed_us()
                continue
            kernels = getattr(e, "kernels", None)
            if not kernels:
                continue
            chain, shape = _launcher(e, self.frames)
            for k in kernels:
                row = self.rows[(k.name, chain, shape)]
                row[0] += 1
                row[1] += float(k.duration)
                d = device[k.name]
                d[0] -= 1
                d[1] -= float(k.duration)
        # kernels the profiler linked to no CPU op (a launch outside any recorded op)
        for name, (n, us) in device.items():
            if n > 0 and us > 0.05:
                row = self.rows[(name, "(no CPU op)", "")]
                row[0] += n
                row[1] += us

    def table(self) -> List[Dict[str, object]]:
        """Rows ``kernel, launcher, shapes, calls, device_us``; the most time first."""
        rows = [dict(kernel=k, launcher=chain, shapes=shape, calls=int(n),
                     device_us=round(us, 1))
                for (k, chain, shape), (n, us) in self.rows.items()]
        return sorted(rows, key=lambda r: -r["device_us"])
