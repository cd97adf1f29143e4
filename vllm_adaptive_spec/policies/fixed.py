"""fixed: always draft the cap K (vLLM's own behaviour)."""

from vllm_adaptive_spec.policies.base import StopPolicy


class FixedPolicy(StopPolicy):
    name = "fixed"
