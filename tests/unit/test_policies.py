"""Stopping policies on hand-made distributions."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_adaptive_spec.policies import POLICY_CLASSES, entropy
from vllm_adaptive_spec.policies.adaedl import AdaEdlPolicy
from vllm_adaptive_spec.policies.base import StopPolicy
from vllm_adaptive_spec.policies.confidence import ConfidencePolicy
from vllm_adaptive_spec.policies.heuristic import HeuristicPolicy
from vllm_adaptive_spec.policies.svip import SvipPolicy

V = 8
PEAKED = torch.tensor([0.97] + [0.03 / (V - 1)] * (V - 1))  # H ~ 0.16 nats
FLAT = torch.full((V,), 1.0 / V)  # H = log 8 ~ 2.08 nats


def batch(*rows):
    return torch.log(torch.stack(rows))  # [B, V] log-probabilities


def stops(d) -> list[bool]:
    """The rows a decision ends, as the loop reads it: not kept, or kept and told to stop."""
    return (~d.keep | d.stop).tolist()


def test_masked_tokens_are_fine():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.0, 0.0]]))  # -inf for masked tokens
    assert entropy(logp).item() == pytest.approx(math.log(2))
    d = SvipPolicy(threshold=1.0).decide(logp, torch.tensor([0]), t=0)
    assert d.keep.tolist() == [True] and d.stop.tolist() == [False]


def test_entropy():
    assert entropy(batch(FLAT)).item() == pytest.approx(math.log(V))
    assert entropy(batch(torch.eye(V)[0])).item() == pytest.approx(0.0, abs=1e-6)


def test_svip_keeps_token_and_stops_when_uncertain():
    d = SvipPolicy(threshold=0.3).decide(batch(PEAKED, FLAT), torch.tensor([0, 0]), t=0)
    assert d.keep.tolist() == [True, True]
    assert d.stop.tolist() == [False, True]


def test_confidence_uses_sampled_token_probability():
    d = ConfidencePolicy(0.4).decide(batch(PEAKED, PEAKED), torch.tensor([0, 3]), t=0)
    assert d.keep.tolist() == [True, True]
    assert d.stop.tolist() == [False, True]


def test_adaedl_drops_uncertain_token_and_adapts_lambda():
    p = AdaEdlPolicy(lam=0.5)
    p.round_limits(["a", "b"], cap=8)
    d = p.decide(batch(PEAKED, FLAT), torch.tensor([0, 0]), t=0)
    assert d.keep.tolist() == [True, False]
    assert stops(d) == [False, True]
    p.end_round(["a"], drafted=[4], accepted=[0])  # AR falls below 0.9 -> lam rises
    assert p._state["a"][0] > 0.5
    p.forget("a")
    assert p.num_tracked() == 0


def test_heuristic_schedule():
    p = HeuristicPolicy(initial=4)
    assert p.round_limits(["r"], cap=16) == [4]
    p.end_round(["r"], [4], [4])
    assert p.round_limits(["r"], cap=16) == [6]
    p.end_round(["r"], [6], [2])
    assert p.round_limits(["r"], cap=5) == [5]
    p.end_round(["r"], [5], [0])
    p.end_round(["r"], [4], [0])
    assert p.round_limits(["r"], cap=16) == [3]
    p.forget("r")
    assert p.num_tracked() == 0


@pytest.mark.parametrize("name", sorted(POLICY_CLASSES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_and_inf_logits_stop_without_crashing(name, bad):
    from benchmarks.harness.plan import SPECDECPP_HEAD
    from vllm_adaptive_spec.policies.step import policy_logprobs

    heads = {"specdecpp": SPECDECPP_HEAD, "pacer": SPECDECPP_HEAD.with_name("pacer.safetensors")}
    p = POLICY_CLASSES[name](**({"head": str(heads[name])} if name in heads else {}))
    p.round_limits(["a", "b"], cap=4)
    logits = torch.stack([torch.log(PEAKED), torch.full((V,), bad)])  # [2, V]
    hidden = torch.zeros(2, 256)  # [2, H] the toy draft's hidden size
    d = p.decide(policy_logprobs(logits, None), torch.tensor([0, 0]), t=0, hidden=hidden)
    assert not d.keep[1]  # not kept: the loop stops the row whatever stop says (test_a_row_not_kept_stops)
    assert d.keep[0] and (not d.stop[0] or name in ("svip", "adaedl"))  # the healthy row is untouched


def test_a_row_not_kept_stops():
    """The contract the policies rely on (base.StopPolicy): a row whose y_t is not kept stops, even with
    stop False; a kept row stops only when it says so or reaches its limit."""
    from vllm_adaptive_spec.integration.proposer import _account

    active, lengths, drawn = [True, True, True, True], [0, 0, 0, 0], [0, 0, 0, 0]
    kept = _account(0, [False, True, True, True], [False, False, True, False], [8, 8, 8, 1], active, lengths, drawn)
    assert kept == [False, True, True, True]
    assert active == [False, True, False, False] and lengths == [0, 1, 1, 1] and drawn == [1, 1, 1, 1]


def test_a_row_below_the_floor_keeps_its_token_and_goes_on():
    """adaptive_spec.min_drafts: below the floor a row keeps y_t and drafts on whatever its policy said
    (more drafts stay lossless), never past its limit; at the floor the policy decides again."""
    from vllm_adaptive_spec.integration.proposer import _account

    active, lengths, drawn = [True, True, True], [0, 0, 0], [0, 0, 0]
    kept = _account(0, [False, True, True], [True, True, False], [8, 8, 1], active, lengths, drawn, floor=2)
    assert kept == [True, True, True] and active == [True, True, False] and lengths == [1, 1, 1]
    kept = _account(1, [False, True, True], [True, True, True], [8, 8, 1], active, lengths, drawn, floor=2)
    assert kept == [True, True, False] and active == [False, False, False] and lengths == [2, 2, 1]
    active, lengths = [True], [2]
    assert _account(2, [False], [False], [8], active, lengths, [2], floor=2) == [False] and active == [False]


def test_no_stop_is_one_cached_all_false_tensor_per_size():
    """The stop of policies whose rows stop exactly when they drop y_t: all False, built once per batch size
    (not one op per step), never modified by the loop (it copies decisions to the host)."""
    p = StopPolicy()
    a, b = p.no_stop(torch.ones(3, dtype=torch.bool)), p.no_stop(torch.zeros(3, dtype=torch.bool))
    assert a is b and a.tolist() == [False] * 3 and a.dtype == torch.bool
    assert p.no_stop(torch.ones(2, dtype=torch.bool)).tolist() == [False, False]
    assert StopPolicy().no_stop(torch.ones(3, dtype=torch.bool)) is not a  # per policy object


def _old_svip(logp, max_entropy):
    """svip's decisions as written before the rewrite of its ops (H from exp, two negations)."""
    h = -torch.linalg.vecdot(logp.exp(), logp.clamp_min(torch.finfo(logp.dtype).min))
    return ~torch.isnan(h), ~(h <= max_entropy)


