"""Every training-free stopping policy inside vLLM, on the bundled drafters (the toy draft
model and the EAGLE-3 head, and for the rules that read q_t the DFlash block drafter; one shared
loop): lossless greedy output, statistics, policy timing, early exit."""

from __future__ import annotations

import json

import pytest

from benchmarks import vllm_run
from benchmarks.paths import load_prompts
from tests.conftest import (
    MIXED_MAX_TOKENS,
    TRAINING_FREE_POLICIES,
    close_llm,
    first_mismatch,
    greedy,
    make_llm,
    released_stats,
    settings_outputs,
    spec_config,
    steep_costs,
)
from vllm_adaptive_spec.config import BASELINES
from vllm_adaptive_spec.policies.costs import DEFAULT_COSTS, load_costs

pytestmark = pytest.mark.e2e

CAP = 8
DRAFTERS = ("draft_model", "eagle3")  # speculative_config.method of the bundled drafters
# the DFlash block drafter (one forward drafts the block; the policy cuts it): the rules that read q_t,
# and vllm_av, which trims the block after deciding every position (one host copy of its decisions)
DFLASH_POLICIES = ("fixed", "svip", "confidence", "adaedl", "vllm_av")
CASES = [(method, policy) for method in DRAFTERS for policy in TRAINING_FREE_POLICIES]
CASES += [("dflash", policy) for policy in DFLASH_POLICIES]
ONLINE_COSTS = ("eagle3", "confidence")  # this case's batch gate measures its costs (adaptive_spec.costs)
# cases whose loop prepares each step's inputs before waiting for the last step's decisions, the order
# it takes on CUDA (adaptive_spec.prepare_ahead); the others run the CPU's default order
# (a block drafter's loop then decides every position of the block and reads the decisions once)
PREPARED_AHEAD = {
    ("draft_model", "svip"),
    ("eagle3", "adaedl"),
    ("eagle3", "vllm_av"),
    ("eagle3", "heuristic"),
    ("dflash", "svip"),
    ("dflash", "adaedl"),
}
# cases whose draft forwards always compute the whole batch (adaptive_spec.compact_drafts false); the
# others, except the block drafter's, compute only the rows still drafting once they are at most half of
# it (the CPU's default), prepared ahead or not, with the gate and without (fixed, vllm_av)
WHOLE_BATCH = {("draft_model", "adaedl"), ("eagle3", "confidence")}


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{p}" for m, p in CASES])
def policy_llm(request):
    method, policy = request.param
    adaptive = {"policy": policy, "time_policy": True} | ({"costs": "online"} if request.param == ONLINE_COSTS else {})
    adaptive |= {"prepare_ahead": True} if request.param in PREPARED_AHEAD else {}
    adaptive |= {"compact_drafts": False} if request.param in WHOLE_BATCH else {}
    llm = make_llm(speculative_config=vllm_run.spec_config(CAP, method), additional_config={"adaptive_spec": adaptive})
    yield request.param, llm
    close_llm(llm)


def _stats(llm) -> dict:
    from vllm_adaptive_spec.integration.runtime import get_stats

    (snapshot,) = get_stats(llm)
    return snapshot


def test_lossless_batched(policy_llm, lossless_prompts, lossless_reference):
    _, llm = policy_llm
    got = greedy(llm, lossless_prompts, MIXED_MAX_TOKENS[: len(lossless_prompts)])  # up to 16 running at once
    assert got == lossless_reference, first_mismatch(got, lossless_reference)


def test_lossless_batch_of_one(policy_llm, lossless_prompts, lossless_reference):
    """Every held-out prompt alone (one request in the engine at a time)."""
    _, llm = policy_llm
    for i in range(len(lossless_prompts)):
        got = greedy(llm, lossless_prompts[i : i + 1], MIXED_MAX_TOKENS[i])
        assert got == lossless_reference[i : i + 1], f"prompt {i}: " + first_mismatch(got, lossless_reference[i:])


