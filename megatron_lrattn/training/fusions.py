"""Fused kernels of the training step on CUDA, where megatron-core has no Apex or TE.

megatron-core fuses the SwiGLU/GeLU activation with its bias, the bias-dropout-add and the
cross-entropy with ``torch.compile``d functions (its ``jit_fuser``) when the config asks for
them, and falls back to torch's ``AdamW`` in its multi-tensor form when neither TE's nor
Apex's fused Adam is installed. On CUDA this module turns the compiled fusions on and moves
that fallback to torch's single-kernel fused AdamW (the same update, one kernel per tensor
group). On CPU nothing changes: compiling there would cost minutes of test time and buys
nothing. The rotary embedding is fused: with the local spec in the SDPA core
(``megatron_lrattn.model.attention``), with the TE spec by TE's kernels (megatron-core's
``apply_rope_fusion``, and ``fused_single_qkv_rope``, one node from the QKV projection's output
to the rotated q, k and v, where megatron-core takes it); ``--no-rope-fusion`` keeps
megatron-core's unfused rotary embedding in both. ``--no-bias-swiglu-fusion``,
``--no-bias-gelu-fusion``, ``--no-bias-dropout-fusion``, ``--no-cross-entropy-loss-fusion``
and ``--no-fused-adamw`` turn each one off. The fused
cross entropy is ``megatron_lrattn.ops.cross_entropy`` (Triton, one pass over the logits; the
backward keeps the logits instead of an fp32 softmax); ``--cross-entropy-fusion-impl
native`` keeps megatron-core's compiled one. The training
step also adds weight gradients to megatron's fp32 gradient buffer inside the GEMM
(megatron-core's gradient-accumulation fusion, ``megatron_lrattn.compat.wgrad_fusion``;
``--no-gradient-accumulation-fusion``).
The clipping, AdamW and the copy of the main weights into the bf16 model weights run as one
kernel after the gradient norm where megatron-core's optimizer allows it
(``megatron_lrattn.training.optimizer_step``; ``--no-fused-optimizer-step``).
``--cuda-graph-impl full_iteration`` replays the step's forward and backward as one CUDA
graph (``megatron_lrattn.training.cuda_graph``).
"""

from __future__ import annotations

import argparse
import logging
from typing import Dict

from megatron_lrattn.training.arg_types import ArgumentError

logger = logging.getLogger(__name__)


def add_fusion_args(parser: argparse.ArgumentParser) -> None:
    """The ``--no-*-fusion`` flags (megatron-LM's names where it has them)."""
    g = parser.add_argument_group("kernel fusion and CUDA graphs (CUDA; the CPU path is "
                                  "always unfused and eager)")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false",
                   help="unfused SwiGLU (default: megatron-core's compiled bias-SwiGLU)")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false",
                   help="unfused bias-GeLU (default: fused where the MLP has biases)")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false",
                   help="unfused bias-dropout-add of the standard residual (default: fused)")
    g.add_argument("--no-cross-entropy-loss-fusion", dest="cross_entropy_loss_fusion",
                   action="store_false",
                   help="megatron-core's unfused vocab-parallel cross-entropy (default: "
                        "fused, --cross-entropy-fusion-impl)")
    g.add_argument("--cross-entropy-fusion-impl", choices=("native", "triton"),
                   default=None,
                   help="the fused cross entropy: triton = megatron_lrattn.ops.cross_entropy "
                        "(one pass over the logits, keeps the logits and two numbers per "
                        "token), native = megatron-core's compiled one (keeps an fp32 softmax "
                        "for the backward: 3.1 GiB more and 5.5 ms slower on an H200 at 1b, "
                        "8 x 2048 tokens, vocabulary 32768; default: triton)")
    g.add_argument("--no-rope-fusion", dest="rope_fusion", action="store_false",
                   help="megatron-core's unfused rotary embedding (default: fused; the local "
                        "spec in its SDPA core, the TE spec with TE's fused RoPE kernels)")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                   action="store_false",
                   help="add each weight gradient to the fp32 gradient buffer in a separate "
                        "kernel (default: inside the weight-gradient GEMM, "
                        "megatron_lrattn.compat.wgrad_fusion where Apex is absent)")
    g.add_argument("--no-fused-adamw", dest="fused_adamw", action="store_false",
                   help="keep torch's multi-tensor AdamW when megatron-core falls back to it "
                        "(default: torch's fused AdamW)")
    g.add_argument("--no-fused-optimizer-step", dest="fused_optimizer_step",
                   action="store_false",
                   help="keep megatron-core's optimizer step (clipping, AdamW, copy into the "
                        "bf16 model weights: three passes). Default: one Triton kernel where "
                        "megatron-core's optimizer is its Float16OptimizerWithFloat16Params "
                        "or DistributedOptimizer around torch's AdamW (CUDA, bf16; the log "
                        "says why not otherwise)")
    add_cuda_graph_args(g)


