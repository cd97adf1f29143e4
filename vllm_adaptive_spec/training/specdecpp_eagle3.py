"""SpecDec++ acceptance head for an EAGLE-3 drafter (seed 001, on the head's own chains).

A draft model can be labelled in one teacher-forced pass (`training.specdecpp`);
an EAGLE-3 head cannot: its k-th draft reads the state it produced at step
k-1, so what the stopping policy sees at step k exists only on a chain the
head drafted itself. So every example comes from such a chain. From each
response position the head drafts greedily (`heads.eagle3.draft_chains`, the
way vLLM drafts a round); the adaptive loop hands the policy, at step t, the
state that produced draft t (the one that consumed draft t-1), and the head
learns p_{t-1} = P(draft t-1 accepted | drafts before it accepted) from it.
Labels: 1 while the chain agrees with the target's response, the first
disagreement 0, nothing after it (the condition no longer holds).

The rest is SpecDec++'s: weighted BCE (w = 6), frozen drafter, and the
recommended threshold from an exact replay of greedy rounds on held-out
responses (exact: a greedy round at position i drafts exactly the chain from
i, so its states and p are the ones computed here).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from vllm_adaptive_spec.heads.eagle3 import draft_chains, load_hf_dir
from vllm_adaptive_spec.heads.fileformat import draft_identity
from vllm_adaptive_spec.heads.specdecpp import SpecDecHead, stop_lengths
from vllm_adaptive_spec.metrics import SpecCounts, replay_row
from vllm_adaptive_spec.training import data
from vllm_adaptive_spec.training.eagle3 import accepted_prefix, target_features
from vllm_adaptive_spec.training.specdecpp import TrainConfig, evaluate, fit_head, is_heldout, save_with_report

logger = logging.getLogger(__name__)


# -- chains (pure given the drafter) --


def chain_examples(states: torch.Tensor, runs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """states [C, K, H] (state t produced draft t), runs [C] agreeing drafts per chain ->
    (x [N, H], a [N]): for t = 1 .. min(run + 1, K - 1), state t labelled 1[draft t-1 agreed]."""
    k = states.shape[1]
    t = torch.arange(1, k)  # [K-1] the state index; it judges draft t-1
    use = t[None, :] <= runs[:, None] + 1  # [C, K-1] up to and including the first disagreement
    label = (t[None, :] - 1 < runs[:, None]).float()  # [C, K-1]
    return states[:, 1:][use], label[use]


def response_chains(
    drafter, target_lm, resp: data.Response, cap: int, layer_ids: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's chain from every round start of one response: (states [C, cap, H], runs [C]).
    Chain i (i = 0 .. len(response) - 2) drafts the response from its token i + 1 on."""
    seq = target_features(target_lm, resp, layer_ids)
    n, first = len(seq.ids), len(resp.prompt_ids)
    starts = torch.arange(first - 1, n - 2)  # c: the head drafts x_{c+2}, ...
    tokens, states = draft_chains(drafter, seq.ids[1:], seq.aux[: n - 1], starts, cap, with_states=True)
    where = (starts[:, None] + 2 + torch.arange(cap)[None, :]).clamp_max(n - 1)
    return states, accepted_prefix(tokens, seq.ids[where], n - 2 - starts)


# -- greedy replay for the threshold --


def replay_lengths(runs: list[torch.Tensor], lengths: list[torch.Tensor], k: int) -> SpecCounts:
    """Greedy speculative decoding over each response: runs [C] agreeing drafts and lengths [C]
    the round length of the chain from every round start (cap k). Token 0 comes from the prefill;
    a round at token i drafts the chain from i, never past the response's end."""
    total = SpecCounts(accepted_per_pos=[0] * k)
    for run, length in zip(runs, lengths):
        n = len(run) + 1  # generated tokens
        counts = SpecCounts(n_gen=1, n_target=1, accepted_per_pos=[0] * k)  # the prefill pass: token 0
        counts.accepted_hist[0] = 1
        run_, length_ = run.tolist(), length.tolist()
        i = 1
        while i < n:
            cap = min(int(length_[i - 1]), n - i - 1)
            accepted = min(int(run_[i - 1]), cap)
            counts.record_step(cap, accepted)
            i += accepted + 1
        total.add(counts)
    return total


