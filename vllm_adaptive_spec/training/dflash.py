"""Training a DFlash parallel block drafter for a target, with uniform, decayed or D-PACE cross-entropy.

Reads top to bottom:
1. Data: the target's own greedy responses to the training prompts (the same
   responses and held-out split as `training.eagle3`), and the target's
   hidden states after the drafter's `target_layer_ids` (`eagle3.target_features`
   with ids + 1: transformers' `hidden_states[l + 1]` is the output of decoder
   layer l before the final norm, what vLLM exports for dflash).
2. Blocks as vLLM drafts them: every response position p is an anchor (the
   round in which the target has just emitted x_p). Its block
   [x_p, mask x K] at positions p..p+K sees the target's features at
   positions < p and predicts x_{p+1}..x_{p+K}; positions past the end of
   the response carry no loss but stay in the block (vLLM always drafts K).
3. Loss: sum_k w_k CE_k / sum_k w_k over all valid (block, position) pairs of
   a batch, with w detached (ALGORITHMS.md, "D-PACE"):
   - `ce`: w_k = 1;
   - `decay`: DFlash's w_k = exp(-(k-1)/gamma) (gamma 4: DFlash's for blocks of 8);
   - `dpace`: q_k = the drafter's probability of the target's token at block
     position k, s_k = (1 - lambda) q_k + lambda, P_k = prod_{j<=k} s_j,
     w_k = sum_{j>=k} P_j over the block's valid positions. With
     `dpace_estimate="agreement"` q_k is instead a running average of the
     drafter's top-1 agreement at position k during training (the same q for
     every block; an ablation, not the paper's).
   Embedding and LM head are the target's, frozen (never shipped); the final
   norm starts from the target's; fc and the layers start random. AdamW,
   linear warm-up then cosine. Same data order, initialisation and steps for
   every loss at one seed.
4. Evaluation on held-out responses, teacher-forced blocks from every anchor:
   per-position top-1 agreement with the target (position k regardless of
   the others: all K come from one forward), the accepted-prefix histogram
   at K, and an exact replay of greedy speculative decoding (rounds jump by
   accepted + 1), whose mean acceptance length is vLLM's 1 + accepted / drafts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vllm_adaptive_spec.heads.dflash import (
    DFlashConfig,
    DFlashDrafter,
    draft_blocks,
    parameter_count,
    save_hf_dir,
)
from vllm_adaptive_spec.training import data
from vllm_adaptive_spec.training.eagle3 import (
    Optimizer,
    Sequence,
    Stopwatch,
    accepted_prefix,
    check_before_final_norm,
    featurize_and_fit,
    pipeline_report,
    read_target_config,
    replay_rounds,
)

logger = logging.getLogger(__name__)

LOSSES = ("ce", "decay", "dpace")
ESTIMATES = ("confidence", "agreement")


@dataclass
class TrainConfig:
    loss: str = "dpace"  # ce | decay | dpace
    gamma: float = 4.0  # decay: w_k = exp(-(k-1)/gamma); DFlash uses 4 for blocks of 8
    dpace_lambda: float = 0.5  # dpace: s_k = (1 - lambda) q_k + lambda (the paper's public code: 0.5)
    dpace_estimate: str = "confidence"  # dpace q_k: per-block confidence (the paper) | running top-1 agreement
    estimate_momentum: float = 0.98  # running per-position agreement: est <- m * est + (1 - m) * batch
    block_size: int = 8  # K: drafts per round (vLLM's num_speculative_tokens)
    num_layers: int = 2
    intermediate_size: int | None = None  # MLP width (None: the target's)
    target_layer_ids: tuple[int, ...] | None = None  # None: DFlashConfig.from_target's choice
    epochs: int = 2
    anchors: int = 0  # blocks per response and step, a fresh random subset each epoch (0: every anchor)
    lr: float = 1e-3
    warmup_frac: float = 0.05  # share of the optimizer steps with a linear warm-up
    min_lr_frac: float = 0.1  # the cosine ends at lr * min_lr_frac
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    batch_size: int = 4  # responses per step
    val_frac: float = 0.1
    seed: int = 0
    eval_responses: int = 0  # held-out responses to evaluate (0: all)

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.dpace_estimate not in ESTIMATES:
            raise ValueError(f"dpace_estimate must be one of {ESTIMATES}, got {self.dpace_estimate!r}")
        if not 0.0 <= self.dpace_lambda <= 1.0:
            raise ValueError(f"dpace_lambda must be in [0, 1], got {self.dpace_lambda}")
        if self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")


# -- position weights (pure) --


def decay_weights(valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """valid [..., K] bool -> DFlash's w_k = exp(-(k-1)/gamma) at valid positions, 0 elsewhere."""
    k = torch.arange(valid.shape[-1], dtype=torch.float32, device=valid.device)
    return torch.exp(-k / gamma) * valid


