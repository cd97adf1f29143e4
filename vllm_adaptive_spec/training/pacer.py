"""Training the Pacer blockwise pre-verifier (seed 000; ALGORITHMS.md, sec. 3.3 / App. D).

Reads top to bottom:
1. `draft_chains`: for each target response y and response position j, the
   draft greedily drafts up to G tokens from prefix y_<j (G = 16 here, the
   replay's cap, rather than the paper's 50: the toy pair's rounds never
   usefully run longer). Label 1 while the draft token equals y at that
   position, 0 from the first mismatch on. One teacher-forced pass gives the
   context hidden states and a KV cache; the cache is copied once per chain
   and all chains of a response advance together, each masked to its own
   prefix, so a response costs G batched one-token forwards. Chains are the
   only drafter-specific step: `train_on_chains` takes the builder
   (`training.pacer_eagle3` builds an EAGLE-3 head's own chains).
2. `pack`: the context hidden states and every chain of one response form one
   sequence; `heads.pacer.build_chain_mask` lets a chain starting at j see the
   context before j (the last `window` positions of it) and its own earlier
   drafts only.
3. BCE on chain tokens, AdamW; held-out BCE, accuracy and calibration.
4. An exact greedy replay on held-out responses chooses block size,
   threshold and growth: the round starting at j drafts chain j (its hidden
   states are what the draft really computes in that round), the layer's
   alphas come from the same packed pass, and the blockwise rule stops it.
   Modeled speedup S(c) = 1 / (N_T/N_gen + (N_D/N_gen)/c), cap K = 16.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_adaptive_spec.heads.fileformat import draft_identity, project_commit
from vllm_adaptive_spec.heads.pacer import HALTING, PacerConfig, PacerLayer, build_chain_mask, save_pacer, stop_lengths
from vllm_adaptive_spec.metrics import SpecCounts, replay_row, simulate_workload
from vllm_adaptive_spec.training import data
from vllm_adaptive_spec.training.specdecpp import calibration_table, is_heldout

logger = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    chain_length: int = 16  # G: draft tokens per chain (the paper: 50)
    train_stride: int = 2  # training chains start at every stride-th response position
    window: int = 64  # W: accepted context tokens the layer sees (0 = none, -1 = all)
    num_heads: int = 4
    mlp_size: int = 512
    max_draft: int = 16  # K_max position embeddings
    use_position: bool = True
    epochs: int = 5  # the paper's 5
    lr: float = 5e-4  # the paper's 5e-4
    weight_decay: float = 0.01
    batch_size: int = 8  # responses per step
    val_frac: float = 0.1
    seed: int = 0
    cap: int = 16  # K for the replay
    cost_ratio: float = 4.0  # c for the replay
    # one call of the layer, in draft steps of the drafter at batch 1, charged in the replay's S (measured:
    # benchmarks.policy_cost); 0 charges nothing and picks on counts alone
    layer_cost: float = 0.0
    replay_responses: int = 60
    block_sizes: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7)
    thresholds: tuple[float, ...] = tuple(round(0.05 * i, 2) for i in range(6, 19))
    growths: tuple[float, ...] = (1.0, 1.03, 1.05, 1.07, 1.09)
    halting: str = "mean"


@dataclass
class Chains:
    """One response's context and draft chains (CPU tensors)."""

    context: torch.Tensor  # [L', H] the draft's first-pass state at each sequence position (teacher-forced)
    offset: int  # context rows the chain at response position 0 sees (draft model: P; EAGLE-3 head: P - 1)
    starts: torch.Tensor  # [C] response position j of each chain (its first draft is y_j)
    hidden: torch.Tensor  # [C, G] + [H]: hidden state consuming each chain token
    label: torch.Tensor  # [C, G] 1 while the chain agrees with y, 0 from the first mismatch on
    valid: torch.Tensor  # [C, G] bool: the chain token lies inside the response


# (response, response positions to start chains at, chain length G) -> that response's Chains
ChainBuilder = Callable[[data.Response, list[int], int], Chains]


# -- chains (transformers draft, lazily loaded by the caller) --


