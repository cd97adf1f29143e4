"""Threshold tuning by replay (training/tune.py): round lengths of each rule, the replay's counts by
hand, and a sweep that must find the threshold separating agreeing drafts from the first miss."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_adaptive_spec.training.specdecpp_eagle3 import replay_lengths
from vllm_adaptive_spec.training.tune import ChainFeatures, TuneConfig, rule_lengths, stop_lengths, sweep


def test_stop_lengths_include_the_step_that_stops():
    stop = torch.tensor([[False, True, False], [False, False, False], [True, True, True]])
    assert stop_lengths(stop).tolist() == [2, 3, 1]


def test_rule_lengths_read_the_policy_features():
    f = ChainFeatures(
        runs=torch.tensor([0, 0]),
        entropy=torch.tensor([[0.1, 0.7, 0.1], [0.1, 0.1, 0.1]]),  # svip h=0.3: stop once H > 0.6
        q_max=torch.tensor([[0.9, 0.5, 0.3], [0.2, 0.9, 0.9]]),
    )
    assert rule_lengths("svip", 0.3, f).tolist() == [2, 3]
    assert rule_lengths("confidence", 0.4, f).tolist() == [3, 1]
    assert rule_lengths("confidence", 0.6, f).tolist() == [2, 1]


def test_replay_counts_by_hand():
    # 6 generated tokens: the prefill gives token 0; rounds at 1 (accepts 2 of 3), 4 (the cap is the one
    # token left before the end: 0 of 1), 5 (nothing left to draft)
    counts = replay_lengths([torch.tensor([2, 0, 1, 0, 0])], [torch.full((5,), 3)], 3)
    assert (counts.n_gen, counts.n_target, counts.n_draft, counts.n_accepted) == (6, 4, 4, 2)
    assert dict(counts.accepted_hist) == {0: 3, 2: 1}


def test_sweep_finds_the_threshold_that_stops_at_the_first_miss():
    torch.manual_seed(0)
    feats = []
    for _ in range(4):
        runs = torch.randint(0, 6, (40,))
        step = torch.arange(8)[None, :]
        q = torch.where(step < runs[:, None], 0.9, 0.2)  # sure while the chain agrees, unsure at its first miss
        feats.append(ChainFeatures(runs=runs, entropy=torch.zeros(40, 8), q_max=q))
    result = sweep(feats, TuneConfig(cap=8, confidence=(0.1, 0.5, 0.95), svip=(0.3,)))
    best = result["policies"]["confidence"]["best"]
    assert best["threshold"] == 0.5
    assert best["speedup"] > result["best_fixed"]["speedup"]
    assert best["discard_rate"] < result["best_fixed"]["discard_rate"]
    # svip never stops here (zero entropy): it is fixed K = cap
    assert result["policies"]["svip"]["best"]["tau"] == result["fixed"][-1]["tau"]


def noisy_chains() -> list[ChainFeatures]:
    """4 responses x 40 chains of up to 5 agreeing drafts: q near 0.9 while a chain agrees, near 0.2 after."""
    torch.manual_seed(0)
    feats = []
    for _ in range(4):
        runs = torch.randint(0, 6, (40,))
        q = torch.where(torch.arange(8)[None, :] < runs[:, None], 0.9, 0.2) + 0.05 * torch.rand(40, 8)
        feats.append(ChainFeatures(runs=runs, entropy=torch.zeros(40, 8), q_max=q))
    return feats


def test_a_measured_step_curve_prices_each_pass_by_its_length(tmp_path):
    """Passes by drafts verified come from the per-position counts; at a flat curve with a draft at
    t_T / c the priced S is S(c); where each verified draft costs much more, the sweep picks shorter rounds."""
    counts = replay_lengths([torch.tensor([2, 0, 1, 0, 0])], [torch.full((5,), 3)], 3)
    assert counts.passes_by_drafts() == {0: 2, 3: 1, 1: 1}  # the prefill and the round with nothing left
    assert counts.priced_speedup([10.0] * 5, 10.0 / 4) == pytest.approx(counts.modeled_speedup(4))

    feats = noisy_chains()
    grid = (0.1, 0.5, 0.93, 0.96)
    flat = sweep(feats, TuneConfig(cap=8, confidence=grid, svip=(0.3,)))
    steep = tmp_path / "steep.json"  # every verified token costs 3 passes: drafting rarely pays
    steep.write_text(json.dumps({"draft_step_ms": [[1, 0.1]], "verify_ms": [[1, 1.0], [2, 4.0], [9, 25.0]]}))
    priced = sweep(feats, TuneConfig(cap=8, confidence=grid, svip=(0.3,), costs=str(steep)))
    assert flat["policies"]["confidence"]["best"]["threshold"] == 0.5
    assert priced["policies"]["confidence"]["best"]["threshold"] > 0.5
    assert "speedup_at_c" in priced["best_fixed"] and priced["best_fixed"]["fixed_k"] == 1


# -- a DFlash block drafter: its block at every round start, one draft forward per round --


def test_block_features_read_the_block_at_every_round_start():
    """Runs agree with the DFlash pipeline's own accepted-prefix count (built on draft_blocks, vLLM's
    drafting of a round), here made non-trivial by writing one block's drafts into the response."""
    from tests.unit.test_dflash import K, make_drafter, make_seq
    from vllm_adaptive_spec.heads.dflash import draft_blocks
    from vllm_adaptive_spec.training.dflash import accepted_per_anchor
    from vllm_adaptive_spec.training.tune import block_features

    drafter, cfg = make_drafter()
    seq = make_seq(cfg)
    p = seq.prompt_len + 2
    # the block at anchor p reads ids[p] and the features before p only: its drafts stay what they were
    seq.ids[p + 1 : p + 4] = draft_blocks(drafter, seq.ids, seq.aux, torch.tensor([p]))[0, :3]
    f = block_features(drafter, seq, K)
    assert f.runs.tolist() == accepted_per_anchor(drafter, seq)
    assert f.runs[2] >= 3 and f.q_max.shape == f.entropy.shape == (len(seq.ids) - 1 - seq.prompt_len, K)
    assert bool(((f.q_max > 0) & (f.q_max <= 1)).all()) and bool((f.entropy >= 0).all())
    short = block_features(drafter, seq, 2)  # a cap below the block: its first positions
    torch.testing.assert_close(short.q_max, f.q_max[:, :2])
    assert short.runs.tolist() == f.runs.clamp_max(2).tolist()


