"""Stopping policies, one module each, behind `base.StopPolicy`."""

from vllm_adaptive_spec.policies.adaedl import AdaEdlPolicy
from vllm_adaptive_spec.policies.base import StepDecision, StopPolicy, entropy
from vllm_adaptive_spec.policies.confidence import ConfidencePolicy
from vllm_adaptive_spec.policies.copy import CopyPolicy
from vllm_adaptive_spec.policies.fixed import FixedPolicy
from vllm_adaptive_spec.policies.heuristic import HeuristicPolicy
from vllm_adaptive_spec.policies.pacer import PacerPolicy
from vllm_adaptive_spec.policies.pearl import PearlPolicy
from vllm_adaptive_spec.policies.specdecpp import SpecDecPPPolicy
from vllm_adaptive_spec.policies.svip import SvipPolicy
from vllm_adaptive_spec.policies.vllm_av import VllmAvPolicy

POLICY_CLASSES: dict[str, type[StopPolicy]] = {
    cls.name: cls
    for cls in (
        FixedPolicy,
        SvipPolicy,
        AdaEdlPolicy,
        ConfidencePolicy,
        CopyPolicy,
        HeuristicPolicy,
        SpecDecPPPolicy,
        PacerPolicy,
        VllmAvPolicy,
        PearlPolicy,
    )
}

__all__ = ["POLICY_CLASSES", "StepDecision", "StopPolicy", "entropy"]
