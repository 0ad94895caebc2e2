"""Downstream evaluation inside the training loop (``--downstream-eval-interval N``).

Every N iterations (and after the last), the model being trained is scored on the local
tasks of ``lrattn-eval`` (``megatron_lrattn.eval``: last-word cloze and next-line choice
built from the embedded corpus's held-out documents, and held-out perplexity / bits per
byte), with the items and the scoring of ``lrattn-eval``. Results go to the log and to the metrics file as ``{"type": "downstream"}``
records (and TensorBoard / W&B through the same writer).

The model is called directly (forward only, eval mode, no gradients), with logits cut to
the tokenizer's vocabulary (the padded rows are not part of the model's distribution). It
needs the full logits on one rank: one tensor- and one pipeline-parallel rank; every
data-parallel rank holds the model, and the first one scores while the others wait.
"""

from __future__ import annotations

import argparse
import logging
import time
from types import SimpleNamespace
from typing import Callable, Dict, Optional

from megatron_lrattn.training.arg_types import ArgumentError

logger = logging.getLogger(__name__)

DEFAULT_TASKS = ("last_word", "next_line")


def add_downstream_args(group) -> None:
    """The ``--downstream-eval-*`` flags (in the evaluation group)."""
    group.add_argument("--downstream-eval-interval", type=int, default=None, metavar="N",
                       help="score lrattn-eval's local tasks every N iterations and after the "
                            "last (default: never)")
    group.add_argument("--downstream-eval-tasks", default=",".join(DEFAULT_TASKS),
                       metavar="T1,T2",
                       help="tasks of lrattn-eval: heldout, last_word, next_line (default: "
                            f"{','.join(DEFAULT_TASKS)})")
    group.add_argument("--downstream-eval-limit", type=int, default=100, metavar="K",
                       help="items per accuracy task (default: 100)")


def check_downstream_args(args: argparse.Namespace) -> None:
    """Refuse settings in-loop scoring cannot run with (raises ``ArgumentError``)."""
    interval = getattr(args, "downstream_eval_interval", None)
    if interval is None:
        return
    from megatron_lrattn.eval.harness import TASKS

    if interval < 1:
        raise ArgumentError(f"--downstream-eval-interval {interval}: must be at least 1")
    if args.downstream_eval_limit < 1:
        raise ArgumentError(f"--downstream-eval-limit {args.downstream_eval_limit}: must be "
                            "at least 1")
    tasks = [t for t in args.downstream_eval_tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if not tasks or unknown:
        raise ArgumentError(f"--downstream-eval-tasks {args.downstream_eval_tasks}: use a "
                            f"comma-separated subset of {','.join(TASKS)}")
    cp = getattr(args, "context_parallel_size", 1) or 1
    if args.tensor_model_parallel_size != 1 or args.pipeline_model_parallel_size != 1 or cp != 1:
        raise ArgumentError(
            "--downstream-eval-interval scores full logits on one rank: it needs "
            "--tensor-model-parallel-size, --pipeline-model-parallel-size and "
            "--context-parallel-size 1 (got "
            f"{args.tensor_model_parallel_size}, {args.pipeline_model_parallel_size} and {cp})")
    if getattr(args, "mock_data", False) and not getattr(args, "tokenizer_model", None):
        raise ArgumentError("--downstream-eval-interval scores text: --mock-data needs "
                            "--tokenizer-model for it")


class _LogitsModel:
    """What ``eval.harness.Scorer`` calls: ``model(tokens).logits`` [b, s, vocab]."""

    def __init__(self, model, vocab_size: int):
        self.model, self.vocab_size = model, vocab_size

    def parameters(self):
        return self.model.parameters()

    def __call__(self, tokens):
        import torch

        b, s = tokens.shape
        position_ids = torch.arange(s, device=tokens.device).expand(b, s)
        logits = self.model(tokens, position_ids, None)
        return SimpleNamespace(logits=logits[..., :self.vocab_size])


def make_downstream(args: argparse.Namespace, tokenizer_dir: Optional[str], model,
                    vocab_size: int, is_main: bool) -> Optional[Callable[[], Dict]]:
    """The scorer of ``--downstream-eval-interval`` (None when it is off).

    Args:
        tokenizer_dir: the run's Hugging Face tokenizer folder.
        model: the (only) model chunk.
        vocab_size: the tokenizer's vocabulary (before padding).
        is_main: this rank scores; the others return an empty result.
    """
    if getattr(args, "downstream_eval_interval", None) is None:
        return None
    import torch
    import torch.distributed as dist

    from megatron_lrattn.eval import harness
    from megatron_lrattn.eval import tasks as T

    tasks = [t for t in args.downstream_eval_tasks.split(",") if t]
    tok = None
    docs = cloze = choice = None
    if is_main:
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
        docs = T.heldout_documents()
        cloze = T.last_word_items(docs, args.downstream_eval_limit) if "last_word" in tasks \
            else None
        choice = T.next_line_items(docs, args.downstream_eval_limit) if "next_line" in tasks \
            else None

    def run() -> Dict:
        out: Dict = {}
        if is_main:
            t0 = time.perf_counter()
            was_training = model.training
            model.eval()
            scorer = harness.Scorer(_LogitsModel(model, vocab_size), batch_size=8,
                                    max_length=args.seq_length, progress=False)
            with torch.no_grad():
                if "heldout" in tasks:
                    out["heldout"] = harness.perplexity(scorer, tok, docs)
                if cloze is not None:
                    out["last_word"] = harness.last_word(scorer, tok, cloze)
                if choice is not None:
                    out["next_line"] = harness.next_line(scorer, tok, choice)
            if was_training:
                model.train()
            out["seconds"] = round(time.perf_counter() - t0, 2)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return out

    return run


def flatten(results: Dict) -> Dict[str, float]:
    """``{"last_word_acc": ..., "next_line_acc_norm": ...}`` of a result (numbers only)."""
    flat = {}
    for task, values in results.items():
        if isinstance(values, dict):
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    flat[f"{task}_{k}"] = v
    return flat
