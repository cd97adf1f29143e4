"""Training an EAGLE-3 head (Li et al., 2025) for a target, with the training-time test.

Reads top to bottom:
1. Data: the target's own responses to the training prompts (greedy, from
   vLLM: `integration.datagen`), 10% of prompts held out.
2. Features: the target runs teacher-forced over prompt + response (HF
   transformers) and we keep `hidden_states[k]` for the head's auxiliary layer
   ids k (output of decoder layer k-1, before the final norm: what vLLM
   exports for eagle3). HF's last entry is after the final norm, so ids must
   stay below the target's layer count.
3. Inputs as vLLM runs them: at position p the head reads embed(x_{p+1}) and
   the fused feature of p, and predicts x_{p+2}.
4. Training-time test: S unrolled steps (`Eagle3Head.forward_ttt`); step s
   at p continues the chain that started at p - s, from the head's own state.
   Token-level cross-entropy against x_{p+2} on every step, where x_{p+2} is a
   response token and p - s >= 0; step s weighted by `step_decay ** s`. No
   feature regression (EAGLE-3 dropped it). Embedding frozen (the target's,
   not shipped); LM head and final norm start from the target's and train;
   fc and the layer start random. AdamW, linear warm-up then cosine.
5. Evaluation on held-out responses: per-step top-1 agreement with the
   target (the k-th draft given the previous ones were right), and greedy
   chains drafted with the incremental (KV-cache) path from every response
   position: the accepted-prefix histogram at cap K, and an exact replay of
   greedy speculative decoding (rounds jump by accepted + 1), whose mean
   acceptance length is what vLLM reports as 1 + accepted / drafts.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from vllm_adaptive_spec.heads.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    copy_target_weights,
    draft_chains,
    parameter_count,
    save_hf_dir,
)
from vllm_adaptive_spec.heads.fileformat import project_commit
from vllm_adaptive_spec.training import data
from vllm_adaptive_spec.training.specdecpp import is_heldout

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=torch.nn.Module)


@dataclass
class TrainConfig:
    ttt_steps: int = 4  # S: unrolled steps in the training-time test
    step_decay: float = 0.8  # step s's loss weight is step_decay ** s
    epochs: int = 4
    lr: float = 2e-3
    warmup_frac: float = 0.05  # share of the optimizer steps with a linear warm-up
    min_lr_frac: float = 0.1  # the cosine ends at lr * min_lr_frac
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    batch_size: int = 4  # responses per step
    val_frac: float = 0.1
    seed: int = 0
    cap: int = 8  # K for the chain evaluation
    eval_responses: int = 100  # held-out responses for the chain evaluation (0 = all)
    aux_layer_ids: tuple[int, ...] | None = None  # None: Eagle3Config.from_target's choice
    intermediate_size: int | None = 512  # head MLP width; the toy target's 768 makes the fp32 head 10.8 MB


@dataclass
class Sequence:
    """One prompt + response with the target's auxiliary hidden states (CPU)."""

    ids: torch.Tensor  # [L] prompt + response token ids
    aux: torch.Tensor  # [L, fc_in] the target layers' outputs side by side, float32
    prompt_len: int  # P


# -- features (transformers target, loaded by the caller) --


@torch.no_grad()
def target_features(target_lm, resp: data.Response, layer_ids: tuple[int, ...]) -> Sequence:
    ids = torch.tensor([resp.prompt_ids + resp.response_ids])  # [1, L]
    states = target_lm.model(input_ids=ids, output_hidden_states=True).hidden_states
    aux = torch.cat([states[k][0] for k in layer_ids], dim=-1)  # [L, fc_in]
    return Sequence(ids[0], aux.float().contiguous(), len(resp.prompt_ids))


# -- batches (pure) --


@dataclass
class Batch:
    next_tokens: torch.Tensor  # [B, T] x_{p+1} at position p (0 past the end)
    aux: torch.Tensor  # [B, T, fc_in]
    target: torch.Tensor  # [B, T] x_{p+2} (0 where none)
    scored: torch.Tensor  # [B, T] bool: x_{p+2} exists and is a response token


