"""TensorBoard and W&B sinks: records reach them (fake modules stand in for the packages),
TensorBoard defaults to SAVE/tensorboard, a missing tensorboard is one info line, a missing
wandb that was asked for is a one-line argument error."""
from __future__ import annotations

import argparse
import logging
import sys
import types

import pytest

from megatron_lrattn.training import trackers


class _Recorder:
    def __init__(self):
        self.lines = []

    def write(self, record):
        self.lines.append(record)

    def close(self):
        self.lines.append("closed")


def _args(**kw):
    base = dict(save=None, tensorboard_dir=None, wandb_project=None, wandb_exp_name=None,
                wandb_save_dir=None)
    base.update(kw)
    return argparse.Namespace(**base)


RECORDS = [{"type": "run", "git_sha": "abc"},
           {"type": "train", "iteration": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": None,
            "skipped": False},
           {"type": "valid", "iteration": 1, "loss": 2.4}]


def test_tensorboard_gets_scalars_and_defaults_to_save_dir(monkeypatch, tmp_path):
    calls = []

    class FakeWriter:
        def __init__(self, log_dir):
            calls.append(("dir", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def add_text(self, tag, text):
            calls.append((tag, "text"))

        def flush(self):
            pass

        def close(self):
            calls.append("closed")

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=FakeWriter))
    primary = _Recorder()
    out = trackers.with_trackers(primary, _args(save=str(tmp_path)), enabled=True)
    for r in RECORDS:
        out.write(r)
    out.close()
    assert calls == [("dir", str(tmp_path / "tensorboard")), ("run", "text"),
                     ("train/loss", 2.5, 1), ("train/lr", 1e-3, 1), ("valid/loss", 2.4, 1),
                     "closed"]
    assert primary.lines == RECORDS + ["closed"]


def test_missing_tensorboard_is_one_info_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    primary = _Recorder()
    with caplog.at_level(logging.INFO, logger=trackers.__name__):
        out = trackers.with_trackers(primary, _args(save=str(tmp_path)), enabled=True)
    assert out is primary
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "tensorboard: not installed" in caplog.records[0].getMessage()


def test_no_sinks_off_rank_0_or_without_save(tmp_path):
    primary = _Recorder()
    assert trackers.with_trackers(primary, _args(save=str(tmp_path)), enabled=False) is primary
    assert trackers.with_trackers(primary, _args(), enabled=True) is primary


def test_wandb_run_gets_config_and_scalars(monkeypatch, tmp_path):
    logged = []

    class FakeRun:
        config = types.SimpleNamespace(update=lambda d, allow_val_change: logged.append(
            ("config", sorted(d))))

        def log(self, values, step):
            logged.append((values, step))

        def finish(self):
            logged.append("finished")

    def init(project, name, dir, config, resume):
        logged.append(("init", project, name, dir))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    out = trackers.with_trackers(_Recorder(), _args(save=str(tmp_path), tensorboard_dir=None,
                                                    wandb_project="p", wandb_exp_name="e"),
                                 enabled=True)
    for r in RECORDS:
        out.write(r)
    out.close()
    assert ("init", "p", "e", str(tmp_path / "wandb")) in logged
    assert ("config", ["run"]) in logged
    assert ({"train/loss": 2.5, "train/lr": 1e-3}, 1) in logged
    assert ({"valid/loss": 2.4}, 1) in logged
    assert logged[-1] == "finished"


def test_wandb_asked_for_but_missing_is_an_argument_error(monkeypatch, tmp_path):
    from megatron_lrattn.training.arguments import ArgumentError, parse_args

    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ArgumentError, match="--wandb-project needs the wandb package"):
        parse_args(["--wandb-project", "p"])
