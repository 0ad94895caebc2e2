"""``lrattn-plan``: predicted memory and step time of parallel layouts on a cluster.

For a preset or an ``lrattn-pretrain --config`` file (and model flags), a global batch and
a cluster, lists TP/CP/PP/VPP/DP layouts (CP: context parallelism, every power of two
whose chunks split the sequence, or only ``--context-parallel-size``; a layout that does
not fit is listed again with activation recomputation) with the predicted memory per GPU
and step time of ``megatron_lrattn.analysis.plan_model``, recommends the fastest that fits and
prints its memory and time breakdown. With ``--json`` it prints one JSON object:
``recommended`` (null when nothing fits) carries ``summary``, the layout in one line, and
``flags``, the ``lrattn-pretrain`` flags that realise it (``pretrain_flags``); ``reason``
says in one line why nothing is recommended (null otherwise); ``context_parallel_size`` is
the recommended CP. Imports neither torch nor megatron-core.

Example, the 8b preset on 64 GPUs (8 nodes of 8 H200s), at 32k tokens a sequence, and the
flags for a preset file on 4 nodes::

    lrattn-plan --preset 8b --gpus 64 --global-batch-size 256
    lrattn-plan --preset 8b --gpus 64 --global-batch-size 64 --seq-length 32768
    lrattn-plan --config examples/presets/1b.yaml --nodes 4 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, NoReturn, Optional, Sequence

from megatron_lrattn.analysis.flops import KEY_TYPES, RESIDUAL_MODES, FlopsConfigError
from megatron_lrattn.analysis.plan import plan, recommend
from megatron_lrattn.analysis.plan_layouts import Cluster, context_parallel_sizes
from megatron_lrattn.analysis.plan_model import USABLE_MEMORY, Prediction, preset_shape
from megatron_lrattn.cli.common import run_cli
from megatron_lrattn.training.arg_types import ArgumentError
from megatron_lrattn.training.presets import PRESETS

PROG = "lrattn-plan"
MODEL_FLAGS = ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
               "--num-query-groups", "--seq-length", "--rank", "--num-blocks")
"""Integer model flags, named as ``lrattn-pretrain``'s (``--residual`` and ``--key`` too)."""
FIXED_LAYOUT_KEYS = ("num_layers_per_virtual_pipeline_stage", "sequence_parallel",
                     "use_distributed_optimizer", "recompute_granularity", "recompute_method",
                     "recompute_num_layers", "recompute_activations")
"""Config keys the recommended flags could not undo (``lrattn-pretrain`` has no flag that
switches them back off): a config file that sets them is refused."""


