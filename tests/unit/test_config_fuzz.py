"""Fuzzed `adaptive_spec` values: a valid config or one ConfigError naming the field, nothing else."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllm_adaptive_spec.config import POLICIES, AdaptiveSpecConfig, ConfigError
from vllm_adaptive_spec.policies import POLICY_CLASSES

KNOWN_KEYS = sorted({"policy", *(k for cls in POLICY_CLASSES.values() for k in cls.PARAMS)})

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
policies = st.sampled_from(POLICIES) | json_values
configs = st.dictionaries(
    st.sampled_from(KNOWN_KEYS) | st.text(max_size=8), json_values | st.floats(-2, 20), max_size=4
)


def _check(raw) -> None:
    try:
        cfg = AdaptiveSpecConfig.from_dict(raw)
    except ConfigError as e:
        msg = str(e)
        assert msg.startswith("adaptive_spec"), msg
        assert "\n" not in msg, msg
        return
    cfg.build_policy()  # a config that validates also builds


@settings(max_examples=400, deadline=None)
@given(configs, policies)
@example({"threshold": 1e308}, "svip")  # regression: threshold**2 overflowed in SvipPolicy.__init__
@example({"\n": 0.0}, "fixed")  # regression: a field name with a newline broke the one-line message
def test_fuzzed_mappings(raw, policy):
    _check(raw | {"policy": policy})


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_fuzzed_values(raw):
    _check(raw)
