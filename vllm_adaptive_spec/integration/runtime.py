"""Per-process record of the model runners the plugin switched on.

This release ships the `fixed` policy only, which drafts K tokens every step
exactly as vLLM's draft-model proposer does, so activation leaves the
runner's drafter untouched and only records the policy. Adaptive policies
replace the drafter here.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_adaptive_spec.config import AdaptiveSpecConfig

logger = logging.getLogger(__name__)

_active: list[str] = []


def activate(runner: Any, cfg: AdaptiveSpecConfig) -> None:
    _active.append(cfg.policy)
    logger.info("vllm-adaptive-spec active in %s: policy=%s", type(runner).__name__, cfg.policy)


def active_policies() -> list[str]:
    """Policies switched on in this process's model runners (empty: plugin off)."""
    return list(_active)