def test_a_block_drafter_pays_one_forward_per_round():
    """The replay of test_replay_counts_by_hand: 4 passes (3 rounds) for 6 tokens. A head pays its 4
    drawn drafts at 1/c each, a block drafter its 3 rounds' forwards."""
    from vllm_adaptive_spec.training.tune import replay_rule

    feats = [ChainFeatures(runs=torch.tensor([2, 0, 1, 0, 0]), entropy=torch.zeros(5, 3), q_max=torch.ones(5, 3))]
    lengths = [torch.full((5,), 3)]
    head = replay_rule(feats, lengths, TuneConfig(cap=3, cost_ratio=4.0), {})
    block = replay_rule(feats, lengths, TuneConfig(drafter="dflash", cap=3, cost_ratio=4.0), {})
    assert head["speedup"] == pytest.approx(1 / (4 / 6 + 4 / 6 / 4), abs=1e-4)
    assert block["speedup"] == pytest.approx(1 / (4 / 6 + 3 / 6 / 4), abs=1e-4)
    assert block["tau"] == head["tau"] and block["draft_per_token"] == head["draft_per_token"]


def test_a_block_drafter_is_cut_only_where_verifying_costs(tmp_path):
    """At one c the full block is never beaten (its draft costs the same at any length); on a curve where
    each verified draft costs, the rule's cut beats every fixed K."""
    feats = noisy_chains()
    grid = (0.1, 0.5, 0.93)
    flat = sweep(feats, TuneConfig(drafter="dflash", cap=8, confidence=grid, svip=(0.3,)))
    assert flat["best_fixed"]["speedup"] == flat["fixed"][-1]["speedup"]  # (runs end at 5: K 5..8 tie)
    assert all(r["speedup"] <= flat["best_fixed"]["speedup"] for r in flat["policies"]["confidence"]["rows"])
    steep = tmp_path / "steep.json"  # a verified token costs a tenth of a pass, the block's forward a third
    steep.write_text(json.dumps({"draft_step_ms": [[1, 3.0]], "verify_ms": [[1, 10.0], [9, 18.0]]}))
    priced = sweep(feats, TuneConfig(drafter="dflash", cap=8, confidence=grid, svip=(0.3,), costs=str(steep)))
    best = priced["policies"]["confidence"]["best"]
    assert best["threshold"] == 0.5 and best["speedup"] > priced["best_fixed"]["speedup"]


