"""What the EAGLE-3 and DFlash unit tests share: a tiny Qwen3 target config and checks of the
directories their heads write."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

TARGET = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 4,
    "vocab_size": 50,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "max_position_embeddings": 256,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights uniform in [0.5, 1.5] (global RNG), so a swapped or skipped norm shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)


def saved_config(out: Path) -> dict:
    """config.json of a head directory that holds exactly config.json and model.safetensors."""
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    return json.loads((out / "config.json").read_text())


def safetensors_summary(path: Path) -> tuple[set[str], dict[str, tuple[int, ...]], set[torch.dtype]]:
    """Names, shapes and dtypes of the tensors in one safetensors file."""
    with safe_open(str(path), framework="pt") as fh:
        keys = set(fh.keys())
        return keys, {k: tuple(fh.get_tensor(k).shape) for k in keys}, {fh.get_tensor(k).dtype for k in keys}


def assert_same_bytes(a: Path, b: Path) -> None:
    """Two head directories hold byte-identical files (the plugin fingerprints them)."""
    for name in ("config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
