"""Thresholds of the training-free policies for a drafter, chosen on training responses.

SVIP's h = 0.3 and the confidence rule's 0.4 are their papers' settings for
their drafters; how sure a head is when it is right depends on the head, and
how long a draft pays depends on the cost ratio c of the deployment. This
picks each policy's threshold for one head and one c the way the trained
heads pick theirs: an exact replay of greedy speculative decoding on held-out
*training* responses (the split `training.specdecpp.is_heldout` keeps out of
every head's training; never the prompts a benchmark reports).

Exact for greedy: a round at response token i drafts exactly the head's own
chain from i (`specdecpp_eagle3.response_chains`, the way vLLM drafts a
round), and both rules read only that step's distribution q_t: svip stops
after y_t once its entropy H(q_t) > h^2 / c_e, confidence once
q_t(y_t) = max q_t < threshold (y_t is the greedy token). Neither ever drops
a draft, so a round drafts up to and including its first stop. The replay
charges no policy time (the harness measures that inside the engine).

A DFlash block drafter (`drafter="dflash"`) drafts a round's whole block in
one forward from the target's features, so the block at every round start is
exact too (`block_features`: position t's distribution never depends on the
drafts before it), and a cut saves verification, never draft work: each round
is charged one draft forward whatever its length. At one c a pass costs the
same whatever it verifies, so no cut beats the full block there; a block
drafter's threshold is chosen on a cost file (`costs`), whose `draft_step_ms`
then prices the block's forward.

An independent draft model (`drafter="draft_model"`) is read teacher-forced,
one forward per response (`draft_model_features`): while its chain agrees
with the target its inputs are the target's tokens, so the runs and every
decision up to a round's first rejected draft are exact; past it the real
draft reads its own token, and the replay takes the round's remaining
decisions from the teacher-forced distributions instead. That moves no
accepted count, only how many wasted drafts a round that goes on past its
first rejection is charged.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from vllm_adaptive_spec.heads import dflash, eagle3
from vllm_adaptive_spec.heads.fileformat import draft_identity, project_commit
from vllm_adaptive_spec.metrics import SpecCounts, modeled_speedup, priced_speedup, replay_row
from vllm_adaptive_spec.policies.base import entropy
from vllm_adaptive_spec.policies.costs import StepCosts, load_costs
from vllm_adaptive_spec.training import data
from vllm_adaptive_spec.training.eagle3 import Sequence, accepted_prefix, target_features
from vllm_adaptive_spec.training.specdecpp import is_heldout
from vllm_adaptive_spec.training.specdecpp_eagle3 import replay_lengths, response_chains

logger = logging.getLogger(__name__)

SVIP_ENTROPY_SCALE = 0.15  # c_e, the policy's default (policies/svip.py)
# what `drafter` directories tune reads: EAGLE-3 heads, DFlash block drafters, independent draft models
DRAFTERS = ("eagle3", "dflash", "draft_model")


@dataclass
class TuneConfig:
    drafter: str = "eagle3"  # one of DRAFTERS
    cap: int = 16  # K: the longest round (a block drafter: at most its block)
    cost_ratio: float = 4.0  # c = t_T / t_D the threshold is chosen for
    costs: str | None = None  # a cost file (policies/costs.py): price passes by length on its batch-1 curves
    val_frac: float = 0.1  # the held-out share of the training prompts (the heads' split)
    replay_responses: int = 200  # held-out training responses replayed (0: all)
    svip: tuple[float, ...] = tuple(round(0.1 * i, 2) for i in range(1, 13))  # h
    confidence: tuple[float, ...] = tuple(round(0.05 * i, 2) for i in range(1, 19))


@dataclass
class ChainFeatures:
    """One response's chains as the two rules see them."""

    runs: torch.Tensor  # [C] agreeing drafts of the chain from each round start
    entropy: torch.Tensor  # [C, cap] H(q_t) in nats
    q_max: torch.Tensor  # [C, cap] max q_t (the greedy draft's probability)


@torch.no_grad()
def chain_features(head: eagle3.Eagle3Head, states: torch.Tensor, runs: torch.Tensor) -> ChainFeatures:
    """states [C, cap, H] (the normed state each draft's logits come from), runs [C]."""
    return _features(head.logits(states), runs)


def _features(logits: torch.Tensor, runs: torch.Tensor) -> ChainFeatures:
    """logits [C, cap, V], runs [C] -> what the rules read."""
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [C, cap, V]
    return ChainFeatures(runs=runs, entropy=entropy(logp), q_max=logp.amax(-1).exp())


@torch.no_grad()
def block_features(drafter: dflash.DFlashDrafter, seq: Sequence, cap: int) -> ChainFeatures:
    """A block drafter's first `cap` block positions at every round start of one response. Block j is
    drafted where the target has just emitted response token j (anchor P + j), as vLLM drafts that round;
    it predicts response tokens j + 1 .., like chain j of `response_chains`."""
    ids, n = seq.ids, len(seq.ids)
    anchors = torch.arange(seq.prompt_len, n - 1)  # [C]
    logits = drafter.logits(drafter(seq.aux[None], anchors[None], ids[anchors][None])[0][:, :cap])  # [C, cap, V]
    where = (anchors[:, None] + 1 + torch.arange(cap)[None, :]).clamp_max(n - 1)  # [C, cap]
    runs = accepted_prefix(logits.argmax(-1), ids[where], n - 1 - anchors)  # [C]
    return _features(logits, runs)


