"""``lrattn-analyze``: routing, activation and gradient statistics of a checkpoint.

Loads the newest checkpoint of a ``lrattn-pretrain --save`` directory (or one ``iter_*``
folder) into a single-process TP=1, PP=1 fp32 model, runs ``--num-batches`` micro-batches of
the training data's ``--split`` through it (forward and backward), and writes
``analysis.json`` and PNG plots into ``--out``. What every number means:
``megatron_lrattn/analysis/routing.py`` and docs/analysis.md.

Example::

    lrattn-analyze runs/tiny/ckpt --out runs/tiny/analysis --num-batches 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, Iterator, NoReturn, Optional, Sequence

from megatron_lrattn.cli.common import run_cli, setup_logging

PROG = "lrattn-analyze"
SPLITS = ("train", "valid", "test")


class AnalyzeArgumentError(ValueError):
    """A bad command-line value; reported as one ``lrattn-analyze: error: ...`` line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise AnalyzeArgumentError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    p = _Parser(prog=PROG, description="Depth-routing, activation-RMS and gradient-norm "
                                       "statistics of an lrattn-pretrain checkpoint.")
    p.add_argument("checkpoint",
                   help="a --save directory (its 'latest' is used) or an iter_* folder")
    p.add_argument("--out", default="lrattn_analysis",
                   help="output folder for analysis.json and the PNG plots (default: %(default)s)")
    p.add_argument("--split", choices=SPLITS, default="valid",
                   help="data split of the training data (default: %(default)s)")
    p.add_argument("--num-batches", type=int, default=4,
                   help="micro-batches (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="sequences per micro-batch (default: the training run's)")
    p.add_argument("--data-path", nargs="+", default=None,
                   help="other indexed-dataset prefixes (default: the training run's data)")
    p.add_argument("--tokenizer-model", default=None,
                   help="tokenizer folder for --data-path (default: the training run's)")
    p.add_argument("--cache-dir", default=None,
                   help="cache of the embedded corpus and indices (default: the training run's)")
    p.add_argument("--no-plots", action="store_true", help="write analysis.json only")
    p.add_argument("--no-progress", action="store_true", help="disable the progress bar")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check ``argv`` (raises ``AnalyzeArgumentError``)."""
    args = build_parser().parse_args(argv)
    if args.num_batches < 1:
        raise AnalyzeArgumentError(f"--num-batches {args.num_batches} must be >= 1")
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        raise AnalyzeArgumentError(f"--micro-batch-size {args.micro_batch_size} must be >= 1")
    if not os.path.isdir(args.checkpoint):
        raise AnalyzeArgumentError(f"checkpoint: {args.checkpoint} is not a directory")
    if args.data_path is not None and args.tokenizer_model is None:
        raise AnalyzeArgumentError("--data-path needs --tokenizer-model")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise AnalyzeArgumentError(f"--out: {args.out} exists and is not a directory")
    if os.path.isdir(args.out) and os.listdir(args.out) and not os.path.isfile(
            os.path.join(args.out, "analysis.json")):
        raise AnalyzeArgumentError(f"--out: {args.out} exists and holds other files (it is "
                                   "replaced as a whole); choose a new folder")
    from megatron_lrattn.training.durable import check_output_parent

    try:
        check_output_parent("--out", args.out)
    except ValueError as e:
        raise AnalyzeArgumentError(str(e)) from None
    return args


def _training_args(meta: Dict, path: str) -> argparse.Namespace:
    from megatron_lrattn.analysis.routing import AnalysisError

    saved = meta.get("args") or {}
    needed = ("num_layers", "hidden_size", "residual", "seq_length", "micro_batch_size")
    missing = [k for k in needed if k not in saved]
    if missing:
        raise AnalysisError(f"{path}: lrattn.json has no training args ({', '.join(missing)} "
                            "missing); it was not written by lrattn-pretrain --save")
    targs = argparse.Namespace(**saved)
    targs.train_tp = targs.tensor_model_parallel_size
    # One process holds the whole model; distributed checkpointing reshards.
    targs.tensor_model_parallel_size = targs.pipeline_model_parallel_size = 1
    targs.context_parallel_size = 1
    targs.sequence_parallel = False
    # A TE-spec (and FP8) checkpoint has the local spec's distributed-checkpoint keys
    # (megatron_lrattn.compat.te), so the local model reads it on any machine; analysis
    # reads depth per site.
    targs.transformer_impl, targs.fp8_format = "local", None
    targs.num_layers_per_virtual_pipeline_stage = None
    targs.depth_schedule = "per_site"
    if targs.depth_backend == "triton":
        targs.depth_backend = "auto"
    return targs


def _dataset(args: argparse.Namespace, targs: argparse.Namespace, needed: int):
    from megatron_lrattn.analysis.routing import AnalysisError
    from megatron_lrattn.data.datasets import build_gpt_datasets
    from megatron_lrattn.data.tokenizer import HFTokenizer

    cache_dir = args.cache_dir or targs.cache_dir
    if args.data_path is not None:
        data_path, tok_dir, split = args.data_path, args.tokenizer_model, targs.split
    elif targs.data_path is None:
        from megatron_lrattn.data.default_corpus import ensure_default_data

        default = ensure_default_data(cache_dir=cache_dir)
        data_path, tok_dir = default.data_prefix, default.tokenizer_dir
        split = default.split if targs.split == "969,30,1" else targs.split
    else:
        data_path, tok_dir, split = targs.data_path, targs.tokenizer_model, targs.split
    if not os.path.isdir(str(tok_dir)):
        raise AnalysisError(f"tokenizer folder {tok_dir} not found (pass --tokenizer-model)")
    tokenizer = HFTokenizer(tok_dir)
    gbs = targs.global_batch_size
    # The training run's sample counts, so the valid batches are the ones it evaluated.
    counts = [targs.train_iters * gbs,
              targs.eval_iters * gbs * (targs.train_iters // targs.eval_interval + 2),
              targs.eval_iters * gbs]
    k = SPLITS.index(args.split)
    counts[k] = max(counts[k], needed)
    datasets = build_gpt_datasets(
        data_path, tokenizer, targs.seq_length, split=split, seed=targs.seed,
        num_samples=tuple(counts),
        cache_dir=os.path.join(cache_dir, "index") if cache_dir else None,
    )
    if datasets[k] is None:
        raise AnalysisError(
            f"--split {args.split}: the data's split {split!r} gives it no documents")
    return tokenizer, datasets[k]


def _batches(dataset, num_batches: int, mbs: int) -> Iterator[Dict]:
    import torch

    for b in range(num_batches):
        samples = [dataset[(b * mbs + i) % len(dataset)] for i in range(mbs)]
        yield {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}


def _title(config, iteration) -> str:
    mode = config.residual
    if config.uses_depth_attention:
        mode += f", {config.key_type} r={config.key_rank} N={config.num_blocks}"
    return f"({mode}, iter {iteration})"


def prepare(args: argparse.Namespace) -> tuple:
    """The checkpoint folder, its ``lrattn.json`` and the training arguments it records
    (imports torch, not megatron-core; raises ``CheckpointError`` / ``AnalysisError``)."""
    from megatron_lrattn.training.checkpoint_io import read_meta, resolve_checkpoint

    path = resolve_checkpoint(args.checkpoint)
    meta = read_meta(path)
    return path, meta, _training_args(meta, path)


def analyze_checkpoint(args: argparse.Namespace, path: str, meta: Dict,
                       targs: argparse.Namespace) -> Dict:
    """Load the checkpoint and data and return the full report (see ``prepare``)."""
    from megatron_lrattn.analysis.routing import analyze_model
    from megatron_lrattn.training.builder import build_config, build_model, padded_vocab_size
    from megatron_lrattn.training.checkpoint_io import load_model_only
    from megatron_lrattn.training.runtime import init_runtime, provenance

    mbs = args.micro_batch_size or targs.micro_batch_size
    rt = init_runtime(1, 1, targs.seed)
    tokenizer, dataset = _dataset(args, targs, args.num_batches * mbs)
    config = build_config(targs, bf16=False)
    model = build_model(config, targs, padded_vocab_size(tokenizer.vocab_size, targs.train_tp))
    model = model.to(rt.device)
    load_model_only(path, [model], config)

    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        def progress(it):
            return tqdm(it, total=args.num_batches, desc="analyze", unit="batch",
                        dynamic_ncols=True)

    report = analyze_model(model, config, _batches(dataset, args.num_batches, mbs), progress)
    head = {
        "checkpoint": os.path.abspath(path),
        "iteration": meta.get("iteration"),
        "model_settings": meta.get("model_settings"),
        "title": _title(config, meta.get("iteration")),
        "data": {"split": args.split, "num_batches": args.num_batches, "micro_batch_size": mbs,
                 "seq_length": targs.seq_length},
        "provenance": provenance(),
    }
    return {**head, **report}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit code (2 on a bad input).

    Arguments and the checkpoint's metadata are checked before megatron-core is imported,
    so bad input fails fast.
    """
    parsed = []

    def _parse() -> int:
        parsed.append(parse_args(argv))
        return 0

    # The flags (and --help) first: nothing heavy is imported for them.
    rc = run_cli(PROG, _parse, (AnalyzeArgumentError,))
    if rc:
        return rc
    args = parsed[0]

    from megatron_lrattn.analysis.plots import PlotsUnavailable, require_matplotlib
    from megatron_lrattn.analysis.routing import AnalysisError
    from megatron_lrattn.training.checkpoint_io import CheckpointError

    def _prepare() -> int:
        if not args.no_plots:
            require_matplotlib()
        parsed.extend(prepare(args))
        return 0

    rc = run_cli(PROG, _prepare, (AnalyzeArgumentError, AnalysisError, CheckpointError,
                                  PlotsUnavailable))
    if rc:
        return rc

    from megatron_lrattn.model.config import ConfigError
    from megatron_lrattn.data.errors import DataError

    def _main() -> int:
        setup_logging()
        from megatron_lrattn.training.durable import output_dir
        from megatron_lrattn.training.runtime import shutdown_runtime

        try:
            report = analyze_checkpoint(*parsed)
        finally:
            shutdown_runtime()
        out_json = os.path.join(args.out, "analysis.json")
        plots = []
        try:
            with output_dir(args.out) as tmp:
                with open(os.path.join(tmp, "analysis.json"), "w") as f:
                    json.dump(report, f, indent=1)
                if not args.no_plots:
                    from megatron_lrattn.analysis.plots import write_plots

                    plots = [os.path.join(args.out, os.path.basename(p))
                             for p in write_plots(report, tmp)]
        except OSError as e:
            raise AnalysisError(f"--out {args.out}: writing the results failed "
                                f"({e.strerror or e}); nothing was written there") from None
        print(f"loss over {report['num_batches']} batches: {report['loss']:.4f}")
        routing = report["routing"]
        if routing is None:
            print(f"note: {report['note']}")
        else:
            eff = ", ".join(f"{e:.2f}/{s}" for e, s in
                            zip(routing["effective_sources"], routing["num_sources"]))
            print(f"effective sources per site (of S_j): {eff}")
        print(f"json: {out_json}")
        for p in plots:
            print(f"plot: {p}")
        return 0

    return run_cli(PROG, _main, (AnalysisError, CheckpointError, ConfigError, DataError))


if __name__ == "__main__":
    sys.exit(main())