def test_fewer_ops_same_decisions():
    """Regression for the cheaper svip, confidence and AdaEDL decide (softmax instead of exp, one
    comparison each): the same keep for every row and the same stop for every kept row as the
    formulas they replace, on random rows, masked tokens and bad rows."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * torch.rand(64, 1, generator=g) * 6  # [B, V] from flat to peaked
    logits[:8, 25:] = float("-inf")  # masked tokens
    logits[8] = float("nan")
    logits[9, 3] = float("inf")
    logp = torch.log_softmax(logits, -1)
    tokens = torch.randint(0, 25, (64,), generator=g)
    for threshold in (0.1, 0.3, 0.5):
        d = SvipPolicy(threshold=threshold).decide(logp, tokens, t=0)
        keep, stop = _old_svip(logp, threshold**2 / 0.15)
        assert torch.equal(d.keep, keep) and torch.equal(d.stop[keep], stop[keep])
        assert 0 < int(d.stop[keep].sum()) < int(keep.sum())  # both decisions occur
    for threshold in (0.2, 0.4, 0.8):
        d = ConfidencePolicy(threshold).decide(logp, tokens, t=0)
        logq = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        keep = ~torch.isnan(logq)
        assert torch.equal(d.keep, keep) and torch.equal(d.stop[keep], ~(logq >= math.log(threshold))[keep])
    p = AdaEdlPolicy(lam=0.5)
    p.round_limits([str(i) for i in range(64)], cap=8)
    keep = ~(~(entropy(logp) <= (1 - 0.5) ** 2 / p.gamma))  # the old rule: H <= (1 - lam)^2 / gamma
    assert torch.equal(p.decide(logp, tokens, t=0).keep, keep)


def test_policy_logprobs_greedy_fast_path_equals_casting_first():
    """Greedy batches take log_softmax(dtype=float32) in one pass: the same values as casting the
    bf16 logits to float32 first; sampled batches divide by each row's temperature."""
    from vllm_adaptive_spec.policies.step import policy_logprobs

    logits = (torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 5).bfloat16()  # [B, V]
    assert torch.equal(policy_logprobs(logits, None), torch.log_softmax(logits.float(), -1))
    temps = torch.tensor([1.0, 0.5, 0.0, 2.0])  # 0: a greedy row in a sampled batch (raw logits)
    want = torch.log_softmax(logits.float() / torch.tensor([1.0, 0.5, 1.0, 2.0]).unsqueeze(-1), -1)
    assert torch.allclose(policy_logprobs(logits, temps), want)


