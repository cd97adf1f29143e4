"""The plugin's config: parsed once, every bad value named."""

from __future__ import annotations

import pytest

from vllm_adaptive_spec import AdaptiveSpecConfig, ConfigError, parse_additional_config


@pytest.mark.parametrize("additional", [None, {}, {"other_plugin": 1}])
def test_absent_means_off(additional):
    assert parse_additional_config(additional) is None


def test_policy_params_are_kept_and_build_the_policy():
    cfg = parse_additional_config({"adaptive_spec": {"policy": "svip", "threshold": 0.5}})
    assert cfg.params == {"threshold": 0.5}
    assert cfg.build_policy().threshold == 0.5
    assert parse_additional_config({"adaptive_spec": {"policy": "heuristic", "initial": 3}}).build_policy().initial == 3


def test_fixed_policy():
    assert parse_additional_config({"adaptive_spec": {"policy": "fixed"}}) == AdaptiveSpecConfig("fixed", {})
    assert parse_additional_config({"adaptive_spec": {}}) == AdaptiveSpecConfig("fixed", {})
    policy = parse_additional_config({"adaptive_spec": {"policy": "fixed"}}).build_policy()
    assert policy.round_limits(["a", "b"], 8) == [8, 8]  # the cap


def test_fixed_policy_with_k_drafts_k_under_the_cap():
    policy = parse_additional_config({"adaptive_spec": {"policy": "fixed", "k": 3}}).build_policy()
    assert policy.round_limits(["a", "b"], 8) == [3, 3]
    assert policy.round_limits(["a"], 2) == [2]  # never past the engine's cap


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"policy": "nope"}, "adaptive_spec.policy: unknown policy 'nope'"),
        ({"policy": 3}, "adaptive_spec.policy: unknown policy 3"),
        (
            {"policy": "fixed", "thresh": 0.5},
            "adaptive_spec.thresh: unknown field for policy 'fixed' (value 0.5)",
        ),
        ({"policy": "svip", "threshold": "high"}, "adaptive_spec.threshold: expected float, got 'high'"),
        ({"policy": "svip", "threshold": -1.0}, "adaptive_spec.threshold: -1.0 is out of range"),
        ({"policy": "confidence", "threshold": float("nan")}, "adaptive_spec.threshold: nan is out of range"),
        ({"policy": "heuristic", "initial": 2.5}, "adaptive_spec.initial: expected int, got 2.5"),
        ({"policy": "fixed", "k": 0}, "adaptive_spec.k: 0 is out of range"),
        ({"policy": "heuristic", "initial": True}, "adaptive_spec.initial: expected int, got True"),
        ({"policy": "svip", "prepare_ahead": "yes"}, "adaptive_spec.prepare_ahead: expected true or false, got 'yes'"),
        ({"policy": "pearl", "prepare_ahead": True}, "adaptive_spec.prepare_ahead: true does not combine with"),
        ({"policy": "svip", "grammar_stop": 1}, "adaptive_spec.grammar_stop: expected true or false, got 1"),
        ({"policy": "pearl", "grammar_stop": True}, "adaptive_spec.grammar_stop: true does not combine with"),
        ({"policy": "svip", "grammar_mask": "yes"}, "adaptive_spec.grammar_mask: expected true or false, got 'yes'"),
        ({"policy": "svip", "grammar_stop": False, "grammar_mask": True}, "adaptive_spec.grammar_mask: true needs"),
        ({"policy": "pearl", "grammar_mask": True}, "adaptive_spec.grammar_mask: true needs grammar_stop true"),
        ({"policy": "copy", "min_drafts": 2.0}, "adaptive_spec.min_drafts: expected an integer from 0 to 64, got 2.0"),
        ({"policy": "copy", "min_drafts": True}, "adaptive_spec.min_drafts: expected an integer from 0 to 64, got T"),
        ({"policy": "copy", "min_drafts": -1}, "adaptive_spec.min_drafts: expected an integer from 0 to 64, got -1"),
        ({"policy": "pearl", "min_drafts": 2}, "adaptive_spec.min_drafts: 2 does not combine with policy 'pearl'"),
        (
            {"policy": "copy", "context_tail": 65},
            "adaptive_spec.context_tail: expected an integer from 0 to 64, got 65",
        ),
        (
            {"policy": "copy", "context_tail": "4"},
            "adaptive_spec.context_tail: expected an integer from 0 to 64, got '4'",
        ),
        ({"policy": "pearl", "context_tail": 4}, "adaptive_spec.context_tail: 4 does not combine with policy 'pearl'"),
        ({"policy": "copy", "context_tail": 4, "tail_gate": 1}, "adaptive_spec.tail_gate: expected true or false"),
        ({"policy": "copy", "tail_gate": True}, "adaptive_spec.tail_gate: true needs context_tail above 0 and batch"),
        (
            {"policy": "fixed", "context_tail": 4, "tail_gate": True},
            "adaptive_spec.tail_gate: true needs context_tail above 0 and batch_aware true (it cuts the tail on the "
            "batch gate's cost curves; context_tail is 4, batch_aware False)",
        ),
        ({"policy": "copy", "skip_first_pass": 1}, "adaptive_spec.skip_first_pass: expected true or false, got 1"),
        (
            {"policy": "fixed", "skip_first_pass": True},
            "adaptive_spec.skip_first_pass: true needs batch_aware true (it skips the first pass of rounds the "
            "batch gate verifies nothing in; batch_aware is false for policy 'fixed')",
        ),
        (
            {"policy": "pacer", "skip_first_pass": True},
            "adaptive_spec.skip_first_pass: true does not combine with policy 'pacer' (it reads every round's first",
        ),
        ("fixed", "adaptive_spec: expected a mapping"),
        ([], "adaptive_spec: expected a mapping"),
    ],
)
def test_bad_values_name_field_and_value(raw, needle):
    with pytest.raises(ConfigError) as err:
        parse_additional_config({"adaptive_spec": raw})
    assert needle in str(err.value)


