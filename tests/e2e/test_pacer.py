"""The Pacer policy with the bundled toy pre-verifier inside vLLM: lossless greedy output under
preemption and chunked prefill, per-request context freed, and the context window it keeps equal
to the draft's own hidden states over the request's tokens (HF teacher-forced pass)."""

from __future__ import annotations

import pytest

from benchmarks.paths import REPO, load_prompts
from tests.conftest import close_llm, first_mismatch, greedy, make_llm, released_stats, spec_config

pytestmark = pytest.mark.e2e

HEAD = REPO / "heads" / "toy" / "pacer.safetensors"
CAP = 8
N_PROMPTS = 20
MAX_MODEL_LEN = 256
CHUNK = 64  # prompts longer than this prefill in chunks
ASKED = [(17, 200, 120, 200, 1)[i % 5] for i in range(N_PROMPTS)]  # 200: runs into max_model_len


def _stash_contexts(worker) -> int:
    """In the worker: keep a copy of each request's context window when the policy forgets it."""
    from vllm_adaptive_spec.integration import runtime

    n = 0
    for proposer in runtime.proposers(worker.model_runner):
        policy = proposer.policy
        policy.stash = {}
        forget = policy.forget

        def keep_then_forget(req_id, policy=policy, forget=forget):
            if req_id in policy._ctx:
                policy.stash[req_id] = policy._ctx[req_id].cpu().clone()
            forget(req_id)

        policy.forget = keep_then_forget
        n += 1
    return n


def _stashed(worker) -> list:
    from vllm_adaptive_spec.integration import runtime

    return [list(getattr(p.policy, "stash", {}).values()) for p in runtime.proposers(worker.model_runner)]


@pytest.fixture(scope="module")
def pacer_llm():
    llm = make_llm(
        speculative_config=spec_config(CAP),
        additional_config={"adaptive_spec": {"policy": "pacer", "head": str(HEAD)}},
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=16,
        enable_chunked_prefill=True,
        max_num_batched_tokens=CHUNK,
        num_gpu_blocks_override=8,  # blocks of 128 tokens on CPU; 16 running requests need more: preemption
    )
    yield llm
    close_llm(llm)


def test_bundled_layer_is_lossless_under_preemption(ref_llm, pacer_llm):

    prompts = load_prompts("code_heldout", N_PROMPTS)
    tok = ref_llm.get_tokenizer()
    lengths = [len(tok(p).input_ids) for p in prompts]
    keep = [i for i, n in enumerate(lengths) if n < MAX_MODEL_LEN - 8]
    prompts, lengths, asked = [prompts[i] for i in keep], [lengths[i] for i in keep], [ASKED[i] for i in keep]
    allowed = [min(m, MAX_MODEL_LEN - n) for m, n in zip(asked, lengths)]
    want = greedy(ref_llm, prompts, allowed)
    got = greedy(pacer_llm, prompts, asked)
    assert got == want, first_mismatch(got, want)
    preemptions = sum(m.value for m in pacer_llm.get_metrics() if m.name == "vllm:num_preemptions")
    assert preemptions > 0, "the KV cache was meant to force preemption"
    (snap,) = released_stats(pacer_llm)
    assert snap["policy"] == "pacer"
    hist = snap["drafted_len_hist"]
    assert len(hist) > 1 and max(int(k) for k in hist) <= CAP, hist
    assert snap["requests"] == {} and snap["tracked"] == 0, snap


def _check_windows(pacer_llm, prompts: list[str]) -> None:
    import torch

    from vllm_adaptive_spec.training import data

    released_stats(pacer_llm)  # earlier tests' requests released first: only this test's are stashed
    assert pacer_llm.collective_rpc(_stash_contexts) == [1]
    outs = pacer_llm.generate(prompts, __import__("vllm").SamplingParams(temperature=0.0, max_tokens=40))
    stashes = [ctx for worker in pacer_llm.collective_rpc(_stashed) for per in worker for ctx in per]
    assert stashes  # requests whose finish reached the worker before generate returned
    draft = data.load_causal_lm(REPO / "benchmarks" / "models" / "toy-draft")

    def rel(ctx, hf, end):  # vLLM's kernels against HF's float32: relative error
        ref = hf[end - len(ctx) : end]
        return float((ctx.float() - ref).abs().mean() / ref.abs().mean())

    hfs = []
    for out in outs:
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        hfs.append(data.final_hidden(draft, torch.tensor([ids]))[0])  # [L, H]
    for ctx in stashes:
        # The window ends with the last token the draft read: the final bonus token or the one before.
        # (A request shorter than the window keeps its whole sequence: end == len(ctx).)
        fits = [(i, end) for i, hf in enumerate(hfs) for end in (len(hf), len(hf) - 1) if end >= len(ctx)]
        err, end, i = min((rel(ctx, hfs[i], end), end, i) for i, end in fits)
        assert err < 0.05, err
        if end - 1 >= len(ctx):
            assert rel(ctx, hfs[i], end - 1) > 5 * err  # one position off is far worse: the spans are exact


def test_context_window_is_the_drafts_hidden_states(pacer_llm):
    _check_windows(pacer_llm, load_prompts("code_heldout", 103)[100:])  # prompts this engine has not seen


def test_context_window_of_requests_shorter_than_the_window(pacer_llm):
    """Regression: the check skipped requests whose whole sequence fits in the window."""
    _check_windows(pacer_llm, load_prompts("code_heldout", 3))