def fusion_config(args: argparse.Namespace, cuda: bool) -> Dict[str, object]:
    """``TransformerConfig`` fields of the fusions that apply (all off without CUDA)."""
    if not cuda:
        return {}
    swiglu = bool(args.swiglu)
    gelu_bias = not swiglu and not args.disable_bias_linear
    act = (swiglu and getattr(args, "bias_swiglu_fusion", True)) or (
        gelu_bias and getattr(args, "bias_gelu_fusion", True))
    out: Dict[str, object] = {
        "bias_activation_fusion": bool(act),
        "bias_dropout_fusion": bool(getattr(args, "bias_dropout_fusion", True)),
    }
    if getattr(args, "cross_entropy_loss_fusion", True):
        out.update(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native")
        if (getattr(args, "cross_entropy_fusion_impl", None) or "triton") == "triton":
            out["triton_cross_entropy"] = True
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        out.update(te_rope_fusion(args))
    return out


def te_rope_fusion(args: argparse.Namespace) -> Dict[str, bool]:
    """megatron-core's rotary-fusion fields for the TE spec: ``apply_rope_fusion`` (TE's fused
    RoPE on q and k) unless ``--no-rope-fusion`` or without rotary embeddings, and
    ``fused_single_qkv_rope`` (TE's one node from the QKV projection's output to rotated q,
    k, v: no split copies forward, no concatenated gradient backward) where megatron-core
    takes it: TE ships the kernel, no QK-norm and no output gate. Imports TE."""
    from megatron_lrattn.compat import te as te_compat

    rope = getattr(args, "position_embedding_type", "rope") == "rope"
    if not (getattr(args, "rope_fusion", True) and rope):
        return {"apply_rope_fusion": False, "fused_single_qkv_rope": False}
    te_compat.require_te()
    from megatron.core.transformer import attention

    single = (bool(getattr(attention, "HAVE_FUSED_QKV_ROPE", False))
              and not getattr(args, "qk_layernorm", False))
    return {"apply_rope_fusion": True, "fused_single_qkv_rope": single}


def gradient_accumulation_fusion(args: argparse.Namespace, cuda: bool) -> bool:
    """Whether the training step's linear layers add their weight gradients to the DDP
    buffer inside the GEMM (megatron-core's ``gradient_accumulation_fusion``): on CUDA unless
    ``--no-gradient-accumulation-fusion``. Only for a model wrapped in megatron's DDP (the
    fused backward writes ``main_grad``), so not part of ``fusion_config``."""
    return bool(cuda and getattr(args, "gradient_accumulation_fusion", True))


def fused_optimizer_step(args: argparse.Namespace) -> bool:
    """Whether the run asks for the one-kernel optimizer step (neither
    ``--no-fused-optimizer-step`` nor ``--no-fused-adamw``)."""
    return bool(getattr(args, "fused_optimizer_step", True)
                and getattr(args, "fused_adamw", True))


def use_fused_adamw(optimizer, enabled: bool = True) -> int:
    """Set every torch ``Adam``/``AdamW`` inside a megatron optimizer to the fused
    implementation where all its parameters are CUDA floating-point tensors and ``enabled``,
    else back to torch's default choice. Called after building the optimizer and again after
    loading a checkpoint, whose saved parameter groups carry the setting of the run that
    wrote it.

    Returns:
        The number of torch optimizers set to fused (0 on CPU, with ``enabled=False`` or with
        TE's/Apex's fused Adam).
    """
    import torch

    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    switched = 0
    for opt in chained:
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        fused = enabled and bool(params) and all(p.is_cuda and p.is_floating_point()
                                                 for p in params)
        setting = dict(fused=True, foreach=False) if fused else dict(fused=None, foreach=None)
        inner.defaults.update(setting)
        for group in inner.param_groups:
            group.update(setting)
        switched += fused
    if switched:
        logger.info("optimizer: torch fused AdamW (%d parameter set%s)", switched,
                    "s" if switched > 1 else "")
    return switched


CUDA_GRAPH_IMPLS = ("auto", "none", "full_iteration")


def add_cuda_graph_args(group) -> None:
    """``--cuda-graph-impl`` and ``--cuda-graph-warmup-steps`` (megatron-LM's names)."""
    group.add_argument("--cuda-graph-impl", choices=CUDA_GRAPH_IMPLS, default="auto",
                       help="full_iteration: capture the training step's forward and backward "
                            "in one CUDA graph and replay it (CUDA, one pipeline stage, no "
                            "dropout; both specs, FP8 included), with the loss reduction and "
                            "the one-kernel optimizer step inside it in the local spec; auto: "
                            "full_iteration where it applies, else none (default: auto)")
    group.add_argument("--cuda-graph-warmup-steps", type=int, default=3, metavar="N",
                       help="eager training steps before the capture (default: 3)")


def _cuda_graph_obstacles(args: argparse.Namespace, cuda: bool) -> list:
    out = []
    if not cuda:
        out.append("it needs a CUDA device")
    if args.pipeline_model_parallel_size != 1:
        out.append("it captures one pipeline stage: it needs --pipeline-model-parallel-size 1 "
                   f"(got {args.pipeline_model_parallel_size})")
    dropout = [f"--{k.replace('_', '-')} {getattr(args, k)}"
               for k in ("hidden_dropout", "attention_dropout") if getattr(args, k, 0) or 0]
    if dropout:
        out.append("it runs without dropout (megatron-core's RNG tracker switches generator "
                   f"states on the host): got {', '.join(dropout)}")
    if getattr(args, "overlap_grad_reduce", None):
        out.append("overlap_grad_reduce: its bucket hooks skip while capturing (untested)")
    if (getattr(args, "context_parallel_size", 1) or 1) > 1:
        out.append("it is not run with context parallelism (its K/V all-gathers are not "
                   "captured or tested): it needs --context-parallel-size 1")
    if getattr(args, "recompute_granularity", None) == "full":
        out.append("it runs without --recompute-granularity full (megatron's checkpoint saves "
                   "and restores the RNG states on the host around each recomputed layer)")
    return out


def cuda_graph_impl(args: argparse.Namespace, cuda: bool) -> str:
    """The CUDA graph the run uses: ``--cuda-graph-impl``, with ``auto`` resolved to
    ``full_iteration`` where nothing stands in its way, else ``none``.

    Raises:
        ArgumentError: ``full_iteration`` asked for where it cannot run, or fewer than one
            warm-up step.
    """
    impl = getattr(args, "cuda_graph_impl", "none")
    if impl == "none":
        return impl
    obstacles = _cuda_graph_obstacles(args, cuda)
    if impl == "auto":
        return "none" if obstacles else "full_iteration"
    if obstacles:
        raise ArgumentError(f"--cuda-graph-impl full_iteration: {obstacles[0]}")
    if args.cuda_graph_warmup_steps < 1:
        raise ArgumentError(f"--cuda-graph-warmup-steps {args.cuda_graph_warmup_steps}: "
                            "at least 1 eager step must run before the capture")
    return impl
