"""Summarise a quality study: final validation loss per arm (mean, sd, every seed), loss
curves, and the ordering of the arms; for a learning-rate sweep, the loss per arm and LR
and each arm's best LR; differences of means with Welch's t for the paper's comparisons;
with evaluations, downstream accuracy and bits per byte per arm.

Reads ``<dir>/<arm>_seed<k>.jsonl`` or ``<dir>/<arm>_lr<LR>_seed<k>.jsonl``
(``lrattn-pretrain --log-json`` files, as written by ``tools/gpu_box/run.sh study``) and,
where present, ``<dir>/<run>_eval.json`` (``lrattn-eval --output`` of the run's final
checkpoint), and writes ``study.json``, ``study_table.md``, ``study_sweep.md`` (runs with an
LR in their name), ``study_curves.png`` and ``study_steps.csv`` (every run's training loss,
gradient norm and step time per step and its validation losses: arm, peak LR, seed) to
``--out``.

    python tools/study_report.py benchmarks/results/study_2026-11-30 --out docs
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

ARM_ORDER = ("standard", "attnres", "lr_sliced", "lr_projected")
LABELS = {
    "standard": "standard residual",
    "attnres": "AttnRes (N=8)",
    "lr_sliced": "LR-AttnRes sliced (r=d/4, N=8)",
    "lr_projected": "LR-AttnRes projected (r=32, N=8)",
}
_NAME = re.compile(r"^(?P<arm>.+?)(?:_lr(?P<lr>[0-9.]+(?:e-?\d+)?))?_seed(?P<seed>\d+)"
                   r"(?P<eval>_eval\.json|\.jsonl)$")


def load_runs(folder: Path) -> Dict[str, Dict[int, List[dict]]]:
    """``{arm: {seed: rows}}`` of every ``<arm>[_lr<LR>]_seed<k>.jsonl`` in ``folder``; a
    run with an LR is the arm ``<arm>_lr<LR>``."""
    runs: Dict[str, Dict[int, List[dict]]] = {}
    for path in sorted(folder.glob("*_seed*.jsonl")):
        m = _NAME.match(path.name)
        if not m or m["eval"] != ".jsonl":
            continue
        arm = m["arm"] + (f"_lr{m['lr']}" if m["lr"] else "")
        runs.setdefault(arm, {})[int(m["seed"])] = _metrics_rows(path)
    return runs


def load_evals(folder: Path) -> Dict[str, Dict[int, dict]]:
    """``{arm: {seed: results}}`` of every ``<arm>[_lr<LR>]_seed<k>_eval.json`` in ``folder``
    (``lrattn-eval --output`` files); arms named as in ``load_runs``."""
    evals: Dict[str, Dict[int, dict]] = {}
    for path in sorted(folder.glob("*_seed*_eval.json")):
        m = _NAME.match(path.name)
        if not m or m["eval"] != "_eval.json":
            continue
        arm = m["arm"] + (f"_lr{m['lr']}" if m["lr"] else "")
        try:
            results = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StudyError(f"{path}: not an lrattn-eval result ({e})") from None
        if not isinstance(results, dict) or not isinstance(results.get("tasks"), dict):
            raise StudyError(f"{path}: not an lrattn-eval result (no 'tasks')")
        evals.setdefault(arm, {})[int(m["seed"])] = results
    return evals


class StudyError(ValueError):
    """A study file that cannot be read; the message names it."""


def _metrics_rows(path: Path) -> List[dict]:
    """The records of one ``--log-json`` file. A run stopped while writing leaves a cut last
    line: that line is left out (with a note); a bad line before it is an error."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise StudyError(f"{path}: unreadable ({e})") from None
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1 and rows:
                print(f"study_report: {path.name}: a cut last line left out", file=sys.stderr)
                break
            raise StudyError(f"{path}: line {i + 1} is not JSON") from None
        if not isinstance(row, dict) or "type" not in row:
            raise StudyError(f"{path}: line {i + 1} is not a metrics record")
        rows.append(row)
    return rows


def eval_metrics(results: dict) -> Dict[str, float]:
    """The downstream numbers of one ``lrattn-eval`` result: held-out bits per byte
    (``heldout_bpb``) and every accuracy (``<task>_acc``, ``<task>_acc_norm``)."""
    out: Dict[str, float] = {}
    for task, r in results.get("tasks", {}).items():
        if "bits_per_byte" in r:
            out[f"{task}_bpb"] = r["bits_per_byte"]
        for m in ("acc", "acc_norm"):
            if m in r:
                out[f"{task}_{m}"] = r[m]
    return out


