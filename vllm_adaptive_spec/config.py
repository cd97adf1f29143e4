"""The plugin's one validated configuration object.

Users pass it through vLLM's channel for plugins:
`additional_config={"adaptive_spec": {"policy": "<name>", ...params}}`. It
is parsed once, at engine start-up, and every bad value raises `ConfigError`
with a message naming the field and the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_adaptive_spec.errors import ConfigError
from vllm_adaptive_spec.policies import POLICY_CLASSES, StopPolicy

CONFIG_KEY = "adaptive_spec"
POLICIES = tuple(POLICY_CLASSES)
PLUGIN_FIELDS = ("policy", "time_policy")  # fields of the plugin itself; the rest are the policy's
__all__ = ["CONFIG_KEY", "AdaptiveSpecConfig", "ConfigError", "parse_additional_config"]


@dataclass(frozen=True)
class AdaptiveSpecConfig:
    policy: str = "fixed"
    params: dict[str, Any] = field(default_factory=dict)  # the policy's constructor keywords
    time_policy: bool = False  # measure the policy's own time in the engine (policies/timing.py)

    @classmethod
    def from_dict(cls, raw: Any) -> AdaptiveSpecConfig:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{CONFIG_KEY}: expected a mapping such as {{'policy': 'svip'}}, got {raw!r}")
        policy = raw.get("policy", cls.policy)
        if not isinstance(policy, str) or policy not in POLICY_CLASSES:
            raise ConfigError(f"{CONFIG_KEY}.policy: unknown policy {policy!r}; expected one of {list(POLICIES)}")
        time_policy = raw.get("time_policy", cls.time_policy)
        if not isinstance(time_policy, bool):
            raise ConfigError(f"{CONFIG_KEY}.time_policy: expected true or false, got {time_policy!r}")
        specs = POLICY_CLASSES[policy].PARAMS
        params = {}
        for key, value in raw.items():
            if key in PLUGIN_FIELDS:
                continue
            if key not in specs:
                name = key if isinstance(key, str) and key.isidentifier() else repr(key)  # one-line message
                raise ConfigError(
                    f"{CONFIG_KEY}.{name}: unknown field for policy {policy!r} (value {value!r}); "
                    f"known fields: {[*PLUGIN_FIELDS, *sorted(specs)]}"
                )
            error = specs[key].check(f"{CONFIG_KEY}.{key}", value)
            if error:
                raise ConfigError(error)
            params[key] = value
        for key, spec in specs.items():
            if spec.required and key not in params:
                raise ConfigError(f"{CONFIG_KEY}.{key}: required for policy {policy!r}")
        return cls(policy=policy, params=params, time_policy=time_policy)

    def build_policy(self) -> StopPolicy:
        return POLICY_CLASSES[self.policy](**self.params)

    @property
    def is_fixed(self) -> bool:
        return self.policy == "fixed"


def parse_additional_config(additional_config: Any) -> AdaptiveSpecConfig | None:
    """The plugin's config from vLLM's `additional_config`, or None when absent.

    None means the plugin stays out of the way: vLLM runs unchanged.
    """
    if not isinstance(additional_config, Mapping) or CONFIG_KEY not in additional_config:
        return None
    return AdaptiveSpecConfig.from_dict(additional_config[CONFIG_KEY])
