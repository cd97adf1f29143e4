"""The plugin's config: parsed once, every bad value named."""

from __future__ import annotations

import pytest

from vllm_adaptive_spec import AdaptiveSpecConfig, ConfigError, parse_additional_config


@pytest.mark.parametrize("additional", [None, {}, {"other_plugin": 1}])
def test_absent_means_off(additional):
    assert parse_additional_config(additional) is None


def test_fixed_policy():
    assert parse_additional_config({"adaptive_spec": {"policy": "fixed"}}) == AdaptiveSpecConfig("fixed")
    assert parse_additional_config({"adaptive_spec": {}}) == AdaptiveSpecConfig("fixed")


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"policy": "nope"}, "adaptive_spec.policy: unknown policy 'nope'"),
        ({"policy": 3}, "adaptive_spec.policy: unknown policy 3"),
        ({"policy": "fixed", "thresh": 0.5}, "adaptive_spec.thresh: unknown field (value 0.5)"),
        ("fixed", "adaptive_spec: expected a mapping"),
        ([], "adaptive_spec: expected a mapping"),
    ],
)
def test_bad_values_name_field_and_value(raw, needle):
    with pytest.raises(ConfigError) as err:
        parse_additional_config({"adaptive_spec": raw})
    assert needle in str(err.value)
