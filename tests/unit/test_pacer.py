"""Pacer pre-verifier: the chain mask worked out by hand, the layer's inference path against its
training path, halting rules, head files, training pieces and the policy on hand-made tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.test_heads import make_draft, make_head_file
from vllm_adaptive_spec import ConfigError, parse_additional_config
from vllm_adaptive_spec.heads.fileformat import META_KEY, draft_identity, model_fingerprint
from vllm_adaptive_spec.heads.pacer import (
    PacerConfig,
    PacerLayer,
    build_chain_mask,
    check_pacer,
    halt,
    load_pacer,
    save_pacer,
    stop_lengths,
)
from vllm_adaptive_spec.policies.pacer import PacerPolicy
from vllm_adaptive_spec.training.pacer import Chains, TrainConfig, collate, pack, replay_counts, replay_row_charged

H = 8
FIELD = "adaptive_spec.head"
RECOMMENDED = {"block_size": 2, "threshold": 0.6, "growth": 1.05, "halting": "mean", "context_window": 3}


def make_layer(seed: int = 0, **kw) -> PacerLayer:
    torch.manual_seed(seed)
    return PacerLayer(PacerConfig(H, num_heads=2, mlp_size=16, max_draft=6, **kw)).eval()


def make_pacer_file(path, draft, **meta) -> PacerLayer:
    layer = make_layer()
    save_pacer(path, layer, {"draft": draft_identity(draft), **RECOMMENDED, "commit": "abc", **meta})
    return layer


@pytest.fixture
def draft(tmp_path):
    return make_draft(tmp_path / "draft")


@pytest.fixture
def pacer_file(tmp_path, draft):
    path = tmp_path / "pacer.safetensors"
    make_pacer_file(path, draft)
    return path


# -- the mask, by hand --


def test_chain_mask_by_hand():
    # Context of 4 tokens c0..c3; chain A (a1, a2) starts at 2, chain B (b1, b2) at 3.
    # Rows/columns: c0 c1 c2 c3 a1 a2 b1 b2.
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0, 0],  # c0: causal context
            [1, 1, 0, 0, 0, 0, 0, 0],  # c1
            [1, 1, 1, 0, 0, 0, 0, 0],  # c2
            [1, 1, 1, 1, 0, 0, 0, 0],  # c3
            [1, 1, 0, 0, 1, 0, 0, 0],  # a1: context before 2, itself
            [1, 1, 0, 0, 1, 1, 0, 0],  # a2: context before 2, a1, itself
            [1, 1, 1, 0, 0, 0, 1, 0],  # b1: context before 3, itself (never chain A)
            [1, 1, 1, 0, 0, 0, 1, 1],  # b2
        ],
        dtype=torch.bool,
    )
    assert torch.equal(build_chain_mask(4, [2, 3], [2, 2]), want)
    windowed = want.clone()
    windowed[4:6, 0] = False  # window 1: chain A sees c1 only
    windowed[6:8, :2] = False  # chain B sees c2 only
    assert torch.equal(build_chain_mask(4, [2, 3], [2, 2], window=1), windowed)
    none = build_chain_mask(4, [2, 3], [2, 2], window=0)
    assert not none[4:, :4].any() and torch.equal(none[4:, 4:], want[4:, 4:])


# -- the layer --


def test_inference_path_equals_training_path_and_ignores_padding():
    layer = make_layer()
    ctx, drafts = torch.randn(5, H), torch.randn(6, H)
    mask = build_chain_mask(5, [5], [6])
    pos = torch.tensor([0] * 5 + [1, 2, 3, 4, 5, 6])
    want = layer(torch.cat([ctx, drafts])[None], pos[None], mask)[0, 5:]  # [6]
    # Padded context (two junk slots) and only the last block of 4 queried.
    padded = torch.cat([ctx, torch.randn(2, H)])[None]  # [1, 7, H]
    valid = torch.tensor([[True] * 5 + [False] * 2])
    got = layer.score(layer.context_kv(padded), valid, drafts[None], first=2)[0]
    torch.testing.assert_close(got, want[2:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_position", [True, False])
def test_blockwise_inference_equals_the_training_path(use_position):
    """score_block over successive blocks (padded batch, cached keys/values) gives the
    logits of one training-path pass over [context; drafts] with the chain mask."""
    torch.manual_seed(1)
    layer = PacerLayer(PacerConfig(hidden_size=H, num_heads=2, mlp_size=16, max_draft=4, use_position=use_position))
    layer.eval()
    ctxs, drafts = [torch.randn(5, H), torch.randn(3, H)], torch.randn(2, 6, H)  # 6 > max_draft: clamped e_i
    want = []
    for ctx, d in zip(ctxs, drafts):
        pos = torch.tensor([0] * len(ctx) + [min(i, 4) for i in range(1, 7)])
        full = layer(torch.cat([ctx, d])[None], pos[None], build_chain_mask(len(ctx), [len(ctx)], [6]))
        want.append(full[0, len(ctx) :])
    layer.freeze()  # the policy's inference path (heads.affine); the training path above stays F.linear
    width, cap, block = 5, 6, 2
    kv = torch.zeros(2, 2, 2, width + cap, H // 2)  # [k/v, B, heads, T, d]
    valid = torch.zeros(2, width, dtype=torch.bool)
    for i, ctx in enumerate(ctxs):
        kv[:, i, :, : len(ctx)] = layer.context_kv(ctx[None])[:, 0]
        valid[i, : len(ctx)] = True
    mask = torch.cat([valid[:, None].expand(2, cap, width), torch.ones(cap, cap).tril().bool().expand(2, -1, -1)], -1)
    x = drafts + layer.position_rows(cap, torch.device("cpu"))  # embedded as the policy stores them
    got = [
        layer.score_block(x[:, f : f + block], kv, width + f, mask[:, f : f + block, : width + f + block])
        for f in range(0, cap, block)
    ]
    torch.testing.assert_close(torch.cat(got, dim=1), torch.stack(want), rtol=1e-5, atol=1e-5)


def test_position_embeddings_and_their_ablation():
    on, off = make_layer(), make_layer(use_position=False)
    h = torch.randn(1, 3, H)
    pos = torch.tensor([[0, 1, 2]])
    assert torch.equal(on.embed(h, pos)[0, 0], h[0, 0])  # context: e_0 = 0
    assert not torch.equal(on.embed(h, pos)[0, 1], h[0, 1])
    assert torch.equal(off.embed(h, pos), h)


# -- halting --


def test_halting_rules_on_hand_made_alphas():
    alpha = torch.tensor([[0.9, 0.9, 0.5], [0.6, 0.6, 0.9], [0.9, 0.9, 0.9], [0.9, float("nan"), 0.9]])
    t = 0.7
    assert halt(alpha, t, "mean").tolist() == [False, True, False, True]  # means .77, .70 (<= t), .9, NaN
    assert halt(alpha, t, "any").tolist() == [True, True, False, True]
    assert halt(alpha, t, "last").tolist() == [True, False, False, False]  # reads the last alpha only
    with pytest.raises(ValueError):
        halt(alpha, t, "median")


def test_stop_lengths_blockwise_with_growth():
    alpha = torch.tensor(
        [
            [0.9, 0.9, 0.2, 0.2, 0.9, 0.9],  # block 2 mean 0.2: stop at 4
            [0.3, 0.3, 0.9, 0.9, 0.9, 0.9],  # block 1 fails: stop at 2
            [0.9, 0.9, 0.9, 0.9, 0.9, 0.9],  # never: the cap 6
            [0.8, 0.8, 0.75, 0.75, 0.9, 0.9],  # t=0.7 passes 0.8, then t=0.77 stops 0.75
        ]
    )
    assert stop_lengths(alpha, 2, 0.7, 1.1).tolist() == [4, 2, 6, 4]
    assert stop_lengths(alpha, 2, 0.7, 1.0).tolist() == [4, 2, 6, 6]
    assert stop_lengths(alpha, 4, 0.7, 1.0).tolist() == [4, 4, 6, 6]  # one block of 4 before the cap: means .55 .6


# -- files --


def test_round_trip(pacer_file, draft):
    layer, meta = load_pacer(pacer_file)
    want = make_layer()
    for (name, a), (_, b) in zip(want.state_dict().items(), layer.state_dict().items()):
        assert torch.equal(a, b), name
    assert meta["kind"] == "pacer" and meta["hidden_size"] == H and meta["max_draft"] == 6
    assert meta["draft"]["fingerprint"] == model_fingerprint(draft)
    assert check_pacer(pacer_file, draft)["block_size"] == 2


def test_mismatches_name_the_field(tmp_path, pacer_file, draft):
    other = make_draft(tmp_path / "other", seed=1)
    with pytest.raises(ConfigError, match=r"^adaptive_spec\.head: .* was trained for draft 'draft'"):
        check_pacer(pacer_file, other)
    specdecpp = tmp_path / "specdecpp.safetensors"
    make_head_file(specdecpp, draft)
    with pytest.raises(ConfigError, match="is a 'specdecpp'/'residual-silu-mlp' head; expected 'pacer'/'pacer'"):
        load_pacer(specdecpp)
    with pytest.raises(ConfigError, match="does not exist"):
        load_pacer(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    make_pacer_file(bad, draft, threshold=1.5)
    with pytest.raises(ConfigError, match="bad recommended settings"):
        load_pacer(bad)
    # Right metadata, wrong tensor shape.
    from safetensors import safe_open

    with safe_open(str(pacer_file), framework="pt") as fh:
        meta = json.loads(fh.metadata()[META_KEY])
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    tensors["out.weight"] = torch.zeros(1, H + 1)
    shapes = tmp_path / "shapes.safetensors"
    save_file(tensors, str(shapes), {META_KEY: json.dumps(meta)})
    with pytest.raises(ConfigError, match="tensor 'out.weight' is torch.float32 \\[1, 9\\]"):
        load_pacer(shapes)


def test_config_validates_pacer_fields(pacer_file):
    cfg = parse_additional_config({"adaptive_spec": {"policy": "pacer", "head": str(pacer_file), "halting": "any"}})
    assert cfg.build_policy().halting == "any"
    with pytest.raises(ConfigError, match=r"adaptive_spec\.halting: 'median' is not one of"):
        parse_additional_config({"adaptive_spec": {"policy": "pacer", "head": str(pacer_file), "halting": "median"}})
    with pytest.raises(ConfigError, match=r"adaptive_spec\.block_size: 0 is out of range"):
        parse_additional_config({"adaptive_spec": {"policy": "pacer", "head": str(pacer_file), "block_size": 0}})


# -- training pieces --


def fake_chains(n_resp: int = 5, prompt: int = 3, g: int = 4, runs=(2, 0, 4, 1, 0)) -> Chains:
    label = torch.zeros(n_resp, g)
    for j, r in enumerate(runs):
        label[j, :r] = 1
    where = torch.arange(n_resp)[:, None] + torch.arange(g)[None, :]
    return Chains(
        context=torch.randn(prompt + n_resp, H),
        offset=prompt,
        starts=torch.arange(n_resp),
        hidden=torch.randn(n_resp, g, H),
        label=label * (where < n_resp),
        valid=where < n_resp,
    )


def test_pack_and_collate_shapes():
    ch = fake_chains()
    p = pack(ch, window=2)
    n_chain = int(ch.valid.sum())  # 4 + 4 + 3 + 2 + 1
    assert p.hidden.shape == (8 + n_chain, H) and int(p.loss.sum()) == n_chain == 14
    assert p.draft_pos[8:12].tolist() == [1, 2, 3, 4]
    assert p.mask[8, :8].tolist() == [False, True, True] + [False] * 5  # chain 0 starts at context 3
    b = collate([p, pack(fake_chains(n_resp=3, runs=(1, 0, 0)), window=2)])
    assert b.hidden.shape[0] == 2 and b.mask[1].any(-1).all()  # padding rows see themselves


def test_replay_counts_follow_the_rounds():
    ch = fake_chains()  # runs 2, 0, 4, 1, 0 at response positions 0..4
    alpha = torch.full((5, 4), 0.9)  # never stops: rounds capped by k and the response end
    counts, calls = replay_counts([alpha], [ch], k=4, block=2, threshold=0.5, growth=1.0, rule="mean")
    # prefill emits token 0 -> j=1: limit 3, length 3, accepts 0 -> j=2: limit 2, accepts 2 -> j=5 done.
    assert counts.n_target == 3 and counts.n_draft == 5 and counts.n_gen == 5
    # the rule never halts: nothing drawn past the limits; the layer judged drafts 1-2 in the first round
    # (at step 2 of 0..2), nothing in the second (steps 0..1)
    assert counts.n_drawn == 5 and calls == 1


def test_replay_charges_the_dropped_draft_and_each_layer_call():
    ch = fake_chains()  # runs 2, 0, 4, 1, 0 at response positions 0..4
    alpha = torch.full((5, 4), 0.1)  # halts at the first judged block: length 2, the third draft drawn and dropped
    counts, calls = replay_counts([alpha], [ch], k=4, block=2, threshold=0.5, growth=1.0, rule="mean")
    # j=1: limit 3, halts at length 2 (3 drawn, 1 call), accepts 0 -> j=2: limit 2, runs to it (2 drawn,
    # no call: step 2 never runs), accepts 2 -> done
    assert (counts.n_target, counts.n_draft, counts.n_drawn, calls) == (3, 4, 5, 1)
    free = replay_row_charged({}, counts, calls, TrainConfig(cost_ratio=4.0))
    charged = replay_row_charged({}, counts, calls, TrainConfig(cost_ratio=4.0, layer_cost=0.5))
    # S = 1 / (N_T/N_gen + (N_drawn + calls * layer_cost) / (c N_gen))
    assert free["speedup"] == round(1 / (3 / 5 + 5 / 20), 4)
    assert charged["speedup"] == round(1 / (3 / 5 + 5.5 / 20), 4) and charged["layer_calls_per_token"] == 0.2


# -- the policy --


def test_policy_judges_full_blocks_and_keeps_context(pacer_file):
    p = PacerPolicy(str(pacer_file), block_size=2, threshold=0.5, growth=1.0, context_window=3)
    logits = iter([torch.tensor([[3.0, 3.0], [-3.0, -3.0]]), torch.full((2, 2), 3.0)])  # [B, block] per judged block
    seen = []

    def fake_score_block(x, kv, at, mask):
        width = p._round[2]
        seen.append((mask[:, 0, :width].clone(), at - width, mask.shape[2] - width, x.shape[1]))
        return next(logits)

    p.layer.score_block = fake_score_block
    # First round for "a", second for "b"; 6 rows: a's prompt (4 rows), b's verified tokens (2 rows).
    assert p.round_limits(["a", "b"], cap=6) == [6, 6]
    hidden = torch.arange(6.0)[:, None].expand(6, H)
    p.observe_context(["a", "b"], hidden, starts=[0, 4], lengths=[4, 2], positions=[0, 10])
    assert p.num_tracked() == 2 and p._ctx["a"][:, 0].tolist() == [1.0, 2.0, 3.0]  # window 3
    logp = torch.log(torch.full((2, 4), 0.25))
    tok = torch.zeros(2, dtype=torch.long)
    d0 = p.decide(logp, tok, 0, torch.zeros(2, H))
    d1 = p.decide(logp, tok, 1, torch.zeros(2, H))
    assert not seen and d0.keep.all() and d1.keep.all() and not d1.stop.any()  # no full block yet
    d2 = p.decide(logp, tok, 2, torch.zeros(2, H))  # block of tokens 1-2: alphas ~.95 / ~.05
    assert d2.keep.tolist() == [True, False] and not d2.stop.any()  # a row not kept stops (the loop's rule)
    assert seen[0][0].tolist() == [[True, True, True], [True, True, False]] and seen[0][1:] == (0, 2, 2)
    p.decide(logp, tok, 3, torch.zeros(2, H))
    p.decide(logp, tok, 4, torch.zeros(2, H))
    assert seen[1][1:] == (2, 4, 2)  # second block: drafts 3-4 after drafts 1-2
    # Next round: "a" re-reads its last token (position 3) and two new ones; dedup by position.
    p.round_limits(["a"], cap=6)
    p.observe_context(["a"], torch.tensor([3.0, 4.0, 5.0])[:, None].expand(3, H), [0], [3], [3])
    assert p._ctx["a"][:, 0].tolist() == [3.0, 4.0, 5.0]
    p.forget("a")
    p.forget("b")
    assert p.num_tracked() == 0


def test_threshold_grows_per_judged_block_of_a_round(pacer_file, monkeypatch):
    """The round's j-th block is judged at threshold * growth^j (the same for every row still drafting: a
    row that stopped is done for the round); each round starts again at the threshold."""
    import vllm_adaptive_spec.policies.pacer as mod

    seen = []
    monkeypatch.setattr(
        mod, "go_on", lambda alpha, threshold, rule: seen.append(threshold) or alpha[:, 0] == alpha[:, 0]
    )
    p = PacerPolicy(str(pacer_file), block_size=2, threshold=0.5, growth=1.1, context_window=3)
    logp = torch.log(torch.full((2, 4), 0.25))
    for _ in range(2):
        p.round_limits(["a", "b"], cap=7)
        p.observe_context(["a", "b"], torch.randn(3, H), starts=[0, 2], lengths=[2, 1], positions=[0, 0])
        for t in range(7):
            p.decide(logp, torch.zeros(2, dtype=torch.long), t, torch.randn(2, H))
    assert seen == pytest.approx([0.5, 0.55, 0.605] * 2)


def test_policy_uses_the_files_recommendations(pacer_file):
    p = PacerPolicy(str(pacer_file))
    assert (p.block, p.threshold, p.growth, p.halting, p.window) == (2, 0.6, 1.05, "mean", 3)
    assert TrainConfig().cap == 16


def test_cached_context_keys_values_equal_a_fresh_projection(pacer_file):
    """The policy projects each context token once; the cached keys/values must equal
    projecting the whole stored window again."""
    p = PacerPolicy(str(pacer_file), context_window=3)
    p.round_limits(["a", "b"], cap=4)
    torch.manual_seed(0)
    p.observe_context(["a", "b"], torch.randn(6, H), starts=[0, 4], lengths=[4, 2], positions=[0, 10])
    p.round_limits(["a", "b"], cap=4)
    p.observe_context(["a", "b"], torch.randn(4, H), starts=[0, 2], lengths=[2, 2], positions=[3, 11])
    for i, req in enumerate(["a", "b"]):
        k, v = p.layer.context_kv(p._ctx[req].unsqueeze(0))  # [1, heads, n, d]
        n = p._ctx[req].shape[0]
        kv, mask, width = p._round
        assert torch.allclose(kv[0, i, :, :n], k[0], atol=1e-6)
        assert torch.allclose(kv[1, i, :, :n], v[0], atol=1e-6)
        assert mask[i, 0, :width].tolist() == [True] * n + [False] * (width - n)
    p.forget("a")
    assert "a" not in p._kv


def test_policy_alphas_equal_the_reference_scoring_on_a_padded_batch(pacer_file):
    """The policy's incremental path (round buffers, padding, cached keys/values) decides
    exactly as scoring each whole round afresh with `PacerLayer.score`."""
    torch.manual_seed(3)
    p = PacerPolicy(str(pacer_file), block_size=2, threshold=0.5, growth=1.0, context_window=3)
    p.round_limits(["a", "b"], cap=6)
    p.observe_context(["a", "b"], torch.randn(5, H) * 3, starts=[0, 4], lengths=[4, 1], positions=[0, 7])
    ctx = [p._ctx["a"], p._ctx["b"]]  # 3 and 1 tokens: b's context is padded
    alphas = []
    real_score_block = p.layer.score_block
    p.layer.score_block = lambda *a: alphas.append(real_score_block(*a)) or alphas[-1]
    logp = torch.log(torch.full((2, 4), 0.25))
    drafts = torch.randn(2, 6, H) * 3
    for t in range(5):
        p.decide(logp, torch.zeros(2, dtype=torch.long), t, drafts[:, t - 1] if t else torch.zeros(2, H))
    padded = torch.zeros(2, 3, H)
    padded[0], padded[1, :1] = ctx[0], ctx[1]
    valid = torch.tensor([[True] * 3, [True, False, False]])
    want = p.layer.score(p.layer.context_kv(padded), valid, drafts[:, :4], first=0)  # [2, 4]
    torch.testing.assert_close(torch.cat(alphas, dim=1), want, rtol=1e-5, atol=1e-5)


def test_policy_moves_and_freezes_once_per_device_as_set(pacer_file):
    """Regression: the layer's "cuda:0" never equalled a set "cuda", so every round moved the layer and
    refolded its weights. Here a set "cpu:0" against the tensors' "cpu"."""
    p = PacerPolicy(str(pacer_file))
    p.device = torch.device("cpu", 0)
    p.round_limits(["a"], cap=4)
    frozen = p.layer._affine
    p.round_limits(["a", "b"], cap=4)
    assert p.layer._affine is frozen
