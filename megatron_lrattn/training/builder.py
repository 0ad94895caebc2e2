"""Build config, model, optimizer and LR schedule from parsed arguments."""

from __future__ import annotations

import argparse
import contextlib
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallel

from megatron_lrattn.model.config import LRAttnResConfig
from megatron_lrattn.training.fusions import fusion_config, use_fused_adamw
from megatron_lrattn.model.gpt import LRAttnResGPTModel
from megatron_lrattn.model.init import init_by_global_name
from megatron_lrattn.model.spec import get_lr_attnres_block_spec, get_lr_attnres_layer_spec
from megatron_lrattn.training.schedule import build_scheduler


SPEC_BACKENDS = {"local": "local", "transformer_engine": "te"}
"""``--transformer-impl`` -> ``get_lr_attnres_layer_spec(backend=...)``."""


def virtual_stages(args: argparse.Namespace) -> Optional[int]:
    """Virtual pipeline stages per rank from ``--num-layers-per-virtual-pipeline-stage``
    (None without interleaving)."""
    per_virtual = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if per_virtual is None:
        return None
    return args.num_layers // (args.pipeline_model_parallel_size * per_virtual)


def build_config(args: argparse.Namespace, bf16: bool) -> LRAttnResConfig:
    """``LRAttnResConfig`` from command-line arguments (raises ``ConfigError`` on bad values)."""
    from megatron.core.distributed import finalize_model_grads

    dtype = torch.bfloat16 if bf16 else torch.float32
    virtual = virtual_stages(args)
    return LRAttnResConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.hidden_size // args.num_attention_heads,
        normalization=args.normalization,
        layernorm_epsilon=1e-5,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        qk_layernorm=args.qk_layernorm,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        # FP8 (TE spec only); arguments recorded by older versions have no such fields.
        fp8=getattr(args, "fp8_format", None),
        fp8_recipe=getattr(args, "fp8_recipe", "delayed"),
        fp8_amax_history_len=getattr(args, "fp8_amax_history_len", 1),
        fp8_amax_compute_algo=getattr(args, "fp8_amax_compute_algo", "most_recent"),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        # older checkpoints' recorded arguments have no context-parallel size
        context_parallel_size=getattr(args, "context_parallel_size", 1) or 1,
        virtual_pipeline_model_parallel_size=virtual,
        # The interleaved schedule takes no per-stage shapes: p2p exchanges them (megatron
        # refuses that with its default MoE dispatcher, unused here: no MoE).
        variable_seq_lengths=virtual is not None,
        moe_token_dispatcher_type="alltoall" if virtual is not None else "allgather",
        # With P = 2 the interleaved ring sends activations and gradients between the same
        # two ranks, and ours differ in shape. Messages between one pair of ranks are
        # matched in posting order (gloo and NCCL alike), and megatron's combined
        # forward+backward exchange (and its shape exchange) posts the two directions in an
        # order that pairs an activation with a gradient. The overlapped schedule exchanges
        # each direction in its own call, and unbatched p2p keeps the directions on separate
        # communicators.
        batch_p2p_comm=virtual is None,
        overlap_p2p_comm=virtual is not None,
        sequence_parallel=args.sequence_parallel,
        recompute_granularity=getattr(args, "recompute_granularity", None),
        recompute_method=getattr(args, "recompute_method", None),
        recompute_num_layers=getattr(args, "recompute_num_layers", None),
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        finalize_model_grads_func=finalize_model_grads,
        residual=args.residual,
        key_type=args.key,
        key_rank=args.rank,
        num_blocks=args.num_blocks,
        key_norm_eps=args.key_norm_eps,
        depth_scale=args.depth_scale,
        depth_backend=args.depth_backend,
        depth_schedule=getattr(args, "depth_schedule", "auto"),
        fuse_depth_norm=getattr(args, "fuse_depth_norm", True),
        recompute_mlp_activation=getattr(args, "recompute_mlp_activation", True),
        **fusion_config(args, torch.cuda.is_available()),
    )


