"""Pacer pre-verifier for an EAGLE-3 drafter (seed 000, on the head's own chains).

Only the chains differ from the draft model's pipeline (`training.pacer`,
which packs, trains, evaluates, replays and saves them): an EAGLE-3 head's
k-th draft reads the state it produced at step k-1, so, as for the SpecDec++
head (`training.specdecpp_eagle3`), the chains are the head's own greedy
rounds (`heads.eagle3.draft_chains`), on the target's features
(`training.eagle3.target_features`).

What the `pacer` policy receives in vLLM's draft loop on eagle3
(`integration/proposer.py`), and so what it is trained on:
- context (`observe_context`): the first pass's output rows for the verified
  tokens, the normed state the head's logits come from. The first-pass row at
  sequence position p reads token x_{p+1} and the target's fused feature at p
  (vLLM shifts the input ids one to the left). Every position gets its row in
  the round after x_{p+1} is verified, and that row's attention reads only
  rows of earlier first passes (draft steps write past the verified tokens,
  and the next first pass overwrites them), so the rows are one teacher-forced
  head pass over prompt + response: `Eagle3Head.decode` over the whole sequence.
- drafts (`decide(..., hidden)` at step t): the state that produced draft t,
  i.e. the one that consumed draft t-1: state t of `draft_chains(...,
  with_states=True)`. The policy files it under draft token t (1-based), so
  chain token i (1-based) gets state i: a chain of G tokens takes G + 1 steps.

Bookkeeping: the chain at response position j (its first draft is y_j, the
token at sequence position P + j) is the round whose first pass ends at row
c = P + j - 2, the row that reads the last verified token; it sees context
rows 0..c, i.e. P + j - 1 of them (`Chains.offset` = P - 1). The engine's
first round after the prefill is j = 1 (row P - 1 reads y_0); j = 0 (row P - 2
reads the last prompt token) never runs in the engine but is a sound example.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from vllm_adaptive_spec.heads.eagle3 import Eagle3Head, draft_chains, load_hf_dir
from vllm_adaptive_spec.training import data
from vllm_adaptive_spec.training.eagle3 import Sequence, target_features
from vllm_adaptive_spec.training.pacer import Chains, TrainConfig, chain_labels, train_on_chains

logger = logging.getLogger(__name__)


@torch.no_grad()
def first_pass_rows(head: Eagle3Head, seq: Sequence) -> torch.Tensor:
    """The rows vLLM's first passes give the policy, over the whole sequence: [L - 1, H], row q
    reading x_{q+1} and the target's feature at q (the last token is read by row L - 2)."""
    n = len(seq.ids)
    normed, _, _ = head.decode(seq.ids[None, 1:], head.fuse(seq.aux[None, : n - 1]), torch.arange(n - 1)[None])
    return normed[0]


@torch.no_grad()
def eagle3_chains(head: Eagle3Head, seq: Sequence, starts: list[int], length: int) -> Chains:
    """The head's greedy chains of `length` tokens from response positions `starts` (pure given the head)."""
    n, p = len(seq.ids), seq.prompt_len
    if p < 2:
        raise ValueError(f"an EAGLE-3 chain at response position 0 needs a prompt of 2 tokens or more, got {p}")
    j = torch.tensor(starts, dtype=torch.long)  # [C]
    tokens, states = draft_chains(head, seq.ids[1:], seq.aux[: n - 1], p - 2 + j, length + 1, with_states=True)
    label, valid = chain_labels(tokens[:, :length], j, seq.ids[p:])  # [C, G] each
    return Chains(
        context=first_pass_rows(head, seq),
        offset=p - 1,
        starts=j,
        hidden=states[:, 1:].contiguous(),  # [C, G, H] state i consumed chain token i (1-based)
        label=label,
        valid=valid,
    )


def train_pacer_eagle3(
    target: str | Path,
    drafter: str | Path,
    responses: list[data.Response],
    out: str | Path | None,
    cfg: TrainConfig,
    extra_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`training.pacer`'s pipeline on the EAGLE-3 head's chains; the layer is tied to the head directory."""
    target_lm = data.load_causal_lm(target)
    head, head_cfg = load_hf_dir(drafter, target_lm.get_input_embeddings().weight)

    def chains_of(resp: data.Response, starts: list[int], length: int) -> Chains:
        return eagle3_chains(head, target_features(target_lm, resp, head_cfg.aux_layer_ids), starts, length)

    usable = [r for r in responses if len(r.prompt_ids) >= 2]
    if len(usable) < len(responses):
        logger.info("skipped %d responses with a one-token prompt", len(responses) - len(usable))
    return train_on_chains(chains_of, target, drafter, usable, out, cfg, extra_meta, drafter_method="eagle3")