def stop_lengths(stop_after: torch.Tensor) -> torch.Tensor:
    """stop_after [C, K] bool (the rule stops after step t) -> round lengths [C] in 1..K."""
    last = torch.ones_like(stop_after[:, :1])
    return torch.cat([stop_after[:, :-1], last], 1).int().argmax(-1) + 1


def rule_lengths(policy: str, threshold: float, f: ChainFeatures) -> torch.Tensor:
    """The round length [C] `policy` at `threshold` gives every chain."""
    if policy == "svip":
        return stop_lengths(f.entropy > threshold**2 / SVIP_ENTROPY_SCALE)
    if policy == "confidence":
        return stop_lengths(f.q_max < threshold)
    raise ValueError(f"no replay for policy {policy!r}")


@functools.cache
def batch1_prices(costs: str, cap: int) -> tuple[list[float], float]:
    """(verify_ms per token count 0..cap + 1, draft_ms per forward) at one request, from a cost file."""
    curves = StepCosts(load_costs(costs))
    return curves.verify_list(cap + 1), curves.draft(1)


@torch.no_grad()
def draft_model_features(draft_lm, resp: data.Response, cap: int) -> ChainFeatures:
    """An independent draft model's round at every response position, read teacher-forced: chain j (the
    round whose bonus token is response token j, as chain j of `response_chains`) reads at step t the
    draft's distribution after response token j + t. Exact while the chain agrees (module docstring)."""
    ids = torch.tensor(resp.prompt_ids + resp.response_ids)  # [L]
    n = len(ids)
    logits = draft_lm(input_ids=ids[None]).logits[0].float()  # [L, V]: position p predicts token p + 1
    starts = torch.arange(len(resp.prompt_ids), n - 1)  # [C] each round's bonus token
    where = (starts[:, None] + torch.arange(cap)[None, :]).clamp_max(n - 1)  # [C, cap] step t reads here
    runs = accepted_prefix(logits.argmax(-1)[where], ids[(where + 1).clamp_max(n - 1)], n - 1 - starts)  # [C]
    return _features(logits[where], runs)


def draft_forwards(counts: SpecCounts, responses: int, cfg: TuneConfig) -> int:
    """What the draft side is charged for: every drawn draft (a head drafts a token per forward), or
    one forward per round for a block drafter (the rounds: every pass but each response's prefill)."""
    return counts.n_target - responses if cfg.drafter == "dflash" else counts.draft_cost_tokens


def replay_rule(feats: list[ChainFeatures], lengths: list[torch.Tensor], cfg: TuneConfig, key: dict) -> dict:
    """One replay row: every chain's round length `lengths` (per response, [C]) at cap cfg.cap. With
    cfg.costs, `speedup` is S priced on the file's batch-1 curves (`speedup_at_c` keeps S at c)."""
    counts = replay_lengths([f.runs for f in feats], lengths, cfg.cap)
    row = replay_row(key, counts, cfg.cost_ratio)
    drawn = draft_forwards(counts, len(feats), cfg)
    row["speedup"] = round(modeled_speedup(counts.n_gen, counts.n_target, drawn, cfg.cost_ratio), 4)
    if cfg.costs:
        row["speedup_at_c"] = row["speedup"]
        prices = batch1_prices(cfg.costs, cfg.cap)
        row["speedup"] = round(priced_speedup(counts.n_gen, counts.passes_by_drafts(), drawn, *prices), 4)
    return row


def baselines(feats: list[ChainFeatures], cfg: TuneConfig) -> dict[str, Any]:
    """Fixed K 1..cap (every row and the best) and the oracle on the same chains."""
    k = cfg.cap
    fixed = [
        replay_rule(feats, [torch.full_like(f.runs, n) for f in feats], cfg, {"fixed_k": n}) for n in range(1, k + 1)
    ]
    oracle = replay_rule(feats, [f.runs.clamp_max(k) for f in feats], cfg, {"oracle": k})
    return {"fixed": fixed, "best_fixed": max(fixed, key=lambda row: row["speedup"]), "oracle": oracle}


def sweep(feats: list[ChainFeatures], cfg: TuneConfig) -> dict[str, Any]:
    """Fixed K 1..cap, the oracle and every threshold of each policy; the best threshold per policy."""
    policies = {}
    for policy in ("svip", "confidence"):
        rows = [
            replay_rule(feats, [rule_lengths(policy, t, f) for f in feats], cfg, {"threshold": t})
            for t in getattr(cfg, policy)
        ]
        policies[policy] = {"rows": rows, "best": max(rows, key=lambda row: row["speedup"])}
    return {**baselines(feats, cfg), "policies": policies}