def _downstream(evals: Dict[int, dict]) -> Dict[str, dict]:
    """Per metric: every seed's value, mean and sd over seeds (n - 1)."""
    per_seed: Dict[str, Dict[int, float]] = {}
    for seed, results in sorted(evals.items()):
        for metric, value in eval_metrics(results).items():
            per_seed.setdefault(metric, {})[seed] = value
    return {metric: {"per_seed": vals,
                     "mean": statistics.fmean(vals.values()),
                     "sd": statistics.stdev(vals.values()) if len(vals) > 1 else None,
                     "n": len(vals)}
            for metric, vals in per_seed.items()}


def split_lr(arm: str) -> tuple:
    """``("lr_sliced_lr2e-3")`` -> ``("lr_sliced", "2e-3")``; ``(arm, None)`` without an LR."""
    m = re.fullmatch(r"(?P<base>.+?)_lr(?P<lr>[0-9.]+(?:e-?\d+)?)", arm)
    return (m["base"], m["lr"]) if m else (arm, None)


def arm_label(arm: str, seeds: Dict[int, List[dict]]) -> str:
    """A label from the runs' own ``run`` record (residual, key, rank, N), else the name;
    ``, LR x`` appended for a sweep run."""
    base, lr = split_lr(arm)
    label = _base_label(base, seeds)
    return f"{label}, LR {lr}" if lr else label


def _base_label(arm: str, seeds: Dict[int, List[dict]]) -> str:
    for rows in seeds.values():
        run = next((r for r in rows if r.get("type") == "run"), None)
        if run and run.get("residual") == "standard":
            return "standard residual"
        if run and run.get("residual") == "attnres":
            return f"AttnRes (N={run.get('num_blocks')})"
        if run and run.get("residual") == "lr_attnres":
            return (f"LR-AttnRes {run.get('key')} (r={run.get('rank')}, "
                    f"N={run.get('num_blocks')})")
    return LABELS.get(arm, arm)


def _order(arm: str) -> tuple:
    base, lr = split_lr(arm)
    return (ARM_ORDER.index(base) if base in ARM_ORDER else 99, base,
            float(lr) if lr else 0.0)


def summarise(runs: Dict[str, Dict[int, List[dict]]],
              evals: Optional[Dict[str, Dict[int, dict]]] = None) -> dict:
    """Final validation loss of every run and mean / sd per arm (sd over seeds, n - 1); with
    ``evals`` (``load_evals``), an arm that has them also gets ``downstream``: per metric of
    ``eval_metrics``, every seed's value and mean / sd over seeds."""
    arms = {}
    for arm in sorted(runs, key=_order):
        finals, iters, tokens = {}, {}, {}
        for seed, rows in sorted(runs[arm].items()):
            valid = [r for r in rows if r.get("type") == "valid"]
            train = [r for r in rows if r.get("type") == "train"]
            if not valid or not train:
                continue
            finals[seed] = valid[-1]["loss"]
            iters[seed] = valid[-1]["iteration"]
            tokens[seed] = train[-1]["consumed_samples"]
        vals = list(finals.values())
        arms[arm] = {
            "label": arm_label(arm, runs[arm]),
            "final_valid_loss": finals,
            "iterations": iters,
            "samples": tokens,
            "mean": statistics.fmean(vals) if vals else None,
            "sd": statistics.stdev(vals) if len(vals) > 1 else None,
            "n": len(vals),
        }
        if evals and evals.get(arm):
            arms[arm]["downstream"] = _downstream(evals[arm])
    ranked = sorted((a for a in arms if arms[a]["mean"] is not None), key=lambda a: arms[a]["mean"])
    sweep: Dict[str, dict] = {}
    for arm, info in arms.items():
        base, lr = split_lr(arm)
        if lr is not None and info["mean"] is not None:
            sweep.setdefault(base, {"losses": {}})["losses"][lr] = info["mean"]
    for entry in sweep.values():
        entry["best_lr"] = min(entry["losses"], key=entry["losses"].get)
    return {"arms": arms, "ranking_by_mean": ranked, "sweep": sweep,
            "comparisons": comparisons(arms)}


# the differences the paper's claims are about: each depth arm against the standard
# residual, and LR-AttnRes against AttnRes
PAIRS = (("attnres", "standard"), ("lr_sliced", "standard"), ("lr_projected", "standard"),
         ("lr_sliced", "attnres"), ("lr_projected", "attnres"))