def test_tune_checks_the_drafter(tmp_path):
    """A DFlash replay runs at most at the drafter's block; a directory that is not one fails by name."""
    from tests.unit.test_dflash import TARGET, make_drafter
    from vllm_adaptive_spec.heads.dflash import save_hf_dir
    from vllm_adaptive_spec.training.tune import for_drafter

    drafter, cfg = make_drafter()
    path = save_hf_dir(drafter, cfg, tmp_path / "dflash", TARGET)
    assert for_drafter(path, TuneConfig(drafter="dflash", cap=16, costs="x.json")).cap == cfg.block_size
    assert for_drafter(path, TuneConfig(drafter="dflash", cap=2, costs="x.json")).cap == 2
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(ValueError, match="holds an eagle3 drafter, not 'dflash': pass --drafter eagle3"):
        for_drafter(tmp_path / "head", TuneConfig(drafter="dflash"))
    with pytest.raises(ValueError, match="drafter 'mtp'"):
        for_drafter(path, TuneConfig(drafter="mtp"))


def test_the_drafter_kind_is_read_from_its_directory(tmp_path):
    """What `tune` replays, from config.json (the CLI's default for --drafter): the bundled drafters."""
    from benchmarks.paths import DFLASH_HEAD, DRAFT, EAGLE3_HEAD
    from vllm_adaptive_spec.training.tune import drafter_kind, for_drafter

    assert [drafter_kind(d) for d in (EAGLE3_HEAD, DFLASH_HEAD, DRAFT)] == ["eagle3", "dflash", "draft_model"]
    with pytest.raises(ValueError, match="holds a draft_model drafter, not 'eagle3': pass --drafter draft_model"):
        for_drafter(DRAFT, TuneConfig())
    with pytest.raises(ValueError, match="no readable config.json"):
        drafter_kind(tmp_path)


def test_tune_a_bundled_dflash_drafter_on_the_targets_own_responses(tmp_path):
    """The whole `tune --drafter dflash` path on the toy target's greedy responses (transformers): the
    bundled drafter's blocks, the replay at its block of 8 on a cost file, a recommended threshold each."""
    from benchmarks.paths import DFLASH_HEAD, TARGET
    from vllm_adaptive_spec.training import data
    from vllm_adaptive_spec.training.tune import tune

    target = data.load_causal_lm(TARGET)
    responses = []
    for prompt in ([1, 400, 401, 402, 403], [1, 17, 29, 31, 37, 41]):
        out = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0].tolist()
        responses.append(data.Response(prompt, out[len(prompt) :], "greedy"))
    costs = tmp_path / "costs.json"  # a verified draft costs a tenth of a plain pass, the block a third
    costs.write_text(json.dumps({"draft_step_ms": [[1, 3.0]], "verify_ms": [[1, 10.0], [9, 18.0]]}))
    cfg = TuneConfig(drafter="dflash", costs=str(costs), val_frac=1.0, replay_responses=0, svip=(0.3, 0.5))
    report = tune(TARGET, DFLASH_HEAD, responses, cfg)
    replay = report["replay"]
    assert report["drafter_method"] == "dflash" and report["config"]["cap"] == 8 and len(replay["fixed"]) == 8
    assert set(report["recommended"]) == {"svip", "confidence"}
    assert replay["oracle"]["tau"] >= replay["best_fixed"]["tau"] > 1.0  # some drafts are accepted
    assert replay["oracle"]["speedup"] >= max(r["speedup"] for r in replay["policies"]["confidence"]["rows"])


