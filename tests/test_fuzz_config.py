"""Property test over random model configurations: each one either builds and runs a forward
pass on the CPU, or is refused by ``lrattn-pretrain``'s validation with ``ArgumentError`` /
``ConfigError`` and a one-line message. Never an internal exception.

Configurations with TP or PP sizes of 2 go through argument and config validation only (a
single process cannot build them). Examples are drawn deterministically (``derandomize``)
so a failure reproduces on every run.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import model_parallel_1x1, seed_all
from megatron_lrattn.model.config import KEY_TYPES, RESIDUAL_MODES, ConfigError
from megatron_lrattn.training.arguments import ArgumentError, parse_args

VOCAB, SEQ = 128, 8


def _mostly(draw, valid, anything):
    """A value from ``valid`` three times in four, else from ``anything``."""
    return draw(valid) if draw(st.integers(0, 3)) else draw(anything)


@st.composite
def flag_sets(draw):
    """Command-line flags of a small random model, mostly valid (invalid values and
    combinations are drawn a quarter of the time for each field)."""
    layers = draw(st.integers(1, 4))
    hidden = draw(st.sampled_from([8, 12, 15, 16, 20, 24, 30, 32]))
    heads = _mostly(draw, st.sampled_from([h for h in (1, 2, 3, 4, 5) if hidden % h == 0]),
                    st.integers(1, 5))
    residual = draw(st.sampled_from(RESIDUAL_MODES))
    key = _mostly(draw, st.just("sliced") if residual != "lr_attnres"
                  else st.sampled_from(KEY_TYPES), st.sampled_from(KEY_TYPES))
    flags = {
        "--num-layers": layers,
        "--hidden-size": hidden,
        "--num-attention-heads": heads,
        "--ffn-hidden-size": draw(st.sampled_from([8, 17, 24, 32])),
        "--residual": residual,
        "--key": key,
        "--num-blocks": _mostly(draw, st.integers(1, 2 * layers), st.integers(0, 9)),
        "--tensor-model-parallel-size": draw(st.sampled_from([1, 1, 2])),
        "--pipeline-model-parallel-size": draw(st.sampled_from([1, 1, 2])),
        "--seq-length": SEQ,
        "--micro-batch-size": 1,
        "--global-batch-size": 1,
        "--train-iters": 2,
        "--lr-warmup-iters": 1,
    }
    rank = draw(st.one_of(st.none(), st.integers(0, 34)))
    if rank is not None and (residual == "lr_attnres" or not draw(st.integers(0, 3))):
        flags["--rank"] = rank
    groups = _mostly(draw, st.sampled_from([g for g in (1, 2, 3) if heads % g == 0]),
                     st.sampled_from([1, 2, 3]))
    if draw(st.booleans()):
        flags["--num-query-groups"] = groups
    argv = [str(x) for kv in flags.items() for x in kv]
    for switch in ("--swiglu", "--qk-layernorm", "--disable-bias-linear",
                   "--untie-embeddings-and-output-weights"):
        argv.append(switch if draw(st.booleans()) else "--no-" + switch[2:])
    argv += ["--position-embedding-type", draw(st.sampled_from(["rope", "learned_absolute"]))]
    argv += ["--normalization", draw(st.sampled_from(["RMSNorm", "LayerNorm"]))]
    return argv


def _refused(e: Exception) -> None:
    message = str(e)
    assert message and "\n" not in message, repr(message)


def _forward(args) -> None:
    from megatron_lrattn.training.builder import build_config, build_model

    config = build_config(args, bf16=False)
    with model_parallel_1x1():
        seed_all(0)
        model = build_model(config, args, VOCAB)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (1, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (1, SEQ), generator=g)
        pos = torch.arange(SEQ).unsqueeze(0)
        with torch.no_grad():
            loss = model(tokens, pos, None, labels=labels)
    assert loss.shape == (1, SEQ) and torch.isfinite(loss).all()


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(flag_sets())
def test_every_config_builds_or_is_refused_clearly(argv):
    from megatron_lrattn.training.builder import build_config

    try:
        args = parse_args(argv)
        if args.tensor_model_parallel_size * args.pipeline_model_parallel_size > 1:
            build_config(args, bf16=False)
            return
        _forward(args)
    except (ArgumentError, ConfigError) as e:
        _refused(e)


_VALUES = ["0", "1", "-1", "2", "7", "nan", "inf", "-inf", "1e309", "1.5", "-5", "abc", "",
           "100,0,0", "1,1,1", "0,0,0", "/nonexistent/x", "/sys/lrattn", "RMSNorm", "triton",
           "standard", "lr_attnres", "projected", "--", "\u00e9\u4e2d"]


def _parse_only(module):
    """What each CLI does with its flags before any work (the work is covered elsewhere)."""
    import importlib

    mod = importlib.import_module(f"megatron_lrattn.cli.{module}")
    if module == "pretrain":
        return parse_args
    if module in ("profile", "analyze"):
        return mod.parse_args
    if module == "flops":
        return mod.parse_shape
    return mod.build_parser().parse_args


def _cli_flags(module):
    import importlib

    if module == "pretrain":
        from megatron_lrattn.training.arguments import build_parser

        parser = build_parser()
    else:
        parser = importlib.import_module(f"megatron_lrattn.cli.{module}").build_parser()
    return sorted(s for a in parser._actions for s in a.option_strings
                  if s.startswith("--") and s not in ("--help", "--config"))


@st.composite
def cli_argv(draw, module):
    flags = _cli_flags(module)
    argv = []
    if module in ("convert_hf", "convert_megatron", "analyze"):
        argv += [draw(st.sampled_from(["/nonexistent/ckpt", "/sys", "."])),
                 draw(st.sampled_from(["/nonexistent/out", "/sys/lrattn"]))][
            : 1 if module == "analyze" else 2]
    for flag in draw(st.lists(st.sampled_from(flags), max_size=6)):
        argv.append(flag)
        if draw(st.integers(0, 4)):
            argv.append(draw(st.sampled_from(_VALUES)))
    return argv


def _one_clean_outcome(call, argv) -> None:
    """argparse's exit (usage error, code 2) or a one-line error of our own; never
    another exception."""
    from megatron_lrattn.analysis.routing import AnalysisError
    from megatron_lrattn.data.errors import DataError
    from megatron_lrattn.training.checkpoint_io import CheckpointError

    try:
        call(argv)
    except SystemExit as e:
        assert e.code in (0, 2), (argv, e.code)
    except (ArgumentError, ConfigError, DataError, CheckpointError, AnalysisError) as e:
        _refused(e)
    except Exception as e:  # noqa: BLE001 - the property under test
        if type(e).__name__.endswith(("ArgumentError", "Error")) and type(e).__module__.startswith(
                "megatron_lrattn"):
            _refused(e)
        else:
            raise AssertionError(f"{argv}: {type(e).__name__}: {e}") from e


@pytest.mark.parametrize("module", ["pretrain", "preprocess", "convert_hf", "convert_megatron",
                                    "analyze", "flops", "profile"])
def test_every_cli_refuses_fuzzed_flags_without_a_traceback(module, capsys):
    call = _parse_only(module)

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(cli_argv(module))
    def check(argv):
        _one_clean_outcome(call, argv)

    check()