def dpace_weights(q: torch.Tensor, valid: torch.Tensor, lam: float) -> torch.Tensor:
    """D-PACE: q [..., K] acceptance estimates, valid [..., K] bool (a prefix of the block) ->
    w_k = sum_{j>=k, valid} P_j with P_j = prod_{i<=j} ((1 - lam) q_i + lam); 0 at invalid positions."""
    s = (1 - lam) * q + lam
    p = torch.cumprod(s, dim=-1) * valid  # [..., K]
    return p.flip(-1).cumsum(-1).flip(-1) * valid


def position_weights(
    cfg: TrainConfig, valid: torch.Tensor, q: torch.Tensor, agreement: torch.Tensor | None = None
) -> torch.Tensor:
    """The loss weights [..., K] of `cfg.loss` (detached). q [..., K]: the drafter's probability of the
    target's token; agreement [K]: the running per-position top-1 agreement (dpace_estimate="agreement")."""
    if cfg.loss == "ce":
        return valid.float()
    if cfg.loss == "decay":
        return decay_weights(valid, cfg.gamma)
    if cfg.dpace_estimate == "agreement":
        if agreement is None:
            raise ValueError("dpace_estimate='agreement' needs the running agreement")
        q = agreement.expand_as(q)
    return dpace_weights(q.detach(), valid, cfg.dpace_lambda)


# -- blocks (pure) --


@dataclass
class Blocks:
    """B responses with N blocks each (padded), as one drafting pass sees them."""

    aux: torch.Tensor  # [B, L, fc_in] target features (zero past a response's end)
    anchors: torch.Tensor  # [B, N] position p of each block's first token (0 for padding blocks)
    anchor_tokens: torch.Tensor  # [B, N] x_p
    targets: torch.Tensor  # [B, N, K] x_{p+k}, k = 1..K; -1 where none (past the end, padding)

    @property
    def valid(self) -> torch.Tensor:
        return self.targets >= 0


def anchor_positions(seq: Sequence) -> torch.Tensor:
    """Every p whose x_p is a response token and x_{p+1} exists: p = P .. L-2."""
    return torch.arange(seq.prompt_len, len(seq.ids) - 1)


def make_blocks(
    seqs: list[Sequence], block_size: int, anchors: int = 0, generator: torch.Generator | None = None
) -> Blocks:
    """Blocks from every anchor of each response, or `anchors` of them drawn at random (sorted)."""
    chosen = []
    for s in seqs:
        a = anchor_positions(s)
        if 0 < anchors < len(a):
            a = a[torch.randperm(len(a), generator=generator)[:anchors].sort().values]
        chosen.append(a)
    b, n, length = len(seqs), max(len(a) for a in chosen), max(len(s.ids) for s in seqs)
    out = Blocks(
        aux=torch.zeros(b, length, seqs[0].aux.shape[1]),
        anchors=torch.zeros(b, n, dtype=torch.long),
        anchor_tokens=torch.zeros(b, n, dtype=torch.long),
        targets=torch.full((b, n, block_size), -1, dtype=torch.long),
    )
    k = torch.arange(1, block_size + 1)
    for i, (s, a) in enumerate(zip(seqs, chosen)):
        out.aux[i, : len(s.ids)] = s.aux
        out.anchors[i, : len(a)] = a
        out.anchor_tokens[i, : len(a)] = s.ids[a]
        where = a[:, None] + k  # [n_i, K]
        inside = where < len(s.ids)
        out.targets[i, : len(a)] = torch.where(inside, s.ids[where.clamp_max(len(s.ids) - 1)], -1)
    return out


@dataclass
class BlockOutput:
    ce: torch.Tensor  # [B, N, K] cross-entropy against x_{p+k} (0 where invalid)
    q: torch.Tensor  # [B, N, K] probability of x_{p+k}, detached (0 where invalid)
    hits: torch.Tensor  # [B, N, K] bool: the drafter's argmax is x_{p+k}
    drafts: torch.Tensor  # [B, N, K] the drafter's argmax


def run_blocks(drafter: DFlashDrafter, blocks: Blocks) -> BlockOutput:
    """One pass; logits only at valid positions (the LM head is most of the cost)."""
    normed = drafter(blocks.aux, blocks.anchors, blocks.anchor_tokens)  # [B, N, K, H]
    valid = blocks.valid
    logits = drafter.logits(normed[valid])  # [M, V]
    target = blocks.targets[valid]  # [M]
    ce = torch.zeros(valid.shape, dtype=logits.dtype)
    ce[valid] = F.cross_entropy(logits, target, reduction="none")
    drafts = torch.zeros(valid.shape, dtype=torch.long)
    drafts[valid] = logits.detach().argmax(-1)
    q = torch.exp(-ce.detach()) * valid
    return BlockOutput(ce=ce, q=q, hits=(drafts == blocks.targets) & valid, drafts=drafts)