def objective(cfg: TuneConfig) -> str:
    if cfg.costs:
        return f"S priced on the batch-1 step costs of {cfg.costs} (a pass over 1 + m tokens at its measured cost)"
    return f"S(c={cfg.cost_ratio})"


def heldout_features(
    target: str | Path, drafter: str | Path, responses: list[data.Response], cfg: TuneConfig
) -> tuple[list[ChainFeatures], list[data.Response]]:
    """The drafter's chain (block, teacher-forced round) features on the held-out greedy training responses
    (at most cfg.replay_responses)."""
    from tqdm import tqdm

    held = [r for r in responses if r.mode == "greedy" and len(r.response_ids) > 2 and is_heldout(r, cfg.val_frac)]
    held = held[: cfg.replay_responses] if cfg.replay_responses else held
    if cfg.drafter == "draft_model":  # the target's responses are all it reads of the target
        draft_lm = data.load_causal_lm(drafter)
        return [draft_model_features(draft_lm, r, cfg.cap) for r in tqdm(held, desc="draft rounds")], held
    target_lm = data.load_causal_lm(target)
    embed = target_lm.get_input_embeddings().weight
    if cfg.drafter == "dflash":
        block, block_cfg = dflash.load_hf_dir(drafter, embed, target_lm.lm_head.weight)
        block.eval()
        seqs = (target_features(target_lm, r, block_cfg.hf_layer_ids) for r in held)
        return [block_features(block, s, cfg.cap) for s in tqdm(seqs, total=len(held), desc="drafter blocks")], held
    head, head_cfg = eagle3.load_hf_dir(drafter, embed)
    head.eval()
    feats = [
        chain_features(head, *response_chains(head, target_lm, r, cfg.cap, head_cfg.aux_layer_ids))
        for r in tqdm(held, desc="drafter chains")
    ]
    return feats, held


def drafter_kind(drafter: str | Path) -> str:
    """What a drafter directory holds, from its config.json: one of DRAFTERS."""
    try:
        conf = json.loads((Path(drafter) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"tune: --draft {str(drafter)!r} has no readable config.json ({exc})") from None
    if "dflash_config" in conf:
        return "dflash"
    if "eagle_aux_hidden_state_layer_ids" in conf or any("Eagle" in a for a in conf.get("architectures") or ()):
        return "eagle3"
    return "draft_model"


def for_drafter(drafter: str | Path, cfg: TuneConfig) -> TuneConfig:
    """cfg checked against the drafter: a known kind that matches the directory; a block drafter's cap is
    at most its block."""
    if cfg.drafter not in DRAFTERS:
        raise ValueError(f"tune: drafter {cfg.drafter!r} is not one of {DRAFTERS}")
    kind = drafter_kind(drafter)
    if kind != cfg.drafter:
        raise ValueError(
            f"tune: --draft {str(drafter)!r} holds {'an' if kind == 'eagle3' else 'a'} {kind} drafter, not "
            f"{cfg.drafter!r}: pass --drafter {kind}"
        )
    if cfg.drafter == "dflash":
        block = dflash.read_config(drafter).block_size
        if cfg.cap > block:
            logger.info("tune: cap %d is past the DFlash drafter's block of %d; replaying at %d", cfg.cap, block, block)
            cfg = replace(cfg, cap=block)
        if not cfg.costs:
            logger.warning(
                "tune: at one cost ratio a block drafter's full block is never beaten (its draft costs the same "
                "at any length, and so does a pass at one c); pass --costs to choose on a machine's step costs"
            )
    return cfg


def tune(
    target: str | Path,
    drafter: str | Path,
    responses: list[data.Response],
    cfg: TuneConfig,
    extra_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Replays the drafter's rounds on held-out training responses; returns the report with each
    policy's recommended threshold at cfg.cost_ratio (or on cfg.costs)."""
    started = time.perf_counter()
    cfg = for_drafter(drafter, cfg)
    if cfg.costs:
        batch1_prices(cfg.costs, cfg.cap)  # a bad file fails here, before the replay
    feats, held = heldout_features(target, drafter, responses, cfg)
    result = sweep(feats, cfg)
    recommended = {p: {"threshold": v["best"]["threshold"]} for p, v in result["policies"].items()}
    what = {
        "dflash": "drafter's block at every round start",
        "draft_model": "draft model's rounds, read teacher-forced (exact up to each round's first rejected draft)",
    }.get(cfg.drafter, "head's chains")
    return {
        "drafter": draft_identity(drafter),
        "drafter_method": cfg.drafter,
        "recommended": recommended,
        "choice": (
            f"maximises modeled speedup {objective(cfg)} at cap K={cfg.cap} in an exact greedy replay of the "
            f"{what} on {len(held)} held-out training responses (no policy time charged)"
        ),
        "config": {k: v for k, v in vars(cfg).items()},
        "data": {"target": Path(str(target)).name, **data.summarize(held), **(extra_meta or {})},
        "replay": result,
        "seconds": round(time.perf_counter() - started, 1),
        "commit": project_commit(),
    }
