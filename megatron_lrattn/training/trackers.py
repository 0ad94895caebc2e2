"""TensorBoard and Weights & Biases next to the JSON-lines metrics file (rank 0 only).

Every record the loop writes (``run``, ``train``, ``valid``) goes to all sinks: TensorBoard
event files in ``--tensorboard-dir`` (default ``SAVE/tensorboard`` with ``--save``; skipped
with one info line when the ``tensorboard`` package is missing) and a W&B run when
``--wandb-project`` is given (an error when ``wandb`` is not installed: it was asked for).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Dict, List, Optional

logger = logging.getLogger(__name__)

SCALARS = ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "tflops_per_gpu", "mfu")


class TensorBoardSink:
    """Scalars ``train/<field>`` and ``valid/loss`` by iteration; the run record as text."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, record: Dict) -> None:
        """Log one metrics record."""
        kind = record.get("type")
        if kind == "run":
            self.writer.add_text("run", json.dumps(record, default=str))
            return
        step = record.get("iteration")
        for field in SCALARS:
            value = record.get(field)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{kind}/{field}", value, step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class WandbSink:
    """A W&B run; the run record becomes its config, scalars are logged by iteration."""

    def __init__(self, args: argparse.Namespace):
        import wandb

        save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=args.wandb_project, name=args.wandb_exp_name, dir=save_dir,
                              config={k: v for k, v in vars(args).items()}, resume="allow")

    def write(self, record: Dict) -> None:
        """Log one metrics record."""
        kind = record.get("type")
        if kind == "run":
            self.run.config.update({"run": record}, allow_val_change=True)
            return
        values = {f"{kind}/{f}": record[f] for f in SCALARS
                  if isinstance(record.get(f), (int, float)) and not isinstance(record[f], bool)}
        self.run.log(values, step=record.get("iteration"))

    def close(self) -> None:
        """Finish the W&B run."""
        self.run.finish()


class FanOut:
    """Writes every record to the JSON-lines writer and the extra sinks."""

    def __init__(self, primary, sinks: List):
        self.primary, self.sinks = primary, sinks

    def write(self, record: Dict) -> None:
        """Write one record everywhere."""
        self.primary.write(record)
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        """Close every sink."""
        self.primary.close()
        for sink in self.sinks:
            sink.close()


def tensorboard_dir(args: argparse.Namespace) -> Optional[str]:
    """``--tensorboard-dir``, else ``SAVE/tensorboard`` when ``--save`` is given."""
    if getattr(args, "tensorboard_dir", None):
        return args.tensorboard_dir
    return os.path.join(args.save, "tensorboard") if getattr(args, "save", None) else None


def with_trackers(metrics, args: argparse.Namespace, enabled: bool):
    """Wrap the JSON-lines ``metrics`` writer with TensorBoard/W&B sinks (rank 0 only).

    Raises:
        ArgumentError: ``--wandb-project`` without the ``wandb`` package.
    """
    if not enabled:
        return metrics
    sinks = []
    tb_dir = tensorboard_dir(args)
    if tb_dir:
        try:
            sinks.append(TensorBoardSink(tb_dir))
            logger.info("tensorboard: %s", tb_dir)
        except ImportError:
            log = logger.warning if getattr(args, "tensorboard_dir", None) else logger.info
            log("tensorboard: not installed (pip install tensorboard), not logging to %s", tb_dir)
    if getattr(args, "wandb_project", None):
        try:
            sinks.append(WandbSink(args))
        except ImportError:
            from megatron_lrattn.training.arguments import ArgumentError

            raise ArgumentError("--wandb-project needs the wandb package (pip install wandb)") from None
    return FanOut(metrics, sinks) if sinks else metrics
