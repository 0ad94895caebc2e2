"""PNG plots of an ``lrattn-analyze`` report (matplotlib, the ``plots`` extra).

``write_plots(report, out_dir)`` writes:

- ``depth_weights.png``: site-by-source heatmap of the mean depth weights. Columns are
  ``v0, B1..BN, P``: a completed block keeps its column on every row, and the running
  partial sum of a site goes to the last column (the y labels name its sub-layer range).
- ``effective_sources.png``: exp(entropy) per read site beside the number of sources S_j
  (the uniform-read maximum).
- ``output_rms.png``: RMS of every sub-layer output.
- ``grad_norms.png``: norm of d loss / d sub-layer output, and parameter-gradient norms per
  sub-layer (log scale).

The two routing plots are skipped for ``residual='standard'`` (no routing).
"""

from __future__ import annotations

import math
import os
from typing import Dict, List


class PlotsUnavailable(ImportError):
    """matplotlib is not installed."""


def require_matplotlib():
    """Import matplotlib with the file-only Agg backend (raises ``PlotsUnavailable``)."""
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable(
            "matplotlib is not installed: pip install 'megatron_lrattn[plots]' (or matplotlib), "
            "or pass --no-plots"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def aligned_weights(routing: Dict) -> tuple:
    """Mean depth weights in the heatmap's column layout ``v0, B1..BN, P``.

    Returns:
        ``(rows, column_labels, row_labels)``: rows are lists of floats with NaN where a
        site has no such source.
    """
    n_blocks = routing["num_blocks"]
    cols = ["v0"] + [f"B{k}" for k in range(1, n_blocks + 1)] + ["P"]
    rows, row_labels = [], []
    for j, labels, weights in zip(routing["sites"], routing["source_labels"],
                                  routing["mean_weights"]):
        row = [math.nan] * len(cols)
        tag = ""
        for k, label in enumerate(labels):
            col = len(cols) - 1 if label.startswith("P") else k
            row[col] = weights[k]
            if label.startswith("P"):
                tag = f" {label}"
        rows.append(row)
        row_labels.append(f"{j}{tag}")
    return rows, cols, row_labels


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def write_plots(report: Dict, out_dir: str) -> List[str]:
    """Write the PNG plots of ``report`` (from ``analyze_model``) into ``out_dir``.

    Returns:
        The paths written.
    """
    plt = require_matplotlib()
    import numpy as np

    os.makedirs(out_dir, exist_ok=True)
    title = report.get("title", "")
    sub = report["sublayers"]
    x = sub["index"]
    colors = ["tab:blue" if k == "attention" else "tab:orange" for k in sub["kind"]]
    paths = []
    routing = report.get("routing")
    if routing:
        rows, cols, row_labels = aligned_weights(routing)
        data = np.ma.masked_invalid(np.array(rows, dtype=float))
        fig, ax = plt.subplots(figsize=(1.2 + 0.55 * len(cols), 1.2 + 0.32 * len(rows)))
        im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_xticks(range(len(cols)), cols)
        ax.set_yticks(range(len(rows)), row_labels, fontsize=7)
        ax.set_xlabel("source")
        ax.set_ylabel("read site j")
        ax.set_title(f"mean depth weights {title}".strip(), fontsize=9)
        if len(rows) * len(cols) <= 400:
            for (i, k), value in np.ndenumerate(data.filled(np.nan)):
                if not math.isnan(value):
                    ax.text(k, i, f"{value:.2f}", ha="center", va="center", fontsize=6,
                            color="white" if value < 0.5 else "black")
        fig.colorbar(im, ax=ax, fraction=0.05)
        paths.append(_save(fig, os.path.join(out_dir, "depth_weights.png")))
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot(routing["sites"], routing["num_sources"], "k--", drawstyle="steps-mid",
                label="sources S_j (uniform read)")
        ax.plot(routing["sites"], routing["effective_sources"], "o-", label="exp(entropy)")
        ax.set_xlabel("read site j")
        ax.set_ylabel("effective number of sources")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax.set_title(f"effective sources per read site {title}".strip(), fontsize=9)
        paths.append(_save(fig, os.path.join(out_dir, "effective_sources.png")))
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(x, [v if v is not None else np.nan for v in sub["output_rms"]], color=colors)
    ax.set_xlabel("sub-layer (blue: attention, orange: MLP)")
    ax.set_ylabel("output RMS")
    ax.set_title(f"sub-layer output RMS {title}".strip(), fontsize=9)
    paths.append(_save(fig, os.path.join(out_dir, "output_rms.png")))
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    for ax, key, label in ((axes[0], "output_grad_norm", "||d loss / d output||"),
                           (axes[1], "param_grad_norm", "parameter-gradient norm")):
        values = [v if v else np.nan for v in sub[key]]
        ax.bar(x, values, color=colors)
        if any(v == v for v in values):
            ax.set_yscale("log")
        ax.set_xlabel("sub-layer (blue: attention, orange: MLP)")
        ax.set_ylabel(label)
    fig.suptitle(f"gradient norms per sub-layer {title}".strip(), fontsize=9)
    paths.append(_save(fig, os.path.join(out_dir, "grad_norms.png")))
    plt.close(fig)
    return paths
