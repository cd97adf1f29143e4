"""Target responses for head training, generated through vLLM (SpecDec++ seed 001, Pacer seed 000).

The only vLLM part of the training pipelines: the target model answers the
training prompts, greedily and/or sampled, with the CPU-friendly settings the
toy pair uses (small KV cache, eager mode, float32 from the model config).
vLLM starts engine processes: call this from under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from vllm_adaptive_spec.training.data import Response

logger = logging.getLogger(__name__)


def generate_responses(
    target: str | Path,
    prompts: list[str],
    max_tokens: int = 128,
    modes: tuple[str, ...] = ("greedy",),
    temperature: float = 1.0,
    seed: int = 0,
    max_model_len: int = 1024,
) -> list[Response]:
    """One response per prompt and mode ("greedy" or "sampled"), with vLLM's exact token ids."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(target), max_model_len=max_model_len, enforce_eager=True, seed=seed, max_num_seqs=64)
    try:
        room = max_model_len - max_tokens - 1
        tokenizer = llm.get_tokenizer()
        prompts = [p for p in prompts if len(tokenizer.encode(p)) <= room]
        responses: list[Response] = []
        for mode in modes:
            if mode == "greedy":
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            elif mode == "sampled":
                params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
            else:
                raise ValueError(f"mode must be 'greedy' or 'sampled', got {mode!r}")
            logger.info("target responses (%s): %d prompts x up to %d tokens", mode, len(prompts), max_tokens)
            for out in llm.generate(prompts, params, use_tqdm=True):
                ids = list(out.outputs[0].token_ids)
                if ids:
                    responses.append(Response(list(out.prompt_token_ids), ids, mode))
        return responses
    finally:
        llm.llm_engine.engine_core.shutdown()
