"""Target passes are counted exactly, and alike, for vLLM's own fixed K and the plugin.

The harness takes vLLM's N_T from the engine's passes that returned tokens
(its latency histograms: one time-to-first-token per request, one inter-token
latency per later pass; `counters`), for draft models the same as the passes
that verified drafts (per-request spec-decode metrics) plus the prefill pass,
and the plugin's from its own per-step records.
On the same greedy work with the same K both must give the same N_T, and
N_gen - N_T must be the drafts actually kept: vLLM's accepted counter also
counts drafts accepted past max_tokens (regression: the report's vLLM K=16
showed tau 3.00, above the oracle's 2.88).
"""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.harness.worker import _delta, plugin_totals, request_counts
from benchmarks.paths import REPO
from tests.conftest import greedy_params

N, MAX_TOKENS = 8, 40


def test_vllm_and_plugin_count_the_same_target_passes(spec_llm, adaptive_llm, prompts, reference_tokens):
    work, params = prompts[:N], greedy_params(MAX_TOKENS)
    outs = spec_llm.generate(work, params, use_tqdm=False)
    vllm = request_counts(outs, speculative=True)

    own0 = plugin_totals(adaptive_llm)
    got_plugin = [list(o.outputs[0].token_ids) for o in adaptive_llm.generate(work, params, use_tqdm=False)]
    own = _delta(plugin_totals(adaptive_llm), own0, 1)

    got_vllm = [list(o.outputs[0].token_ids) for o in outs]
    assert got_vllm == got_plugin == [t[:MAX_TOKENS] for t in reference_tokens[:N]]
    n_gen = sum(map(len, got_vllm))
    assert vllm["n_gen"] == own["n_gen"] == n_gen
    assert vllm["n_target"] == own["n_target"]
    assert vllm["n_accepted"] == own["n_accepted"] == n_gen - own["n_target"]
    # vLLM's per-request histogram counts at least the drafts kept (more when accepted past max_tokens)
    vllm_accepted = sum(j * n for o in outs for j, n in enumerate(o.outputs[0].spec_decode_metrics.histogram))
    assert vllm_accepted >= vllm["n_accepted"]
    # the plugin never drafts past max_tokens, vLLM's fixed K does
    assert own["n_draft"] <= vllm["n_draft"]


def test_passes_without_drafts_count_too():
    """vLLM's prompt lookup (method ngram) drafts nothing where the context has no match: those passes
    are target passes too. Regression: N_T from the per-request histogram (passes that verified drafts)
    gave vLLM ngram K=8 tau 6.9 on code prompts at batch 1, where the engine ran 3.5x as many steps.
    In a subprocess: the ngram proposer loads numba, and after that vLLM's start-up scan of sys.modules
    (triton_utils.dispatcher) fails for every later engine of the process."""
    code = """
import json
from vllm import SamplingParams
from benchmarks import vllm_run
from benchmarks.harness.worker import counters, request_counts
from benchmarks.paths import load_prompts
llm = vllm_run.make_llm(k=8, method="ngram", per_request_spec_decode_metrics="summary", dtype="float32")
before = counters(llm)
outs = llm.generate(load_prompts("code_heldout", 1), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
after = counters(llm)
verified = request_counts(outs, speculative=True)["n_target"]
print(json.dumps({k: after[k] - before[k] for k in ("passes", "steps")} | {"verified": verified}))
""".replace("MAX_TOKENS", str(MAX_TOKENS))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True, cwd=REPO
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["passes"] == got["steps"] > got["verified"], got  # batch 1: a step is a pass
