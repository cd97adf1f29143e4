"""Pacer on an EAGLE-3 head's own chains, on a tiny random head: the chains hold what vLLM's draft
loop hands the policy (first-pass rows as context, the state that produced draft t at step t), the
policy scores a round exactly as training packs it, the pipeline runs end to end, and a layer is
tied to the drafter it was trained for."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_eagle3_head import TARGET, make_head
from tests.unit.test_heads import make_draft
from vllm_adaptive_spec import ConfigError
from vllm_adaptive_spec.heads.eagle3 import save_hf_dir
from vllm_adaptive_spec.heads.fileformat import draft_identity
from vllm_adaptive_spec.heads.pacer import PacerConfig, PacerLayer, check_pacer, load_pacer, save_pacer
from vllm_adaptive_spec.policies.pacer import PacerPolicy
from vllm_adaptive_spec.training.data import Response
from vllm_adaptive_spec.training.eagle3 import Sequence
from vllm_adaptive_spec.training.pacer import TrainConfig, pack, predict, train_on_chains
from vllm_adaptive_spec.training.pacer_eagle3 import eagle3_chains

P, R, G = 5, 8, 4  # prompt tokens, response tokens, chain length
RECOMMENDED = {"block_size": 1, "threshold": 0.0, "growth": 1.0, "halting": "mean", "context_window": 4}


@torch.no_grad()
def make_sequence(head, seed: int = 0, agreeing: int = 5) -> Sequence:
    """Prompt + response with random target features; the first `agreeing` response tokens after y_0
    are the head's own teacher-forced greedy tokens (so chains agree for a while), the rest random."""
    cfg = head.cfg
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(cfg.vocab_size, (P + R,), generator=g)
    aux = torch.randn(P + R, cfg.fc_in, generator=g)
    for p in range(P - 1, P - 1 + agreeing):  # row p predicts x_{p+2}
        normed, _, _ = head.decode(ids[None, 1 : p + 2], head.fuse(aux[None, : p + 1]), torch.arange(p + 1)[None])
        ids[p + 2] = head.logits(normed[0, p]).argmax()
    return Sequence(ids, aux, P)


@torch.no_grad()
def engine_round(head, seq: Sequence, j: int, cuts: tuple[int, ...]) -> tuple[torch.Tensor, list, list]:
    """vLLM's round for response position j, step by step: first passes over the verified rows in
    chunks (`cuts`, as successive rounds verify them), each reading the cache of earlier ones; then
    draft steps from the last row. Returns (context rows [c+1, H], the state decide() gets at each
    step t (t = 0: the last first-pass row), the drafted tokens)."""
    c = P + j - 2
    ids, feats = seq.ids, head.fuse(seq.aux)
    cache, rows, bounds = None, [], [0, *[k for k in cuts if 0 < k <= c], c + 1]
    for lo, hi in zip(bounds, bounds[1:]):
        normed, prenorm, cache = head.decode(
            ids[None, lo + 1 : hi + 1], feats[None, lo:hi], torch.arange(lo, hi)[None], cache
        )
        rows.append(normed[0])
    context = torch.cat(rows)
    state, carried = normed[:, -1:], prenorm[:, -1:]
    states, tokens = [state[0, 0]], [head.logits(state[0, 0]).argmax()]
    for t in range(1, G + 1):
        state, carried, cache = head.decode(tokens[-1].view(1, 1), carried, torch.tensor([[c + t]]), cache)
        states.append(state[0, 0])
        tokens.append(head.logits(state[0, 0]).argmax())
    return context, states, tokens


def test_chains_hold_what_the_draft_loop_hands_the_policy():
    head, _ = make_head()
    seq = make_sequence(head)
    ch = eagle3_chains(head, seq, list(range(R)), G)
    assert ch.context.shape == (P + R - 1, head.cfg.hidden_size) and ch.offset == P - 1
    assert ch.hidden.shape == (R, G, head.cfg.hidden_size)
    y = seq.ids[P:]
    labels_seen = set()
    for j in range(R):
        context, states, tokens = engine_round(head, seq, j, cuts=(3, P, P + 2))
        c = P + j - 2
        # context: the first passes' rows 0..c, exactly the rows the chain at j may see
        torch.testing.assert_close(ch.context[: c + 1], context, rtol=1e-4, atol=1e-5)
        # draft token i (1-based) is judged on the state decide() gets at step i: states[i]
        torch.testing.assert_close(ch.hidden[j], torch.stack(states[1:]), rtol=1e-4, atol=1e-5)
        agree, want = True, []
        for i in range(G):
            agree = agree and j + i < R and int(tokens[i]) == int(y[j + i])
            want.append(float(agree))
        assert ch.label[j].tolist() == want
        assert ch.valid[j].tolist() == [j + i < R for i in range(G)]
        labels_seen.update(want)
    assert labels_seen == {0.0, 1.0}, "the sequence is meant to give agreeing and disagreeing drafts"
    # packed: chain j's rows see context rows 0..P+j-2 and nothing after (full window)
    packed = pack(ch, window=-1)
    n_ctx, row = ch.context.shape[0], ch.context.shape[0]
    for j in range(R):
        assert packed.mask[row, :n_ctx].tolist() == [q <= P + j - 2 for q in range(n_ctx)]
        row += int(ch.valid[j].sum())


