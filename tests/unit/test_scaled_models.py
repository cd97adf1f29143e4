"""Cost-scaled checkpoint copies: same function, wider MLPs, deterministic, reused when cached."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.paths import TARGET
from benchmarks.scaled_models import STAMP, check_function, scaled_copy, widen_mlps


def test_widened_mlp_computes_the_same_function():
    torch.manual_seed(0)
    h, i = 8, 12
    state = {
        "l.mlp.gate_proj.weight": torch.randn(i, h),
        "l.mlp.up_proj.weight": torch.randn(i, h),
        "l.mlp.down_proj.weight": torch.randn(h, i),
    }
    wide = widen_mlps(state, factor=3, seed=1, std=0.5)
    assert wide["l.mlp.gate_proj.weight"].shape == (3 * i, h) and wide["l.mlp.down_proj.weight"].shape == (h, 3 * i)

    def mlp(s, x):  # [N, H] -> [N, H]
        g, u, d = (s[f"l.mlp.{p}_proj.weight"] for p in ("gate", "up", "down"))
        return (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T

    x = torch.randn(5, h)
    torch.testing.assert_close(mlp(wide, x), mlp(state, x), rtol=1e-6, atol=1e-6)
    # deterministic: the same seed gives the same extra weights
    again = widen_mlps(state, factor=3, seed=1, std=0.5)
    assert all(torch.equal(wide[k], again[k]) for k in wide)


@pytest.fixture(scope="module")
def scaled_toy(tmp_path_factory):
    return scaled_copy(TARGET, 2, tmp_path_factory.mktemp("scaled") / "toy-target-mlp2")


def test_scaled_toy_target_keeps_its_logits(scaled_toy):
    config = json.loads((scaled_toy / "config.json").read_text())
    original = json.loads((TARGET / "config.json").read_text())
    assert config["intermediate_size"] == 2 * original["intermediate_size"]
    assert (scaled_toy / "tokenizer.json").exists()
    ids = [[5, 17, 300, 42, 7, 99, 1000, 3], list(range(10, 60))]
    check = check_function(TARGET, scaled_toy, ids)
    assert check["greedy_agree"] == check["positions"] == 58
    assert check["max_abs_logit_diff"] < 1e-4, check


def test_scaled_copy_is_cached_by_its_stamp(scaled_toy):
    weights = scaled_toy / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert scaled_copy(TARGET, 2, scaled_toy) == scaled_toy
    assert weights.stat().st_mtime_ns == mtime  # reused, not rewritten
    stamp = json.loads((scaled_toy / STAMP).read_text())
    assert stamp["mlp_factor"] == 2 and stamp["seed"] == 0
    assert set(load_file(str(weights))) == set(load_file(str(TARGET / "model.safetensors"))) - {"lm_head.weight"}


def test_bad_factor_is_refused(tmp_path):
    with pytest.raises(ValueError, match="mlp_factor"):
        scaled_copy(TARGET, 0, tmp_path / "x")


def test_head_restamped_for_a_scaled_draft(tmp_path):
    """A scaled draft computes the original's hidden states: its restamped head loads on it (same
    tensors), and the original head still refuses it."""
    from benchmarks.paths import DRAFT, REPO
    from benchmarks.scaled_models import restamped_head
    from vllm_adaptive_spec.config import ConfigError
    from vllm_adaptive_spec.heads.fileformat import check_draft, load_head_file, read_head_meta

    head = REPO / "heads" / "toy" / "specdecpp.safetensors"
    wide = scaled_copy(DRAFT, 2, tmp_path / "toy-draft-mlp2")
    copy = restamped_head(head, wide)
    assert copy.parent == wide / "heads"
    check_draft(read_head_meta(copy, "head"), copy, wide, "head")
    with pytest.raises(ConfigError, match="trained for draft"):
        check_draft(read_head_meta(head, "head"), head, wide, "head")
    original, restamped = load_head_file(head, "head"), load_head_file(copy, "head")
    assert all(torch.equal(original.tensors[k], restamped.tensors[k]) for k in original.tensors)
    assert restamped.meta["restamped_from"] == original.meta["draft"]
    with pytest.raises(ValueError, match="not trained for"):
        restamped_head(head, scaled_copy(TARGET, 2, tmp_path / "toy-target-mlp2"))
