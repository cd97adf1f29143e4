"""pearl: PEARL's parallel drafting (seed 002), not a stopping rule.

The draft drafts the next round while the target verifies this one
(`integration/pearl.py`, `parallel_draft.py`); the draft length adapts by
itself: a round whose drafts are all accepted hands its successor a full
draft; after a rejection the next round verifies `pre_draft` drafts made at
once (PEARL's pre-verify with 0: none). The class exists so the config
validates `pearl` like every policy; `decide` is never called.
"""

from __future__ import annotations

import os

from vllm_adaptive_spec.errors import ConfigError
from vllm_adaptive_spec.policies.base import StopPolicy
from vllm_adaptive_spec.policies.params import Param


class PearlPolicy(StopPolicy):
    name = "pearl"
    PARAMS = {
        "draft_cpu": Param(int, 0, 4095),  # the CPU the draft runs on (default: those the engine does not use)
        # where the draft runs: its own process (CPU default: no interpreter lock shared with the
        # engine) or a thread of the engine's process (GPU: on its own CUDA stream)
        "draft_worker": Param(str, choices=("process", "thread")),
        # after a rejection, drafts made at once, before the target's next step (0: PEARL's pre-verify,
        # where that step verifies none and only checks the worker's first token). Default 1: faster
        # than 0 in every cell measured (README, "Parallel drafting")
        "pre_draft": Param(int, 0, 16),
    }

    def __init__(self, draft_cpu: int | None = None, draft_worker: str | None = None, pre_draft: int = 1):
        self.draft_cpu = draft_cpu
        self.draft_worker = draft_worker
        self.pre_draft = pre_draft

    @classmethod
    def check_engine(cls, params: dict, draft_model: str) -> None:
        from vllm_adaptive_spec.parallel_draft import check_draft_dir

        try:
            check_draft_dir(draft_model)
        except ValueError as e:
            raise ConfigError(
                f"speculative_config.model={draft_model!r}: policy 'pearl' runs the draft itself "
                f"and cannot load it: {e}"
            ) from None
        cpu = params.get("draft_cpu")
        if cpu is not None and cpu >= (os.cpu_count() or 1):
            raise ConfigError(f"adaptive_spec.draft_cpu: {cpu!r} is not a CPU of this machine ({os.cpu_count()} CPUs)")
