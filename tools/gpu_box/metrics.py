"""Summaries of ``lrattn-pretrain --log-json`` files for the GPU-box driver (``run.sh``).

    python3 tools/gpu_box/metrics.py table FILE... [--skip N] [--json OUT]
    python3 tools/gpu_box/metrics.py compare REF FILE...

``table``: one row per run (iterations, median step time and tokens/s over the training
rows after the first N, its ratio to the first run, mean train loss of the last 10, last
validation loss, peak memory). ``compare``: each run's training losses against REF's at the
iterations both have (max and mean |dloss| / loss, and whether they are bitwise equal).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


class MetricsError(ValueError):
    """A metrics file that cannot be read as ``--log-json`` records."""


def _records(path: str) -> list:
    try:
        with open(path) as f:
            recs = [json.loads(line) for line in f if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MetricsError(f"{path}: not a readable metrics file ({e})") from None
    if not all(isinstance(r, dict) and "type" in r for r in recs):
        raise MetricsError(f"{path}: not a metrics file (records without a 'type')")
    return recs


def summarize(path: str, skip: int) -> dict | None:
    """Median step time, tokens/s, losses and peak memory of one metrics file."""
    recs = _records(path)
    train = [r for r in recs if r["type"] == "train"]
    if not train:
        return None
    valid = [r for r in recs if r["type"] == "valid"]
    steady = train[skip:] or train
    losses = [r["loss"] for r in train[-10:] if r.get("loss") is not None]
    return {
        "run": os.path.basename(path).removesuffix(".jsonl"),
        "iterations": len(train),
        "median_step_ms": 1000 * statistics.median(r["step_time_s"] for r in steady),
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "train_loss_last10": statistics.mean(losses) if losses else None,
        "valid_loss": valid[-1]["loss"] if valid else None,
        "peak_memory_gib": max((r.get("peak_memory_gib") or 0) for r in train),
    }


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(paths: list, skip: int, json_out: str | None) -> None:
    rows = []
    for path in paths:
        try:
            row = summarize(path, skip) if os.path.isfile(path) else None
        except (MetricsError, KeyError, TypeError) as e:
            print(f"{path}: unreadable ({str(e).splitlines()[0]})")
            continue
        if row is None:
            print(f"{path}: missing or no training rows")
        else:
            rows.append(row)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(rows, f, indent=1)
    if not rows:
        return
    ref = rows[0]["median_step_ms"]
    width = max(len(r["run"]) for r in rows)
    print(f"{'run':{width}s} {'iters':>5s} {'step ms':>8s} {'vs first':>8s} {'tokens/s':>10s} "
          f"{'loss(last10)':>12s} {'valid':>7s} {'peak GiB':>8s}")
    for r in rows:
        print(f"{r['run']:{width}s} {r['iterations']:5d} {r['median_step_ms']:8.1f} "
              f"{r['median_step_ms'] / ref:8.3f} {r['median_tokens_per_s']:10,.0f} "
              f"{_fmt(r['train_loss_last10'], '12.4f')} {_fmt(r['valid_loss'], '7.4f')} "
              f"{r['peak_memory_gib']:8.2f}")


def _losses(path: str) -> dict:
    return {r["iteration"]: r["loss"] for r in _records(path)
            if r["type"] == "train" and "iteration" in r and isinstance(r.get("loss"), float)}


def compare(ref_path: str, paths: list) -> None:
    ref = _losses(ref_path)
    for path in paths:
        name = os.path.basename(path)
        try:
            got = _losses(path) if os.path.isfile(path) else {}
        except MetricsError as e:
            print(f"{name}: unreadable ({e})")
            continue
        common = sorted(set(ref) & set(got))
        if not common:
            print(f"{name}: no iterations in common with {os.path.basename(ref_path)}")
            continue
        rel = [abs(got[i] - ref[i]) / max(abs(ref[i]), 1e-30) for i in common]
        same = all(repr(got[i]) == repr(ref[i]) for i in common)
        print(f"{name} vs {os.path.basename(ref_path)}: {len(common)} iterations, max |dloss|/loss "
              f"{max(rel):.2e}, mean {sum(rel) / len(rel):.2e}{', bitwise equal' if same else ''}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="one row per metrics file")
    t.add_argument("files", nargs="+")
    t.add_argument("--skip", type=_nonnegative, default=4,
                   help="training rows left out of the medians")
    t.add_argument("--json", help="also write the rows here")
    c = sub.add_parser("compare", help="training losses against a reference run")
    c.add_argument("ref")
    c.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "table" and args.json and (os.path.isdir(args.json) or not os.path.isdir(
            os.path.dirname(os.path.abspath(args.json)))):
        p.error(f"--json {args.json}: not a file in an existing folder")
    if args.cmd == "compare" and not os.path.isfile(args.ref):
        p.error(f"compare: the reference {args.ref} is not a file")
    try:
        if args.cmd == "table":
            table(args.files, args.skip, args.json)
        else:
            compare(args.ref, args.files)
    except MetricsError as e:
        print(f"metrics.py: error: {e}", file=sys.stderr)
        return 2
    return 0


def _nonnegative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not an integer >= 0")
    return value


if __name__ == "__main__":
    sys.exit(main())
