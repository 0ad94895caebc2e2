"""Preset files in examples/presets/ are generated from presets.py and equal to it; --config
loads YAML/JSON with explicit flags winning; unknown keys and wrong types are one-line errors
naming the file and the key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_lrattn.training.arguments import ArgumentError, parse_args
from megatron_lrattn.training.presets import PRESETS, preset_yaml

PRESET_DIR = Path(__file__).resolve().parents[1] / "examples" / "presets"


def test_preset_files_are_generated_from_presets_py():
    assert sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) == sorted(PRESETS)
    for name in PRESETS:
        assert (PRESET_DIR / f"{name}.yaml").read_text() == preset_yaml(name), (
            f"examples/presets/{name}.yaml is stale: run "
            f"python -m megatron_lrattn.training.presets examples/presets")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_file_equals_its_preset(name):
    a = vars(parse_args(["--config", str(PRESET_DIR / f"{name}.yaml")]))
    b = vars(parse_args(["--preset", name]))
    for d in (a, b):
        d.pop("config"), d.pop("preset")
    assert a == b


def test_explicit_flags_win_and_json_works(tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"preset": "tiny", "num-layers": 2, "lr": 1, "residual": "attnres",
                               "data_path": None, "qk_layernorm": True}))
    args = parse_args(["--config", str(cfg), "--num-layers", "3"])
    assert (args.num_layers, args.lr, args.residual, args.qk_layernorm) == (3, 1.0, "attnres", True)


@pytest.mark.parametrize("content, needle", [
    ("num_layerz: 4\n", "unknown key 'num_layerz'"),
    ("num_layers: four\n", "key 'num_layers': expected an integer, got 'four'"),
    ("num_layers: 0\n", "key 'num_layers': expected a positive integer"),
    ("lr: true\n", "key 'lr': expected a number, got True"),
    ("swiglu: 1\n", "key 'swiglu': expected true or false, got 1"),
    ("residual: dense\n", "key 'residual': expected one of"),
    ("- a list\n", "expected a mapping"),
    ("a: [\n", "not valid YAML"),
])
def test_bad_config_is_one_line_error_naming_file_and_key(tmp_path, content, needle):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(content)
    with pytest.raises(ArgumentError) as e:
        parse_args(["--config", str(cfg)])
    assert needle in str(e.value) and "bad.yaml" in str(e.value)
    assert "\n" not in str(e.value)


def test_conflicting_preset(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("preset: 1b\n")
    with pytest.raises(ArgumentError, match="--preset tiny disagrees with preset '1b'"):
        parse_args(["--config", str(cfg), "--preset", "tiny"])
    assert parse_args(["--config", str(cfg)]).hidden_size == 2048
