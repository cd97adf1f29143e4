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
from vllm_adaptive_spec.policies.batch_gate import BatchGate
from vllm_adaptive_spec.policies.costs import load_costs

CONFIG_KEY = "adaptive_spec"
POLICIES = tuple(POLICY_CLASSES)
# the plugin's own fields; the rest are the policy's
PLUGIN_FIELDS = (
    "policy",
    "time_policy",
    "batch_aware",
    "costs",
    "prepare_ahead",
    "compact_drafts",
    "grammar_stop",
    "grammar_mask",
    "min_drafts",
    "context_tail",
    "tail_gate",
    "skip_first_pass",
)
ONLINE = "online"  # adaptive_spec.costs: the gate measures this machine's costs as it runs
BASELINES = ("fixed", "vllm_av", "pearl")  # policies the batch gate is off for unless asked (vllm_av, pearl: never)
__all__ = ["CONFIG_KEY", "AdaptiveSpecConfig", "ConfigError", "parse_additional_config"]


@dataclass(frozen=True)
class AdaptiveSpecConfig:
    policy: str = "fixed"
    params: dict[str, Any] = field(default_factory=dict)  # the policy's constructor keywords
    time_policy: bool = False  # measure the policy's own time in the engine (policies/timing.py)
    batch_aware: bool = False  # the batch gate (policies/batch_gate.py); default on for adaptive policies
    costs: str | None = None  # cost-curve file (policies/costs.py); None: the bundled curves; "online": measured
    # the loop prepares draft step t+1's inputs before it waits for step t's decisions; None: on CUDA only
    prepare_ahead: bool | None = None
    # once the rows still drafting are at most half of a batch, later draft forwards compute them only;
    # None: on CPU only
    compact_drafts: bool | None = None
    # under structured outputs a row stops drafting at its first draft token the grammar refuses
    # (integration/grammar.py); default on for adaptive policies
    grammar_stop: bool = False
    # under structured outputs a row's draft draws only tokens its grammar allows (integration/grammar.py);
    # needs grammar_stop; default: grammar_stop's value
    grammar_mask: bool = False
    # every row drafts at least this many tokens (as its cap and max_tokens allow) before its policy or the
    # gate may end its draft: for a target whose pass over a few tokens costs no more than over one
    min_drafts: int = 0
    # after a round's drafts, up to this many more that the request's context predicts (prompt lookup), free
    # of draft forwards; a row whose context predicts its next token drafts one token first (policies/tail.py)
    context_tail: int = 0
    # the tail is cut to what pays for its verification where the batch gate runs, on its cost curves
    # (policies/tail.py: TailGate); default on with a tail and the gate
    tail_gate: bool = False
    # a draft model skips its first pass in every other round the batch gate verifies nothing in (those
    # rounds then verify no tail either); None: on wherever it applies (a draft model, the gate on, a
    # policy that reads no first pass)
    skip_first_pass: bool | None = None

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
        batch_aware = raw.get("batch_aware", policy not in BASELINES)
        if not isinstance(batch_aware, bool):
            raise ConfigError(f"{CONFIG_KEY}.batch_aware: expected true or false, got {batch_aware!r}")
        if batch_aware and policy in ("vllm_av", "pearl"):
            why = {"vllm_av": "it drafts the full K", "pearl": "it serves one request at a time"}[policy]
            raise ConfigError(f"{CONFIG_KEY}.batch_aware: true does not combine with policy {policy!r} ({why})")
        if time_policy and policy == "pearl":
            raise ConfigError(
                f"{CONFIG_KEY}.time_policy: true does not combine with policy 'pearl' "
                "(it has no stopping rule to time; its per-step timeline is in the statistics)"
            )
        # the step loop's options (None: the device decides); pearl's draft runs in a worker, not in that loop
        prepare_ahead = _loop_option(raw, "prepare_ahead", policy, "its draft runs in a worker of its own")
        compact_drafts = _loop_option(raw, "compact_drafts", policy, "it serves one request at a time, in a worker")
        grammar_stop = raw.get("grammar_stop", policy not in BASELINES)
        if not isinstance(grammar_stop, bool):
            raise ConfigError(f"{CONFIG_KEY}.grammar_stop: expected true or false, got {grammar_stop!r}")
        if grammar_stop and policy == "pearl":
            raise ConfigError(
                f"{CONFIG_KEY}.grammar_stop: true does not combine with policy 'pearl' (its draft runs ahead of "
                "the target, in a worker of its own)"
            )
        grammar_mask = raw.get("grammar_mask", grammar_stop)
        if not isinstance(grammar_mask, bool):
            raise ConfigError(f"{CONFIG_KEY}.grammar_mask: expected true or false, got {grammar_mask!r}")
        if grammar_mask and not grammar_stop:
            raise ConfigError(
                f"{CONFIG_KEY}.grammar_mask: true needs grammar_stop true (the matchers it masks with are the "
                f"grammar stop's; grammar_stop is false{' for policy pearl' if policy == 'pearl' else ''})"
            )
        min_drafts = _draft_count(raw, "min_drafts", policy)
        context_tail = _draft_count(raw, "context_tail", policy)
        tail_gate = raw.get("tail_gate", False)  # opt-in: README, "The context tail"
        if not isinstance(tail_gate, bool):
            raise ConfigError(f"{CONFIG_KEY}.tail_gate: expected true or false, got {tail_gate!r}")
        if tail_gate and not (context_tail and batch_aware):
            raise ConfigError(
                f"{CONFIG_KEY}.tail_gate: true needs context_tail above 0 and batch_aware true (it cuts the tail "
                f"on the batch gate's cost curves; context_tail is {context_tail}, batch_aware {batch_aware})"
            )
        skip_first_pass = raw.get("skip_first_pass")
        if skip_first_pass is not None and not isinstance(skip_first_pass, bool):
            raise ConfigError(f"{CONFIG_KEY}.skip_first_pass: expected true or false, got {skip_first_pass!r}")
        if skip_first_pass and not batch_aware:
            raise ConfigError(
                f"{CONFIG_KEY}.skip_first_pass: true needs batch_aware true (it skips the first pass of rounds "
                f"the batch gate verifies nothing in; batch_aware is false for policy {policy!r})"
            )
        if skip_first_pass and POLICY_CLASSES[policy].observes_context:
            raise ConfigError(
                f"{CONFIG_KEY}.skip_first_pass: true does not combine with policy {policy!r} (it reads every "
                "round's first pass)"
            )
        costs = raw.get("costs")
        if costs is not None:
            if not isinstance(costs, str) or not costs:
                raise ConfigError(f"{CONFIG_KEY}.costs: expected a path to a cost file or {ONLINE!r}, got {costs!r}")
            if costs == ONLINE and not batch_aware:
                raise ConfigError(
                    f"{CONFIG_KEY}.costs: {ONLINE!r} measures costs for the batch gate, which is off here "
                    f"(policy {policy!r}, batch_aware false); pass a cost file, or turn the gate on"
                )
            load_costs(None if costs == ONLINE else costs)  # a bad file fails here, at start-up
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
        return cls(
            policy=policy,
            params=params,
            time_policy=time_policy,
            batch_aware=batch_aware,
            costs=costs,
            prepare_ahead=prepare_ahead,
            compact_drafts=compact_drafts,
            grammar_stop=grammar_stop,
            grammar_mask=grammar_mask,
            min_drafts=min_drafts,
            context_tail=context_tail,
            tail_gate=tail_gate,
            skip_first_pass=skip_first_pass,
        )

    @property
    def online_costs(self) -> bool:
        return self.costs == ONLINE

    def _cost_curves(self) -> dict:
        return load_costs(None if self.online_costs else self.costs)

    def build_policy(self) -> StopPolicy:
        cls = POLICY_CLASSES[self.policy]
        extra = {"costs": self._cost_curves()} if getattr(cls, "uses_costs", False) else {}
        return cls(**self.params, **extra)

    def build_gate(self) -> BatchGate | None:
        return BatchGate(self._cost_curves(), online=self.online_costs) if self.batch_aware else None

    @property
    def is_fixed(self) -> bool:
        return self.policy == "fixed"


