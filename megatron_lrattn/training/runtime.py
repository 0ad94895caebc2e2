"""Process-group and model-parallel initialisation, seeding and run provenance."""

from __future__ import annotations

import contextlib
import os
import platform
import random
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_lrattn.compat.cpu import apply_cpu_compat
from megatron_lrattn.compat.multi_tensor import install as install_multi_tensor


def _free_port() -> int:
    """A TCP port that is free on this host now (single-process runs rendezvous on it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Runtime:
    """Where this process sits: device, global rank/world and the parallel layout."""

    device: torch.device
    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    cp: int = 1

    @property
    def is_main(self) -> bool:
        """Global rank 0."""
        return self.rank == 0


def init_runtime(tp: int, pp: int, seed: int, vp: Optional[int] = None,
                 cp: int = 1) -> Runtime:
    """Initialise torch.distributed (env:// under torchrun, else a single process) and
    megatron's model-parallel groups (with ``vp`` virtual pipeline stages per rank and
    ``cp`` context-parallel ranks), then seed every generator.

    Raises:
        ArgumentError: when the world size is not divisible by tp * pp * cp.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cuda = torch.cuda.is_available()
    if not cuda:
        apply_cpu_compat()
    install_multi_tensor()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        from megatron_lrattn.training.arguments import ArgumentError

        raise ArgumentError(
            f"world size {world} is not divisible by tensor x pipeline x context parallel size "
            f"{tp} x {pp} x {cp}"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp, context_parallel_size=cp,
        )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed + 100 * pp_rank)
    np.random.seed(seed + 100 * pp_rank)
    torch.manual_seed(seed + 100 * pp_rank)
    model_parallel_cuda_manual_seed(seed + 100 * pp_rank)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return Runtime(device=device, rank=dist.get_rank(), world_size=world, tp=tp, pp=pp,
                   dp=world // (tp * pp * cp), cp=cp)


@contextlib.contextmanager
def single_process_model_parallel():
    """A one-process group (gloo; NCCL for CUDA tensors) with TP = PP = 1, for tools and tests that build a model in
    the current process (the CPU compatibility layer is applied when CUDA is absent).

    Creates only what does not exist yet and tears down only what it created.
    """
    from megatron.core import parallel_state

    if not torch.cuda.is_available():
        apply_cpu_compat()
    install_multi_tensor()
    made_pg = made_mp = False
    store = None
    if not dist.is_initialized():
        fd, store = tempfile.mkstemp(prefix="lrattn_gloo_")
        os.close(fd)
        os.unlink(store)
        # gloo for CPU tensors, NCCL for CUDA ones (gloo cannot reduce CUDA tensors)
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
        made_pg = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
        made_mp = True
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)  # megatron's attention forks this RNG state
    try:
        yield
    finally:
        if made_mp:
            parallel_state.destroy_model_parallel()
        if made_pg:
            dist.destroy_process_group()
            if store and os.path.exists(store):
                os.unlink(store)


def shutdown_runtime() -> None:
    """Destroy model-parallel groups and the process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def provenance() -> Dict[str, str]:
    """Git SHA (with a dirty flag), versions and host, for the start of every run log."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root,
                             capture_output=True, text=True, timeout=5).stdout.strip()
        if not top or os.path.realpath(top) != os.path.realpath(root):
            # not a checkout of its own (an exported copy, perhaps inside another checkout)
            raise OSError("no git checkout at " + root)
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                             capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=5).stdout.strip()
        sha = sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        sha = ""
    # A copy on another machine names its commit in GIT_SHA, which wins: such a copy can sit
    # beside a stale .git of another commit.
    sha = os.environ.get("GIT_SHA") or (sha if sha and sha != "-dirty" else "unknown")
    try:
        from megatron.core import __version__ as mcore
    except ImportError:
        mcore = "unknown"
    info = {
        "git_sha": sha,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": mcore,
        "host": platform.node(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    return info