def collate(seqs: list[Sequence]) -> Batch:
    """Right-padded (causal attention keeps padding out of every real position's view)."""
    t = max(len(s.ids) for s in seqs) - 1  # positions 0 .. L-2 have a next token
    b, width = len(seqs), seqs[0].aux.shape[1]
    out = Batch(
        next_tokens=torch.zeros(b, t, dtype=torch.long),
        aux=torch.zeros(b, t, width),
        target=torch.zeros(b, t, dtype=torch.long),
        scored=torch.zeros(b, t, dtype=torch.bool),
    )
    for i, s in enumerate(seqs):
        n = len(s.ids)
        out.next_tokens[i, : n - 1] = s.ids[1:]
        out.aux[i, : n - 1] = s.aux[: n - 1]
        out.target[i, : n - 2] = s.ids[2:]
        out.scored[i, max(s.prompt_len - 2, 0) : n - 2] = True  # x_{p+2} with p + 2 >= P
    return out


def step_masks(scored: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """scored [B, T] -> per step s, [B, T]: scored and p - s >= 0 (a chain can start there)."""
    p = torch.arange(scored.shape[1])
    return [scored & (p >= s) for s in range(steps)]


def ttt_losses(head: Eagle3Head, batch: Batch, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per step: (mean cross-entropy, top-1 hits [N_s] bool) over that step's scored positions."""
    outputs = head.forward_ttt(batch.next_tokens, batch.aux, steps)
    losses, hits = [], []
    for normed, mask in zip(outputs, step_masks(batch.scored, steps)):
        logits = head.logits(normed[mask])  # [N_s, V]
        target = batch.target[mask]
        losses.append(F.cross_entropy(logits, target) if len(target) else logits.sum() * 0)
        hits.append(logits.argmax(-1) == target)
    return losses, hits


# -- training --


def lr_factor(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, round(cfg.warmup_frac * total))
    if step < warm:
        return (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac))


class Optimizer:
    """AdamW over a model's trainable parameters, `lr_factor`'s schedule, clipped gradients (cfg: either
    trainer's TrainConfig); `total` optimizer steps for `n_train` sequences."""

    def __init__(self, model: torch.nn.Module, n_train: int, cfg: Any) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.total = cfg.epochs * math.ceil(n_train / cfg.batch_size)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda i: lr_factor(i, self.total, cfg))
        self.grad_clip = cfg.grad_clip

    def step(self, loss: torch.Tensor) -> None:
        """Backward, clip, one optimizer and schedule step."""
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.opt.step()
        self.sched.step()


def fit(head: Eagle3Head, train: list[Sequence], cfg: TrainConfig, progress: bool = True) -> list[dict[str, Any]]:
    from tqdm import tqdm

    optimizer = Optimizer(head, len(train), cfg)
    weights = [cfg.step_decay**s for s in range(cfg.ttt_steps)]
    gen = torch.Generator().manual_seed(cfg.seed)
    history = []
    bar = tqdm(total=optimizer.total, desc="train eagle3", disable=not progress)
    for epoch in range(cfg.epochs):
        head.train()
        order = torch.randperm(len(train), generator=gen).tolist()
        loss_sum = [0.0] * cfg.ttt_steps
        hit_sum = [0] * cfg.ttt_steps
        count = [0] * cfg.ttt_steps
        for i in range(0, len(order), cfg.batch_size):
            batch = collate([train[k] for k in order[i : i + cfg.batch_size]])
            losses, hits = ttt_losses(head, batch, cfg.ttt_steps)
            loss = sum(w * x for w, x in zip(weights, losses))
            optimizer.step(loss)
            for s, (x, h) in enumerate(zip(losses, hits)):
                loss_sum[s] += float(x.detach()) * len(h)
                hit_sum[s] += int(h.sum())
                count[s] += len(h)
            bar.update()
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc0=f"{hit_sum[0] / max(count[0], 1):.3f}")
        history.append(
            {
                "epoch": epoch + 1,
                "loss_per_step": [round(x / max(n, 1), 4) for x, n in zip(loss_sum, count)],
                "agreement_per_step": [round(x / max(n, 1), 4) for x, n in zip(hit_sum, count)],
            }
        )
        logger.info("epoch %d: %s", epoch + 1, history[-1])
    bar.close()
    return history


# -- evaluation --


