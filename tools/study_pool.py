"""Pool a quality study's runs at each arm's chosen learning rate across several calls.

Reads ``study_steps.csv`` files (``tools/study_report.py``'s, as committed under
``benchmarks/results/study_<date>_*.csv``: arm, peak LR, seed, type, iteration, loss), keeps
every run of an arm at its ``--pick`` LR that reached ``--iteration``, and reports per arm
the final validation loss (mean, sd, the runs), the paper's differences of means with
Welch's t and, where each seed appears once in both arms, the t of the differences paired
by seed (a seed sets the data order, the same for every arm). Writes ``pooled.json``,
``pooled.md`` and ``pooled_curves.png`` (validation loss per arm and each depth arm's gap
to the standard residual over training) to ``--out``.

    python tools/study_pool.py benchmarks/results/study_2026-12-0{4,6}_prose_*.csv \\
        benchmarks/results/study_2026-12-0{3,4}_prose_attnres_lr1e-3.csv \\
        --pick standard=2e-3 attnres=1e-3 lr_sliced=2e-3 lr_projected=2e-3 --out /tmp/pool
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_report import ARM_ORDER, LABELS, PAIRS, welch_t  # noqa: E402

COLUMNS = {"arm", "lr", "seed", "type", "iteration", "loss"}
Run = Tuple[str, int]  # (file name, seed)


class PoolError(Exception):
    """A bad input file; the message names it."""


def _same_lr(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def load(paths: List[Path], pick: Dict[str, str]) -> Dict[str, Dict[Run, Dict[int, float]]]:
    """arm -> (file, seed) -> iteration -> validation loss, for the runs at the picked LRs."""
    out: Dict[str, Dict[Run, Dict[int, float]]] = {arm: {} for arm in pick}
    for path in paths:
        try:
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                missing = COLUMNS - set(reader.fieldnames or ())
                if missing:
                    raise PoolError(f"{path}: not a study steps CSV (no column "
                                    f"{', '.join(sorted(missing))})")
                for line, row in enumerate(reader, start=2):
                    arm = row["arm"]
                    if row["type"] != "valid" or arm not in pick or not _same_lr(row["lr"], pick[arm]):
                        continue
                    try:
                        seed, it, loss = int(row["seed"]), int(row["iteration"]), float(row["loss"])
                    except ValueError:
                        raise PoolError(f"{path}, line {line}: seed, iteration and loss must be "
                                        f"numbers") from None
                    out[arm].setdefault((path.name, seed), {})[it] = loss
        except OSError as e:
            raise PoolError(f"{path}: {e.strerror or e}") from None
        except (csv.Error, UnicodeDecodeError) as e:
            raise PoolError(f"{path}: not a readable CSV ({e})") from None
    return out


def paired_t(a: Dict[int, float], b: Dict[int, float]) -> Tuple[Optional[float], int]:
    """t of the mean of a[s] - b[s] over the seeds both have; (None, n) below two pairs or
    with no spread."""
    common = sorted(set(a) & set(b))
    d = [a[s] - b[s] for s in common]
    if len(d) < 2 or statistics.stdev(d) == 0:
        return None, len(d)
    return statistics.fmean(d) / (statistics.stdev(d) / len(d) ** 0.5), len(d)


def summarise(curves: Dict[str, Dict[Run, Dict[int, float]]], pick: Dict[str, str],
              iteration: int) -> dict:
    arms = {}
    for arm, runs in curves.items():
        finals = {run: c[iteration] for run, c in runs.items() if iteration in c}
        if not finals:
            raise PoolError(f"no run of {arm} at LR {pick[arm]} reached iteration {iteration}")
        values = list(finals.values())
        seeds = [s for _, s in finals]
        arms[arm] = {
            "label": LABELS.get(arm, arm), "lr": pick[arm], "n": len(values),
            "mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else None,
            "runs": [{"file": f, "seed": s, "loss": v} for (f, s), v in sorted(finals.items())],
            # by seed only where no seed repeats (a repeated seed cannot be paired)
            "by_seed": dict(zip(seeds, values)) if len(set(seeds)) == len(seeds) else None,
        }
    comps = []
    for a, b in PAIRS + (("lr_projected", "lr_sliced"),):
        if a not in arms or b not in arms:
            continue
        va = [r["loss"] for r in arms[a]["runs"]]
        vb = [r["loss"] for r in arms[b]["runs"]]
        entry = {"a": a, "b": b, "diff": arms[a]["mean"] - arms[b]["mean"],
                 "welch_t": welch_t(va, vb), "n_a": len(va), "n_b": len(vb),
                 "paired_t": None, "pairs": 0}
        if arms[a]["by_seed"] is not None and arms[b]["by_seed"] is not None:
            entry["paired_t"], entry["pairs"] = paired_t(arms[a]["by_seed"], arms[b]["by_seed"])
        comps.append(entry)
    return {"iteration": iteration, "arms": arms, "comparisons": comps}


def _t(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(summary: dict) -> str:
    lines = [f"| arm | LR | final validation loss (iteration {summary['iteration']}) | runs |",
             "|---|---|---|---|"]
    for arm, info in summary["arms"].items():
        sd = "" if info["sd"] is None else f" ± {info['sd']:.4f}"
        lines.append(f"| {info['label']} | {info['lr']} | {info['mean']:.4f}{sd} | {info['n']} |")
    lines += ["", "| difference of means | value | Welch t | paired t (pairs) |", "|---|---|---|---|"]
    for c in summary["comparisons"]:
        la, lb = summary["arms"][c["a"]]["label"], summary["arms"][c["b"]]["label"]
        paired = f"{_t(c['paired_t'])} ({c['pairs']})" if c["pairs"] else "-"
        lines.append(f"| {la} - {lb} | {c['diff']:+.4f} | {_t(c['welch_t'])} | {paired} |")
    return "\n".join(lines)


def plot(curves: Dict[str, Dict[Run, Dict[int, float]]], summary: dict, path: Path) -> bool:
    """Mean validation loss per arm, and each depth arm's mean minus the standard
    residual's, over the iterations every pooled run has; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    means = {}
    for arm, runs in curves.items():
        # the runs the table pools: those that reached the final iteration
        done = [c for c in runs.values() if summary["iteration"] in c]
        its = sorted(set.intersection(*(set(c) for c in done)))
        means[arm] = {i: statistics.fmean(c[i] for c in done) for i in its}
    fig, (ax_v, ax_g) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, m in means.items():
        info = summary["arms"][arm]
        color = f"C{ARM_ORDER.index(arm)}"  # one colour per arm in both panels
        ax_v.plot(list(m), list(m.values()), marker="o", ms=3, color=color,
                  label=f"{info['label']}, LR {info['lr']} ({info['n']} runs)")
        if arm != "standard" and "standard" in means:
            its = [i for i in m if i in means["standard"] and i > 0]
            ax_g.plot(its, [m[i] - means["standard"][i] for i in its], marker="o", ms=3,
                      color=color, label=info["label"])
    finals = [a["mean"] for a in summary["arms"].values()]
    ax_v.set_ylim(min(finals) - 0.1, max(finals) + 1.0)
    ax_v.set(xlabel="iteration", ylabel="validation loss (mean over runs)",
             title="validation loss at each arm's LR")
    ax_g.axhline(0, color="k", lw=0.8)
    ax_g.set(xlabel="iteration", ylabel="mean validation loss - standard residual's",
             title="gap to the standard residual")
    for ax in (ax_v, ax_g):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _pick(text: str) -> Tuple[str, str]:
    arm, sep, lr = text.partition("=")
    if not sep or arm not in ARM_ORDER:
        raise argparse.ArgumentTypeError(f"'{text}' is not arm=LR with arm one of "
                                         f"{', '.join(ARM_ORDER)}")
    try:
        if not float(lr) > 0:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': the LR must be a number > 0") from None
    return arm, lr


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="study_pool", description=__doc__.splitlines()[0])
    p.add_argument("csv", type=Path, nargs="+", help="study steps CSV files")
    p.add_argument("--pick", type=_pick, nargs="+", required=True, metavar="ARM=LR",
                   help="each arm to pool and its LR (e.g. standard=2e-3 attnres=1e-3)")
    p.add_argument("--iteration", type=int, default=916,
                   help="the final iteration: runs that did not reach it are left out (916)")
    p.add_argument("--out", type=Path, default=Path("."), help="output folder (.)")
    args = p.parse_args(argv)
    pick = dict(args.pick)
    if len(pick) != len(args.pick):
        p.error("--pick names an arm twice")
    if args.iteration < 1:
        p.error(f"--iteration {args.iteration}: a whole number >= 1")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out} is not a folder")
    pick = {arm: pick[arm] for arm in ARM_ORDER if arm in pick}
    try:
        curves = load(args.csv, pick)
        summary = summarise(curves, pick, args.iteration)
    except PoolError as e:
        print(f"study_pool: error: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pooled.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = markdown(summary)
    (args.out / "pooled.md").write_text(text + "\n")
    print(text)
    if plot(curves, summary, args.out / "pooled_curves.png"):
        print(f"plot: {args.out / 'pooled_curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
