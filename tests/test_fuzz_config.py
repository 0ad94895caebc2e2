"""Property test over random model configurations: each one either builds and runs a forward
pass on the CPU, or is refused by ``lrattn-pretrain``'s validation with ``ArgumentError`` /
``ConfigError`` and a one-line message. Never an internal exception.

Configurations with TP or PP sizes of 2 go through argument and config validation only (a
single process cannot build them). Examples are drawn deterministically (``derandomize``)
so a failure reproduces on every run.
"""
from __future__ import annotations

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