class PlanArgumentError(ValueError):
    """A bad command-line value; reported as one ``lrattn-plan: error: ...`` line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise PlanArgumentError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (model defaults come from ``--preset``)."""
    p = _Parser(prog=PROG, description="Predict memory per GPU and step time of TP/CP/PP/VPP/DP "
                                       "layouts and recommend the fastest that fits.")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="named model (default: 1b; with --config the file's preset key, else "
                        "tiny, as for lrattn-pretrain)")
    p.add_argument("--config", default=None,
                   help="an lrattn-pretrain --config file (YAML or JSON, e.g. "
                        "examples/presets/1b.yaml): its model and global batch over the "
                        "preset's, as lrattn-pretrain reads it (default: none)")
    g = p.add_argument_group("model (default: the preset's or the config file's; given "
                             "ones are repeated in the recommended flags)")
    for flag in MODEL_FLAGS:
        g.add_argument(flag, type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=4096,
                   help="V (default 4096: the embedded corpus's tokenizer, as measured)")
    g.add_argument("--residual", choices=RESIDUAL_MODES, default=None)
    g.add_argument("--key", choices=KEY_TYPES, default=None)
    g = p.add_argument_group("batch")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="sequences per step (default: the config file's, else the "
                        "preset's)")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="only this micro-batch size (default: try 1, 2, 4, 8)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--context-parallel-size", type=int, default=None,
                   help="only this CP size (default: try the powers of two up to the GPUs "
                        "whose 2 x CP chunks split the sequence)")
    g.add_argument("--no-recompute", action="store_true",
                   help="no activation recomputation (default: a layout that does not fit "
                        "is tried with the fewest recomputed layers that make it fit)")
    g = p.add_argument_group("cluster")
    g.add_argument("--gpus", type=int, default=None, help="total GPUs (default: nodes x "
                                                         "GPUs per node)")
    g.add_argument("--nodes", type=int, default=None, help="nodes (default: 1)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="(default: 8)")
    g.add_argument("--gpu-memory-gib", type=float, default=141.0,
                   help="memory per GPU (default: 141, H200)")
    g.add_argument("--intra-node-gbps", type=float, default=3600.0,
                   help="NVLink Gbit/s per GPU and direction (default: 3600, H200)")
    g.add_argument("--inter-node-gbps", type=float, default=400.0,
                   help="network Gbit/s per GPU (default: 400, one NDR NIC per GPU)")
    g.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 peak per GPU (default: 989, H100/H200 SXM)")
    g = p.add_argument_group("output")
    g.add_argument("--top", type=int, default=12, help="table rows (default: 12)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _cluster(args: argparse.Namespace) -> Cluster:
    if args.gpus is None:
        gpus = args.nodes * args.gpus_per_node if args.nodes is not None else 1
    else:
        gpus = args.gpus
        if args.nodes is not None and args.nodes * args.gpus_per_node != gpus:
            raise PlanArgumentError(f"--gpus {gpus} disagrees with --nodes {args.nodes} x "
                                    f"--gpus-per-node {args.gpus_per_node}")
    try:
        return Cluster(gpus=gpus, gpus_per_node=args.gpus_per_node,
                       gpu_memory_gib=args.gpu_memory_gib, peak_tflops=args.peak_tflops,
                       intra_node_gbps=args.intra_node_gbps,
                       inter_node_gbps=args.inter_node_gbps)
    except ValueError as e:
        raise PlanArgumentError(str(e)) from None


_HEADER = ("  TP  CP  PP VPP    DP mbs micro distopt recompute  mem GiB fits   step ms     "
           "tokens/s  MFU% bubble ms comm ms CP comm ms")


def _recompute_text(p: Prediction) -> str:
    """``-``, ``uniform`` or ``block K`` (K recomputed layers per model chunk)."""
    if p.recompute == "block":
        return f"block {p.layout.recompute_layers}"
    return "-" if p.recompute == "none" else p.recompute


def _row(p: Prediction, mark: str) -> str:
    lay = p.layout
    comm = p.tp_comm_s + p.cp_comm_s + p.dp_comm_s + p.pp_comm_s
    return (f"{mark}{lay.tp:>2} {lay.cp:>3} {lay.pp:>3} {lay.vpp:>3} {lay.dp:>5} "
            f"{lay.micro_batch:>3} {p.num_micro:>5} "
            f"{'yes' if lay.distributed_optimizer else 'no':>7} {_recompute_text(p):>9} "
            f"{p.memory_gib:>8.1f} "
            f"{'yes' if p.fits else 'NO':>4} {p.step_s * 1e3:>9.1f} {p.tokens_per_s:>12,.0f} "
            f"{100 * p.mfu:>5.1f} {p.bubble_s * 1e3:>9.1f} {comm * 1e3:>7.1f} "
            f"{p.cp_comm_s * 1e3:>10.1f}")


def _breakdown(p: Prediction) -> str:
    """Two lines: the recommended layout's memory and step-time parts."""
    return (f"  memory GiB: weights {p.weights_gib:.1f}, grads {p.grads_gib:.1f}, optimizer "
            f"{p.optimizer_gib:.1f}, activations {p.activations_gib:.1f}, depth state "
            f"{p.depth_state_gib:.1f}, logits {p.logits_gib:.1f}\n"
            f"  step ms: compute {p.compute_s * 1e3:.1f}, recompute {p.recompute_s * 1e3:.1f}, "
            f"optimizer {p.optimizer_s * 1e3:.1f}, TP comm {p.tp_comm_s * 1e3:.1f}, CP comm "
            f"{p.cp_comm_s * 1e3:.1f}, DP comm {p.dp_comm_s * 1e3:.1f}, PP comm "
            f"{p.pp_comm_s * 1e3:.1f}, bubble {p.bubble_s * 1e3:.1f}")


def layout_text(p: Prediction) -> str:
    """One line: the layout of ``p``, its predicted step time and memory per GPU."""
    lay = p.layout
    recompute = {"none": "", "uniform": ", full recompute of every layer",
                 "block": f", full recompute of {lay.recompute_layers} layer(s) per chunk"}
    return (f"TP={lay.tp} CP={lay.cp} PP={lay.pp} VPP={lay.vpp} DP={lay.dp} micro-batch "
            f"{lay.micro_batch}{', distributed optimizer' if lay.distributed_optimizer else ''}"
            f"{', overlapped grad reduce' if lay.dp * lay.cp > 1 else ''}"
            f"{recompute[p.recompute]}: {p.step_s * 1e3:.1f} ms, {p.memory_gib:.1f} GiB per GPU")


def pretrain_flags(p: Prediction, num_layers: int, global_batch: int,
                   model_flags: Sequence[str] = ()) -> List[str]:
    """The ``lrattn-pretrain`` flags that realise the layout of ``p``.

    Args:
        p: a prediction of ``analysis.plan_model``.
        num_layers: L of the model planned.
        global_batch: the global batch planned.
        model_flags: model flags to repeat first (those given to ``lrattn-plan``).

    Returns:
        ``model_flags``, then the global and micro-batch, TP (with ``--sequence-parallel``
        when above 1), PP (and the layers of a virtual stage when V > 1), CP, the
        distributed optimizer when used, both overlap flags explicitly on or off as
        modelled (on when gradients are reduced over DP x CP > 1 ranks, the parameter
        all-gather with the distributed optimizer), and the full-recompute flags when
        layers are recomputed.
    """
    lay = p.layout
    out = list(model_flags) + [
        "--global-batch-size", str(global_batch), "--micro-batch-size", str(lay.micro_batch),
        "--tensor-model-parallel-size", str(lay.tp)]
    if lay.tp > 1:
        out.append("--sequence-parallel")
    out += ["--pipeline-model-parallel-size", str(lay.pp)]
    if lay.vpp > 1:
        out += ["--num-layers-per-virtual-pipeline-stage", str(num_layers // (lay.pp * lay.vpp))]
    out += ["--context-parallel-size", str(lay.cp)]
    if lay.distributed_optimizer:
        out.append("--use-distributed-optimizer")
    reduce = lay.overlap and lay.dp * lay.cp > 1
    gather = reduce and lay.distributed_optimizer
    out += ["--overlap-grad-reduce" if reduce else "--no-overlap-grad-reduce",
            "--overlap-param-gather" if gather else "--no-overlap-param-gather"]
    if p.recompute != "none":
        units = 1 if p.recompute == "uniform" else lay.recompute_layers
        out += ["--recompute-granularity", "full", "--recompute-method", p.recompute,
                "--recompute-num-layers", str(units)]
    return out


def _read_config(args: argparse.Namespace) -> Dict[str, Any]:
    """``--config``'s values as ``lrattn-pretrain`` reads them (``training.config_file``),
    with ``args.preset`` set to the base preset as ``lrattn-pretrain`` picks it."""
    if args.config is None:
        args.preset = args.preset or "1b"
        return {}
    from megatron_lrattn.training.arguments import build_parser as pretrain_parser
    from megatron_lrattn.training.config_file import load_config_file

    config = load_config_file(args.config, pretrain_parser())
    named = config.get("preset")
    if named is not None and args.preset is not None and args.preset != named:
        raise PlanArgumentError(f"--preset {args.preset} disagrees with preset {named!r} in "
                                f"{args.config}")
    args.preset = named or args.preset or "tiny"
    fixed = [k for k in FIXED_LAYOUT_KEYS if config.get(k) not in (None, False)]
    if fixed:
        raise PlanArgumentError(f"{args.config}: {', '.join(fixed)} fix(es) a layout choice "
                                "that the recommended flags cannot undo; remove it from the "
                                "file (the planner chooses) or set the whole layout by hand")
    return config


def _reason(preds: Sequence[Prediction], gbs: int, seq_length: int,
            cluster: Cluster) -> str:
    """One line: why no layout is recommended."""
    if not preds:
        return (f"no layout: global batch {gbs} or sequence length {seq_length} does not "
                f"split over {cluster.gpus} GPU(s)")
    low = min(preds, key=lambda p: p.memory_gib)
    return (f"no layout fits in memory: the smallest needs {low.memory_gib:.1f} GiB per GPU "
            f"({layout_text(low).split(':')[0]}); {USABLE_MEMORY * cluster.gpu_memory_gib:.1f} "
            f"of {cluster.gpu_memory_gib:g} GiB are usable")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit code (2 on a bad input)."""

    def _main() -> int:
        args = build_parser().parse_args(argv)
        for name in ("global_batch_size", "micro_batch_size", "context_parallel_size", "top",
                     "nodes"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise PlanArgumentError(f"--{name.replace('_', '-')} {value} must be >= 1")
        cluster = _cluster(args)
        config = _read_config(args)
        given = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                               "num_attention_heads", "num_query_groups",
                                               "seq_length", "rank", "num_blocks", "residual",
                                               "key")}
        shape = preset_shape(args.preset, vocab_size=args.vocab_size, config=config, **given)
        model_flags = [x for k, v in given.items() if v is not None
                       for x in (f"--{k.replace('_', '-')}", str(v))]
        gbs = (args.global_batch_size or config.get("global_batch_size")
               or PRESETS[args.preset]["global_batch_size"])
        mbs = [args.micro_batch_size] if args.micro_batch_size else None
        cp = args.context_parallel_size
        if cp is not None and cp > cluster.gpus:
            raise PlanArgumentError(f"--context-parallel-size {cp} exceeds the {cluster.gpus} "
                                    f"GPU(s)")
        if cp is not None and cp > 1 and shape.seq_length % (2 * cp):
            raise PlanArgumentError(f"--context-parallel-size {cp}: sequence length "
                                    f"{shape.seq_length} is not divisible by 2 x CP = {2 * cp}")
        te = config.get("transformer_impl") == "transformer_engine"
        if te and cp is not None and cp > 1:
            raise PlanArgumentError(f"--context-parallel-size {cp}: {args.config} sets "
                                    "transformer_impl transformer_engine, which lrattn-pretrain "
                                    "runs with CP = 1 only")
        cps = [cp] if cp else [1] if te else context_parallel_sizes(cluster.gpus)
        # lrattn-pretrain refuses full recompute with FP8 under depth attention
        recompute = not args.no_recompute and not (
            config.get("fp8_format") and shape.residual != "standard")
        preds = plan(shape, gbs, cluster, mbs, cps, recompute=recompute)
        best = recommend(preds)
        reason = None if best else _reason(preds, gbs, shape.seq_length, cluster)
        if args.json:
            rec = None
            if best is not None:
                rec = dict(best.as_dict(), summary=layout_text(best),
                           flags=pretrain_flags(best, shape.num_layers, gbs, model_flags))
            print(json.dumps({"preset": args.preset, "config": args.config,
                              "global_batch_size": gbs, "cluster": vars(cluster),
                              "context_parallel_size": best.layout.cp if best else None,
                              "recommended": rec, "reason": reason,
                              "layouts": [p.as_dict() for p in preds]}))
            return 0
        source = f"{args.config} (over preset {args.preset})" if args.config else args.preset
        print(f"{source}: L={shape.num_layers} d={shape.hidden_size} "
              f"h={shape.ffn_hidden_size} seq={shape.seq_length} {shape.residual}; global "
              f"batch {gbs}; {cluster.gpus} GPU(s), {cluster.gpus_per_node} per node, "
              f"{cluster.gpu_memory_gib:g} GiB; CP tried: {', '.join(map(str, cps))}")
        if not preds:
            print(reason)
            return 0
        print(_HEADER)
        shown = preds[:args.top]
        if best is not None and best not in shown:
            shown.append(best)
        for p in shown:
            print(_row(p, "*" if p is best else " "))
        if best is None:
            print(reason)
        else:
            print(f"recommended (*): {layout_text(best)}")
            print(_breakdown(best))
            print("  lrattn-pretrain flags: "
                  + " ".join(pretrain_flags(best, shape.num_layers, gbs, model_flags)))
        return 0

    return run_cli(PROG, _main, (PlanArgumentError, FlopsConfigError, ArgumentError))


if __name__ == "__main__":
    sys.exit(main())