def test_float32_argmax_draws_the_same_tokens_as_bfloat16():
    """The loop's greedy draw casts the logits to float32 first (cheaper on CPU, and the policy
    reads float32): the cast is exact and argmax keeps the first maximum, even among many ties."""
    torch.manual_seed(0)
    for scale in (0.01, 1.0, 5.0):
        logits = (torch.randn(32, 6144) * scale).round(decimals=1).bfloat16()  # [B, V]
        logits[::4, ::3] = logits.max()  # exact ties in every fourth row
        assert torch.equal(logits.argmax(dim=-1), logits.float().argmax(dim=-1))


def test_row_graphs_bucket_pad_and_fall_back():
    """heads.cuda_graph.RowGraphs on CPU with an eager stand-in for the capture: one capture per
    power-of-two bucket of rows, each call's rows in front of stale padding, the outputs cut to the
    call's rows; a failed capture runs the head eagerly from then on."""
    from vllm_adaptive_spec.heads.cuda_graph import RowGraphs

    captured = []

    def fake_capture(fn, device):
        captured.append(fn)
        return fn

    weight = torch.randn(4, 1)

    def head(x):
        return (x @ weight).squeeze(-1)

    rows = RowGraphs(head, 4, torch.float32, torch.device("cpu"), capture=fake_capture)
    for b in (3, 4, 1, 2, 3, 5):
        x = torch.randn(b, 4)
        assert torch.allclose(rows(x), head(x))
    assert len(captured) == 4  # buckets 4, 1, 2, 8

    def broken_capture(fn, device):
        raise RuntimeError("capture refused")

    rows = RowGraphs(head, 4, torch.float32, torch.device("cpu"), capture=broken_capture)
    x = torch.randn(3, 4)
    assert torch.allclose(rows(x), head(x)) and rows.eager
    assert torch.allclose(rows(x[:2]), head(x[:2]))


def test_decisions_to_host_carries_the_steps_tokens_in_the_same_copy():
    from vllm_adaptive_spec.policies.step import decisions_to_host

    keep, stop = torch.tensor([True, False, True]), torch.tensor([False, True, True])
    tokens = torch.tensor([151_935, 0, 7])  # a large vocabulary's last id stays exact
    top = torch.tensor([-0.1, -2.5, -0.7], dtype=torch.float32)
    assert decisions_to_host(keep, stop, None) == ([True, False, True], [False, True, True], None, None)
    assert decisions_to_host(keep, stop, top)[2] == top.tolist()
    assert decisions_to_host(keep, stop, None, tokens) == (
        [True, False, True],
        [False, True, True],
        None,
        tokens.tolist(),
    )
    keeps, stops, tops, toks = decisions_to_host(keep, stop, top, tokens)
    assert (keeps, stops, tops, toks) == ([True, False, True], [False, True, True], top.tolist(), tokens.tolist())