def _lr_text(lr: float) -> str:
    """0.001 -> '1e-3', 0.00025 -> '2.5e-4' (the notation of ``LRS`` and run names)."""
    mant, exp = f"{lr:e}".split("e")
    return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"


def write_steps_csv(runs: Dict[str, Dict[int, List[dict]]], path: Path) -> int:
    """Every run's per-step records as CSV rows ``arm, lr, seed, type, iteration, loss,
    grad_norm, step_time_s`` (``lr``: the run's peak learning rate, that is its ``--lr``);
    returns the number of rows."""
    import csv

    n = 0
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "lr", "seed", "type", "iteration", "loss", "grad_norm",
                    "step_time_s"])
        for arm in sorted(runs, key=_order):
            base = split_lr(arm)[0]
            for seed in sorted(runs[arm]):
                rows = runs[arm][seed]
                lrs = [r["lr"] for r in rows if r.get("type") == "train" and "lr" in r]
                lr = _lr_text(max(lrs)) if lrs else ""
                for r in rows:
                    if r.get("type") not in ("train", "valid") or "loss" not in r:
                        continue
                    w.writerow([base, lr, seed, r["type"], r.get("iteration", ""),
                                f"{r['loss']:.5f}",
                                f"{r['grad_norm']:.4f}" if r.get("grad_norm") is not None else "",
                                f"{r['step_time_s']:.4f}" if r.get("step_time_s") is not None
                                else ""])
                    n += 1
    return n


def welch_t(a: List[float], b: List[float]) -> Optional[float]:
    """Welch's t of mean(a) - mean(b) (unequal variances); None with fewer than two values
    on a side or zero spread on both."""
    if len(a) < 2 or len(b) < 2:
        return None
    se2 = statistics.variance(a) / len(a) + statistics.variance(b) / len(b)
    if se2 == 0:
        return None
    return (statistics.fmean(a) - statistics.fmean(b)) / se2 ** 0.5


def comparisons(arms: Dict[str, dict]) -> List[dict]:
    """Per pair of ``PAIRS`` present (plain arms, not sweep arms): difference of the mean
    final validation losses, Welch's t and the seed counts."""
    out = []
    for a, b in PAIRS:
        if a not in arms or b not in arms or arms[a]["mean"] is None or arms[b]["mean"] is None:
            continue
        va, vb = list(arms[a]["final_valid_loss"].values()), list(arms[b]["final_valid_loss"].values())
        out.append({"a": a, "b": b, "diff": arms[a]["mean"] - arms[b]["mean"],
                    "welch_t": welch_t(va, vb), "n_a": len(va), "n_b": len(vb)})
    return out


def comparison_table(summary: dict) -> str:
    """Markdown table of ``comparisons``; empty when there are none."""
    rows = summary.get("comparisons") or []
    if not rows:
        return ""
    arms = summary["arms"]
    lines = ["| difference of means | value | Welch t | seeds |", "|---|---|---|---|"]
    for r in rows:
        t = "-" if r["welch_t"] is None else f"{r['welch_t']:.2f}"
        lines.append(f"| {arms[r['a']]['label']} - {arms[r['b']]['label']} | {r['diff']:+.4f} "
                     f"| {t} | {r['n_a']} + {r['n_b']} |")
    return "\n".join(lines)


def sweep_table(summary: dict) -> str:
    """Markdown table of a learning-rate sweep: final validation loss (mean over seeds) per
    arm and LR, the arm's best LR in bold; empty without sweep runs."""
    sweep = summary["sweep"]
    if not sweep:
        return ""
    lrs = sorted({lr for e in sweep.values() for lr in e["losses"]}, key=float)
    lines = ["| arm | " + " | ".join(f"LR {lr}" for lr in lrs) + " | best LR |",
             "|---" * (len(lrs) + 2) + "|"]
    for base, entry in sweep.items():
        cells = []
        for lr in lrs:
            loss = entry["losses"].get(lr)
            cell = "-" if loss is None else f"{loss:.4f}"
            cells.append(f"**{cell}**" if lr == entry["best_lr"] else cell)
        label = LABELS.get(base, base)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {entry['best_lr']} |")
    return "\n".join(lines)


def _metric_order(metric: str) -> tuple:
    return (not metric.endswith("_bpb"), metric)