def test_statistics_and_draft_lengths(policy_llm, tmp_path):
    (method, policy), llm = policy_llm
    (snap,) = released_stats(llm)
    work = snap["workload"]
    assert snap["policy"] == policy
    assert snap["prepare_ahead"] == ((method, policy) in PREPARED_AHEAD)  # on CPU only where asked for
    assert snap["compact_drafts"] == ((method, policy) not in WHOLE_BATCH and method != "dflash")
    if not snap["compact_drafts"]:
        assert snap["rows_saved"] == 0
    assert work["n_target"] > 0 and work["n_gen"] > work["n_target"]
    assert 0 < work["n_accepted"] <= work["n_draft"]
    lengths = snap["drafted_len_hist"]
    assert max(int(k) for k in lengths) <= CAP
    if policy == "fixed":
        # all full-width, except requests with fewer than K tokens left
        assert lengths.get(CAP, 0) > sum(v for k, v in lengths.items() if k != CAP)
    else:
        assert len(lengths) > 1, "an adaptive policy drafts varying lengths"
    timing = snap["timing"]
    assert timing["decides"] > 0 and timing["propose_s"] > 0
    # the rest of a steady step, split: the target's forward (hooked) inside the engine's gap between rounds
    assert timing["steady_rounds"] > 0 and 0 < timing["steady_target_s"] < timing["steady_gap_s"], timing
    # finished requests leave neither live statistics nor policy state behind
    assert snap["requests"] == {} and snap["tracked"] == 0, snap
    assert snap["n_finished"] > 0
    if (method, policy) == ONLINE_COSTS:
        # the gate measured target passes and draft steps here, and decides on them
        measured = snap["gate_costs"]["measured"]
        assert measured["verify_ms"] and measured["draft_step_ms"], snap["gate_costs"]
        assert snap["gate_costs"]["curves"] != DEFAULT_COSTS
        # ... and they are a cost file as they stand (`tune --costs`, `adaptive_spec.costs`)
        path = tmp_path / "online_costs.json"
        path.write_text(json.dumps(snap["gate_costs"]["curves"]))
        assert load_costs(str(path)) == snap["gate_costs"]["curves"]
    else:
        assert "gate_costs" not in snap


def test_the_grammar_stop_without_the_mask(prompts, settings_reference):
    """grammar_mask false: the EAGLE-3 head draws unmasked and a row stops at its first draft token the
    grammar refuses; outputs stay equal to no speculation's under every request setting."""
    adaptive = {"policy": "svip", "grammar_mask": False}
    llm = make_llm(
        speculative_config=vllm_run.spec_config(CAP, "eagle3"), additional_config={"adaptive_spec": adaptive}
    )
    try:
        got = settings_outputs(llm, prompts[:4])
        (snap,) = released_stats(llm)
    finally:
        close_llm(llm)
    for name, want in settings_reference.items():
        assert got[name] == want, f"{name}: " + first_mismatch([t for t, _ in got[name]], [t for t, _ in want])
    assert snap["grammar_stops"] > 0 and snap["grammar_masked"] == 0 and snap["grammar_tracked"] == 0


def test_batch_of_64_is_lossless(ref_llm):
    """64 requests running at once (max_num_seqs=64) with an adaptive policy."""
    prompts = load_prompts("code_heldout", 64)
    max_tokens = [(5, 33, 48)[i % 3] for i in range(64)]
    want = greedy(ref_llm, prompts, max_tokens)
    llm = make_llm(
        speculative_config=spec_config(CAP), additional_config={"adaptive_spec": {"policy": "svip"}}, max_num_seqs=64
    )
    try:
        got = greedy(llm, prompts, max_tokens)
        snap = _stats(llm)
    finally:
        close_llm(llm)
    assert got == want, first_mismatch(got, want)
    # at 64 rows the batch gate ends rounds after one step and holds that verdict: the path ran here
    assert snap["gate_held_rounds"] > 0, snap


