"""The plugin's one validated configuration object.

Users pass it through vLLM's channel for plugins:
`additional_config={"adaptive_spec": {"policy": "<name>", ...}}`. It is parsed
once, at engine start-up, and every bad value raises `ConfigError` with a
message naming the field and the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

CONFIG_KEY = "adaptive_spec"

# Stopping policies available in this release. "fixed" drafts the full K
# every step, exactly as vLLM's own draft-model proposer does.
POLICIES = ("fixed",)


class ConfigError(ValueError):
    """A bad `adaptive_spec` value; the message names the field and the value."""


@dataclass(frozen=True)
class AdaptiveSpecConfig:
    policy: str = "fixed"

    @classmethod
    def from_dict(cls, raw: Any) -> AdaptiveSpecConfig:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{CONFIG_KEY}: expected a mapping such as {{'policy': 'fixed'}}, got {raw!r}")
        known = {f.name for f in fields(cls)}
        for key in raw:
            if key not in known:
                raise ConfigError(
                    f"{CONFIG_KEY}.{key}: unknown field (value {raw[key]!r}); known fields: {sorted(known)}"
                )
        policy = raw.get("policy", cls.policy)
        if not isinstance(policy, str) or policy not in POLICIES:
            raise ConfigError(
                f"{CONFIG_KEY}.policy: unknown policy {policy!r}; expected one of {list(POLICIES)}"
            )
        return cls(policy=policy)


def parse_additional_config(additional_config: Any) -> AdaptiveSpecConfig | None:
    """The plugin's config from vLLM's `additional_config`, or None when absent.

    None means the plugin stays out of the way: vLLM runs unchanged.
    """
    if not isinstance(additional_config, Mapping) or CONFIG_KEY not in additional_config:
        return None
    return AdaptiveSpecConfig.from_dict(additional_config[CONFIG_KEY])
