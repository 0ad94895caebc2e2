"""Transformer Engine (TE) without importing it: availability, FP8 checks, and the
checkpoint key map between the local and the TE layer spec.

TE is optional. Nothing here imports it at module load; ``require_te`` does, and turns any
failure into one ``TEUnavailableError`` that says how to get TE.

Checkpoint names. The TE spec fuses each sub-layer's PreNorm into the following linear
(``TELayerNormColumnParallelLinear``), so its gain is a parameter of that linear:

====================================================  ===========================================
local spec (``model.state_dict()``)                   TE spec
====================================================  ===========================================
``decoder.layers.{i}.input_layernorm.weight/.bias``   ``...self_attention.linear_qkv.layer_norm_weight/_bias``
``decoder.layers.{i}.pre_mlp_layernorm.weight/.bias`` ``...mlp.linear_fc1.layer_norm_weight/_bias``
(none)                                                ``...self_attention.core_attention._extra_state``
====================================================  ===========================================

Distributed checkpoints need no mapping: megatron-core's local spec already writes the two
norms under the TE names (its ``sharded_state_dict_keys_map``), every other module is the same
class or has the same parameters in both specs, and the linears' ``_extra_state`` objects
exist in both (``None`` from megatron's local linears, FP8 scaling state from TE's; each side
ignores the other's). So a checkpoint written with one spec loads into the other as it is.
The functions below rename plain ``state_dict()`` keys (``torch.save`` files, the Hugging Face
converter, tests).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import sys
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

TE_VERSION = "2.20.2"
"""The TE release the GPU box fetches and builds (``tools/gpu_box/te_fetch.sh``, ``run.sh te``)."""

TE_INSTALL_HINT = (
    "On a CUDA machine with network: pip install --no-build-isolation "
    f"'transformer_engine[pytorch]=={TE_VERSION}' (its PyTorch extension is compiled against "
    "the installed torch), or use the NGC PyTorch container (docker/Dockerfile); on the "
    "offline GPU box: tools/gpu_box/te_fetch.sh, then run.sh te carry NN and run.sh te build "
    "(tools/gpu_box/README.md). The local spec "
    "(--transformer-impl local, backend='local') needs no TE."
)

FUSED_NORMS: Tuple[Tuple[str, str], ...] = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)
"""(local prefix, TE prefix) inside ``decoder.layers.{i}.``: the norm gain (and bias) that TE
fuses into the next linear. megatron-core's local spec maps the same pairs when it writes a
distributed checkpoint."""

TE_ONLY_EXTRA_STATES: Tuple[str, ...] = ("self_attention.core_attention._extra_state",)
"""Plain-state-dict entries only the TE spec has (TE attention's FP8 state; megatron does not
put it in distributed checkpoints)."""

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise")
"""FP8 scaling recipes we accept (megatron-core 0.16-0.19 names): ``delayed`` (scales from an
amax history) and ``tensorwise`` (per-tensor current scaling)."""

FP8_FAN_IN = FP8_FAN_OUT = FP8_TOKENS = 16
"""TE's FP8 GEMMs need every GEMM dimension divisible by 16: the backward multiplies each
operand transposed as well, and cuBLASLt asks FP8 operands for leading dimensions divisible by
16. Seen on an H200 with TE 2.20: a weight of 40 output rows (d = 32 plus r = 8 projected-key
rows) passes TE's own input checks and the forward, then stops the data-gradient GEMM with
``ret.lda % 16 == 0 ... Caller must pad``. So: weight input and output widths, and tokens per
micro-batch and rank, are multiples of 16."""


class TEUnavailableError(ImportError):
    """Transformer Engine cannot be imported; the message says why and how to install it."""


def te_available() -> bool:
    """True when ``transformer_engine.pytorch`` imports (it needs CUDA libraries)."""
    try:
        require_te()
    except TEUnavailableError:
        return False
    return True


def require_te():
    """Import and return ``transformer_engine.pytorch``.

    Raises:
        TEUnavailableError: TE is missing or fails to load (no CUDA libraries, version
            mismatch between its packages, ...), with the cause and ``TE_INSTALL_HINT``.
    """
    if importlib.util.find_spec("transformer_engine") is None:
        raise TEUnavailableError(
            "Transformer Engine is not installed (no module 'transformer_engine'); the TE "
            f"spec and FP8 need it. {TE_INSTALL_HINT}")
    try:
        with _torch_cudnn_for_te():
            te = importlib.import_module("transformer_engine.pytorch")
    except Exception as e:  # noqa: BLE001 - TE raises ImportError, OSError, RuntimeError, ...
        first = str(e).splitlines()[0] if str(e) else ""
        raise TEUnavailableError(
            f"Transformer Engine is installed but does not load ({type(e).__name__}: {first}). "
            f"{TE_INSTALL_HINT}") from e
    from megatron.core.extensions import transformer_engine as megatron_te

    if not getattr(megatron_te, "HAVE_TE", False):
        raise TEUnavailableError(
            "megatron.core.extensions.transformer_engine was imported before Transformer "
            "Engine could load and keeps a stand-in; import TE first (or start a new process)")
    return te


def _loaded_cudnn_dir() -> Optional[str]:
    """The folder of the cuDNN library this process has loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if os.path.basename(path).startswith("libcudnn.so"):
                    return os.path.dirname(path)
    except OSError:
        pass
    return None


