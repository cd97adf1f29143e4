"""The DFlash drafter on a tiny random config: loss weights by hand, shapes, the batched block pass
against one block at a time as vLLM runs it, the directory vLLM loads, and the bundled drafters."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks.paths import REPO
from tests.unit import tiny_qwen3
from tests.unit.tiny_qwen3 import assert_same_bytes, randomize_norms, safetensors_summary, saved_config
from vllm_adaptive_spec.heads.dflash import (
    DFlashConfig,
    DFlashDrafter,
    draft_blocks,
    expected_keys,
    load_hf_dir,
    save_hf_dir,
)
from vllm_adaptive_spec.training.dflash import (
    TrainConfig,
    decay_weights,
    dpace_weights,
    evaluate,
    fit,
    make_blocks,
    position_weights,
    replay_response,
    run_blocks,
)
from vllm_adaptive_spec.training.eagle3 import Sequence

TARGET = {**tiny_qwen3.TARGET, "pad_token_id": 0}
K, L = 4, 14
BUNDLED = [REPO / "heads" / "toy" / "dflash", REPO / "heads" / "toy" / "dflash-ce"]


def make_drafter(seed: int = 0) -> tuple[DFlashDrafter, DFlashConfig]:
    torch.manual_seed(seed)
    cfg = DFlashConfig.from_target(TARGET, block_size=K)
    drafter = DFlashDrafter(cfg)
    randomize_norms(drafter)
    return drafter.eval(), cfg


def make_seq(cfg: DFlashConfig, length: int = L, prompt_len: int = 5, seed: int = 1) -> Sequence:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, cfg.vocab_size, (length,), generator=g)
    return Sequence(ids, torch.randn(length, cfg.fc_in, generator=g), prompt_len)


# -- loss weights, by hand --


def test_decay_weights() -> None:
    valid = torch.tensor([[True, True, True], [True, True, False]])
    e = math.exp
    want = torch.tensor([[1.0, e(-0.25), e(-0.5)], [1.0, e(-0.25), 0.0]])
    torch.testing.assert_close(decay_weights(valid, 4.0), want)


def test_dpace_weights() -> None:
    q = torch.tensor([0.8, 0.6, 0.4])
    # s = 0.5 q + 0.5 = (0.9, 0.8, 0.7); P = (0.9, 0.72, 0.504); w_k = sum_{j>=k} P_j
    all_valid = torch.ones(3, dtype=torch.bool)
    torch.testing.assert_close(dpace_weights(q, all_valid, 0.5), torch.tensor([2.124, 1.224, 0.504]))
    # the last position has no target: it drops out of every continuation sum
    prefix = torch.tensor([True, True, False])
    torch.testing.assert_close(dpace_weights(q, prefix, 0.5), torch.tensor([1.62, 0.72, 0.0]))
    # lambda 0.25: s = (0.85, 0.7, 0.55); P = (0.85, 0.595, 0.32725)
    torch.testing.assert_close(dpace_weights(q, all_valid, 0.25), torch.tensor([1.77225, 0.92225, 0.32725]))
    # lambda 1: every s is 1, w_k = number of valid positions from k on
    torch.testing.assert_close(dpace_weights(q, all_valid, 1.0), torch.tensor([3.0, 2.0, 1.0]))
    # lambda 0: the raw surrogate's gradient weights
    raw = torch.tensor([0.8 + 0.48 + 0.192, 0.48 + 0.192, 0.192])
    torch.testing.assert_close(dpace_weights(q, all_valid, 0.0), raw)


def test_position_weights_per_loss() -> None:
    valid = torch.tensor([[True, True, False]])
    q = torch.tensor([[0.8, 0.6, 0.4]], requires_grad=True)
    assert position_weights(TrainConfig(loss="ce"), valid, q).tolist() == [[1.0, 1.0, 0.0]]
    torch.testing.assert_close(
        position_weights(TrainConfig(loss="decay", gamma=2.0), valid, q), torch.tensor([[1.0, math.exp(-0.5), 0.0]])
    )
    w = position_weights(TrainConfig(loss="dpace"), valid, q)
    assert not w.requires_grad  # detached: the weights assign credit, they carry no gradient
    torch.testing.assert_close(w, torch.tensor([[1.62, 0.72, 0.0]]))
    # the running-agreement variant: one q per position, the same for every block
    agreement = torch.tensor([0.8, 0.6, 0.4])
    cfg = TrainConfig(loss="dpace", dpace_estimate="agreement")
    w = position_weights(cfg, valid.expand(2, 3), torch.zeros(2, 3), agreement)
    torch.testing.assert_close(w, torch.tensor([[1.62, 0.72, 0.0]] * 2))
    with pytest.raises(ValueError, match="loss"):
        TrainConfig(loss="kl")
    with pytest.raises(ValueError, match="dpace_lambda"):
        TrainConfig(dpace_lambda=1.5)


# -- the module --


def test_config_from_target() -> None:
    cfg = DFlashConfig.from_target(TARGET)
    assert cfg.target_layer_ids == (0, 1, 2) and cfg.hf_layer_ids == (1, 2, 3)
    assert (cfg.fc_in, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size) == (96, 4, 2, 8, 8)
    assert cfg.mask_token_id == 0 and cfg.num_layers == 2 and cfg.intermediate_size == 48
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashConfig.from_target(TARGET, target_layer_ids=(1, 1))


def test_shapes() -> None:
    drafter, cfg = make_drafter()
    aux = torch.randn(3, L, cfg.fc_in)
    anchors = torch.tensor([[5, 6], [7, 8], [9, 0]])
    normed = drafter(aux, anchors, torch.ones_like(anchors))
    assert normed.shape == (3, 2, K, cfg.hidden_size)
    assert drafter.logits(normed).shape == (3, 2, K, cfg.vocab_size)
    assert torch.isfinite(normed).all()  # the anchor at 0 sees no context: only its block


def vllm_block(drafter: DFlashDrafter, ids: torch.Tensor, aux: torch.Tensor, p: int) -> torch.Tensor:
    """One round as vLLM runs it: context K/V of positions < p written to a cache
    (`precompute_and_store_context_kv`), then the K+1 block tokens at p..p+K through the
    layers, attending to the cache and to each other without a causal mask. -> [K, H]."""
    cfg = drafter.cfg
    c = drafter.hidden_norm(drafter.fc(aux[:p]))  # [p, H]
    tokens = torch.tensor([int(ids[p])] + [cfg.mask_token_id] * cfg.block_size)
    pos = torch.arange(p, p + cfg.block_size + 1)
    x = drafter.embed_tokens(tokens)  # [Q, H]
    for layer in drafter.layers:
        attn = layer.self_attn
        ctx_k, ctx_v = attn.kv(c, torch.arange(p))  # [nh, p, d]
        h = layer.input_layernorm(x)
        q = attn._rope(attn.q_norm(attn._heads(h, attn.q_proj)), pos)  # [nh, Q, d]
        k, v = attn.kv(h, pos)
        o = F.scaled_dot_product_attention(q, torch.cat([ctx_k, k], -2), torch.cat([ctx_v, v], -2))
        x = x + attn.o_proj(o.transpose(0, 1).flatten(-2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)[1:]


def test_batched_blocks_equal_one_round_at_a_time() -> None:
    drafter, cfg = make_drafter()
    seqs = [make_seq(cfg, L, 5, seed=1), make_seq(cfg, L - 3, 3, seed=2)]
    blocks = make_blocks(seqs, K)
    with torch.no_grad():
        normed = drafter(blocks.aux, blocks.anchors, blocks.anchor_tokens)  # [2, N, K, H]
        for row, s in enumerate(seqs):
            for n, p in enumerate(range(s.prompt_len, len(s.ids) - 1)):
                assert int(blocks.anchors[row, n]) == p
                want = vllm_block(drafter, s.ids, s.aux, p)
                torch.testing.assert_close(normed[row, n], want, rtol=1e-4, atol=1e-5)


def test_a_block_never_sees_context_at_or_after_its_anchor() -> None:
    drafter, cfg = make_drafter()
    s = make_seq(cfg)
    anchors = torch.tensor([[6, 9]])
    changed = s.aux.clone()
    changed[9:] = torch.randn_like(changed[9:])
    with torch.no_grad():
        a = drafter(s.aux[None], anchors, s.ids[anchors])
        b = drafter(changed[None], anchors, s.ids[anchors])
    torch.testing.assert_close(a[0, 0], b[0, 0])
    torch.testing.assert_close(a[0, 1], b[0, 1])  # position 9 is the anchor's own: not context
    changed[8] += 1.0
    with torch.no_grad():
        c = drafter(changed[None], anchors, s.ids[anchors])
    torch.testing.assert_close(a[0, 0], c[0, 0])
    assert not torch.allclose(a[0, 1], c[0, 1])


def test_draft_blocks_are_the_greedy_tokens() -> None:
    drafter, cfg = make_drafter()
    s = make_seq(cfg)
    anchors = torch.tensor([5, 8])
    drafts = draft_blocks(drafter, s.ids, s.aux, anchors)
    assert drafts.shape == (2, K)
    with torch.no_grad():
        want = drafter.logits(vllm_block(drafter, s.ids, s.aux, 8)).argmax(-1)
    assert drafts[1].tolist() == want.tolist()


# -- blocks, loss, evaluation --


def test_make_blocks_targets_and_padding() -> None:
    cfg = DFlashConfig.from_target(TARGET, block_size=3)
    ids = torch.tensor([1, 10, 11, 20, 21, 22, 2])  # prompt 3 tokens, response 4
    a = Sequence(ids, torch.zeros(7, cfg.fc_in), 3)
    b = Sequence(torch.arange(3, 8), torch.zeros(5, cfg.fc_in), 4)
    blocks = make_blocks([a, b], 3)
    assert blocks.anchors.tolist() == [[3, 4, 5], [0, 0, 0]]  # anchors p = P .. L-2; the second row has none
    assert blocks.anchor_tokens[0].tolist() == [20, 21, 22]
    assert blocks.targets[0].tolist() == [[21, 22, 2], [22, 2, -1], [2, -1, -1]]
    assert (blocks.targets[1] == -1).all()
    assert blocks.aux.shape == (2, 7, cfg.fc_in)
    g = torch.Generator().manual_seed(0)
    some = make_blocks([Sequence(torch.arange(1, 21), torch.zeros(20, cfg.fc_in), 4)], 3, anchors=5, generator=g)
    got = some.anchors[0].tolist()
    assert len(got) == 5 and got == sorted(got) and min(got) >= 4 and max(got) <= 18


def test_loss_trains_and_evaluation_counts() -> None:
    drafter, cfg = make_drafter()
    seqs = [make_seq(cfg, L, 5, seed=i) for i in range(4)]
    out = run_blocks(drafter, make_blocks(seqs, K))
    assert out.ce.shape == out.q.shape == out.hits.shape == (4, L - 6, K)
    torch.testing.assert_close(out.q, torch.exp(-out.ce.detach()) * (out.q > 0))
    before = evaluate(drafter, seqs, K)
    history = fit(drafter, seqs, TrainConfig(loss="dpace", block_size=K, epochs=3, lr=3e-3), progress=False)
    assert len(history) == 3 and history[-1]["loss"] < history[0]["loss"]
    after = evaluate(drafter, seqs, K)
    assert after["ce_per_position"][0] < before["ce_per_position"][0]
    assert after["blocks"] == 4 * (L - 6) and sum(after["accepted_histogram"]) == after["blocks"]
    assert after["positions_per_position"] == [4 * (L - 6 - k) for k in range(K)]
    assert after["replay_rounds"] >= 4


# -- the directory vLLM loads --


def test_saved_directory(tmp_path) -> None:
    drafter, cfg = make_drafter()
    out = save_hf_dir(drafter, cfg, tmp_path / "dflash", TARGET)
    conf = saved_config(out)
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["model_type"] == "qwen3"
    assert conf["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [0, 1, 2], "block_size": K + 1}
    assert conf["num_hidden_layers"] == 2 and conf["layer_types"] == ["full_attention"] * 2
    assert conf["target_hidden_size"] == 32 and conf["draft_vocab_size"] == conf["vocab_size"] == 50
    keys, shapes, dtypes = safetensors_summary(out / "model.safetensors")
    # exactly what vLLM's DFlashQwen3ForCausalLM loads: q/k/v and gate/up stacked by its loader,
    # no embed_tokens / lm_head (shared from the target), no d2t (same vocabulary)
    per_layer = {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    }
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in (0, 1) for n in per_layer}
    assert keys == want == expected_keys(cfg)
    assert dtypes == {torch.float32}
    assert shapes["fc.weight"] == (32, 96)
    assert shapes["layers.1.self_attn.q_proj.weight"] == (32, 32)  # [n_q * d, H]: H wide, not 2H as in EAGLE-3
    assert shapes["layers.1.self_attn.k_proj.weight"] == (16, 32)
    assert shapes["layers.0.self_attn.k_norm.weight"] == (8,)
    assert_same_bytes(out, save_hf_dir(drafter, cfg, tmp_path / "again", TARGET))
    loaded, cfg2 = load_hf_dir(out, drafter.embed_tokens.weight, drafter.lm_head.weight)
    assert cfg2 == cfg
    seq = make_seq(cfg)
    anchors = torch.tensor([[5, 9]])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(seq.aux[None], anchors, seq.ids[anchors]), drafter(seq.aux[None], anchors, seq.ids[anchors])
        )


def test_save_refuses_missing_keys_and_oversize(tmp_path) -> None:
    drafter, cfg = make_drafter()
    del drafter.layers[1].self_attn.k_norm
    with pytest.raises(AssertionError, match="k_norm"):
        save_hf_dir(drafter, cfg, tmp_path / "a", TARGET)
    assert not (tmp_path / "a").exists()
    drafter, cfg = make_drafter()
    with pytest.raises(ValueError, match="MB"):
        save_hf_dir(drafter, cfg, tmp_path / "b", TARGET, max_bytes=1000)


@pytest.mark.parametrize("path", BUNDLED, ids=[p.name for p in BUNDLED])
def test_bundled_drafter_directories(path) -> None:
    conf = json.loads((path / "config.json").read_text())
    target = json.loads((REPO / "benchmarks" / "models" / "toy-target" / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"]
    assert conf["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    assert conf["vocab_size"] == target["vocab_size"] and conf["target_hidden_size"] == target["hidden_size"]
    _, cfg = load_hf_dir(path)
    assert safetensors_summary(path / "model.safetensors")[0] == expected_keys(cfg)
    assert sum(p.stat().st_size for p in path.iterdir()) <= 8_000_000


def test_replay_response_walks_rounds() -> None:
    drafter, cfg = make_drafter()
    s = make_seq(cfg)
    rounds = replay_response(drafter, s)
    n = len(s.ids) - 1 - s.prompt_len  # anchors
    assert 1 <= len(rounds) <= n and sum(r + 1 for r in rounds) >= n
    # a drafter that always drafts the truth: every round accepts min(K, what is left)
    ids = torch.arange(1, L + 1)
    perfect = Sequence(ids, torch.zeros(L, cfg.fc_in), 5)

    class Oracle(torch.nn.Module):
        cfg = drafter.cfg

        def forward(self, aux, anchors, anchor_tokens):
            return anchors[..., None] + torch.arange(1, K + 1)  # the positions to predict

        def logits(self, where):
            return F.one_hot(ids[where.clamp_max(L - 1)], L + 1).float()

    assert replay_response(Oracle(), perfect) == [4, 3]  # anchors 5..12: 5 -> accepts 4 -> 10 -> accepts 3 -> done