def test_the_gate_verifies_no_draft_where_verification_is_compute_bound(tmp_path, lossless_prompts, lossless_reference):
    """On curves where a pass costs 10 ms a token (compute-bound), one draft a row adds less than it costs
    at any acceptance below 0.95 (policies/batch_gate.py: no_draft_round): the gate verifies no draft in
    most rounds and drafts one round after each hold (its probe); greedy output stays the target's, with
    the draft model's first pass skipped in every other such round (skip_first_pass) and without."""
    steep = steep_costs(tmp_path)
    snaps = {}
    for skip in (True, False):
        adaptive = {"policy": "confidence", "costs": steep, "skip_first_pass": skip}
        llm = make_llm(speculative_config=spec_config(CAP), additional_config={"adaptive_spec": adaptive})
        try:
            got = greedy(llm, lossless_prompts, MIXED_MAX_TOKENS[: len(lossless_prompts)])
            (snaps[skip],) = released_stats(llm)
        finally:
            close_llm(llm)
        assert got == lossless_reference, f"skip_first_pass {skip}: " + first_mismatch(got, lossless_reference)
        snap = snaps[skip]
        rounds = sum(snap["forwards_per_step"].values())
        assert snap["gate_none_rounds"] > rounds / 2 and snap["workload"]["n_draft"] > 0, snap
    # The draft model skipped the first pass of about every other round without drafts (a skipped round
    # runs no forward), and the draft's KV cache stayed current: its probes drafted what they drafted with
    # a first pass in every round, and the target accepted as many of them.
    skipped = snaps[True]["forwards_per_step"].get(0, 0)
    assert snaps[True]["gate_none_rounds"] / 3 < skipped <= snaps[True]["gate_none_rounds"] / 2 + 1, snaps[True]
    assert 0 not in snaps[False]["forwards_per_step"]
    counts = [{k: s["workload"][k] for k in ("n_draft", "n_accepted")} for s in snaps.values()]
    assert counts[0] == counts[1], counts


def test_a_block_read_at_once_is_cut_where_step_by_step_cuts_it(lossless_prompts):
    """DFlash with prepare_ahead (the CUDA order: the policy decides every position of the block, then
    the host reads all the decisions once) against the step-by-step loop: the same cuts, so the same
    draft lengths and counts, on the same prompts one at a time."""
    seen = []
    for ahead in (False, True):
        adaptive = {"policy": "svip", "prepare_ahead": ahead}
        llm = make_llm(
            speculative_config=vllm_run.spec_config(CAP, "dflash"), additional_config={"adaptive_spec": adaptive}
        )
        try:
            for i in range(8):
                greedy(llm, lossless_prompts[i : i + 1], 48)
            (snap,) = released_stats(llm)
        finally:
            close_llm(llm)
        assert snap["prepare_ahead"] is ahead
        seen.append((snap["drafted_len_hist"], snap["workload"]))
    assert seen[0] == seen[1]
    assert len(seen[0][0]) > 1  # the rule cut blocks at several lengths


def test_never_drafts_past_max_tokens(policy_llm, lossless_prompts):
    """With 3 tokens to generate, the prefill gives one and at most 2 remain:
    a draft longer than 1 could only be discarded."""
    _, llm = policy_llm
    before = _stats(llm)["drafted_len_hist"]
    greedy(llm, lossless_prompts[:4], 3)
    after = _stats(llm)["drafted_len_hist"]
    new_lengths = {int(k) for k, v in after.items() if v > before.get(k, 0)}
    assert new_lengths and max(new_lengths) <= 1, new_lengths


def test_request_settings_keep_output_lossless(policy_llm, prompts, settings_reference):
    """Penalties, banned and allowed tokens, min_tokens, stop strings and logprobs: greedy output
    equals no speculation's under each (conftest.request_settings)."""
    (method, policy), llm = policy_llm
    got = settings_outputs(llm, prompts[:4])
    for name, want in settings_reference.items():
        assert got[name] == want, f"{name}: " + first_mismatch([t for t, _ in got[name]], [t for t, _ in want])
    assert all(n == len(t) > 0 for t, n in got["logprobs"])  # one logprob entry per sampled token
    # the grammar stop and mask (default on for adaptive policies, off for the baselines and the block
    # drafter) kept the outputs above; their matchers are released with their requests
    (snap,) = released_stats(llm)
    grammar_stop = policy not in BASELINES and method != "dflash"
    assert ("grammar_stops" in snap) == grammar_stop
    if grammar_stop:
        assert snap["grammar_tracked"] == 0
        assert snap["grammar_masked"] > 0  # the structured requests drew masked drafts
