"""Shared test helpers: the relative-RMS error metric, a single-process gloo model-parallel
setup, tiny model builders, and what the tests that run the CLIs in subprocesses share
(environment, free port, wait)."""
from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed.*")

VOCAB = 128
SEQ = 16
BATCH = 2


from megatron_lrattn.training.runtime import single_process_model_parallel as model_parallel_1x1  # noqa: E402,F401


def rel_rms(x, ref, floor=1e-30):
    """RMS(x - ref) / RMS(ref); ``floor`` stands in for RMS(ref) when that is smaller
    (an identically zero reference, e.g. every key gradient of a single source)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(floor)).item()


def grad_errors(errs, names, grads, ref_grads, leaves, floor):
    """Add each leaf's gradient error (relative RMS, ``floor`` for tiny references) to
    ``errs``; every gradient must have its leaf's dtype and shape."""
    for name, gr, rg, t in zip(names, grads, ref_grads, leaves):
        assert gr.dtype == t.dtype and gr.shape == t.shape, name
        errs[name] = rel_rms(gr, torch.zeros_like(gr, dtype=torch.float64) if rg is None
                             else rg, floor=floor)
    return errs


def seed_all(seed: int) -> None:
    """Seed torch's default generator and megatron's model-parallel RNG tracker."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def tiny_config(residual: str = "lr_attnres", *, num_layers: int = 2, hidden_size: int = 32,
                ffn_hidden_size: int = 64, num_attention_heads: int = 4, bias: bool = False,
                dropout: float = 0.0, **depth):
    """A tiny fp32 SwiGLU/RMSNorm ``LRAttnResConfig`` (depth fields passed through)."""
    from megatron_lrattn.model.config import LRAttnResConfig

    return LRAttnResConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=bias,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        init_method_std=0.02,
        use_cpu_initialization=True,
        residual=residual,
        **depth,
    )


def build_gpt(config, seed: int = 1234, *, spec=None, cls=None, vocab_size: int = VOCAB,
              seq_length: int = SEQ):
    """Seed, then build a model (``LRAttnResGPTModel`` with our spec by default)."""
    from megatron_lrattn.model.gpt import LRAttnResGPTModel
    from megatron_lrattn.model.spec import get_lr_attnres_layer_spec

    cls = cls or LRAttnResGPTModel
    spec = spec if spec is not None else get_lr_attnres_layer_spec(config, core_attention="local")
    seed_all(seed)
    return cls(
        config,
        spec,
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )


def tiny_batch(seed: int = 0, vocab_size: int = VOCAB, seq_length: int = SEQ, batch: int = BATCH):
    """(tokens, position_ids, labels), each [b, s]."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq_length), generator=g)
    labels = torch.randint(0, vocab_size, (batch, seq_length), generator=g)
    pos = torch.arange(seq_length).unsqueeze(0).expand(batch, -1)
    return tokens, pos, labels


def cli_env(cache_dir, **extra) -> dict:
    """The environment of a CLI subprocess: this one's, with ``LRATTN_CACHE=cache_dir``,
    warnings off, and ``extra`` (e.g. ``OMP_NUM_THREADS="1"``)."""
    return dict(os.environ, LRATTN_CACHE=str(cache_dir), PYTHONWARNINGS="ignore", **extra)


def torchrun(nproc: int) -> list:
    """The command prefix of a one-node torchrun with ``nproc`` workers. ``--standalone``:
    the launcher binds its rendezvous store to a port it is given by the system and the
    workers share that store, so concurrent tests never race for a port."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc)]


def finish(proc, timeout: float = 300):
    """Wait for a text-mode ``subprocess.Popen`` with piped output: (returncode, stdout,
    stderr)."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def pretrain_rows(nproc: int, argv, log, cache_dir, timeout: int = 600) -> list:
    """Run ``lrattn-pretrain`` (under torchrun for ``nproc`` > 1, one thread per process)
    with ``--log-json log`` and return the metrics file's records; the run must succeed."""
    import json
    import subprocess
    import sys

    launcher = [sys.executable, "-m", "megatron_lrattn.cli.pretrain"]
    if nproc > 1:
        launcher = torchrun(nproc) + ["-m", "megatron_lrattn.cli.pretrain"]
    proc = subprocess.run(launcher + list(argv) + ["--cache-dir", str(cache_dir),
                                                   "--log-json", str(log)],
                          env=cli_env(cache_dir, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(log) as f:
        return [json.loads(line) for line in f]


def tmpfs(path, size: str):
    """Context manager: a tmpfs of ``size`` (e.g. "1m") mounted at the new folder ``path``
    for the block, unmounted after; the test skips where mounting is not permitted (root
    only)."""
    import contextlib
    import subprocess

    import pytest

    @contextlib.contextmanager
    def mounted():
        os.mkdir(path)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode:
            pytest.skip("mounting a tmpfs is not permitted here (needs root)")
        try:
            yield path
        finally:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)

    return mounted()