def test_prepare_ahead_is_a_plugin_field_and_defaults_to_the_device():
    """Absent (None): the loop prepares ahead on CUDA only (integration/proposer.py); true or false
    forces it, and it never reaches the policy's parameters."""
    assert AdaptiveSpecConfig.from_dict({"policy": "svip"}).prepare_ahead is None
    cfg = AdaptiveSpecConfig.from_dict({"policy": "svip", "prepare_ahead": True})
    assert cfg.prepare_ahead is True and cfg.params == {}
    assert AdaptiveSpecConfig.from_dict({"policy": "pearl", "prepare_ahead": False}).prepare_ahead is False


def test_grammar_stop_is_on_for_adaptive_policies_and_off_for_the_baselines():
    from vllm_adaptive_spec.config import AdaptiveSpecConfig

    assert AdaptiveSpecConfig.from_dict({"policy": "svip"}).grammar_stop is True
    for baseline in ("fixed", "vllm_av", "pearl"):
        assert AdaptiveSpecConfig.from_dict({"policy": baseline}).grammar_stop is False
    cfg = AdaptiveSpecConfig.from_dict({"policy": "fixed", "grammar_stop": True})
    assert cfg.grammar_stop is True and cfg.params == {}
    assert AdaptiveSpecConfig.from_dict({"policy": "confidence", "grammar_stop": False}).grammar_stop is False


def test_grammar_mask_follows_the_grammar_stop_unless_set():
    from vllm_adaptive_spec.config import AdaptiveSpecConfig

    assert AdaptiveSpecConfig.from_dict({"policy": "svip"}).grammar_mask is True
    for baseline in ("fixed", "vllm_av", "pearl"):
        assert AdaptiveSpecConfig.from_dict({"policy": baseline}).grammar_mask is False
    assert AdaptiveSpecConfig.from_dict({"policy": "fixed", "grammar_stop": True}).grammar_mask is True
    assert AdaptiveSpecConfig.from_dict({"policy": "svip", "grammar_stop": False}).grammar_mask is False
    cfg = AdaptiveSpecConfig.from_dict({"policy": "svip", "grammar_mask": False})
    assert cfg.grammar_stop is True and cfg.grammar_mask is False and cfg.params == {}


def test_context_tail_is_a_plugin_field_off_by_default():
    assert AdaptiveSpecConfig.from_dict({"policy": "svip"}).context_tail == 0
    cfg = AdaptiveSpecConfig.from_dict({"policy": "svip", "context_tail": 8})
    assert cfg.context_tail == 8 and "context_tail" not in cfg.params
    # the tail gate: off by default (since 2026-12-06, README "The context tail"), on when asked
    assert cfg.tail_gate is False and AdaptiveSpecConfig.from_dict({"policy": "svip"}).tail_gate is False
    assert AdaptiveSpecConfig.from_dict({"policy": "fixed", "context_tail": 8}).tail_gate is False
    on = AdaptiveSpecConfig.from_dict({"policy": "svip", "context_tail": 8, "tail_gate": True})
    assert on.tail_gate is True and on.batch_aware is True and "tail_gate" not in on.params


def test_min_drafts_is_a_plugin_field_off_by_default():
    assert AdaptiveSpecConfig.from_dict({"policy": "copy"}).min_drafts == 0
    cfg = AdaptiveSpecConfig.from_dict({"policy": "copy", "min_drafts": 2})
    assert cfg.min_drafts == 2 and "min_drafts" not in cfg.params