@torch.no_grad()
def step_agreement(head: Eagle3Head, seqs: list[Sequence], steps: int, batch_size: int = 16) -> dict[str, Any]:
    """Teacher-forced per-step top-1 agreement and cross-entropy: the k-th draft, earlier ones right."""
    head.eval()
    loss_sum, hit_sum, count = [0.0] * steps, [0] * steps, [0] * steps
    for i in range(0, len(seqs), batch_size):
        losses, hits = ttt_losses(head, collate(seqs[i : i + batch_size]), steps)
        for s, (x, h) in enumerate(zip(losses, hits)):
            loss_sum[s] += float(x) * len(h)
            hit_sum[s] += int(h.sum())
            count[s] += len(h)
    return {
        "positions_per_step": count,
        "agreement_per_step": [round(x / max(n, 1), 4) for x, n in zip(hit_sum, count)],
        "loss_per_step": [round(x / max(n, 1), 4) for x, n in zip(loss_sum, count)],
    }


def accepted_prefix(drafted: torch.Tensor, truth: torch.Tensor, available: torch.Tensor) -> torch.Tensor:
    """drafted, truth [C, K], available [C] (truth tokens that exist) -> agreeing prefix length [C]."""
    k = torch.arange(drafted.shape[1])
    agree = (drafted == truth) & (k[None, :] < available[:, None])
    return agree.long().cumprod(-1).sum(-1)


def replay_rounds(accepted: torch.Tensor) -> tuple[int, int]:
    """Greedy speculative decoding along one response: accepted [C] per chain start c = P-1, P, ...

    A round at c accepts a[c] drafts plus the target's own token, so the next
    round starts at c + a[c] + 1. Returns (rounds, accepted drafts).
    """
    rounds, total, c = 0, 0, 0
    values = accepted.tolist()
    while c < len(values):
        rounds, total = rounds + 1, total + values[c]
        c += values[c] + 1
    return rounds, total


@torch.no_grad()
def chain_acceptance(head: Eagle3Head, seqs: list[Sequence], cap: int) -> dict[str, Any]:
    """Greedy chains with the incremental path from every response position of each sequence."""
    head.eval()
    hist = torch.zeros(cap + 1, dtype=torch.long)
    rounds = accepted_total = 0
    for s in seqs:
        n = len(s.ids)
        starts = torch.arange(s.prompt_len - 1, n - 2)  # x_{c+1} is a response token, x_{c+2} exists
        if len(starts) == 0:
            continue
        drafted = draft_chains(head, s.ids[1:], s.aux[: n - 1], starts, cap)  # [C, cap]
        where = (starts[:, None] + 2 + torch.arange(cap)[None, :]).clamp_max(n - 1)  # [C, cap]
        acc = accepted_prefix(drafted, s.ids[where], n - 2 - starts)
        hist += torch.bincount(acc, minlength=cap + 1)
        r, a = replay_rounds(acc)
        rounds, accepted_total = rounds + r, accepted_total + a
    chains = int(hist.sum())
    mean = float((hist * torch.arange(cap + 1)).sum()) / max(chains, 1)
    return {
        "cap": cap,
        "chains": chains,
        "accepted_histogram": hist.tolist(),
        "mean_accepted_per_chain": round(mean, 4),
        "acceptance_length_per_chain": round(1 + mean, 4),
        "replay_rounds": rounds,
        "replay_accepted": accepted_total,
        "replay_acceptance_length": round(1 + accepted_total / max(rounds, 1), 4),
    }


# -- pipeline steps (training.dflash runs the same ones) --


class Stopwatch:
    """Wall-clock seconds per pipeline phase, as the report's "seconds"."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        """End `phase` now."""
        now = time.perf_counter()
        self.phases[phase], self.last = round(now - self.last, 1), now

    def seconds(self) -> dict[str, float]:
        """Each phase's seconds, then the total so far."""
        return {**self.phases, "total": round(time.perf_counter() - self.started, 1)}


def read_target_config(target: str | Path) -> dict[str, Any]:
    """The target's config.json as a dict."""
    return json.loads((Path(target) / "config.json").read_text())


def check_before_final_norm(hf_layer_ids: tuple[int, ...], target_config: dict[str, Any], message: str) -> None:
    """Raise ValueError(message) if an id reaches transformers' last hidden state (after the final norm)."""
    if max(hf_layer_ids) >= target_config["num_hidden_layers"]:
        raise ValueError(message)


@dataclass
class Run:
    """A fitted, frozen draft model and its data: the responses, their train / held-out split, and
    the held-out part to evaluate."""

    model: Any
    responses: list[data.Response]
    train: list[Sequence]
    heldout: list[Sequence]
    evaluated: list[Sequence]
    history: list[dict[str, Any]]


