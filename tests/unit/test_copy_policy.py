"""The copy rule: drafting goes on while a draft repeats its request's context or is confident."""

import math

import pytest
import torch

from vllm_adaptive_spec.config import AdaptiveSpecConfig, ConfigError
from vllm_adaptive_spec.policies.copy import CopyPolicy

V = 8


def _logp(q: list[float], tokens: list[int]) -> torch.Tensor:
    """[B, V] log-probabilities where row i gives tokens[i] probability q[i] (the rest spread evenly)."""
    rows = []
    for p, y in zip(q, tokens):
        row = torch.full((V,), (1 - p) / (V - 1))
        row[y] = p
        rows.append(row.log())
    return torch.stack(rows)


def test_stops_after_a_draft_that_neither_repeats_the_context_nor_is_confident():
    pol = CopyPolicy(threshold=0.7)
    pol.observe_tokens(["a", "b"], [[1, 2, 3, 1, 2], [5, 6]])  # a: (1, 2) was followed by 3
    assert pol.tokens_seen("a") == 5 and pol.tokens_seen("b") == 2
    assert pol.round_limits(["a", "b"], 4) == [4, 4]
    # step 0: a draws 3 after (1, 2): a repeat, though unsure; b draws 7 after (5, 6): new and unsure
    d = pol.decide(_logp([0.3, 0.3], [3, 7]), torch.tensor([3, 7]), 0)
    assert d.keep.tolist() == [True, True] and d.stop.tolist() == [False, True]
    # step 1: a's key is now (2, 3), followed by 1 in its context; a confident new token goes on too
    d = pol.decide(_logp([0.2, 0.9], [1, 0]), torch.tensor([1, 0]), 1)
    assert d.stop.tolist() == [False, False]
    # step 2: a's key (3, 1): 2 repeats; 4 does not
    assert pol.decide(_logp([0.2, 0.2], [2, 4]), torch.tensor([2, 4]), 2).stop.tolist() == [False, True]


def test_the_round_starts_from_the_context_and_this_steps_tokens_extend_it():
    pol = CopyPolicy(threshold=0.5)
    pol.observe_tokens(["r"], [[4, 5, 6]])
    pol.round_limits(["r"], 2)
    assert pol.decide(_logp([0.1], [7]), torch.tensor([7]), 0).stop.tolist() == [True]  # (5, 6) -> 7 unseen
    pol.observe_tokens(["r"], [[4, 5]])  # the step's verified tokens: context 4 5 6 4 5
    pol.round_limits(["r"], 2)
    assert pol.decide(_logp([0.1], [6]), torch.tensor([6]), 0).stop.tolist() == [False]  # (4, 5) -> 6 seen
    assert pol.tokens_seen("r") == 5 and pol.num_tracked() == 1
    pol.forget("r")
    assert pol.num_tracked() == 0 and pol.tokens_seen("r") == 0


def test_unknown_rows_and_bad_rows():
    pol = CopyPolicy()
    pol.round_limits(["new"], 2)  # nothing read yet: no repeat possible
    d = pol.decide(_logp([0.5], [1]), torch.tensor([1]), 0)
    assert d.keep.tolist() == [True] and d.stop.tolist() == [True]
    nan = torch.full((1, V), math.nan)
    d = pol.decide(nan, torch.tensor([1]), 1)
    assert d.keep.tolist() == [False]  # a NaN row drops its token (and so stops)


def test_threshold_zero_never_stops_and_config():
    pol = CopyPolicy(threshold=0.0)
    pol.observe_tokens(["r"], [[1, 2, 3]])
    pol.round_limits(["r"], 4)
    assert pol.decide(_logp([0.99], [5]), torch.tensor([5]), 0).stop.tolist() == [False]  # never stops
    assert AdaptiveSpecConfig.from_dict({"policy": "copy", "threshold": 0.6}).build_policy().threshold == 0.6
    assert AdaptiveSpecConfig.from_dict({"policy": "copy"}).batch_aware  # an adaptive policy: the gate is on
    with pytest.raises(ConfigError, match="adaptive_spec.threshold"):
        AdaptiveSpecConfig.from_dict({"policy": "copy", "threshold": 1.5})


def test_the_replay_reads_the_same_repeats_as_the_policy():
    """benchmarks.copy_signal scores the rule offline: its repeat feature must be the policy's."""
    from benchmarks.copy_signal import repeats

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (60,), generator=g).tolist()  # a small vocabulary: many repeats, many not
    starts = list(range(10, 50, 3))  # round bonus tokens
    drafts = [torch.randint(0, 5, (6,), generator=g).tolist() for _ in starts]
    want = repeats(ids, [(ids[s - 1], ids[s]) for s in starts], drafts, starts)
    for row, (s, chain) in enumerate(zip(starts, drafts)):
        pol = CopyPolicy(threshold=1.0)  # stops exactly where a draft repeats nothing
        pol.observe_tokens(["r"], [ids[: s + 1]])
        pol.round_limits(["r"], 6)
        got = [not pol.decide(_logp([0.5], [y]), torch.tensor([y]), t).stop.item() for t, y in enumerate(chain)]
        assert got == want[row].tolist(), (s, chain)
    assert 0 < want.float().mean() < 1


def test_the_gate_sees_a_repeated_draft_as_a_sure_one():
    from vllm_adaptive_spec.policies.base import StopPolicy
    from vllm_adaptive_spec.policies.copy import REPEAT_LOG_Q

    pol = CopyPolicy(threshold=0.7)
    pol.observe_tokens(["a", "b", "c"], [[1, 2, 3, 1, 2], [1, 2, 3, 1, 2], [5, 6]])
    pol.round_limits(["a", "b", "c"], 4)
    q = [0.1, 0.1, 0.1]
    pol.decide(_logp(q, [3, 4, 3]), torch.tensor([3, 4, 3]), 0)  # a repeats; b and c do not
    top = torch.tensor([math.log(0.1), math.log(0.1), math.log(0.99)])
    got = pol.gate_top(top)
    assert got.tolist() == pytest.approx([REPEAT_LOG_Q, math.log(0.1), math.log(0.99)])
    assert torch.equal(StopPolicy().gate_top(top), top)  # other policies: q alone
