"""Switches the adaptive proposer on in a model runner, and finds it again.

The runner keeps its `drafter` attribute; we only replace the object behind
it. Proposers are tracked here, per process, so the worker can report their
statistics (see `worker_stats`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from vllm_adaptive_spec.config import AdaptiveSpecConfig

logger = logging.getLogger(__name__)

_proposers: weakref.WeakSet = weakref.WeakSet()
_policies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model runner -> its policy's name


def activate(runner: Any, cfg: AdaptiveSpecConfig) -> None:
    from vllm_adaptive_spec.integration.fixes import apply_cpu_sampling_fix
    from vllm_adaptive_spec.integration.proposer import DRAFTERS

    _policies[runner] = cfg.policy
    apply_cpu_sampling_fix()
    if getattr(runner, "drafter", None) is None:
        return  # not the rank that drafts (pipeline parallelism)
    drafter_class = DRAFTERS[runner.speculative_config.method]
    if cfg.policy == "pearl":
        from vllm_adaptive_spec.integration.pearl import PearlProposer

        drafter_class = PearlProposer
    runner.drafter = drafter_class(runner.vllm_config, runner.device, runner, cfg)
    _proposers.add(runner.drafter)
    logger.info(
        "vllm-adaptive-spec: %s drafts with policy %s %s (cap K=%d)",
        type(runner).__name__,
        cfg.policy,
        cfg.params,
        runner.speculative_config.num_speculative_tokens,
    )


def active_policies(runner: Any = None) -> list[str]:
    """Policies switched on in one model runner (None: in every runner of this process; empty: plugin off)."""
    return [policy for r, policy in list(_policies.items()) if runner is None or r is runner]


def proposers(runner: Any = None) -> list:
    """The adaptive proposers of one model runner (None: every one in this process).

    Engines running in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0) share this module, so a worker
    asks for its own runner's: otherwise it would see the other engines' too."""
    return [p for p in list(_proposers) if runner is None or p.runner is runner]


def worker_stats(runner: Any = None) -> list[dict]:
    """Snapshots of the adaptive proposers of one model runner (None: every one in this process)."""
    return [
        p.stats.snapshot()
        | {
            "policy": p.policy.name,
            "tracked": p.policy.num_tracked(),
            "prepare_ahead": p.prepare_ahead,
            "compact_drafts": p.compact_drafts,
        }
        | (
            {"gate_held_rounds": p.gate.held_rounds, "gate_none_rounds": p.gate.none_rounds}
            if p.gate is not None
            else {}
        )
        | (
            {
                "grammar_stops": p.grammar.stops,
                "grammar_masked": p.grammar.masked,
                "grammar_tracked": p.grammar.num_tracked(),
            }
            if p.grammar is not None
            else {}
        )
        | ({"gate_costs": _gate_costs(p.gate)} if p.gate is not None and p.gate.meter is not None else {})
        | ({"parallel": p.parallel_stats()} if hasattr(p, "parallel_stats") else {})
        for p in proposers(runner)
    ]


def _gate_costs(gate: Any) -> dict:
    """The curves the gate decides on now, and the points measured so far (costs: online)."""
    return {"curves": gate.costs.curves, "measured": {k: gate.meter.measured(k) for k in gate.meter.KINDS}}


def _stats_rpc(worker: Any) -> list[dict]:
    return worker_stats(worker.model_runner)


def get_stats(llm: Any) -> list[dict]:
    """Statistics from every worker of an offline `vllm.LLM` (one list per worker).

    Uses `collective_rpc` with a function, which vLLM allows only with
    VLLM_ALLOW_INSECURE_SERIALIZATION=1.
    """
    return [s for per_worker in llm.collective_rpc(_stats_rpc) for s in per_worker]