_CUDNN_ORDER = ("libcudnn_graph", "libcudnn_engines_precompiled",
                "libcudnn_engines_runtime_compiled", "libcudnn_heuristic", "libcudnn_ops",
                "libcudnn_cnn", "libcudnn_adv", "libcudnn")


def _preload_cudnn(folder: str) -> None:
    """Load every cuDNN library in ``folder`` into the process's global namespace, the
    sub-libraries before those that need them (a library that fails is tried again after
    the others)."""
    import ctypes
    import glob

    def rank(path):
        stem = os.path.basename(path).split(".so")[0]
        return _CUDNN_ORDER.index(stem) if stem in _CUDNN_ORDER else len(_CUDNN_ORDER)

    todo = sorted(glob.glob(os.path.join(folder, "libcudnn*.so*")), key=rank)
    while todo:
        left = []
        for path in todo:
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                left.append(path)
        if len(left) == len(todo):
            return  # what loads is loaded; TE's own search handles the rest
        todo = left


@contextlib.contextmanager
def _torch_cudnn_for_te():
    """While TE is imported, point it at the cuDNN torch uses.

    TE's import loads cuDNN itself, preferring ``CUDNN_HOME``/``CUDNN_PATH``, then the CUDA
    toolkit's folders, over the copy torch brings; where the system has an older cuDNN, both
    end up in the process and torch's own cuDNN calls can resolve to TE's copy, whereupon
    torch refuses cuDNN ("cuDNN version incompatibility") and its SDPA falls back to flash
    attention (twice the attention time at 1b on an H100). So unless the user set
    ``CUDNN_HOME`` or ``CUDNN_PATH``, torch's cuDNN libraries (the main one and the
    sub-libraries it would load later) are loaded first and TE is shown their folder: every
    later lookup of a cuDNN library by name finds torch's.
    """
    import torch

    folder = None
    if not (os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH")) \
            and "transformer_engine" not in sys.modules and torch.cuda.is_available():
        try:
            torch.backends.cudnn.version()  # torch loads its cuDNN
        except Exception:  # noqa: BLE001 - no usable cuDNN: leave TE's own search alone
            pass
        folder = _loaded_cudnn_dir()
    if folder is None:
        yield
        return
    _preload_cudnn(folder)
    os.environ["CUDNN_HOME"] = folder
    try:
        yield
    finally:
        os.environ.pop("CUDNN_HOME", None)


def fp8_shape_problems(*, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                       num_query_groups: int, kv_channels: int, tensor_parallel: int = 1,
                       swiglu: bool = True, key_rows: int = 0) -> List[str]:
    """The layer GEMMs that TE's FP8 kernels refuse, per tensor-parallel rank.

    Args:
        hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, kv_channels:
            the model shape (d, h, heads, query groups, head dim).
        tensor_parallel: TP size (column-parallel outputs and row-parallel inputs are split).
        swiglu: FC1 emits [gate; up] (2h rows).
        key_rows: extra output rows of the attention and MLP output projections (r for
            projected keys, else 0).

    Returns:
        One line per offending GEMM (``name: fan_in -> fan_out``); empty when all fit.
    """
    tp, d, h, kv = tensor_parallel, hidden_size, ffn_hidden_size, kv_channels
    gemms = {
        "linear_qkv": (d, (num_attention_heads + 2 * num_query_groups) * kv // tp),
        "linear_proj": (num_attention_heads * kv // tp, d + key_rows),
        "linear_fc1": (d, (2 * h if swiglu else h) // tp),
        "linear_fc2": (h // tp, d + key_rows),
    }
    return [f"{name}: {fan_in} -> {fan_out} per TP rank"
            for name, (fan_in, fan_out) in gemms.items()
            if fan_in % FP8_FAN_IN or fan_out % FP8_FAN_OUT]


def check_fp8_config(config) -> None:
    """Refuse FP8 settings the TE spec does not support, before any module is built.

    Raises:
        ValueError: an unknown recipe, ``fp8_param``, or GEMM shapes TE's FP8 kernels refuse
            (naming them; with projected keys pick a rank r that keeps d + r a multiple of 16).
    """
    if not getattr(config, "fp8", None):
        return
    recipe = getattr(config.fp8_recipe, "value", config.fp8_recipe)
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe={recipe!r} is not supported; use one of {FP8_RECIPES} "
                         "(tensorwise is per-tensor current scaling)")
    if getattr(config, "fp8_param", False):
        raise ValueError("fp8_param (FP8 parameter storage) is not supported; parameters stay "
                         "bf16 with fp32 main weights, only TE's GEMMs run in FP8")
    bad = fp8_shape_problems(
        hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups or config.num_attention_heads,
        kv_channels=config.kv_channels or config.hidden_size // config.num_attention_heads,
        tensor_parallel=config.tensor_model_parallel_size, swiglu=config.gated_linear_unit,
        key_rows=config.key_rank if getattr(config, "projected_keys", False) else 0)
    if bad:
        raise ValueError(f"FP8 needs GEMM input widths divisible by {FP8_FAN_IN} and output "
                         f"widths by {FP8_FAN_OUT}: {'; '.join(bad)}")


_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")


def _rename(key: str, src: int, dst: int) -> Optional[str]:
    """``key`` with a fused-norm prefix of naming ``src`` (0 local, 1 TE) in naming ``dst``,
    or None when it holds none."""
    if not _LAYER.search(key):
        return None
    for pair in FUSED_NORMS:
        marker = "." + pair[src]
        if marker in key:
            head, tail = key.split(marker, 1)
            if tail in ("weight", "bias"):
                return f"{head}.{pair[dst]}{tail}"
    return None


def local_to_te_keys(state_dict: Mapping[str, object]) -> Dict[str, object]:
    """A local-spec ``state_dict()`` under TE-spec names (values untouched).

    ``input_layernorm.{weight,bias}`` -> ``self_attention.linear_qkv.layer_norm_{weight,bias}``
    and ``pre_mlp_layernorm.*`` -> ``mlp.linear_fc1.layer_norm_*``; everything else keeps its
    name. TE attention's ``_extra_state`` has no local counterpart and is not invented (load
    with ``load_state_dict_across_specs``).
    """
    return {(_rename(k, 0, 1) or k): v for k, v in state_dict.items()}


def te_to_local_keys(state_dict: Mapping[str, object]) -> Dict[str, object]:
    """A TE-spec ``state_dict()`` under local-spec names (values untouched); the inverse of
    ``local_to_te_keys``. TE-only entries (``TE_ONLY_EXTRA_STATES``) are dropped."""
    out = {}
    for k, v in state_dict.items():
        if any(k.endswith("." + t) for t in TE_ONLY_EXTRA_STATES):
            continue
        out[_rename(k, 1, 0) or k] = v
    return out


def spec_naming(keys: Iterable[str]) -> Optional[str]:
    """``"local"`` or ``"te"``: which spec's names a state dict uses (by its layer norms).

    Returns:
        None when the keys hold no transformer layer (e.g. a pipeline stage without layers).

    Raises:
        ValueError: both namings appear in one state dict.
    """
    local = te = False
    for k in keys:
        local = local or _rename(k, 0, 1) is not None
        te = te or _rename(k, 1, 0) is not None
    if local and te:
        raise ValueError("state dict mixes local-spec (input_layernorm) and TE-spec "
                         "(linear_qkv.layer_norm_weight) names")
    return "local" if local else "te" if te else None


def load_state_dict_across_specs(model, state_dict: Mapping[str, object]) -> None:
    """Load a plain ``state_dict()`` written with either spec into ``model`` (either spec).

    Keys are renamed to the model's naming; ``_extra_state`` entries present on one side only
    are tolerated (megatron's local linears ignore TE's FP8 state, TE accepts ``None``).

    Raises:
        RuntimeError: any parameter or buffer is missing or unexpected after renaming.
    """
    target = spec_naming(model.state_dict().keys())
    source = spec_naming(state_dict.keys())
    sd = dict(state_dict)
    if source == "local" and target == "te":
        sd = local_to_te_keys(sd)
    elif source == "te" and target == "local":
        sd = te_to_local_keys(sd)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    unexpected = [k for k in unexpected if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"state dict does not fit the model: missing {missing[:6]}, "
                           f"unexpected {unexpected[:6]}")