def _draft_count(raw: Mapping, name: str, policy: str) -> int:
    """A plugin field counting drafts (min_drafts, context_tail): an integer from 0 (off) to 64, which
    pearl's draft, running ahead of the target in a worker of its own, cannot take."""
    value = raw.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 64:
        raise ConfigError(f"{CONFIG_KEY}.{name}: expected an integer from 0 to 64, got {value!r}")
    if value and policy == "pearl":
        raise ConfigError(
            f"{CONFIG_KEY}.{name}: {value} does not combine with policy 'pearl' (its draft runs "
            "ahead of the target, in a worker of its own)"
        )
    return value


def _loop_option(raw: Mapping, key: str, policy: str, pearl_why: str) -> bool | None:
    """A plugin field that is true, false or absent (None: the device decides); true is refused with pearl."""
    value = raw.get(key)
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{CONFIG_KEY}.{key}: expected true or false, got {value!r}")
    if value and policy == "pearl":
        raise ConfigError(
            f"{CONFIG_KEY}.{key}: true does not combine with policy 'pearl' ({pearl_why}, not in the step loop)"
        )
    return value


def parse_additional_config(additional_config: Any) -> AdaptiveSpecConfig | None:
    """The plugin's config from vLLM's `additional_config`, or None when absent.

    None means the plugin stays out of the way: vLLM runs unchanged.
    """
    if not isinstance(additional_config, Mapping) or CONFIG_KEY not in additional_config:
        return None
    return AdaptiveSpecConfig.from_dict(additional_config[CONFIG_KEY])
