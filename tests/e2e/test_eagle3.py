"""EAGLE-3 through the shared adaptive loop, with the bundled head for the toy target.

The loop that serves the draft model serves the EAGLE-3 head too (proposer.py:
the head reads the target's fused hidden states in the first pass and its own
last state at every later step). Every training-free policy runs on it in
test_adaptive_policies.py; here: with the fixed policy the loop must draft what
vLLM's own EAGLE loop drafts (same passes, same drafts kept), which checks that
the state carried from step to step is the one vLLM carries; the SpecDec++
head and the Pacer layer trained on the EAGLE-3 head's own chains (for Pacer
also: the context the policy keeps is the first-pass rows it was trained on);
and what is refused at start-up.
"""

from __future__ import annotations

import json
import time

import pytest

from benchmarks import vllm_run
from benchmarks.harness.plan import EAGLE3_PACER_HEAD, EAGLE3_SPECDECPP_HEAD, PACER_HEAD, SPECDECPP_HEAD
from benchmarks.paths import EAGLE3_HEAD, REPO, TARGET, beside, load_prompts
from tests.conftest import (
    MIXED_MAX_TOKENS,
    N_LOSSLESS,
    close_llm,
    first_mismatch,
    greedy,
    greedy_params,
    make_llm,
    released_stats,
    same_work_as_vllm,
)

pytestmark = pytest.mark.e2e

CAP = 8


def eagle3_config(k: int = CAP) -> dict:
    return vllm_run.spec_config(k, "eagle3")


def _drafter_name(worker) -> str:
    return type(worker.model_runner.drafter).__name__


@pytest.fixture(scope="module")
def vllm_eagle3_llm():
    """vLLM's own EAGLE-3 speculation (plugin installed, not configured), with per-request counts."""
    llm = make_llm(speculative_config=eagle3_config(), per_request_spec_decode_metrics="summary")
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def eagle3_llm():
    llm = make_llm(speculative_config=eagle3_config(), additional_config={"adaptive_spec": {"policy": "fixed"}})
    yield llm
    close_llm(llm)


def test_the_drafter_is_the_shared_loop_in_front_of_vllms_eagle_proposer(eagle3_llm, vllm_eagle3_llm):
    assert eagle3_llm.collective_rpc(_drafter_name) == ["AdaptiveEagleProposer"]
    assert vllm_eagle3_llm.collective_rpc(_drafter_name) == ["EagleProposer"]


def test_fixed_policy_drafts_what_vllms_eagle_loop_drafts(eagle3_llm, vllm_eagle3_llm):
    """Same work, same K: the same target passes and the same drafts kept (conftest.same_work_as_vllm)."""
    own = same_work_as_vllm(eagle3_llm, vllm_eagle3_llm)
    assert own["n_accepted"] > 2 * own["n_target"], "the head gets long drafts accepted"


def test_fixed_k_under_a_larger_cap_does_vllms_work_at_that_k(vllm_eagle3_llm):
    """fixed with k = 8 in an engine whose cap is 16: vLLM's K=8 work exactly (the cap's own cost, isolated)."""
    llm = make_llm(
        speculative_config=eagle3_config(16), additional_config={"adaptive_spec": {"policy": "fixed", "k": CAP}}
    )
    try:
        same_work_as_vllm(llm, vllm_eagle3_llm)
    finally:
        close_llm(llm)


def _assert_lossless_one_at_a_time(llm, prompts: list[str], reference: list[list[int]]) -> None:
    """Every held-out prompt alone in the engine (batch 1)."""
    for i, prompt in enumerate(prompts):
        got = greedy(llm, [prompt], MIXED_MAX_TOKENS[i])
        assert got == reference[i : i + 1], f"prompt {i}: " + first_mismatch(got, reference[i:])


@pytest.fixture(scope="module")
def eagle3_specdecpp_llm():
    adaptive = {"policy": "specdecpp", "head": str(EAGLE3_SPECDECPP_HEAD)}
    llm = make_llm(speculative_config=eagle3_config(), additional_config={"adaptive_spec": adaptive})
    yield llm
    close_llm(llm)


