"""The EAGLE-3 head on a tiny random config: shapes, training-time test vs the KV-cache path, files."""

from __future__ import annotations

import pytest
import torch

from tests.unit.tiny_qwen3 import TARGET, assert_same_bytes, randomize_norms, safetensors_summary, saved_config
from vllm_adaptive_spec.heads.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    apply_rope,
    draft_chains,
    expected_keys,
    load_hf_dir,
    rope_cos_sin,
    save_hf_dir,
)
from vllm_adaptive_spec.training.eagle3 import (
    Sequence,
    accepted_prefix,
    collate,
    replay_rounds,
    step_masks,
    ttt_losses,
)

T, STEPS = 12, 4


def make_head(seed: int = 0) -> tuple[Eagle3Head, Eagle3Config]:
    torch.manual_seed(seed)
    cfg = Eagle3Config.from_target(TARGET)
    head = Eagle3Head(cfg)
    randomize_norms(head)
    return head.eval(), cfg


def inputs(cfg: Eagle3Config, b: int = 1, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(cfg.vocab_size, (b, T), generator=g), torch.randn(b, T, cfg.fc_in, generator=g)


def test_config_from_target() -> None:
    cfg = Eagle3Config.from_target(TARGET)
    assert cfg.aux_layer_ids == (1, 2, 3)  # not vLLM's (2, 2, 1) default for 4 layers
    assert (cfg.fc_in, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (96, 4, 2, 8)
    assert Eagle3Config.from_target({**TARGET, "num_hidden_layers": 32}).aux_layer_ids == (2, 16, 29)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        Eagle3Config.from_target(TARGET, (2, 2, 1))


def test_shapes() -> None:
    head, cfg = make_head()
    tokens, aux = inputs(cfg, b=3)
    assert head.fuse(aux).shape == (3, T, cfg.hidden_size)
    positions = torch.arange(T).expand(3, T)
    normed, prenorm, cache = head.decode(tokens, head.fuse(aux), positions)
    assert normed.shape == prenorm.shape == (3, T, cfg.hidden_size)
    assert cache.k.shape == cache.v.shape == (3, cfg.num_kv_heads, T, cfg.head_dim)
    assert head.logits(normed).shape == (3, T, cfg.vocab_size)
    outs = head.forward_ttt(tokens, aux, STEPS)
    assert len(outs) == STEPS and all(o.shape == (3, T, cfg.hidden_size) for o in outs)
    assert all(torch.isfinite(o).all() for o in outs)


def test_ttt_matches_incremental_decoding() -> None:
    """Step s at position p of the training forward = the s-th pass of a chain started at p - s."""
    head, cfg = make_head()
    tokens, aux = inputs(cfg)
    with torch.no_grad():
        ttt = [head.logits(o[0]) for o in head.forward_ttt(tokens, aux, STEPS)]  # [T, V] per step
        for c in range(T - STEPS + 1):
            pos = torch.arange(c + 1)[None]
            normed, hidden, cache = head.decode(tokens[:, : c + 1], head.fuse(aux[:, : c + 1]), pos)
            torch.testing.assert_close(head.logits(normed[0, c]), ttt[0][c], rtol=1e-4, atol=1e-5)
            hidden = hidden[:, c : c + 1]
            for s in range(1, STEPS):
                p = c + s  # the ground-truth token at p, as the training-time test feeds it
                normed, hidden, cache = head.decode(tokens[:, p : p + 1], hidden, torch.tensor([[p]]), cache)
                torch.testing.assert_close(head.logits(normed[0, 0]), ttt[s][p], rtol=1e-4, atol=1e-5)


def test_ttt_batch_rows_are_independent_of_padding() -> None:
    head, cfg = make_head()
    tokens, aux = inputs(cfg, b=2)
    with torch.no_grad():
        full = head.forward_ttt(tokens, aux, STEPS)
        short = head.forward_ttt(tokens[:1, : T - 3], aux[:1, : T - 3], STEPS)
    for a, b in zip(full, short):
        torch.testing.assert_close(a[0, : T - 3], b[0], rtol=1e-5, atol=1e-6)


def test_draft_chains_equal_one_chain_at_a_time() -> None:
    head, cfg = make_head()
    tokens, aux = inputs(cfg)
    starts, length = torch.tensor([2, 5, 7]), 4
    batched = draft_chains(head, tokens[0], aux[0], starts, length)
    assert batched.shape == (3, length)
    with torch.no_grad():
        for row, c in enumerate(starts.tolist()):
            pos = torch.arange(c + 1)[None]
            normed, hidden, cache = head.decode(tokens[:, : c + 1], head.fuse(aux[:, : c + 1]), pos)
            token, hidden = head.logits(normed[0, c]).argmax(), hidden[:, c : c + 1]
            chain = [int(token)]
            for k in range(1, length):
                normed, hidden, cache = head.decode(token.view(1, 1), hidden, torch.tensor([[c + k]]), cache)
                token = head.logits(normed[0, 0]).argmax()
                chain.append(int(token))
            assert batched[row].tolist() == chain


def test_rope_rotates_by_relative_position() -> None:
    d = 8
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, d, generator=g), torch.randn(1, 1, 1, d, generator=g)

    def at(x: torch.Tensor, p: int) -> torch.Tensor:
        cos, sin = rope_cos_sin(torch.tensor([[p]]), d, 10000.0)
        return apply_rope(x, cos[:, None], sin[:, None])

    torch.testing.assert_close(at(q, 0), q)
    torch.testing.assert_close(at(q, 7).norm(), q.norm())
    dot = (at(q, 9) * at(k, 4)).sum()
    torch.testing.assert_close((at(q, 105) * at(k, 100)).sum(), dot, rtol=1e-4, atol=1e-5)


def test_rope_matches_transformers_qwen3() -> None:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    hf = Qwen3Config(**{k: v for k, v in TARGET.items() if k != "architectures"})
    pos = torch.arange(20)[None]
    x = torch.randn(1, 2, 20, 8)
    cos, sin = Qwen3RotaryEmbedding(hf)(x, pos)
    want, _ = apply_rotary_pos_emb(x, x, cos, sin)
    mine_cos, mine_sin = rope_cos_sin(pos, 8, 10000.0)
    torch.testing.assert_close(apply_rope(x, mine_cos[:, None], mine_sin[:, None]), want)


def test_saved_directory(tmp_path) -> None:
    head, cfg = make_head()
    out = save_hf_dir(head, cfg, tmp_path / "eagle3", TARGET)
    conf = saved_config(out)
    assert conf["architectures"] == ["Eagle3Qwen3ForCausalLM"] and conf["model_type"] == "qwen3"
    assert conf["num_hidden_layers"] == 1 and conf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert conf["target_hidden_size"] == 32 and conf["draft_vocab_size"] == conf["vocab_size"] == 50
    assert conf["tie_word_embeddings"] is False and conf["rope_parameters"]["rope_theta"] == 10000.0
    keys, shapes, dtypes = safetensors_summary(out / "model.safetensors")
    assert keys == expected_keys(cfg) and "embed_tokens.weight" not in keys
    assert dtypes == {torch.float32}
    assert shapes["fc.weight"] == (32, 96)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (32, 64)  # [n_q * d, 2H]
    assert shapes["midlayer.self_attn.k_proj.weight"] == (16, 64)
    assert shapes["lm_head.weight"] == (50, 32)
    # deterministic bytes (the plugin fingerprints drafter directories)
    assert_same_bytes(out, save_hf_dir(head, cfg, tmp_path / "again", TARGET))
    # round trip
    loaded, cfg2 = load_hf_dir(out, head.embed_tokens.weight)
    assert cfg2 == cfg
    tokens, aux = inputs(cfg)
    with torch.no_grad():
        for a, b in zip(head.forward_ttt(tokens, aux, 2), loaded.forward_ttt(tokens, aux, 2)):
            torch.testing.assert_close(a, b)


def test_save_refuses_missing_keys_and_oversize(tmp_path) -> None:
    head, cfg = make_head()
    del head.midlayer.self_attn.q_norm
    with pytest.raises(AssertionError, match="q_norm"):
        save_hf_dir(head, cfg, tmp_path / "a", TARGET)
    head, cfg = make_head()
    with pytest.raises(ValueError, match="MB"):
        save_hf_dir(head, cfg, tmp_path / "b", TARGET, max_bytes=1000)


def test_collate_and_loss_masks() -> None:
    # prompt 3 tokens, response 4: L = 7, positions 0..5 read x_{p+1}; x_{p+2} is scored for p = 1..4
    ids = torch.tensor([1, 10, 11, 20, 21, 22, 2])
    short = Sequence(ids, torch.arange(7.0)[:, None].expand(7, 96).clone(), 3)
    longer = Sequence(torch.arange(3, 12), torch.zeros(9, 96), 5)
    b = collate([short, longer])
    assert b.next_tokens.shape == (2, 8)
    assert b.next_tokens[0].tolist() == [10, 11, 20, 21, 22, 2, 0, 0]
    assert b.target[0].tolist() == [11, 20, 21, 22, 2, 0, 0, 0]
    assert b.scored[0].tolist() == [False, True, True, True, True, False, False, False]
    assert b.aux[0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    masks = step_masks(b.scored, 3)
    assert masks[2][0].tolist() == [False, False, True, True, True, False, False, False]
    head, cfg = make_head()
    losses, hits = ttt_losses(head, b, 3)
    assert [len(h) for h in hits] == [int(m.sum()) for m in masks]
    assert all(torch.isfinite(x) for x in losses)


def test_acceptance_replay() -> None:
    drafted = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3]])
    truth = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    assert accepted_prefix(drafted, truth, torch.tensor([3, 3, 3])).tolist() == [3, 1, 0]
    assert accepted_prefix(drafted, truth, torch.tensor([2, 3, 3])).tolist() == [2, 1, 0]
    # chain at 0 accepts 2 -> next round at 3 accepts 0 -> at 4 accepts 1 -> at 6: done
    assert replay_rounds(torch.tensor([2, 5, 5, 0, 1, 9])) == (3, 3)
