"""Turn measured arms into numbers, ratios to ``standard``, a table, JSON and a chart."""

from __future__ import annotations

import json
import logging
import os
import statistics
from typing import Dict, List, Optional

from megatron_lrattn.analysis.flops import parameter_counts
from megatron_lrattn.profiling.arms import flops_per_token, mfu, model_shape
from megatron_lrattn.profiling.runner import ArmRun

logger = logging.getLogger(__name__)

RATIO_FIELDS = ("median_step_time_s", "tokens_per_s_per_gpu", "mfu", "peak_memory_bytes")
"""Per-arm numbers that get a ratio to the ``standard`` arm (``<field>_vs_standard``)."""


def arm_result(run: ArmRun, args, vocab_size: int, tokens_per_step: int, world_size: int,
               peak_tflops: float, cuda: bool) -> Dict[str, object]:
    """Every number of one arm (ratios are added by ``add_ratios``)."""
    from megatron_lrattn.profiling.arms import arm_args

    shape = model_shape(arm_args(args, run.arm), vocab_size)
    flops = flops_per_token(shape)
    step = statistics.median(run.step_times_s)
    share = None
    if run.depth_read_s is not None and run.profiled_step_s:
        share = run.depth_read_s / run.profiled_step_s
    return {
        "arm": run.arm.name,
        "label": run.arm.label,
        "residual": run.arm.residual,
        "key": run.arm.key,
        "rank": None if run.arm.residual == "standard" else run.arm.rank,
        "num_blocks": None if run.arm.residual == "standard" else run.arm.num_blocks,
        "params": parameter_counts(shape).total,
        "step_times_s": run.step_times_s,
        "median_step_time_s": step,
        "min_step_time_s": min(run.step_times_s),
        "max_step_time_s": max(run.step_times_s),
        "tokens_per_s_per_gpu": tokens_per_step / step / world_size,
        "model_flops_per_token": flops["model"],
        "depth_read_flops_per_token": flops["depth_reads"],
        "flops_per_token": flops["total"],
        "mfu": mfu(flops["total"], tokens_per_step, step, world_size, peak_tflops),
        "peak_memory_bytes": run.resident_bytes + run.step_peak_bytes if cuda else None,
        "resident_memory_bytes": run.resident_bytes if cuda else None,
        "process_peak_memory_bytes": run.process_peak_bytes if cuda else None,
        "depth_read_time_s": run.depth_read_s,
        "profiled_step_time_s": run.profiled_step_s,
        "depth_read_share": share,
        "top_ops_profiled_step": [{"name": k, "time_s": t} for k, t in run.top_ops],
        # every step sees one fixed batch: a step that trains lowers the loss
        "first_loss": run.losses[0] if run.losses else None,
        "last_loss": run.losses[-1] if run.losses else None,
    }


def add_ratios(results: List[Dict[str, object]]) -> None:
    """Add ``<field>_vs_standard`` for every field of ``RATIO_FIELDS`` (None without a
    ``standard`` arm or a value)."""
    base = next((r for r in results if r["arm"] == "standard"), None)
    for r in results:
        for f in RATIO_FIELDS:
            a, b = r[f], (base or {}).get(f)
            r[f + "_vs_standard"] = a / b if a is not None and b else None


def _fmt(value: Optional[float], spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{suffix}"


def format_table(results: List[Dict[str, object]]) -> str:
    """A plain-text table: one row per arm, ratios to ``standard`` in brackets, and the loss
    of the first and last step on the fixed batch (falling when the step trains)."""
    head = ["arm", "step ms", "tok/s/GPU", "MFU", "peak mem GB", "depth-read share",
            "loss first -> last"]
    rows = [head]
    for r in results:
        rows.append([
            r["label"],
            f"{r['median_step_time_s'] * 1e3:.1f} ({_fmt(r['median_step_time_s_vs_standard'], '.3f')})",
            f"{r['tokens_per_s_per_gpu']:,.0f}",
            f"{r['mfu'] * 100:.1f}% ({_fmt(r['mfu_vs_standard'], '.3f')})",
            f"{_fmt(r['peak_memory_bytes'], '.2f', 1e-9)} "
            f"({_fmt(r['peak_memory_bytes_vs_standard'], '.3f')})",
            _fmt(r["depth_read_share"], ".1f", 100.0, "%"),
            f"{_fmt(r.get('first_loss'), '.3f')} -> {_fmt(r.get('last_loss'), '.3f')}",
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, report: Dict[str, object]) -> None:
    """Write ``report`` (provenance, settings, arms) as indented JSON."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def write_plot(path: str, report: Dict[str, object]) -> bool:
    """Bar chart of step time, MFU, peak memory and depth-read share per arm.

    Returns:
        False (with a warning) when matplotlib is not installed, else True.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'megatron_lrattn[plots]'); "
                       "no plot written to %s", path)
        return False
    arms = report["arms"]
    labels = ["\n".join(a["label"].split(" ", 2)) for a in arms]
    panels = [
        ("median step time (ms)", "median_step_time_s", 1e3),
        ("MFU (%)", "mfu", 100.0),
        ("peak memory (GB)", "peak_memory_bytes", 1e-9),
        ("depth-read share of step (%)", "depth_read_share", 100.0),
    ]
    colors = ["#7f7f7f", "#d62728", "#1f77b4", "#2ca02c"][: len(arms)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2))
    for ax, (title, key, scale) in zip(axes, panels):
        values = [0.0 if a[key] is None else a[key] * scale for a in arms]
        bars = ax.bar(range(len(arms)), values, color=colors)
        ratio_key = key + "_vs_standard"
        for bar, a in zip(bars, arms):
            ratio = a.get(ratio_key)
            text = "n/a" if a[key] is None else (f"{ratio:.3f}x" if ratio is not None else "")
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(arms)), labels, fontsize=7)
        ax.set_title(title, fontsize=10)
    s = report["settings"]
    prov = report["provenance"]
    vp = f" VP{s['virtual_stages']}" if s.get("virtual_stages") else ""
    fig.suptitle(f"lrattn-profile {s['preset']}: {prov['device']} x{s['world_size']} "
                 f"(TP{s['tp']} PP{s['pp']}{vp} DP{s['dp']}), seq {s['seq_length']}, "
                 f"{s['tokens_per_step']} tokens/step, git {prov['git_sha']}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