# -- an independent draft model: its rounds read teacher-forced --


def tiny_draft_lm():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.unit.tiny_qwen3 import TARGET

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in TARGET.items() if k != "architectures"})).eval()


@torch.no_grad()
def unrolled(draft_lm, prefix: list[int], steps: int) -> tuple[list[int], list[float]]:
    """The draft's own greedy chain after `prefix`, as it drafts a round: (tokens, max q per step)."""
    ids, tokens, q = list(prefix), [], []
    for _ in range(steps):
        p = torch.softmax(draft_lm(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
        tokens.append(int(p.argmax()))
        q.append(float(p.max()))
        ids.append(tokens[-1])
    return tokens, q


def test_draft_model_rounds_are_exact_up_to_their_first_rejected_draft():
    """Teacher-forced features against the draft's own unrolled chain from every round start: the same
    agreeing run, and the same distribution at every step up to and including the first rejected draft."""
    from vllm_adaptive_spec.training import data
    from vllm_adaptive_spec.training.tune import draft_model_features

    draft_lm = tiny_draft_lm()
    prompt = [1, 7, 11, 13]
    greedy, _ = unrolled(draft_lm, prompt, 14)
    response = list(greedy)
    response[4], response[9] = (response[4] + 1) % 50, (response[9] + 1) % 50  # the target parts twice
    cap = 4
    f = draft_model_features(draft_lm, data.Response(prompt, response, "greedy"), cap)
    assert f.runs.shape == (len(response) - 1,) and f.q_max.shape == (len(response) - 1, cap)
    assert f.runs.max() == 3 and f.runs.min() == 0  # a rejection every fifth token
    for j in range(len(response) - 1):
        tokens, q = unrolled(draft_lm, prompt + response[: j + 1], cap)
        left = len(response) - 1 - j  # tokens of the response after the round's bonus token
        run = next((t for t in range(min(cap, left)) if tokens[t] != response[j + 1 + t]), min(cap, left))
        assert f.runs[j] == run, j
        exact = min(run + 1, cap, left)  # steps whose inputs are all the target's tokens
        torch.testing.assert_close(f.q_max[j, :exact], torch.tensor(q[:exact]), rtol=1e-4, atol=1e-5)


def test_tune_the_bundled_draft_model_on_the_targets_own_responses():
    """`tune --drafter draft_model` on the toy pair: no target forward needed, a threshold per rule."""
    from benchmarks.paths import DRAFT, TARGET
    from vllm_adaptive_spec.training import data
    from vllm_adaptive_spec.training.tune import tune

    target = data.load_causal_lm(TARGET)
    prompt = [1, 400, 401, 402, 403]
    out = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0].tolist()
    cfg = TuneConfig(drafter="draft_model", cap=8, val_frac=1.0, replay_responses=0, svip=(0.3,), confidence=(0.4,))
    report = tune(TARGET, DRAFT, [data.Response(prompt, out[len(prompt) :], "greedy")], cfg)
    assert report["drafter_method"] == "draft_model" and set(report["recommended"]) == {"svip", "confidence"}
    assert report["replay"]["oracle"]["tau"] > 1.0 and "teacher-forced" in report["choice"]