def test_a_one_token_prompt_is_refused():
    head, _ = make_head()
    seq = make_sequence(head)
    with pytest.raises(ValueError, match="prompt of 2 tokens"):
        eagle3_chains(head, Sequence(seq.ids[P - 1 :], seq.aux[P - 1 :], 1), [0], G)


def _layer(hidden: int, seed: int = 0) -> PacerLayer:
    torch.manual_seed(seed)
    layer = PacerLayer(PacerConfig(hidden, num_heads=2, mlp_size=16, max_draft=G))
    with torch.no_grad():  # larger weights than the init: alphas far from 0.5, differences visible
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer.eval()


def test_policy_scores_an_engine_round_as_training_packs_it(tmp_path):
    """The policy fed as the loop feeds it (first-pass rows, then decide's states) gives each draft
    token the alpha `predict` gives it from the packed chains: same context window, same states."""
    head, _ = make_head()
    seq = make_sequence(head)
    ch = eagle3_chains(head, seq, list(range(R)), G)
    layer = _layer(head.cfg.hidden_size)
    path = tmp_path / "pacer.safetensors"
    save_pacer(path, layer, {"draft": {"name": "eagle3", "fingerprint": "0"}, **RECOMMENDED})
    window = RECOMMENDED["context_window"]
    want = predict(layer, [ch], window)[0]  # [R, G]
    for j in (1, 3, R - 3):
        context, states, _ = engine_round(head, seq, j, cuts=(P,))
        policy = PacerPolicy(str(path))  # block 1, threshold 0: scores every token, never stops
        scored = []
        score_block = policy.layer.score_block

        def spy(*args, score_block=score_block, scored=scored):
            logits = score_block(*args)
            scored.append(torch.sigmoid(logits)[0, -1])
            return logits

        policy.layer.score_block = spy
        policy.round_limits(["r"], cap=G)
        first = P  # one first pass for the prompt, one for the rest (the round's own)
        policy.observe_context(["r"], context[:first], [0], [first], [0])
        policy.round_limits(["r"], cap=G)
        policy.observe_context(["r"], context[first:], [0], [len(context) - first], [first])
        logp = torch.zeros(1, head.cfg.vocab_size)
        for t in range(G):
            decision = policy.decide(logp, torch.zeros(1, dtype=torch.long), t, states[t][None])
            assert bool(decision.keep[0])
        # at step t the policy judged draft token t (1-based): alpha[j, t - 1]
        torch.testing.assert_close(torch.stack(scored), want[j, : G - 1], rtol=1e-4, atol=1e-5)


def test_pipeline_on_eagle3_chains_writes_a_layer_tied_to_the_head(tmp_path):
    head, _ = make_head()
    eagle_dir = save_hf_dir(head, head.cfg, tmp_path / "eagle3", TARGET)
    seqs = [make_sequence(head, seed=s) for s in range(8)]
    responses = [Response(s.ids[:P].tolist(), s.ids[P:].tolist(), "greedy") for s in seqs]
    by_prompt = {tuple(r.prompt_ids): s for r, s in zip(responses, seqs)}

    def chains_of(resp, starts, length):
        return eagle3_chains(head, by_prompt[tuple(resp.prompt_ids)], starts, length)

    cfg = TrainConfig(
        chain_length=G, window=4, num_heads=2, mlp_size=16, max_draft=G, epochs=1, batch_size=4, val_frac=0.3,
        cap=G, block_sizes=(1, 2), thresholds=(0.3, 0.6), growths=(1.0,),
    )  # fmt: skip
    out = tmp_path / "pacer.safetensors"
    report = train_on_chains(chains_of, "toy", eagle_dir, responses, out, cfg, drafter_method="eagle3")
    assert report["metrics"]["heldout"]["examples"] > 0 and report["replay"]["responses"] > 0
    meta = check_pacer(out, eagle_dir)
    assert meta["drafter_method"] == "eagle3" and meta["block_size"] in (1, 2)
    assert load_pacer(out)[0].cfg.hidden_size == head.cfg.hidden_size


@pytest.mark.parametrize("trained_for", ["eagle3", "draft_model"])
def test_a_layer_trained_for_one_drafter_is_refused_on_the_other(tmp_path, trained_for):
    head, _ = make_head()
    drafters = {
        "eagle3": save_hf_dir(head, head.cfg, tmp_path / "eagle3", TARGET),
        "draft_model": make_draft(tmp_path / "draft", hidden=head.cfg.hidden_size),
    }
    path = tmp_path / "pacer.safetensors"
    meta = {"draft": draft_identity(drafters[trained_for]), **RECOMMENDED}
    save_pacer(path, _layer(head.cfg.hidden_size), meta)
    check_pacer(path, drafters[trained_for])
    (other,) = set(drafters) - {trained_for}
    with pytest.raises(ConfigError) as err:
        check_pacer(path, drafters[other])
    msg = str(err.value)
    assert msg.startswith("adaptive_spec.head: ") and "the running draft is" in msg, msg
