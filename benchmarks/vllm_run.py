"""Small helpers to run the toy pair through vLLM, shared by scripts and tests."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.paths import DRAFTERS, TARGET

# Before vLLM starts: a small KV cache (vLLM on CPU reserves ~8 GiB by
# default) and no hub access, ever.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Structured outputs of the lossless tests and benchmarks.grammar_stop (vLLM's grammar backend, xgrammar by
# default): the scheduler cuts each draft at its first token the grammar refuses, and the target's pass
# masks every verified position.
STRUCTURED_REGEX = r"def [a-z_]{1,12}\(([a-z_]{1,8}, ){0,3}[a-z_]{1,8}\):"
STRUCTURED_JSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "size": {"type": "integer"}},
    "required": ["name", "size"],
}


def spec_config(k: int, method: str = "draft_model") -> dict:
    """Speculation with the bundled drafter of `method` (benchmarks.paths.DRAFTERS), cap K; "ngram" is
    vLLM's prompt lookup (no drafter), matching the context's last 2-4 tokens."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    return {"method": method, "model": str(DRAFTERS[method]), "num_speculative_tokens": k}


def make_llm(k: int | None = None, adaptive: dict | None = None, method: str = "draft_model", **kwargs: Any):
    """The toy target in vLLM; with `k`, speculation with the bundled drafter of `method`, cap K."""
    from vllm import LLM

    args: dict[str, Any] = dict(
        model=str(TARGET),
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
        max_num_seqs=64,
        disable_log_stats=False,
    )
    if k is not None:
        args["speculative_config"] = spec_config(k, method)
    if adaptive is not None:
        args["additional_config"] = {"adaptive_spec": adaptive}
    args.update(kwargs)
    return LLM(**args)


def close_llm(llm) -> None:
    """Shut the engine down.

    An engine in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as the tests run them) shares
    vLLM's distributed groups with every other engine of the process: its shutdown
    (`EngineCore.shutdown` -> `cleanup_dist_env_and_memory`) would destroy them under the engines
    still running (their next step fails: "pipeline model parallel group is not initialized"). Those
    groups stay for the process's other and later engines; the rest of the engine is released."""
    import gc

    import vllm.envs
    from vllm.v1.engine import core
    from vllm.v1.engine.core_client import InprocClient

    client = llm.llm_engine.engine_core
    if not isinstance(client, InprocClient):
        client.shutdown()
        return
    teardown = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = lambda *args, **kwargs: (vllm.envs.disable_envs_cache(), gc.collect())
    try:
        client.shutdown()
    finally:
        core.cleanup_dist_env_and_memory = teardown


@dataclass
class SpecMetrics:
    """vLLM's own spec-decode counters (cumulative since engine start)."""

    drafts: int = 0  # target verification steps that carried drafts
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    def __sub__(self, other: SpecMetrics) -> SpecMetrics:
        per_pos = tuple(
            a - (other.accepted_per_pos[i] if i < len(other.accepted_per_pos) else 0)
            for i, a in enumerate(self.accepted_per_pos)
        )
        return SpecMetrics(
            self.drafts - other.drafts,
            self.draft_tokens - other.draft_tokens,
            self.accepted - other.accepted,
            per_pos,
        )

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else float("nan")


def spec_metrics(llm) -> SpecMetrics:
    m = SpecMetrics()
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            m.drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_draft_tokens":
            m.draft_tokens += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            m.accepted += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            m.accepted_per_pos = tuple(metric.values)
    return m


def greedy_params(max_tokens: int, **kwargs: Any):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def generate_tokens(llm, prompts: list[str], max_tokens: int | list[int]) -> list[list[int]]:
    """Greedy tokens per prompt; `max_tokens` may differ per prompt."""
    params = [greedy_params(m) for m in max_tokens] if isinstance(max_tokens, list) else greedy_params(max_tokens)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def repeated_rates(llm, prompts: list[str], max_tokens: int, batch: int, repeats: int) -> list[float]:
    """Tokens/s of `repeats` timed runs, after a short warm-up."""
    timed_generate(llm, prompts[:2], max_tokens, batch)
    return [n / s for s, n in (timed_generate(llm, prompts, max_tokens, batch) for _ in range(repeats))]


def timed_generate(llm, prompts: list[str], max_tokens: int, batch: int) -> tuple[float, int]:
    """Wall seconds and generated tokens for `prompts` sent `batch` at a time."""
    params = greedy_params(max_tokens)
    n_tokens, start = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        n_tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return time.perf_counter() - start, n_tokens
