"""SpecDec++ on an EAGLE-3 drafter's own chains: examples and the exact greedy replay."""

from __future__ import annotations

import torch

from vllm_adaptive_spec.heads.specdecpp import SpecDecHead, SpecDecHeadConfig
from vllm_adaptive_spec.metrics import simulate_greedy
from vllm_adaptive_spec.training.specdecpp_eagle3 import chain_examples, replay


def test_chain_examples_label_up_to_the_first_disagreement():
    states = torch.arange(2 * 4, dtype=torch.float32).view(2, 4, 1)  # state t of chain c = 4c + t
    x, a = chain_examples(states, torch.tensor([1, 3]))
    # chain 0 agreed once: state 1 judges draft 0 (agreed), state 2 judges draft 1 (the miss)
    # chain 1 agreed 3 times: states 1-3 judge drafts 0-2, all agreed (no state judges draft 3)
    assert x.squeeze(-1).tolist() == [1.0, 2.0, 5.0, 6.0, 7.0]
    assert a.tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]


def test_fixed_replay_equals_the_metrics_replay():
    runs = torch.tensor([2, 1, 0, 4, 3, 2, 1, 0, 0])  # chain from tokens 1..9 of a 10-token response
    states = torch.zeros(len(runs), 4, 8)
    head = SpecDecHead(SpecDecHeadConfig(8, 1))
    got = replay(head, [(states, runs)], 4, None)
    want = simulate_greedy([r > 0 for r in [0, *runs.tolist()]], 4, runs=[0, *runs.tolist()])
    assert (got.n_gen, got.n_target, got.n_draft, got.n_accepted) == (
        want.n_gen,
        want.n_target,
        want.n_draft,
        want.n_accepted,
    )


def test_threshold_replay_stops_where_the_head_is_unsure():
    runs = torch.tensor([3, 2, 1, 0, 3, 2, 1, 0])
    head = SpecDecHead(SpecDecHeadConfig(8, 1))
    torch.nn.init.zeros_(head.out.weight)
    torch.nn.init.constant_(head.out.bias, -5.0)  # p ~ 0.007: stop after one draft
    counts = replay(head, [(torch.zeros(len(runs), 4, 8), runs)], 4, 0.5)
    assert counts.n_draft == counts.n_target - 1  # one draft per round after the prefill
