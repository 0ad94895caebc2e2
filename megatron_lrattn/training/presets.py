"""Named model and training presets (defaults for ``lrattn-pretrain`` flags)."""

from __future__ import annotations

from typing import Any, Dict

_COMMON: Dict[str, Any] = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    untie_embeddings_and_output_weights=True,
    disable_bias_linear=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    residual="lr_attnres",
    key="sliced",
    num_blocks=8,
    lr_decay_style="cosine",
    weight_decay=0.1,
    adam_beta1=0.9,
    adam_beta2=0.95,
    clip_grad=1.0,
    tensor_model_parallel_size=1,
    context_parallel_size=1,
    log_interval=10,
    eval_interval=1000,
    eval_iters=10,
    pipeline_model_parallel_size=1,
)

# What the quality study's models share (docs/results.md): 32 x 1024 tokens per step, N = 8.
_STUDY: Dict[str, Any] = dict(
    _COMMON,
    seq_length=1024,
    global_batch_size=32,
    train_iters=500,
    lr=2e-3,
    min_lr=2e-4,
    lr_warmup_iters=50,
    eval_interval=50,
    eval_iters=10,
    log_interval=50,
    num_blocks=8,
    rotary_base=10000,
)

PRESETS: Dict[str, Dict[str, Any]] = {
    # A few million parameters; trains on the embedded stdlib corpus on 2 CPU cores in
    # a few minutes.
    "tiny": dict(
        _COMMON,
        num_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        ffn_hidden_size=352,
        seq_length=128,
        micro_batch_size=8,
        global_batch_size=16,
        train_iters=300,
        lr=3e-3,
        min_lr=3e-4,
        lr_warmup_iters=30,
        eval_interval=100,
        eval_iters=10,
        log_interval=10,
        num_blocks=4,
        rotary_base=10000,
    ),
    # The quality study's model (docs/results.md): 25.7M non-embedding parameters, 8
    # depth blocks of one layer each; 500 steps of 32 x 1024 tokens.
    "study-25m": dict(
        _STUDY,
        num_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        ffn_hidden_size=1408,
        micro_batch_size=32,
    ),
    # The quality study's larger model: 103.8M non-embedding parameters, 8 depth blocks
    # of two layers each; the same tokens per step as study-25m in two micro-batches.
    "study-100m": dict(
        _STUDY,
        num_layers=16,
        hidden_size=768,
        num_attention_heads=12,
        ffn_hidden_size=1792,
        micro_batch_size=16,
    ),
    # The LR-AttnRes paper's 0.5B model.
    "0.5b": dict(
        _COMMON,
        num_layers=24,
        hidden_size=1024,
        num_attention_heads=16,
        ffn_hidden_size=2816,
        seq_length=2048,
        micro_batch_size=4,
        global_batch_size=256,
        train_iters=20000,
        lr=3e-3,
        min_lr=3e-4,
        lr_warmup_iters=1000,
        lr_decay_style="WSD",
        rotary_base=500000,
        qk_layernorm=True,
    ),
    "1b": dict(
        _COMMON,
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=16,
        ffn_hidden_size=5632,
        seq_length=2048,
        micro_batch_size=4,
        global_batch_size=512,
        train_iters=50000,
        lr=2e-3,
        min_lr=2e-4,
        lr_warmup_iters=2000,
        lr_decay_style="WSD",
        rotary_base=500000,
        qk_layernorm=True,
    ),
    "4b": dict(
        _COMMON,
        num_layers=32,
        hidden_size=3072,
        num_attention_heads=24,
        num_query_groups=8,
        ffn_hidden_size=8192,
        seq_length=4096,
        micro_batch_size=1,
        global_batch_size=512,
        train_iters=100000,
        lr=1.2e-3,
        min_lr=1.2e-4,
        lr_warmup_iters=2000,
        lr_decay_style="WSD",
        rotary_base=500000,
        qk_layernorm=True,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
    ),
    # An 8B-class model (Llama-3-8B's layer shape; lrattn-plan picks its layout).
    "8b": dict(
        _COMMON,
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        seq_length=8192,
        micro_batch_size=1,
        global_batch_size=256,
        train_iters=100000,
        lr=3e-4,
        min_lr=3e-5,
        lr_warmup_iters=2000,
        lr_decay_style="WSD",
        rotary_base=500000,
        qk_layernorm=True,
        tensor_model_parallel_size=4,
        pipeline_model_parallel_size=2,
    ),
}


PRESET_FILES_HEADER = (
    "# Generated from megatron_lrattn/training/presets.py (the single source; a test keeps\n"
    "# this file equal to it). Copy it, edit the copy and pass it with --config FILE;\n"
    "# keys are lrattn-pretrain flags without '--'.\n"
)


def preset_yaml(name: str) -> str:
    """The text of ``examples/presets/<name>.yaml`` for preset ``name``."""
    import yaml

    body = yaml.safe_dump(PRESETS[name], sort_keys=True, default_flow_style=False)
    return PRESET_FILES_HEADER + f"# preset: {name}\n" + body


def write_preset_files(out_dir: str) -> None:
    """Write ``<out_dir>/<name>.yaml`` for every preset (``python -m
    megatron_lrattn.training.presets examples/presets``)."""
    import os

    os.makedirs(out_dir, exist_ok=True)
    for name in PRESETS:
        with open(os.path.join(out_dir, f"{name}.yaml"), "w") as f:
            f.write(preset_yaml(name))


if __name__ == "__main__":
    import sys

    write_preset_files(sys.argv[1] if len(sys.argv) > 1 else "examples/presets")
