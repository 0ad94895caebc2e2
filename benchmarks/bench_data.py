"""Host time the training loop spends on data per step: the next micro-batches from the
loader (``data/loader.rank_batches``) and their copy to the device, with the step's GPU work
stood in for by a sleep (during which background workers prefetch).

    python benchmarks/bench_data.py --data-path PREFIX --tokenizer-model TOK \\
        --seq-length 2048 --micro-batch-size 4 --micro-batches 2 --step-seconds 0.25

Defaults: the 1b shape on one GPU as docs/performance.md times it (8 x 2048 tokens per
step: 2 micro-batches of 4) and its measured 0.25 s step; ``--num-workers 0 2`` compares the
in-process reader with two workers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def main() -> int:
    from megatron_lrattn.data.errors import DataError
    from megatron_lrattn.training.arg_types import nonnegative_int, positive_float, positive_int

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-path", required=True, help="indexed-dataset prefix")
    p.add_argument("--tokenizer-model", required=True, help="Hugging Face tokenizer folder")
    p.add_argument("--split", default="90,5,5", help="document split (default: 90,5,5)")
    p.add_argument("--cache-dir", default=None, help="index cache (default: the library's)")
    p.add_argument("--seq-length", type=positive_int, default=2048, help="default: 2048")
    p.add_argument("--micro-batch-size", type=positive_int, default=4, help="default: 4")
    p.add_argument("--micro-batches", type=positive_int, default=2, help="per step (default: 2)")
    p.add_argument("--step-seconds", type=positive_float, default=0.25,
                   help="stand-in for the step's GPU work (default: 0.25)")
    p.add_argument("--steps", type=positive_int, default=40, help="timed steps (default: 40)")
    p.add_argument("--num-workers", type=nonnegative_int, nargs="+", default=[0, 2],
                   help="default: 0 2")
    args = p.parse_args()

    from megatron_lrattn.data.datasets import build_gpt_datasets
    from megatron_lrattn.data.loader import rank_batches
    from megatron_lrattn.data.tokenizer import HFTokenizer

    per_step = args.micro_batch_size * args.micro_batches
    try:
        tok = HFTokenizer(args.tokenizer_model)
        train, _, _ = build_gpt_datasets(args.data_path, tok, args.seq_length, split=args.split,
                                         num_samples=(per_step * (args.steps + 10), 8, 8),
                                         cache_dir=args.cache_dir)
    except DataError as e:
        print(f"bench_data.py: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"device {name}, {os.cpu_count()} cores, torch {torch.__version__}")
    for workers in args.num_workers:
        it = rank_batches(train, 0, args.micro_batch_size, 0, 1, num_workers=workers)
        for _ in range(5):
            next(it)
        times = []
        for _ in range(args.steps):
            time.sleep(args.step_seconds)
            t = time.perf_counter()
            for _ in range(args.micro_batches):
                {k: v.to(dev, non_blocking=True) for k, v in next(it).items()}
            times.append(time.perf_counter() - t)
        times.sort()
        print(f"--num-workers {workers}: host data time per step median "
              f"{1e3 * statistics.median(times):.3f} ms, p90 "
              f"{1e3 * times[int(0.9 * len(times))]:.3f} ms "
              f"({100 * statistics.median(times) / args.step_seconds:.2f}% of the step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