def test_specdecpp_head_trained_on_the_eagle3_head(eagle3_specdecpp_llm, lossless_prompts, lossless_reference):
    got = greedy(eagle3_specdecpp_llm, lossless_prompts, MIXED_MAX_TOKENS[: len(lossless_prompts)])
    assert got == lossless_reference, first_mismatch(got, lossless_reference)
    _assert_lossless_one_at_a_time(eagle3_specdecpp_llm, lossless_prompts, lossless_reference)
    (snap,) = released_stats(eagle3_specdecpp_llm)
    assert snap["workload"]["n_accepted"] > 0
    assert len(snap["drafted_len_hist"]) > 1, "the head stops drafts at varying lengths"
    assert snap["requests"] == {} and snap["tracked"] == 0, snap


@pytest.fixture(scope="module")
def eagle3_pacer_llm():
    adaptive = {"policy": "pacer", "head": str(EAGLE3_PACER_HEAD)}
    llm = make_llm(speculative_config=eagle3_config(), additional_config={"adaptive_spec": adaptive})
    yield llm
    close_llm(llm)


def test_pacer_layer_trained_on_the_eagle3_head(eagle3_pacer_llm, lossless_prompts, lossless_reference):
    got = greedy(eagle3_pacer_llm, lossless_prompts, MIXED_MAX_TOKENS[: len(lossless_prompts)])
    assert got == lossless_reference, first_mismatch(got, lossless_reference)
    _assert_lossless_one_at_a_time(eagle3_pacer_llm, lossless_prompts, lossless_reference)
    (snap,) = released_stats(eagle3_pacer_llm)
    assert snap["policy"] == "pacer" and snap["workload"]["n_accepted"] > 0
    assert len(snap["drafted_len_hist"]) > 1, "the layer stops drafts at varying lengths"
    assert snap["requests"] == {} and snap["tracked"] == 0, snap


def _stash_contexts(worker) -> int:
    """In the worker: keep each request's context window and the position after it when the policy forgets it."""
    from vllm_adaptive_spec.integration import runtime

    for proposer in runtime.proposers(worker.model_runner):
        policy = proposer.policy
        policy.stash = []
        forget = policy.forget

        def keep_then_forget(req_id, policy=policy, forget=forget):
            if req_id in policy._ctx:
                policy.stash.append((policy._ctx[req_id].cpu().clone(), policy._next_pos[req_id]))
            forget(req_id)

        policy.forget = keep_then_forget
    return len(runtime.proposers(worker.model_runner))


def _stashed(worker) -> list:
    from vllm_adaptive_spec.integration import runtime

    # plain lists: collective_rpc does not hand tensors back as tensors
    return [
        (ctx.float().tolist(), end)
        for p in runtime.proposers(worker.model_runner)
        for ctx, end in getattr(p.policy, "stash", [])
    ]


def test_pacer_context_is_the_first_pass_rows_it_was_trained_on(eagle3_pacer_llm):
    """The window the policy keeps inside vLLM equals the rows `training.pacer_eagle3` trains on
    (one teacher-forced head pass over the HF target's features), position for position."""
    from vllm_adaptive_spec.heads.eagle3 import load_hf_dir
    from vllm_adaptive_spec.training import data
    from vllm_adaptive_spec.training.eagle3 import target_features
    from vllm_adaptive_spec.training.pacer_eagle3 import first_pass_rows

    released_stats(eagle3_pacer_llm)  # earlier tests' requests released first: only this test's are stashed
    assert eagle3_pacer_llm.collective_rpc(_stash_contexts) == [1]
    prompts = load_prompts("code_heldout", N_LOSSLESS + 25)[N_LOSSLESS + 20 :]  # unseen by this engine
    outs = eagle3_pacer_llm.generate(prompts, greedy_params(40), use_tqdm=False)
    released_stats(eagle3_pacer_llm)  # every request's state released (and stashed)
    import torch

    stashes = [
        (torch.as_tensor(ctx), end) for worker in eagle3_pacer_llm.collective_rpc(_stashed) for ctx, end in worker
    ]
    assert len(stashes) == len(prompts)
    target_lm = data.load_causal_lm(TARGET)
    head, head_cfg = load_hf_dir(EAGLE3_HEAD, target_lm.get_input_embeddings().weight)
    rows = []  # per request: [L - 1, H]
    for out in outs:
        resp = data.Response(list(out.prompt_token_ids), list(out.outputs[0].token_ids), "greedy")
        rows.append(first_pass_rows(head, target_features(target_lm, resp, head_cfg.aux_layer_ids)))

    def rel(ctx, ref, end):
        want = ref[end - len(ctx) : end]
        return float((ctx - want).abs().mean() / want.abs().mean())

    for ctx, end in stashes:  # the window holds the rows at positions end - len(ctx) .. end - 1
        err, i = min((rel(ctx, ref, end), i) for i, ref in enumerate(rows) if len(ctx) <= end <= len(ref))
        assert err < 2e-2, err  # the engine's kernels are not the module's (and in bfloat16 relative precision is 4e-3)
        assert end == len(rows[i]) or rel(ctx, rows[i], end + 1) > 10 * err  # one row off is far worse
        assert end - 1 < len(ctx) or rel(ctx, rows[i], end - 1) > 10 * err


