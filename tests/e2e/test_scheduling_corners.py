"""Issue 7: the adaptive proposer under KV pressure and vLLM's scheduling corners.

One engine combines them: a KV cache so small that running requests are
preempted and recomputed, prefix caching, chunked prefill with prompts longer
than a chunk, a model length that requests reach while drafting, and
max_tokens of 1. Every greedy output must equal the target alone.
"""

from __future__ import annotations

import pytest

from benchmarks.paths import load_prompts
from tests.conftest import close_llm, first_mismatch, greedy, make_llm, released_stats, spec_config, steep_costs

pytestmark = pytest.mark.e2e

MAX_MODEL_LEN = 256
CHUNK = 64  # max_num_batched_tokens: prompts longer than this prefill in chunks
N = 32


@pytest.fixture(scope="module")
def work(ref_llm):
    base = load_prompts("code_heldout", N)
    # Long prompts (several chunks) and shared prefixes (prefix caching hits).
    tok = ref_llm.get_tokenizer()
    prompts = [base[i] + base[(i + 1) % N] if i % 3 == 0 else base[i] for i in range(N)]
    # Two requests that share a prefix longer than one KV block (128 tokens on CPU), sent first.
    prefix = next(p for p in sorted(prompts, key=len) if len(tok(p).input_ids) > 140)
    prompts = [prefix + "    pass\n", prefix + "    return None\n", *prompts]
    lengths = [len(tok(p).input_ids) for p in prompts]
    keep = [i for i, n in enumerate(lengths) if n < MAX_MODEL_LEN - 8]
    prompts, lengths = [prompts[i] for i in keep], [lengths[i] for i in keep]
    asked = [(1, 120, 400, 17)[i % 4] for i in range(len(prompts))]  # 400: runs into max_model_len
    # The reference has room for everything: it stops where the model length would.
    allowed = [min(m, MAX_MODEL_LEN - n) for m, n in zip(asked, lengths)]
    assert any(m < a for m, a in zip(allowed, asked)), "some request must reach max_model_len"
    assert max(lengths) > CHUNK, "some prompt must need chunked prefill"
    return prompts, asked, greedy(ref_llm, prompts, allowed)


# On STEEP_COSTS the batch gate verifies no draft in most rounds, and the draft model skips every other such
# round's first pass (skip_first_pass) among preemptions, chunks and prefix hits.
@pytest.mark.parametrize("steep", [False, True], ids=["svip", "svip-no-draft-rounds"])
def test_preemption_prefix_cache_chunked_prefill_model_length(work, steep, tmp_path):

    prompts, asked, want = work
    adaptive = {"policy": "svip", "threshold": 0.8}
    if steep:
        adaptive["costs"] = steep_costs(tmp_path)
    llm = make_llm(
        speculative_config=spec_config(8),
        additional_config={"adaptive_spec": adaptive},
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=16,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=CHUNK,
        num_gpu_blocks_override=8,  # blocks of 128 tokens on CPU; 16 running requests need ~32: preemption
    )
    try:
        got = greedy(llm, prompts, asked)
        preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
        prefix_hits = sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
        (snap,) = released_stats(llm)
    finally:
        close_llm(llm)
    assert got == want, first_mismatch(got, want)
    assert preemptions > 0, "the KV cache was meant to force preemption"
    assert prefix_hits > 0
    assert snap["requests"] == {} and snap["tracked"] == 0
    assert max(int(k) for k in snap["drafted_len_hist"]) <= 8
    if steep:  # rounds without a draft forward happened here
        assert snap["gate_none_rounds"] > 0 and snap["forwards_per_step"].get(0, 0) > 0, snap