def chain_labels(
    tokens: torch.Tensor, starts: torch.Tensor, response: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [C, G] drafted from response positions starts [C] on, response [R] ->
    (label [C, G]: 1 while the chain agrees with the response, valid [C, G]: inside the response)."""
    n_resp = len(response)
    where = starts[:, None] + torch.arange(tokens.shape[1])[None, :]  # [C, G] response position of each token
    valid = where < n_resp
    agree = (tokens == response[where.clamp_max(n_resp - 1)]) & valid  # [C, G]
    return agree.long().cumprod(-1).float(), valid


@torch.no_grad()
def draft_chains(draft, resp: data.Response, starts: list[int], length: int) -> Chains:
    """Greedy draft chains of `length` tokens from each prefix prompt + y_<j, j in `starts`."""
    full = resp.prompt_ids + resp.response_ids
    n_prompt, n_resp = len(resp.prompt_ids), len(resp.response_ids)
    ids = torch.tensor([full])  # [1, L]
    res = draft.model(input_ids=ids, use_cache=True)
    context = res.last_hidden_state[0]  # [L, H]
    greedy = data.log_probs(draft, context[n_prompt - 1 : n_prompt + n_resp - 1]).argmax(-1)  # [R]
    j = torch.tensor(starts, dtype=torch.long)  # [C]
    cache = res.past_key_values
    cache.batch_repeat_interleave(len(starts))
    mask = (torch.arange(len(full))[None, :] < (n_prompt + j)[:, None]).long()  # [C, L] the chain's prefix
    token, pos = greedy[j], (n_prompt + j)[:, None]  # [C], [C, 1]
    states, tokens = [], []
    for _ in range(length):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        step = draft.model(
            input_ids=token[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
        )
        cache = step.past_key_values
        h = step.last_hidden_state[:, -1]  # [C, H]
        states.append(h)
        tokens.append(token)
        token, pos = data.log_probs(draft, h).argmax(-1), pos + 1
    label, valid = chain_labels(torch.stack(tokens, 1), j, torch.tensor(resp.response_ids))
    return Chains(
        context=context.clone(),
        offset=n_prompt,
        starts=j,
        hidden=torch.stack(states, 1).contiguous(),
        label=label,
        valid=valid,
    )


# -- packing (pure) --


@dataclass
class Packed:
    hidden: torch.Tensor  # [T, H]
    draft_pos: torch.Tensor  # [T] 0 = context, i = i-th token of a chain
    mask: torch.Tensor  # [T, T] bool
    label: torch.Tensor  # [T]
    loss: torch.Tensor  # [T] bool: chain tokens inside the response


def pack(ch: Chains, window: int) -> Packed:
    """One response's context + chains as one sequence (window: -1 = full context, 0 = none)."""
    lengths = ch.valid.sum(-1).tolist()  # [C] tokens inside the response per chain
    keep = [n > 0 for n in lengths]
    starts = [ch.offset + int(j) for j, k in zip(ch.starts, keep) if k]
    lengths = [n for n in lengths if n > 0]
    sel = ch.valid
    n_ctx = ch.context.shape[0]
    g = ch.valid.shape[1]
    pos = torch.arange(1, g + 1).expand_as(ch.valid)[sel]  # [N]
    return Packed(
        hidden=torch.cat([ch.context, ch.hidden[sel]]),
        draft_pos=torch.cat([torch.zeros(n_ctx, dtype=torch.long), pos]),
        mask=build_chain_mask(n_ctx, starts, lengths, None if window < 0 else window),
        label=torch.cat([torch.zeros(n_ctx), ch.label[sel]]),
        loss=torch.cat([torch.zeros(n_ctx, dtype=torch.bool), torch.ones(len(pos), dtype=torch.bool)]),
    )


def collate(items: list[Packed]) -> Packed:
    """Pad to the longest; a padding row attends only to itself and carries no loss."""
    t = max(p.hidden.shape[0] for p in items)
    b, h = len(items), items[0].hidden.shape[1]
    out = Packed(
        hidden=torch.zeros(b, t, h),
        draft_pos=torch.zeros(b, t, dtype=torch.long),
        mask=torch.eye(t, dtype=torch.bool).repeat(b, 1, 1),
        label=torch.zeros(b, t),
        loss=torch.zeros(b, t, dtype=torch.bool),
    )
    for i, p in enumerate(items):
        n = p.hidden.shape[0]
        out.hidden[i, :n], out.draft_pos[i, :n], out.mask[i, :n, :n] = p.hidden, p.draft_pos, p.mask
        out.label[i, :n], out.loss[i, :n] = p.label, p.loss
    return out


def bce(logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, label)


# -- training and evaluation --


def predict(layer: PacerLayer, chains: list[Chains], window: int, batch: int = 8) -> list[torch.Tensor]:
    """Per response: alpha [C, G] for every chain token (NaN outside the response)."""
    out = []
    with torch.no_grad():
        for i in range(0, len(chains), batch):
            group = chains[i : i + batch]
            packed = [pack(c, window) for c in group]
            b = collate(packed)
            alpha = torch.sigmoid(layer(b.hidden, b.draft_pos, b.mask))  # [b, T]
            for k, (c, p) in enumerate(zip(group, packed)):
                full = torch.full(c.valid.shape, float("nan"))
                full[c.valid] = alpha[k, : p.hidden.shape[0]][p.loss]
                out.append(full)
    return out


def evaluate(alphas: list[torch.Tensor], chains: list[Chains], prior: float) -> dict[str, Any]:
    p = torch.cat([a[c.valid] for a, c in zip(alphas, chains)])
    y = torch.cat([c.label[c.valid] for c in chains])
    logits = torch.logit(p.clamp(1e-6, 1 - 1e-6))
    const = torch.full_like(y, prior)
    return {
        "examples": len(y),
        "mean_label": round(float(y.mean()), 4),
        "mean_predicted": round(float(p.mean()), 4),
        "bce": round(float(bce(logits, y)), 4),
        "bce_constant_baseline": round(float(bce(torch.logit(const), y)), 4),
        "accuracy": round(float(((p > 0.5).float() == y).float().mean()), 4),
        "accuracy_constant_baseline": round(float(max(y.mean(), 1 - y.mean())), 4),
        "calibration": calibration_table(p, y),
    }


def fit(chains: list[Chains], cfg: TrainConfig, progress: bool = True) -> tuple[PacerLayer, list]:
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    h = chains[0].context.shape[1]
    layer = PacerLayer(PacerConfig(h, cfg.num_heads, cfg.mlp_size, cfg.max_draft, cfg.use_position))
    opt = torch.optim.AdamW(layer.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.epochs * math.ceil(len(chains) / cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=max(steps, 1), pct_start=0.05)
    gen = torch.Generator().manual_seed(cfg.seed)
    history = []
    for epoch in tqdm(range(cfg.epochs), desc="train pre-verifier", disable=not progress):
        order = torch.randperm(len(chains), generator=gen).tolist()
        total, seen = 0.0, 0
        for i in range(0, len(order), cfg.batch_size):
            b = collate([pack(chains[k], cfg.window) for k in order[i : i + cfg.batch_size]])
            logits = layer(b.hidden, b.draft_pos, b.mask)  # [b, T]
            loss = bce(logits[b.loss], b.label[b.loss])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            n = int(b.loss.sum())
            total, seen = total + float(loss.detach()) * n, seen + n
        history.append({"epoch": epoch + 1, "bce": round(total / max(seen, 1), 4)})
    return layer.eval().requires_grad_(False), history


# -- exact greedy replay --


def replay_counts(
    alphas: list[torch.Tensor], chains: list[Chains], k: int, block: int, threshold: float, growth: float, rule: str
) -> tuple[SpecCounts, int]:
    """Greedy speculative decoding of each held-out response with the blockwise rule: the counts
    (N_drawn included) and the number of layer calls.

    Chains must start at every response position. The round at j drafts chain j;
    its length is the rule's on alpha[j, :limit], its accepted count the chain's
    agreeing run (capped by the length). As in the policy, the block of drafts t-b+1..t
    is judged at draft step t (0-based), after y_t was drawn: a round that halts at
    length t drew t + 1 drafts and called the layer t / b times; one that runs to its
    limit L drew L and called it floor((L - 1) / b) times.
    """
    total = SpecCounts(accepted_per_pos=[0] * k, drafted_per_pos=[0] * k)
    calls = 0
    for alpha, ch in zip(alphas, chains):
        n = ch.label.shape[0]
        runs = ch.label.sum(-1).long().tolist()  # [R] agreeing run of each chain
        # A smaller cap L only cuts: the rule's length under L is min(its length under k, L)
        # (alpha is NaN only past the response's end, beyond any round's cap).
        lengths = stop_lengths(alpha[:, :k], block, threshold, growth, rule).tolist()  # [R]
        total.record_step(0, 0)  # the prefill pass emits token 0 and verifies no drafts (as the engine)
        i = 1
        while i < n:
            limit = min(k, n - 1 - i)  # never past the response's end (vLLM: max_tokens)
            length = min(lengths[i], limit)
            halted = lengths[i] < limit  # the rule fired before the round's limit (lengths == k: it never fired)
            acc = min(length, runs[i])
            total.record_step(length, acc)
            total.n_drawn += length + halted
            calls += length // block if halted else (length - 1) // block if length else 0
            i += acc + 1
    return total, calls


def replay_row_charged(key: dict, counts: SpecCounts, calls: int, cfg: TrainConfig) -> dict:
    """`replay_row` with the layer's calls charged at cfg.layer_cost draft steps each."""
    row = replay_row(key, counts, cfg.cost_ratio)
    overhead = calls * cfg.layer_cost / (cfg.cost_ratio * counts.n_gen)  # in target steps per generated token
    return row | {
        "layer_calls_per_token": round(calls / counts.n_gen, 4),
        "speedup": round(counts.modeled_speedup(cfg.cost_ratio, overhead), 4),
    }


def replay_grid(alphas: list[torch.Tensor], chains: list[Chains], cfg: TrainConfig) -> dict[str, Any]:
    """Every (block, threshold, growth) under cfg.halting, beside fixed K and the oracle."""
    c = cfg.cost_ratio
    rows = [
        replay_row_charged(
            {"block_size": b, "threshold": t, "growth": g},
            *replay_counts(alphas, chains, cfg.cap, b, t, g, cfg.halting),
            cfg,
        )
        for b, t, g in itertools.product(cfg.block_sizes, cfg.thresholds, cfg.growths)
    ]
    matches = [ch.label[:, 0].bool().tolist() for ch in chains]
    fixed = [replay_row({"fixed_k": k}, simulate_workload(matches, k), c) for k in range(1, cfg.cap + 1)]
    oracle = replay_row({"oracle_cap": cfg.cap}, simulate_workload(matches, cfg.cap, oracle=True), c)
    best = max(rows, key=lambda r: r["speedup"])
    paper = next((r for r in rows if (r["block_size"], r["threshold"], r["growth"]) == (4, 0.7, 1.05)), None)
    return {
        "responses": len(chains),
        "cap": cfg.cap,
        "cost_ratio": c,
        "layer_cost": cfg.layer_cost,
        "halting": cfg.halting,
        "note": (
            "fixed-K and oracle rows count drafts past a response's end; the Pacer rows do not, and charge"
            " N_drawn (a halted round drew the draft it dropped) and layer_cost per layer call"
        ),
        "best": best,
        "paper_defaults": paper,
        "best_fixed_k": max(fixed, key=lambda r: r["speedup"]),
        "oracle": oracle,
        "fixed": fixed,
        "grid": rows,
    }


# -- the pipeline --


def build_chains(
    chains_of: ChainBuilder, responses: list[data.Response], cfg: TrainConfig, every: list[bool]
) -> list[Chains]:
    """Chains per response: every position where every[i], else every train_stride-th."""
    from tqdm import tqdm

    out = []
    for resp, all_starts in tqdm(list(zip(responses, every)), desc="draft chains"):
        stride = 1 if all_starts else cfg.train_stride
        out.append(chains_of(resp, list(range(0, len(resp.response_ids), stride)), cfg.chain_length))
    return out


def train_pacer(
    target: str | Path,
    draft: str | Path,
    responses: list[data.Response],
    out: str | Path | None,
    cfg: TrainConfig,
    extra_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The pipeline on an independent draft model's chains (`draft_chains`)."""
    chains_of = functools.partial(draft_chains, data.load_causal_lm(draft))
    return train_on_chains(chains_of, target, draft, responses, out, cfg, extra_meta)


def train_on_chains(
    chains_of: ChainBuilder,
    target: str | Path,
    draft: str | Path,
    responses: list[data.Response],
    out: str | Path | None,
    cfg: TrainConfig,
    extra_meta: dict[str, Any] | None = None,
    drafter_method: str = "draft_model",
) -> dict[str, Any]:
    """Chains (from `chains_of`), training, evaluation, replay; saves the layer (unless out is None),
    tied to `draft` by its fingerprint, and returns the report."""
    if cfg.halting not in HALTING:
        raise ValueError(f"halting must be one of {HALTING}, got {cfg.halting!r}")
    started = time.perf_counter()
    val = [is_heldout(r, cfg.val_frac) for r in responses]
    replay_ids = [i for i, v in enumerate(val) if v and responses[i].mode == "greedy"][: cfg.replay_responses]
    chains = build_chains(chains_of, responses, cfg, [i in set(replay_ids) for i in range(len(responses))])
    train = [c for c, v in zip(chains, val) if not v]
    heldout = [c for c, v in zip(chains, val) if v]
    built = time.perf_counter()
    layer, history = fit(train, cfg)
    trained = time.perf_counter()
    prior = float(torch.cat([c.label[c.valid] for c in train]).mean())
    metrics = {
        "train": evaluate(predict(layer, train, cfg.window), train, prior),
        "heldout": evaluate(predict(layer, heldout, cfg.window), heldout, prior),
    }
    replay_chains = [chains[i] for i in replay_ids]
    replay = replay_grid(predict(layer, replay_chains, cfg.window), replay_chains, cfg) if replay_chains else {}
    best = replay.get("best") or {"block_size": 4, "threshold": 0.7, "growth": 1.05}
    choice = (
        f"maximise modeled speedup S(c={cfg.cost_ratio}) at cap K={cfg.cap} in an exact greedy replay of "
        f"{len(replay_chains)} held-out responses ({cfg.halting} halting; each layer call charged "
        f"{cfg.layer_cost} draft steps)"
        if replay_chains
        else "the paper's defaults: no held-out greedy responses to replay"
    )
    meta = {
        "draft": draft_identity(draft),
        "drafter_method": drafter_method,
        "block_size": best["block_size"],
        "threshold": best["threshold"],
        "growth": best["growth"],
        "halting": cfg.halting,
        "context_window": cfg.window if cfg.window > 0 else 1_000_000,
        "settings_choice": choice,
        "training_data": {
            "target": Path(str(target)).name,
            **data.summarize(responses),
            "chain_length": cfg.chain_length,
            "train_stride": cfg.train_stride,
            "train_chain_tokens": metrics["train"]["examples"],
            "heldout_chain_tokens": metrics["heldout"]["examples"],
            **(extra_meta or {}),
        },
        "metrics": {
            name: {k: m[k] for k in ("bce", "bce_constant_baseline", "accuracy", "examples")}
            for name, m in metrics.items()
        },
        "commit": project_commit(),
    }
    if out is not None:
        save_pacer(out, layer, meta)
    report = {
        "config": asdict(cfg),
        "meta": meta,
        "parameters": sum(p.numel() for p in layer.parameters()),
        "history": history,
        "metrics": metrics,
        "replay": replay,
        "seconds": {
            "chains": round(built - started, 1),
            "train": round(trained - built, 1),
            "eval_replay": round(time.perf_counter() - trained, 1),
        },
    }
    logger.info(
        "pre-verifier: BCE train %.4f held-out %.4f; block %s threshold %s growth %s",
        metrics["train"]["bce"],
        metrics["heldout"]["bce"],
        best["block_size"],
        best["threshold"],
        best["growth"],
    )
    return report