def featurize_and_fit(
    target: str | Path,
    responses: list[data.Response],
    layer_ids: tuple[int, ...],
    build: Callable[[], torch.nn.Module],
    fit: Callable[..., list[dict[str, Any]]],
    cfg: Any,
    watch: Stopwatch,
    progress: bool = True,
) -> Run:
    """Target features of each response, split by `is_heldout`; then build() from the target's embedding,
    LM head and final norm, `fit(model, train, cfg, progress)`, frozen. cfg: either trainer's TrainConfig."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    target_lm = data.load_causal_lm(target)
    seqs = [
        target_features(target_lm, r, layer_ids) for r in tqdm(responses, desc="target features", disable=not progress)
    ]
    held = [is_heldout(r, cfg.val_frac) for r in responses]
    train = [s for s, h in zip(seqs, held) if not h]
    heldout = [s for s, h in zip(seqs, held) if h]
    watch.lap("features")

    model = build()
    copy_target_weights(
        model, target_lm.model.embed_tokens.weight, target_lm.lm_head.weight, target_lm.model.norm.weight
    )
    del target_lm
    history = fit(model, train, cfg, progress)
    watch.lap("train")
    model.eval().requires_grad_(False)
    evaluated = heldout[: cfg.eval_responses] if cfg.eval_responses else heldout
    return Run(model, responses, train, heldout, evaluated, history)


def pipeline_report(
    cfg: Any,
    model: tuple[str, Any],
    target: str | Path,
    out: str | Path,
    parameters: int,
    loss: str,
    run: Run,
    data_extra: dict[str, Any],
    metrics: dict[str, Any],
    watch: Stopwatch,
) -> dict[str, Any]:
    """A trainer's report; model: its key for the trained model's config, and that config."""
    key, model_cfg = model
    split = {"train_responses": len(run.train), "heldout_responses": len(run.heldout)}
    summary = {**data.summarize(run.responses), **split, **data_extra}
    return {
        "config": asdict(cfg),
        key: asdict(model_cfg),
        "target": Path(str(target)).name,
        "out": str(out),
        "parameters": parameters,
        "loss": loss,
        "data": summary,
        "history": run.history,
        "metrics": metrics,
        "seconds": watch.seconds(),
        "commit": project_commit(),
    }


# -- the pipeline --


def train_eagle3(
    target: str | Path,
    responses: list[data.Response],
    out: str | Path,
    cfg: TrainConfig,
    extra_meta: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Features, training, evaluation; writes the head directory. Returns the report."""
    watch = Stopwatch()
    target_config = read_target_config(target)
    head_cfg = Eagle3Config.from_target(target_config, cfg.aux_layer_ids, cfg.intermediate_size)
    n = target_config["num_hidden_layers"]
    reason = f"aux_layer_ids {head_cfg.aux_layer_ids}: HF's last hidden state is after the final norm; "
    check_before_final_norm(head_cfg.aux_layer_ids, target_config, f"{reason}use ids below {n}")
    build = partial(Eagle3Head, head_cfg)
    run = featurize_and_fit(target, responses, head_cfg.aux_layer_ids, build, fit, cfg, watch, progress)
    head: Eagle3Head = run.model
    metrics = {
        "train": step_agreement(head, run.train[: len(run.heldout)], cfg.ttt_steps),
        "heldout": step_agreement(head, run.heldout, cfg.ttt_steps),
        "heldout_chains": chain_acceptance(head, run.evaluated, cfg.cap),
    }
    watch.lap("evaluate")
    save_hf_dir(head, head_cfg, out, target_config)
    logger.info(
        "EAGLE-3 head saved to %s: held-out agreement per step %s; replayed acceptance length %.3f at K=%d",
        out,
        metrics["heldout"]["agreement_per_step"],
        metrics["heldout_chains"]["replay_acceptance_length"],
        cfg.cap,
    )
    loss = f"sum over steps s of {cfg.step_decay}**s x token cross-entropy against x_(p+2)"
    data_extra = {"chain_eval_responses": len(run.evaluated), **(extra_meta or {})}
    model, parameters = ("head", head_cfg), parameter_count(head)
    return pipeline_report(cfg, model, target, out, parameters, loss, run, data_extra, metrics, watch)
