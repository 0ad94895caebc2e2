"""Causality of the whole model: the logits at positions before t do not change when the
tokens from t on change, for every residual mode, depth schedule and core attention
(megatron's local one and the SDPA one the training builds use), on CPU and (with the
GPU kernels: fused SDPA, Triton depth reads and merges, bf16) on CUDA. A model that sees
later tokens would still train, and faster on a repeated batch."""
from __future__ import annotations

import pytest
import torch

from helpers import build_gpt, model_parallel_1x1, tiny_config

SEQ, CUT, VOCAB = 64, 40, 128

ARMS = {
    "standard": ("standard", {}),
    "attnres": ("attnres", {"num_blocks": 2}),
    "lr_sliced": ("lr_attnres", {"num_blocks": 2, "key_type": "sliced"}),
    "lr_projected": ("lr_attnres", {"num_blocks": 2, "key_type": "projected", "key_rank": 8}),
}


@pytest.fixture(scope="module")
def mp():
    with model_parallel_1x1():
        yield


def _prefix_and_suffix_change(arm: str, schedule: str, device: str, dtype,
                              core_attention: str = "auto") -> tuple:
    from megatron_lrattn.model.spec import get_lr_attnres_layer_spec

    residual, depth = ARMS[arm]
    if residual != "standard":
        depth = dict(depth, depth_schedule=schedule)
    config = tiny_config(residual, num_layers=3, hidden_size=64, **depth)
    model = build_gpt(config, seed=5, vocab_size=VOCAB, seq_length=SEQ,
                      spec=get_lr_attnres_layer_spec(config, core_attention=core_attention))
    model = model.to(device=device, dtype=dtype).eval()
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():  # routing away from uniform, so every source matters
        for q in getattr(model.decoder, "depth_queries", {}).values():
            q.weight.copy_(torch.randn(q.weight.shape, generator=g).to(q.weight) * 2.0)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    changed = tokens.clone()
    changed[:, CUT:] = torch.randint(0, VOCAB, (2, SEQ - CUT), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        a = model(tokens.to(device), pos.to(device), None).float()
        b = model(changed.to(device), pos.to(device), None).float()
    # logits are [b, s, V]
    return ((a[:, :CUT] - b[:, :CUT]).abs().max().item(),
            (a[:, CUT:] - b[:, CUT:]).abs().max().item())


@pytest.mark.parametrize("core_attention", ["local", "sdpa"])
@pytest.mark.parametrize("schedule", ["per_site", "two_phase"])
@pytest.mark.parametrize("arm", list(ARMS))
def test_no_position_sees_later_tokens_cpu(mp, arm, schedule, core_attention):
    if torch.cuda.is_available():
        pytest.skip("CPU variant: megatron's rotary tables go to CUDA where it exists; the "
                    "CUDA variant runs here")
    if arm == "standard" and schedule == "two_phase":
        pytest.skip("the standard residual has no depth schedule")
    prefix, suffix = _prefix_and_suffix_change(arm, schedule, "cpu", torch.float64,
                                               core_attention)
    assert suffix > 1e-3, (arm, suffix)  # the change reaches the later positions
    assert prefix == 0.0, (arm, schedule, prefix)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["per_site", "two_phase"])
@pytest.mark.parametrize("arm", list(ARMS))
def test_no_position_sees_later_tokens_cuda(mp, arm, schedule):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the fused attention and depth kernels)")
    if arm == "standard" and schedule == "two_phase":
        pytest.skip("the standard residual has no depth schedule")
    prefix, suffix = _prefix_and_suffix_change(arm, schedule, "cuda", torch.bfloat16, "sdpa")
    assert suffix > 1e-2, (arm, suffix)
    assert prefix <= 1e-3 * suffix, (arm, schedule, prefix, suffix)
