"""``lrattn-plan``: predicted memory and step time of parallel layouts on a cluster.

For a preset (or model flags), a global batch and a cluster, lists TP/CP/PP/VPP/DP layouts
(CP: context parallelism, every power of two whose chunks split the sequence, or only
``--context-parallel-size``) with the predicted memory per GPU and step time of
``megatron_lrattn.analysis.plan``, recommends the fastest that fits and prints its memory
and time breakdown; with ``--json`` prints one JSON object (``context_parallel_size`` is
the recommended layout's CP, null when none fits). Imports neither torch nor megatron-core.

Example, the 8b preset on 64 GPUs (8 nodes of 8 H200s), then at 32k tokens a sequence::

    lrattn-plan --preset 8b --gpus 64 --global-batch-size 256
    lrattn-plan --preset 8b --gpus 64 --global-batch-size 64 --seq-length 32768
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn, Optional, Sequence

from megatron_lrattn.analysis.flops import KEY_TYPES, RESIDUAL_MODES, FlopsConfigError
from megatron_lrattn.analysis.plan import (
    Cluster,
    context_parallel_sizes,
    plan,
    preset_shape,
    recommend,
)
from megatron_lrattn.cli.common import run_cli
from megatron_lrattn.training.presets import PRESETS

PROG = "lrattn-plan"


class PlanArgumentError(ValueError):
    """A bad command-line value; reported as one ``lrattn-plan: error: ...`` line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise PlanArgumentError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (model defaults come from ``--preset``)."""
    p = _Parser(prog=PROG, description="Predict memory per GPU and step time of TP/CP/PP/VPP/DP "
                                       "layouts and recommend the fastest that fits.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b",
                   help="named model (default: 1b)")
    g = p.add_argument_group("model (default: the preset's)")
    for flag in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                 "--num-query-groups", "--seq-length", "--rank", "--num-blocks"):
        g.add_argument(flag, type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=4096,
                   help="V (default 4096: the embedded corpus's tokenizer, as measured)")
    g.add_argument("--residual", choices=RESIDUAL_MODES, default=None)
    g.add_argument("--key", choices=KEY_TYPES, default=None)
    g = p.add_argument_group("batch")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="sequences per step (default: the preset's)")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="only this micro-batch size (default: try 1, 2, 4, 8)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--context-parallel-size", type=int, default=None,
                   help="only this CP size (default: try the powers of two up to the GPUs "
                        "whose 2 x CP chunks split the sequence)")
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


_HEADER = ("  TP  CP  PP VPP    DP mbs micro distopt  mem GiB fits   step ms     tokens/s  MFU% "
           "bubble ms comm ms CP comm ms")


def _row(p, mark: str) -> str:
    lay = p.layout
    comm = p.tp_comm_s + p.cp_comm_s + p.dp_comm_s + p.pp_comm_s
    return (f"{mark}{lay.tp:>2} {lay.cp:>3} {lay.pp:>3} {lay.vpp:>3} {lay.dp:>5} "
            f"{lay.micro_batch:>3} {p.num_micro:>5} "
            f"{'yes' if lay.distributed_optimizer else 'no':>7} {p.memory_gib:>8.1f} "
            f"{'yes' if p.fits else 'NO':>4} {p.step_s * 1e3:>9.1f} {p.tokens_per_s:>12,.0f} "
            f"{100 * p.mfu:>5.1f} {p.bubble_s * 1e3:>9.1f} {comm * 1e3:>7.1f} "
            f"{p.cp_comm_s * 1e3:>10.1f}")


def _breakdown(p) -> str:
    """Two lines: the recommended layout's memory and step-time parts."""
    return (f"  memory GiB: weights {p.weights_gib:.1f}, grads {p.grads_gib:.1f}, optimizer "
            f"{p.optimizer_gib:.1f}, activations {p.activations_gib:.1f}, depth state "
            f"{p.depth_state_gib:.1f}, logits {p.logits_gib:.1f}\n"
            f"  step ms: compute {p.compute_s * 1e3:.1f}, optimizer {p.optimizer_s * 1e3:.1f}, "
            f"TP comm {p.tp_comm_s * 1e3:.1f}, CP comm {p.cp_comm_s * 1e3:.1f}, DP comm "
            f"{p.dp_comm_s * 1e3:.1f}, PP comm {p.pp_comm_s * 1e3:.1f}, bubble "
            f"{p.bubble_s * 1e3:.1f}")


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
        shape = preset_shape(args.preset, vocab_size=args.vocab_size, **{
            k: getattr(args, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                          "num_attention_heads", "num_query_groups",
                                          "seq_length", "rank", "num_blocks", "residual",
                                          "key")})
        gbs = args.global_batch_size or PRESETS[args.preset]["global_batch_size"]
        mbs = [args.micro_batch_size] if args.micro_batch_size else None
        cp = args.context_parallel_size
        if cp is not None and cp > cluster.gpus:
            raise PlanArgumentError(f"--context-parallel-size {cp} exceeds the {cluster.gpus} "
                                    f"GPU(s)")
        if cp is not None and cp > 1 and shape.seq_length % (2 * cp):
            raise PlanArgumentError(f"--context-parallel-size {cp}: sequence length "
                                    f"{shape.seq_length} is not divisible by 2 x CP = {2 * cp}")
        cps = [cp] if cp else context_parallel_sizes(cluster.gpus)
        preds = plan(shape, gbs, cluster, mbs, cps)
        best = recommend(preds)
        if args.json:
            print(json.dumps({"preset": args.preset, "global_batch_size": gbs,
                              "cluster": vars(cluster),
                              "context_parallel_size": best.layout.cp if best else None,
                              "recommended": best.as_dict() if best else None,
                              "layouts": [p.as_dict() for p in preds]}))
            return 0
        print(f"{args.preset}: L={shape.num_layers} d={shape.hidden_size} "
              f"h={shape.ffn_hidden_size} seq={shape.seq_length} {shape.residual}; global "
              f"batch {gbs}; {cluster.gpus} GPU(s), {cluster.gpus_per_node} per node, "
              f"{cluster.gpu_memory_gib:g} GiB; CP tried: {', '.join(map(str, cps))}")
        if not preds:
            print("no layout: the batch or the sequence does not split over these GPUs")
            return 0
        print(_HEADER)
        shown = preds[:args.top]
        if best is not None and best not in shown:
            shown.append(best)
        for p in shown:
            print(_row(p, "*" if p is best else " "))
        if best is None:
            print("no layout fits in memory")
        else:
            lay = best.layout
            print(f"recommended (*): TP={lay.tp} CP={lay.cp} PP={lay.pp} VPP={lay.vpp} "
                  f"DP={lay.dp} micro-batch {lay.micro_batch}"
                  f"{', distributed optimizer' if lay.distributed_optimizer else ''}"
                  f"{', overlapped grad reduce' if lay.dp * lay.cp > 1 else ''}: "
                  f"{best.step_s * 1e3:.1f} ms, {best.memory_gib:.1f} GiB per GPU")
            print(_breakdown(best))
        return 0

    return run_cli(PROG, _main, (PlanArgumentError, FlopsConfigError))


if __name__ == "__main__":
    sys.exit(main())