def replay(head: SpecDecHead, chains: list[tuple[torch.Tensor, torch.Tensor]], k: int, threshold: float | None):
    """Rounds of the SpecDec++ rule (threshold None: fixed K) over each response's chains."""
    lengths = []
    for states, runs in chains:
        if threshold is None:
            lengths.append(torch.full((len(runs),), k))
            continue
        with torch.no_grad():
            p = torch.sigmoid(head(states[:, 1:k]))  # [C, K-1] p_0 .. p_{K-2}
        lengths.append(stop_lengths(torch.cat([p, torch.ones_like(p[:, :1])], 1), threshold))  # [C]
    return replay_lengths([runs for _, runs in chains], lengths, k)


def train_specdecpp_eagle3(
    target: str | Path,
    drafter: str | Path,
    responses: list[data.Response],
    out: str | Path,
    cfg: TrainConfig,
    extra_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Chains, training, evaluation, threshold by replay; saves the head. Returns the report."""
    from tqdm import tqdm

    started = time.perf_counter()
    target_lm = data.load_causal_lm(target)
    eagle, eagle_cfg = load_hf_dir(drafter, target_lm.get_input_embeddings().weight)
    responses = [r for r in responses if r.mode == "greedy" and len(r.response_ids) > 2]
    chains = [
        response_chains(eagle, target_lm, r, cfg.cap, eagle_cfg.aux_layer_ids)
        for r in tqdm(responses, desc="drafter chains")
    ]
    held = [is_heldout(r, cfg.val_frac) for r in responses]
    split = {}
    for name, side in (("train", False), ("heldout", True)):
        pairs = [chain_examples(s, r) for (s, r), h in zip(chains, held) if h == side]
        split[name] = (torch.cat([x for x, _ in pairs]), torch.cat([a for _, a in pairs]))
    labelled = time.perf_counter()
    head, history = fit_head(*split["train"], cfg)
    trained = time.perf_counter()
    prior = float(split["train"][1].mean())
    metrics = {name: evaluate(head, x, a, cfg.weight, prior) for name, (x, a) in split.items()}
    replayed = [c for c, h in zip(chains, held) if h][: cfg.replay_responses]
    c = cfg.cost_ratio
    fixed = [replay_row({"fixed_k": k}, replay(head, replayed, k, None), c) for k in range(1, cfg.cap + 1)]
    sweep = [replay_row({"threshold": t}, replay(head, replayed, cfg.cap, t), c) for t in cfg.thresholds]
    best = max(sweep, key=lambda row: row["speedup"])
    meta = {
        "draft": draft_identity(drafter),
        "drafter_method": "eagle3",
        "recommended_threshold": best["threshold"],
        "threshold_choice": (
            f"maximises modeled speedup S(c={c}) at cap K={cfg.cap} in an exact greedy replay of "
            f"{len(replayed)} held-out responses"
        ),
        "training_data": {
            "target": Path(str(target)).name,
            "label_mode": "greedy chains of the drafter",
            **data.summarize(responses),
            "train_examples": len(split["train"][1]),
            "heldout_examples": len(split["heldout"][1]),
            "bce_weight": cfg.weight,
            **(extra_meta or {}),
        },
    }
    seconds = {
        "chains": round(labelled - started, 1),
        "train": round(trained - labelled, 1),
        "replay": round(time.perf_counter() - trained, 1),
    }
    replay_summary = {"responses": len(replayed), "fixed": fixed, "thresholds": sweep, "best": best}
    report = save_with_report(out, head, cfg, meta, history, metrics, replay_summary, seconds)
    logger.info("head saved to %s: %s", out, json.dumps(report["meta"]["metrics"]))
    return report