EAGLE3_MIXED_HEAD = REPO / "heads" / "toy" / "eagle3-mixed"  # the same architecture, trained on code and prose


def test_the_head_trained_on_code_and_prose_at_its_tuned_threshold(ref_llm, lossless_prompts, lossless_reference):
    """The second bundled head loads as `method: "eagle3"`, and confidence at the threshold `tune` chose for it
    on its training responses is lossless on held-out code and prose prompts (one batch)."""
    tuned = json.loads(beside(EAGLE3_MIXED_HEAD, ".tune.json").read_text())["recommended"]
    adaptive = {"policy": "confidence", "threshold": tuned["confidence"]["threshold"]}
    llm = make_llm(
        speculative_config=eagle3_config() | {"model": str(EAGLE3_MIXED_HEAD)},
        additional_config={"adaptive_spec": adaptive},
    )
    try:
        prose = load_prompts("prose_heldout", 20)
        want = lossless_reference + greedy(ref_llm, prose, 64)
        got = greedy(llm, lossless_prompts + prose, MIXED_MAX_TOKENS[: len(lossless_prompts)] + [64] * len(prose))
        assert got == want, first_mismatch(got, want)
        (snap,) = released_stats(llm)
        assert len(snap["drafted_len_hist"]) > 1 and snap["workload"]["n_accepted"] > 0, snap
    finally:
        close_llm(llm)


def test_a_stopping_head_trained_on_one_eagle3_head_fails_on_another():
    """The fingerprint covers the EAGLE-3 head's weights, not just its kind."""
    from vllm_adaptive_spec import ConfigError

    with pytest.raises(ConfigError) as err:
        make_llm(
            speculative_config=eagle3_config() | {"model": str(EAGLE3_MIXED_HEAD)},
            additional_config={"adaptive_spec": {"policy": "specdecpp", "head": str(EAGLE3_SPECDECPP_HEAD)}},
        )
    msg = str(err.value)
    assert msg.startswith("adaptive_spec.head: ") and "the running draft is" in msg, msg


@pytest.mark.parametrize(
    "method, policy, head",
    [
        ("eagle3", "specdecpp", SPECDECPP_HEAD),
        ("draft_model", "specdecpp", EAGLE3_SPECDECPP_HEAD),
        ("eagle3", "pacer", PACER_HEAD),
        ("draft_model", "pacer", EAGLE3_PACER_HEAD),
    ],
)
def test_a_head_trained_for_one_drafter_fails_on_the_other(method, policy, head):
    from vllm_adaptive_spec import ConfigError

    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        make_llm(
            speculative_config=vllm_run.spec_config(CAP, method),
            additional_config={"adaptive_spec": {"policy": policy, "head": str(head)}},
        )
    msg = str(err.value)
    assert msg.startswith("adaptive_spec.head: ") and "the running draft is" in msg, msg
    assert time.monotonic() - start < 60


class _Spec:
    method = "ngram"


class _Engine:
    additional_config = {"adaptive_spec": {"policy": "svip"}}
    speculative_config = _Spec()


def test_unsupported_drafters_fail_at_startup_with_one_clear_error():
    from vllm_adaptive_spec import ConfigError
    from vllm_adaptive_spec.integration.hooks import check_engine_config

    with pytest.raises(ConfigError) as err:
        check_engine_config(_Engine())
    msg = str(err.value)
    assert "speculative_config.method='ngram'" in msg and "'mtp'" in msg, msg  # names what is supported


