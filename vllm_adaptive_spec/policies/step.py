"""What the draft loop does around a policy at every draft step: host-free tensor functions.

The loop (integration.proposer) and the GPU cost benchmark (benchmarks.gpu_costs) both run these,
so a benchmark without vLLM times the loop's own per-step work.
"""

from __future__ import annotations

import torch

GREEDY_EPS = 1e-5  # temperatures below this are greedy requests (as in vLLM's sampler)


def policy_logprobs(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """log q_t: the draft's log-distribution after each request's temperature.

    logits: [B, V]; temperature: [B] or None (all greedy) -> [B, V] float32.
    Greedy requests use the raw logits (ALGORITHMS.md).
    """
    if temperature is None:  # one pass: the cast happens inside the softmax (same values as .float() first)
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    temp = torch.where(temperature < GREEDY_EPS, torch.ones_like(temperature), temperature)
    return torch.log_softmax(logits.float() / temp.float().unsqueeze(-1), dim=-1)


def decisions_to_host(
    keep: torch.Tensor, stop: torch.Tensor, top: torch.Tensor | None, tokens: torch.Tensor | None = None
) -> tuple[list[bool], list[bool], list[float] | None, list[int] | None]:
    """One host copy of a step's decisions: keep, stop [B] bool, the gate's top [B] (or None) and, when
    the loop needs them (the grammar stop), the step's draft tokens [B] (or None) -> the same as lists.
    On a GPU this is the step's one synchronisation (ending the loop early needs it)."""
    if tokens is not None:  # float64 holds token ids and a float32 top exactly
        rows = [keep, stop, tokens] + ([] if top is None else [top])
        host = torch.stack([r.to(torch.float64) for r in rows]).tolist()
        keeps, stops, toks = [k > 0.5 for k in host[0]], [s > 0.5 for s in host[1]], [int(x) for x in host[2]]
        return keeps, stops, (host[3] if top is not None else None), toks
    if top is None:
        keeps, stops = torch.stack([keep, stop]).tolist()
        return keeps, stops, None, None
    keeps, stops, tops = torch.stack([keep.to(top.dtype), stop.to(top.dtype), top]).tolist()
    return [k > 0.5 for k in keeps], [s > 0.5 for s in stops], tops, None


def rows_to_compute(computed: int, drafting: int) -> int:
    """compact_drafts: how many rows the next draft forward computes, when `computed` rows ran the last
    one and `drafting` of them still draft. The batch shrinks to the drafting rows once they are at most
    half of it: each shrink costs new attention metadata and a few gathers, and a draft forward's cost
    grows slowly with its rows (on the 2-core CPU 0.47 ms for 1 row, 0.57 for 4, 0.93 for 32), so
    dropping a row or two would not pay for it."""
    return drafting if 0 < drafting and 2 * drafting <= computed else computed