def table(summary: dict) -> str:
    """Markdown table: arm, mean, sd, every seed's final validation loss; with evaluations,
    a column per downstream metric (mean +- sd over seeds)."""
    arms = summary["arms"]
    seeds = sorted({s for a in arms.values() for s in a["final_valid_loss"]})
    metrics = sorted({m for a in arms.values() for m in a.get("downstream", {})},
                     key=_metric_order)
    heads = [f"seed {s}" for s in seeds] + [_metric_label(m) for m in metrics]
    head = "| arm | mean | sd | " + " | ".join(heads) + " |"
    sep = "|---" * (3 + len(heads)) + "|"
    lines = [head, sep]
    for a in arms.values():
        cells = [f"{a['final_valid_loss'][s]:.4f}" if s in a["final_valid_loss"] else "-"
                 for s in seeds]
        for m in metrics:
            d = a.get("downstream", {}).get(m)
            cells.append("-" if d is None else f"{d['mean']:.4f}" +
                         (f" ± {d['sd']:.4f}" if d["sd"] is not None else ""))
        mean = f"{a['mean']:.4f}" if a["mean"] is not None else "-"
        sd = f"{a['sd']:.4f}" if a["sd"] is not None else "-"
        lines.append(f"| {a['label']} | {mean} | {sd} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _metric_label(metric: str) -> str:
    """``heldout_bpb`` -> ``held-out bits/byte``; ``next_line_acc_norm`` -> ``next_line
    acc_norm``."""
    if metric == "heldout_bpb":
        return "held-out bits/byte"
    for m in ("acc_norm", "acc", "bpb"):
        if metric.endswith(f"_{m}"):
            return f"{metric[:-len(m) - 1]} {m}"
    return metric


def plot(runs: Dict[str, Dict[int, List[dict]]], summary: dict, path: Path) -> bool:
    """Training loss (mean over seeds, smoothed) and validation loss per arm; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, info in summary["arms"].items():
        seeds = runs[arm]
        per_seed = [{r["iteration"]: r["loss"] for r in rows if r.get("type") == "train"
                     and r.get("loss") is not None} for rows in seeds.values()]
        its = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
        mean = [statistics.fmean(p[i] for p in per_seed) for i in its]
        k = 10
        smooth = [statistics.fmean(mean[max(0, j - k + 1): j + 1]) for j in range(len(mean))]
        ax_t.plot(its, smooth, label=info["label"])
        vper = [{r["iteration"]: r["loss"] for r in rows if r.get("type") == "valid"}
                for rows in seeds.values()]
        vits = sorted(set.intersection(*(set(p) for p in vper))) if vper else []
        ax_v.plot(vits, [statistics.fmean(p[i] for p in vper) for i in vits], marker="o",
                  ms=3, label=info["label"])
    ax_t.set(xlabel="iteration", ylabel="training loss (mean over seeds, 10-step mean)",
             title="training loss")
    ax_v.set(xlabel="iteration", ylabel="validation loss (mean over seeds)",
             title="held-out validation loss")
    for ax in (ax_t, ax_v):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    # show the late part of training for every arm (the first steps are far above it)
    finals = [a["mean"] for a in summary["arms"].values() if a["mean"] is not None]
    if finals:
        spread = max(finals) - min(finals)
        ax_v.set_ylim(min(finals) - 0.1 - 0.05 * spread, max(finals) + 0.3 + 0.3 * spread)
        ax_t.set_ylim(min(finals) - 0.4 - 0.05 * spread, max(finals) + 0.5 + 0.3 * spread)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="study_report", description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="folder with <arm>_seed<k>.jsonl files")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: folder)")
    args = p.parse_args(argv)
    if not args.folder.is_dir():
        p.error(f"{args.folder} is not a folder")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out} is not a folder")
    try:
        runs = load_runs(args.folder)
        evals = load_evals(args.folder)
    except StudyError as e:
        print(f"study_report: error: {e}", file=sys.stderr)
        return 2
    if not runs:
        print(f"study_report: error: no <arm>_seed<k>.jsonl files in {args.folder}",
              file=sys.stderr)
        return 2
    out = args.out or args.folder
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(runs, evals)
    (out / "study.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = table(summary)
    diffs = comparison_table(summary)
    if diffs:
        text += "\n\n" + diffs
    (out / "study_table.md").write_text(text + "\n")
    print(text)
    sweep = sweep_table(summary)
    if sweep:
        (out / "study_sweep.md").write_text(sweep + "\n")
        print(sweep)
    print("ranking by mean final validation loss (best first):",
          " < ".join(summary["arms"][a]["label"] for a in summary["ranking_by_mean"]))
    rows = write_steps_csv(runs, out / "study_steps.csv")
    print(f"steps: {out / 'study_steps.csv'} ({rows} rows)")
    if plot(runs, summary, out / "study_curves.png"):
        print(f"plot: {out / 'study_curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