def test_the_batch_gate_is_off_for_a_parallel_drafter_and_refused_when_asked_for():
    from vllm_adaptive_spec import ConfigError
    from vllm_adaptive_spec.integration.hooks import check_engine_config

    class Spec:
        method = "dflash"
        model = str(REPO / "heads" / "toy" / "dflash")

    class Engine:
        additional_config = {"adaptive_spec": {"policy": "svip"}}
        speculative_config = Spec()

    assert check_engine_config(Engine()).batch_aware is False
    Engine.additional_config = {"adaptive_spec": {"policy": "svip", "batch_aware": True}}
    with pytest.raises(ConfigError) as err:
        check_engine_config(Engine())
    msg = str(err.value)
    assert msg.startswith("adaptive_spec.batch_aware: true") and "method='dflash'" in msg, msg
    # the tail gate runs on the batch gate's costs: off with it, refused when asked for
    Spec.num_speculative_tokens = 4
    Engine.additional_config = {"adaptive_spec": {"policy": "svip", "context_tail": 2}}
    cfg = check_engine_config(Engine())
    assert cfg.context_tail == 2 and cfg.batch_aware is False and cfg.tail_gate is False
    Engine.additional_config = {"adaptive_spec": {"policy": "svip", "context_tail": 2, "tail_gate": True}}
    with pytest.raises(ConfigError) as err:
        check_engine_config(Engine())
    msg = str(err.value)
    assert msg.startswith("adaptive_spec.tail_gate: true") and "method='dflash'" in msg, msg
    # the grammar stop too: the block comes from one forward, so there is no draft step to save
    Engine.additional_config = {"adaptive_spec": {"policy": "svip", "batch_aware": False}}
    cfg = check_engine_config(Engine())
    assert cfg.grammar_stop is False and cfg.grammar_mask is False
    for field in ("grammar_stop", "grammar_mask"):
        Engine.additional_config = {"adaptive_spec": {"policy": "svip", "batch_aware": False, field: True}}
        with pytest.raises(ConfigError) as err:
            check_engine_config(Engine())
        msg = str(err.value)
        assert msg.startswith(f"adaptive_spec.{field}: true") and "method='dflash'" in msg, msg


def test_every_supported_method_has_a_drafter():
    from vllm_adaptive_spec.integration.hooks import SUPPORTED_METHODS
    from vllm_adaptive_spec.integration.proposer import DRAFTERS

    assert set(DRAFTERS) == set(SUPPORTED_METHODS)


def _write_eagle1_head(out) -> str:
    """A random EAGLE-1 head in vLLM's Llama layout (`EagleLlamaForCausalLM`) for the toy target: `fc`
    passes the target's hidden state through, the decoder layer's outputs are small. Nothing is
    trained for method "eagle" (its drafts are almost never accepted); it exercises the path."""
    import json

    import torch
    from safetensors.torch import save_file

    hidden, inner, gen = 256, 768, torch.Generator().manual_seed(0)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    fc = torch.zeros(hidden, 2 * hidden)  # reads cat([token embedding, target hidden state])
    fc[:, hidden:] = torch.eye(hidden)
    layer = "layers.0."
    tensors = {
        "fc.weight": fc,
        layer + "self_attn.q_proj.weight": normal(4 * 64, hidden, std=hidden**-0.5),
        layer + "self_attn.k_proj.weight": normal(2 * 64, hidden, std=hidden**-0.5),
        layer + "self_attn.v_proj.weight": normal(2 * 64, hidden, std=hidden**-0.5),
        layer + "self_attn.o_proj.weight": normal(hidden, 4 * 64, std=1e-3),
        layer + "mlp.gate_proj.weight": normal(inner, hidden, std=hidden**-0.5),
        layer + "mlp.up_proj.weight": normal(inner, hidden, std=hidden**-0.5),
        layer + "mlp.down_proj.weight": normal(hidden, inner, std=1e-3),
        layer + "post_attention_layernorm.weight": torch.ones(hidden),
    }
    config = {
        "architectures": ["EagleLlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inner,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 1,
        "vocab_size": 6144,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_an_eagle1_head_runs_through_the_shared_loop(tmp_path, lossless_prompts, lossless_reference):
    """method "eagle" (EAGLE-1): the same adapter as eagle3, without the fused target features."""
    spec = {"method": "eagle", "model": _write_eagle1_head(tmp_path), "num_speculative_tokens": 3}
    llm = make_llm(speculative_config=spec, additional_config={"adaptive_spec": {"policy": "svip"}})
    try:
        assert llm.collective_rpc(_drafter_name) == ["AdaptiveEagleProposer"]
        got = greedy(llm, lossless_prompts, MIXED_MAX_TOKENS[: len(lossless_prompts)])
        (snap,) = released_stats(llm)
    finally:
        close_llm(llm)
    assert got == lossless_reference, first_mismatch(got, lossless_reference)
    assert snap["workload"]["n_draft"] > 0 and snap["requests"] == {} and snap["tracked"] == 0, snap