def per_position(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of x [..., K] over valid entries, per position -> [K] (nan where none)."""
    x, valid = x.flatten(0, -2), valid.flatten(0, -2)
    return (x * valid).sum(0) / valid.sum(0)


# -- training --


def fit(drafter: DFlashDrafter, train: list[Sequence], cfg: TrainConfig, progress: bool = True) -> list[dict[str, Any]]:
    from tqdm import tqdm

    optimizer = Optimizer(drafter, len(train), cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    k = cfg.block_size
    agreement: torch.Tensor | None = None  # [K] running top-1 agreement per position
    history = []
    bar = tqdm(total=optimizer.total, desc=f"train dflash ({cfg.loss})", disable=not progress)
    for epoch in range(cfg.epochs):
        drafter.train()
        order = torch.randperm(len(train), generator=gen).tolist()
        sums = {name: torch.zeros(k) for name in ("ce", "hits", "weight", "count")}
        loss_sum, steps = 0.0, 0
        for i in range(0, len(order), cfg.batch_size):
            blocks = make_blocks([train[j] for j in order[i : i + cfg.batch_size]], k, cfg.anchors, gen)
            out = run_blocks(drafter, blocks)
            valid = blocks.valid
            batch_agreement = per_position(out.hits.float(), valid).nan_to_num(0.0)
            m = cfg.estimate_momentum
            agreement = batch_agreement if agreement is None else m * agreement + (1 - m) * batch_agreement
            w = position_weights(cfg, valid, out.q, agreement)
            loss = (w * out.ce).sum() / w.sum().clamp_min(1e-8)
            optimizer.step(loss)
            flat_valid = valid.flatten(0, -2)
            sums["ce"] += (out.ce.detach().flatten(0, -2) * flat_valid).sum(0)
            sums["hits"] += out.hits.flatten(0, -2).sum(0)
            sums["weight"] += (w / w.sum(-1, keepdim=True).clamp_min(1e-8)).flatten(0, -2).sum(0)
            sums["count"] += flat_valid.sum(0)
            loss_sum, steps = loss_sum + float(loss.detach()), steps + 1
            bar.update()
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc1=f"{float(agreement[0]):.3f}")
        count = sums["count"].clamp_min(1)
        history.append(
            {
                "epoch": epoch + 1,
                "loss": round(loss_sum / max(steps, 1), 4),
                "ce_per_position": _rounded(sums["ce"] / count),
                "agreement_per_position": _rounded(sums["hits"] / count),
                # each block's weights normalised to sum 1, averaged per position: where the signal went
                "weight_share_per_position": _rounded(sums["weight"] / sums["weight"].sum()),
                "running_agreement": _rounded(agreement) if agreement is not None else None,
            }
        )
        logger.info("epoch %d: %s", epoch + 1, history[-1])
    bar.close()
    return history


def _rounded(x: torch.Tensor) -> list[float]:
    return [round(float(v), 4) for v in x]


# -- evaluation --


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, seqs: list[Sequence], block_size: int, batch_size: int = 4) -> dict[str, Any]:
    """Teacher-forced blocks from every anchor of every sequence: per-position agreement and CE,
    the accepted-prefix histogram, and the replay of greedy speculative decoding."""
    drafter.eval()
    k = block_size
    ce, hits, count = torch.zeros(k), torch.zeros(k), torch.zeros(k)
    hist = torch.zeros(k + 1, dtype=torch.long)
    rounds = accepted_total = 0
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i : i + batch_size]
        blocks = make_blocks(chunk, k)
        out = run_blocks(drafter, blocks)
        valid = blocks.valid
        flat_valid = valid.flatten(0, -2)
        ce += (out.ce.flatten(0, -2) * flat_valid).sum(0)
        hits += out.hits.flatten(0, -2).sum(0)
        count += flat_valid.sum(0)
        for row, s in enumerate(chunk):
            n = len(anchor_positions(s))
            available = valid[row, :n].sum(-1)  # [n] truth tokens that exist
            acc = accepted_prefix(out.drafts[row, :n], blocks.targets[row, :n], available)
            hist += torch.bincount(acc, minlength=k + 1)
            r, a = replay_rounds(acc)
            rounds, accepted_total = rounds + r, accepted_total + a
    blocks_total = int(hist.sum())
    reach = hist.flip(0).cumsum(0).flip(0)[1:]  # [K] blocks whose accepted prefix reaches position k
    mean = float((hist * torch.arange(k + 1)).sum()) / max(blocks_total, 1)
    return {
        "block_size": k,
        "responses": len(seqs),
        "positions_per_position": [int(c) for c in count],
        "agreement_per_position": _rounded(hits / count.clamp_min(1)),
        "ce_per_position": _rounded(ce / count.clamp_min(1)),
        "blocks": blocks_total,
        "accepted_histogram": hist.tolist(),
        "prefix_reaches_position": _rounded(reach / max(blocks_total, 1)),
        "mean_accepted_per_block": round(mean, 4),
        "replay_rounds": rounds,
        "replay_accepted": accepted_total,
        "replay_acceptance_length": round(1 + accepted_total / max(rounds, 1), 4),
    }


@torch.no_grad()
def accepted_per_anchor(drafter: DFlashDrafter, seq: Sequence) -> list[int]:
    """Drafts the target would accept from the block at every anchor of one response (greedy),
    anchor i = the i-th response position whose bonus token starts a round (anchor_positions)."""
    anchors = anchor_positions(seq)
    if len(anchors) == 0:
        return []
    k = drafter.cfg.block_size
    drafts = draft_blocks(drafter, seq.ids, seq.aux, anchors)  # [N, K]
    where = anchors[:, None] + torch.arange(1, k + 1)  # [N, K]
    truth = seq.ids[where.clamp_max(len(seq.ids) - 1)]
    return accepted_prefix(drafts, truth, len(seq.ids) - 1 - anchors).tolist()


def walk_rounds(acc: list[int]) -> list[int]:
    """Greedy speculative decoding along the anchors: a round at anchor c accepts acc[c] drafts and
    the next round's anchor is c + acc[c] + 1. Returns the accepted count of each round."""
    rounds, c = [], 0
    while c < len(acc):
        rounds.append(acc[c])
        c += acc[c] + 1
    return rounds


def replay_response(drafter: DFlashDrafter, seq: Sequence) -> list[int]:
    """Accepted drafts per round of greedy speculative decoding along one response: the round whose
    bonus token is x_p drafts the block at anchor p; the next round's anchor is p + accepted + 1.
    (vLLM's per-step counts also include drafts accepted past the response's end in its last round.)"""
    return walk_rounds(accepted_per_anchor(drafter, seq))


# -- the pipeline --


def loss_description(cfg: TrainConfig) -> str:
    if cfg.loss == "ce":
        return "uniform cross-entropy over the K block positions"
    if cfg.loss == "decay":
        return f"DFlash decayed cross-entropy, w_k = exp(-(k-1)/{cfg.gamma})"
    q = "the drafter's probability of the target's token (detached)"
    if cfg.dpace_estimate == "agreement":
        q = f"a running average (momentum {cfg.estimate_momentum}) of the per-position top-1 agreement"
    lam = cfg.dpace_lambda
    return f"D-PACE, w_k = sum_(j>=k) prod_(i<=j) ((1-{lam}) q_i + {lam}), q_i = {q}"


def train_dflash(
    target: str | Path,
    responses: list[data.Response],
    out: str | Path,
    cfg: TrainConfig,
    extra_meta: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Features, training, evaluation; writes the drafter directory. Returns the report."""
    watch = Stopwatch()
    target_config = read_target_config(target)
    drafter_cfg = DFlashConfig.from_target(
        target_config, cfg.block_size, cfg.num_layers, cfg.intermediate_size, cfg.target_layer_ids
    )
    n = target_config["num_hidden_layers"]
    reason = f"target_layer_ids {drafter_cfg.target_layer_ids}: transformers' last hidden state is after the final "
    check_before_final_norm(
        drafter_cfg.hf_layer_ids, target_config, f"{reason}norm, vLLM's is before; use ids below {n - 1}"
    )
    build = partial(DFlashDrafter, drafter_cfg)
    run = featurize_and_fit(target, responses, drafter_cfg.hf_layer_ids, build, fit, cfg, watch, progress)
    drafter: DFlashDrafter = run.model
    metrics = {
        "train": evaluate(drafter, run.train[: len(run.evaluated)], cfg.block_size),
        "heldout": evaluate(drafter, run.evaluated, cfg.block_size),
    }
    watch.lap("evaluate")
    save_hf_dir(drafter, drafter_cfg, out, target_config)
    logger.info(
        "DFlash drafter saved to %s: held-out agreement per position %s; replayed acceptance length %.3f at K=%d",
        out,
        metrics["heldout"]["agreement_per_position"],
        metrics["heldout"]["replay_acceptance_length"],
        cfg.block_size,
    )
    data_extra = {"eval_responses": len(run.evaluated), **(extra_meta or {})}
    model, parameters = ("drafter", drafter_cfg), parameter_count(drafter)
    return pipeline_report(cfg, model, target, out, parameters, loss_description(cfg), run, data_extra, metrics, watch)