def build_model(config: LRAttnResConfig, args: argparse.Namespace, vocab_size: int,
                vp_stage=None):
    """This rank's model chunk (pre/post-process from its pipeline position), its initial
    weights drawn from ``args.seed`` and each parameter's global name
    (``megatron_lrattn.model.init``), so every layout starts from the same model.

    Args:
        vp_stage: virtual pipeline stage of the chunk (interleaved schedule), else None.
    """
    from megatron.core import parallel_state

    backend = SPEC_BACKENDS[getattr(args, "transformer_impl", "local")]
    layer_spec = get_lr_attnres_layer_spec(config, backend=backend, qk_layernorm=args.qk_layernorm,
                                           rope_fusion=getattr(args, "rope_fusion", True))
    virtual = dict(ignore_virtual=False, vp_stage=vp_stage) if vp_stage is not None else {}
    model = LRAttnResGPTModel(
        config,
        get_lr_attnres_block_spec(config, layer_spec, vp_stage=vp_stage),
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(**virtual),
        post_process=parallel_state.is_pipeline_last_stage(**virtual),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
    )
    if config.perform_initialization:
        init_by_global_name(model, config, args.seed)
    return model


def build_model_chunks(config: LRAttnResConfig, args: argparse.Namespace, vocab_size: int
                       ) -> List:
    """This rank's model chunks: one per virtual pipeline stage (interleaved schedule),
    sharing one rank-local depth-source cache, else a list of the one model."""
    from megatron_lrattn.model.block import link_model_chunks

    virtual = config.virtual_pipeline_model_parallel_size
    if not virtual:
        return [build_model(config, args, vocab_size)]
    chunks = [build_model(config, args, vocab_size, vp_stage=v) for v in range(virtual)]
    link_model_chunks(chunks)
    return chunks


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Vocabulary padded to a multiple of ``multiple * tp`` (Megatron's convention)."""
    m = multiple * tp
    return ((vocab_size + m - 1) // m) * m


def resolve_overlap(args: argparse.Namespace, dp: int) -> None:
    """Resolve ``--overlap-grad-reduce`` / ``--overlap-param-gather`` in place: an explicit
    flag wins; unset (None) means both overlap when the data-parallel size ``dp`` is above
    1, the parameter all-gather only with the distributed optimizer (whose step it
    replaces), as Megatron-LM's multi-GPU launch scripts set them; the results equal the
    non-overlapped ones bit for bit where the buckets are the same (``tests/test_overlap.py``).
    megatron-core's ``DistributedDataParallelConfig`` itself defaults both to off.

    Raises:
        ArgumentError: ``--overlap-param-gather`` without the distributed optimizer or
            without ``--overlap-grad-reduce``.
    """
    from megatron_lrattn.training.arg_types import ArgumentError

    dist_opt = bool(getattr(args, "use_distributed_optimizer", False))
    if getattr(args, "overlap_grad_reduce", None) is None:
        args.overlap_grad_reduce = dp > 1
    if getattr(args, "overlap_param_gather", None) is None:
        args.overlap_param_gather = dp > 1 and dist_opt and args.overlap_grad_reduce
    if args.overlap_param_gather and not dist_opt:
        raise ArgumentError("--overlap-param-gather requires --use-distributed-optimizer")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise ArgumentError("--overlap-param-gather requires --overlap-grad-reduce")


def ddp_config(args: argparse.Namespace):
    """megatron-core's ``DistributedDataParallelConfig`` from the resolved flags
    (``resolve_overlap`` first): fp32 gradient reduction, Megatron-LM's meanings of
    ``--overlap-grad-reduce``, ``--overlap-param-gather`` (param all-gathers aligned
    across pipeline stages only with interleaving, as Megatron-LM does),
    ``--ddp-bucket-size`` (parameters per bucket; None: megatron's max(4e7, 1e6 x DP)
    with overlap, one bucket without) and ``--ddp-average-in-collective``."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
        overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
        align_param_gather=virtual_stages(args) is not None,
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
        bucket_size=getattr(args, "ddp_bucket_size", None),
        average_in_collective=bool(getattr(args, "ddp_average_in_collective", False)),
    )


class ParamSyncingDDP(DistributedDataParallel):
    """megatron's DDP whose state dicts first finish a pending overlapped param
    all-gather (``--overlap-param-gather`` leaves it to the next forward's pre-hooks,
    so between an optimizer step and that forward the non-local shards are stale;
    Megatron-LM disables the pre-hooks around checkpoint saves for the same reason)."""

    def sync_params(self) -> None:
        """All-gather every bucket's updated parameters now (no-op without overlap)."""
        if self.use_forward_hook:
            self.disable_forward_pre_hook(param_sync=True)
            self.enable_forward_pre_hook()

    def state_dict(self, *a, **k):
        self.sync_params()
        return super().state_dict(*a, **k)

    def sharded_state_dict(self, *a, **k):
        self.sync_params()
        return super().sharded_state_dict(*a, **k)


def wrap_model(model, config: LRAttnResConfig, args):
    """Move to the device, cast for bf16 and wrap in megatron's DDP (``ddp_config(args)``;
    call ``resolve_overlap`` first).

    Args:
        args: the parsed arguments, or a bool ``use_distributed_optimizer`` (no overlap,
            one bucket: what unit tests build).
    """
    from megatron.core.transformer.module import Float16Module

    if isinstance(args, bool):
        args = argparse.Namespace(use_distributed_optimizer=args, overlap_grad_reduce=False,
                                  overlap_param_gather=False)

    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    if config.bf16:
        model = Float16Module(config, model)
    return ParamSyncingDDP(config, ddp_config(args), model)


def torch_adamw_for_fused_step(args: argparse.Namespace, bf16: bool) -> bool:
    """Whether megatron-core must build torch's ``AdamW`` (not TE's or Apex's ``FusedAdam``,
    which it picks when either is installed) because the run will step it with the one-kernel
    step (``megatron_lrattn.training.optimizer_step``): CUDA, bf16, Triton present, the step
    not turned off. The kernel replaces the inner optimizer's step
    and keeps torch's state layout (per-parameter ``step``, ``exp_avg``, ``exp_avg_sq``)."""
    import importlib.util

    from megatron_lrattn.training.fusions import fused_optimizer_step

    return bool(torch.cuda.is_available() and bf16 and fused_optimizer_step(args)
                and importlib.util.find_spec("triton") is not None)


@contextlib.contextmanager
def _torch_adamw_under_megatron(enabled: bool):
    """megatron-core chooses its Adam class from a module flag set at import
    (``USING_PYTORCH_OPTIMIZER``); while ``enabled`` it is set to torch's."""
    from megatron.core import optimizer as mcore_optimizer

    before = getattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", None)
    if not enabled or before is None or before:
        yield
        return
    mcore_optimizer.USING_PYTORCH_OPTIMIZER = True
    try:
        yield
    finally:
        mcore_optimizer.USING_PYTORCH_OPTIMIZER = before


def build_optimizer(models: List, config: LRAttnResConfig, args: argparse.Namespace
                    ) -> Tuple[object, object]:
    """AdamW (1-D parameters, i.e. norms, biases and depth queries, get no weight decay)
    and the LR schedule (``schedule.build_scheduler``: warm-up then cosine, linear, constant
    or WSD)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        clip_grad=args.clip_grad,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
    )
    with _torch_adamw_under_megatron(torch_adamw_for_fused_step(args, config.bf16)):
        optimizer = get_megatron_optimizer(opt_config, models)
    use_fused_adamw(optimizer, getattr(args, "fused_adamw", True))
    scheduler = build_scheduler(optimizer, args)
    return optimizer, scheduler
