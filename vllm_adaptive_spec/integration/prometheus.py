"""Prometheus metrics of adaptive speculation, beside vLLM's `vllm:spec_decode_*`.

A stat-logger plugin (entry point group `vllm.stat_logger_plugins`, which
`vllm serve` loads) reads the per-step `SpecDecodingStats` the scheduler
already sends to the front end. Per step it has, per position j, how many
requests drafted a token at j; the differences give the distribution of
per-request draft lengths. Engines without `adaptive_spec` export nothing.

Exported (names avoid the `vllm:` prefix, which vLLM clears on start-up):
- adaptive_spec:draft_length               histogram of per-request draft lengths per step
- adaptive_spec:num_draft_tokens_per_pos   counter, label position (0-based)
- adaptive_spec:mean_acceptance_length     gauge, 1 + accepted / drafts since start
- adaptive_spec:discard_rate               gauge, (drafted - accepted) / generated in steps with drafts
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_adaptive_spec.config import parse_additional_config
from vllm_adaptive_spec.metrics import lengths_from_per_pos

_metrics: dict[str, Any] = {}  # created once per process; engines share them


def _get_metrics(cap: int) -> dict[str, Any]:
    if not _metrics:
        _metrics["length"] = Histogram(
            "adaptive_spec:draft_length",
            "Draft tokens proposed per request per step (steps with at least one draft token).",
            buckets=[float(b) for b in range(1, max(cap, 1) + 1)],
        )
        _metrics["per_pos"] = Counter(
            "adaptive_spec:num_draft_tokens_per_pos", "Draft tokens proposed at each position.", ["position"]
        )
        _metrics["tau"] = Gauge("adaptive_spec:mean_acceptance_length", "1 + accepted / drafts since start.")
        _metrics["discard"] = Gauge(
            "adaptive_spec:discard_rate", "(drafted - accepted) / generated tokens, over steps with drafts."
        )
    return _metrics


class AdaptiveSpecStatLogger(StatLoggerBase):
    def __init__(self, vllm_config: Any, engine_index: int = 0):
        self.enabled = parse_additional_config(vllm_config.additional_config) is not None
        if not self.enabled:
            return
        self.metrics = _get_metrics(vllm_config.speculative_config.num_speculative_tokens)
        self.drafts = self.drafted = self.accepted = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        spec = getattr(scheduler_stats, "spec_decoding_stats", None) if self.enabled else None
        if spec is None or spec.num_drafts == 0:
            return
        for length, count in lengths_from_per_pos(spec.num_draft_tokens_per_pos).items():
            for _ in range(count):
                self.metrics["length"].observe(length)
        for pos, n in enumerate(spec.num_draft_tokens_per_pos):
            if n:
                self.metrics["per_pos"].labels(position=str(pos)).inc(n)
        self.drafts += spec.num_drafts
        self.drafted += spec.num_draft_tokens
        self.accepted += spec.num_accepted_tokens
        self.metrics["tau"].set(1 + self.accepted / self.drafts)
        self.metrics["discard"].set((self.drafted - self.accepted) / (self.drafts + self.accepted))

    def log_engine_initialized(self):
        pass
