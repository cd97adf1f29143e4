"""Training data for acceptance heads (SpecDec++ seed 001, ALGORITHMS.md).

The target generates a response y to each prompt (through vLLM,
`integration.datagen`). Draft and target then run teacher-forced over
prompt + y. At response position i the draft proposes z_i (argmax q_i in
greedy mode, z_i ~ q_i in sampling mode) and the label says whether the target
would accept it: a_i = 1[z_i == argmax p_i] (greedy) or
a_i = min(1, p_i(z_i) / q_i(z_i)) (sampling). Token mixing: the draft's input
holds y_i with probability r, else z_i; the head reads the draft's final hidden
state at the positions holding z_i, and only those carry a loss.

The pure tensor functions come first; the model passes (transformers, loaded
lazily) after them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

MODES = ("greedy", "sampling")


@dataclass
class Response:
    prompt_ids: list[int]  # as the target's tokenizer encoded the prompt (BOS first)
    response_ids: list[int]  # the target's generated tokens
    mode: str  # "greedy" or "sampled": how the target generated it


def greedy_labels(draft_logp: torch.Tensor, target_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_logp, target_logp: [N, V] -> z [N] = argmax q, a [N] = 1[z == argmax p] (float)."""
    z = draft_logp.argmax(-1)  # [N]
    return z, (z == target_logp.argmax(-1)).float()


def sampling_labels(
    draft_logp: torch.Tensor, target_logp: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_logp, target_logp: [N, V] -> z [N] ~ q, a [N] = min(1, p(z) / q(z))."""
    z = torch.multinomial(draft_logp.exp(), 1, generator=generator).squeeze(-1)  # [N]
    log_ratio = target_logp.gather(-1, z[:, None]) - draft_logp.gather(-1, z[:, None])  # [N, 1]
    return z, log_ratio.squeeze(-1).clamp_max(0.0).exp()


def mix_tokens(
    y: torch.Tensor, z: torch.Tensor, r: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token mixing: y, z [N] -> (inputs [N], holds_z [N] bool).

    Each position keeps the target's y_i with probability r, else takes the
    draft's z_i. Only positions holding z_i carry a label.
    """
    holds_z = torch.rand(y.shape, generator=generator) >= r  # [N]
    return torch.where(holds_z, z, y), holds_z


# -- model passes (transformers, lazily imported) --


def load_causal_lm(path: str | Path):
    """A local HF causal LM in float32, eval mode, never touching the hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def final_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """ids: [B, T] -> the final hidden state after the last norm [B, T, H] (what vLLM's draft returns)."""
    return model.model(input_ids=ids).last_hidden_state


@torch.no_grad()
def log_probs(model, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """hidden: [..., H] -> log-distribution over the vocabulary [..., V] (float32)."""
    logits = model.lm_head(hidden).float()
    return torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)


@dataclass
class Example:
    """One response's labelled positions (all tensors on CPU)."""

    hidden: torch.Tensor  # [n, H] draft hidden state at positions holding z_i
    label: torch.Tensor  # [n] acceptance label a_i
    clean_hidden: torch.Tensor  # [R, H] draft hidden state consuming y_i (unmixed), for replay
    match: torch.Tensor  # [R] bool: the draft's greedy token equals y_i given y_<i
    draft_greedy: torch.Tensor  # [R] the draft's greedy token at each response position


@torch.no_grad()
def label_response(
    draft,
    target,
    resp: Response,
    mode: str = "greedy",
    mix: float = 0.15,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> Example:
    """Teacher-forced passes over one prompt + response and its labelled, mixed draft pass."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    n_prompt, n_resp = len(resp.prompt_ids), len(resp.response_ids)
    ids = torch.tensor([resp.prompt_ids + resp.response_ids])  # [1, P + R]
    clean = final_hidden(draft, ids)[0]  # [P + R, H]
    before = slice(n_prompt - 1, n_prompt + n_resp - 1)  # positions whose output predicts response token i
    temp = temperature if mode == "sampling" else 0.0
    q = log_probs(draft, clean[before], temp)  # [R, V]
    p = log_probs(target, final_hidden(target, ids)[0, before], temp)  # [R, V]
    y = ids[0, n_prompt:]  # [R]
    if mode == "greedy":
        z, a = greedy_labels(q, p)
    else:
        z, a = sampling_labels(q, p, generator)
    mixed, holds_z = mix_tokens(y, z, mix, generator)  # [R], [R]
    mixed_ids = torch.cat([ids[0, :n_prompt], mixed])[None]  # [1, P + R]
    h = final_hidden(draft, mixed_ids)[0, n_prompt:]  # [R, H] hidden consuming the mixed token
    greedy = q.argmax(-1)  # [R]
    return Example(
        hidden=h[holds_z].clone(),
        label=a[holds_z].clone(),
        clean_hidden=clean[n_prompt:].clone(),
        match=greedy == y,
        draft_greedy=greedy,
    )


@torch.no_grad()
def branch_rollouts(draft, resp: Response, positions: list[int], length: int, batch: int = 32) -> torch.Tensor:
    """Greedy draft rollouts that start with the draft's own (wrong) token at response positions.

    For each response index j in `positions`, the prefix is prompt + y_<j, the
    first input is the draft's greedy token at j, and the draft continues
    greedily. Returns the hidden states consuming each rollout token
    [len(positions), length, H]: what the draft sees inside a round after its
    first rejected token, needed to replay greedy rounds exactly.
    """
    full = resp.prompt_ids + resp.response_ids
    n_prompt = len(resp.prompt_ids)
    out = []
    for start in range(0, len(positions), batch):
        chunk = positions[start : start + batch]
        prefixes = [full[: n_prompt + j] for j in chunk]
        width = max(len(x) for x in prefixes)
        pad = [width - len(x) for x in prefixes]
        ids = torch.tensor([[0] * k + x for k, x in zip(pad, prefixes)])  # [b, W] left-padded
        mask = torch.tensor([[0] * k + [1] * len(x) for k, x in zip(pad, prefixes)])  # [b, W]
        pos = (mask.cumsum(-1) - 1).clamp_min(0)  # [b, W]
        res = draft.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache = res.past_key_values
        token = log_probs(draft, res.last_hidden_state[:, -1]).argmax(-1)  # [b] the wrong token at j
        next_pos = pos[:, -1:] + 1  # [b, 1]
        states = []
        for _ in range(length):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            step = draft.model(
                input_ids=token[:, None], attention_mask=mask, position_ids=next_pos, past_key_values=cache
            )
            cache = step.past_key_values
            h = step.last_hidden_state[:, -1]  # [b, H]
            states.append(h)
            token = log_probs(draft, h).argmax(-1)
            next_pos = next_pos + 1
        out.append(torch.stack(states, dim=1))  # [b, length, H]
    return torch.cat(out) if out else torch.zeros(0, length, draft.config.hidden_size)


def save_responses(responses: list[Response], path: str | Path) -> None:
    import json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for r in responses:
            fh.write(json.dumps({"prompt_ids": r.prompt_ids, "response_ids": r.response_ids, "mode": r.mode}) + "\n")


def load_responses(path: str | Path) -> list[Response]:
    import json

    with open(path) as fh:
        return [Response(**json.loads(line)) for line in fh if line.strip()]


def summarize(responses: list[Response]) -> dict[str, Any]:
    return {
        "responses": len(responses),
        "response_tokens": sum(len(r.response_ids) for r in responses),
        "prompt_tokens": sum(len(r.prompt_ids) for r in responses),
        "modes": sorted({r.mode for r in responses}),
    }
