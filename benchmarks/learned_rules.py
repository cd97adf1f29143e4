"""Does an EAGLE-3 head's own state say more about acceptance than its distribution q_t does?

    .venv/bin/python -m benchmarks.learned_rules --responses /tmp/prose.jsonl \\
        --out benchmarks/results/learned_rules/prose_halves.json
    .venv/bin/python -m benchmarks.learned_rules --responses /tmp/code.jsonl --test-responses /tmp/prose.jsonl \\
        --out benchmarks/results/learned_rules/code_to_prose.json

The confidence rule reads one number of q_t; the SpecDec++ head reads the head's state h_t (the state
q_t's logits come from). This fits acceptance estimators p_t = P(y_t accepted | the drafts before it
accepted) on the head's own greedy chains of one set of training responses and replays them, exactly as
`tune` does (`training/tune.py`), on another set: the two halves of --responses split by a fixed hash of
the prompt (each half in turn), or --test-responses. Estimators: logistic regression and a small MLP on
(log q_max, H(q_t), t), an MLP on h_t with them, an MLP on h_t alone, and the small MLP given also the
target's own confidence where the round starts (log max and entropy of the target distribution that
produced the round's first token, known from verification before the round drafts: a signal no draft-side
rule has; the plugin does not read it). Each stops after y_t once its
estimate (the step's, or the running product over the round) falls below a threshold chosen on the
training side's replay; the confidence rule and its running product are chosen alike. Scores: S at
--cost-ratio on the test side and the share of the oracle's gain over the best fixed K.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from benchmarks.paths import EAGLE3_HEAD, TARGET
from vllm_adaptive_spec.heads.eagle3 import load_hf_dir
from vllm_adaptive_spec.policies.base import entropy
from vllm_adaptive_spec.training import data
from vllm_adaptive_spec.training.specdecpp_eagle3 import response_chains
from vllm_adaptive_spec.training.tune import TuneConfig, baselines, replay_rule, stop_lengths

CAP = 16
GRID = [round(0.05 * i, 2) for i in range(1, 20)]
# name -> (reads the state, reads q features, reads the target's confidence, MLP width; 0: logistic regression)
ESTIMATORS = {
    "logistic (q, H, t)": (False, True, False, 0),
    "mlp (q, H, t)": (False, True, False, 32),
    "mlp (state, q, H, t)": (True, True, False, 64),
    "mlp (state)": (True, False, False, 64),
    "mlp (q, H, t, target's confidence)": (False, True, True, 32),
}


class Chains:
    """One response's chains: runs [C], per step t the head's state [C, K, H], q_max and H(q_t) [C, K], and
    per chain the target's log max probability and entropy where the round starts [C, 2]."""

    def __init__(self, runs, states, q_max, ent, target, side: int):
        self.runs, self.states, self.q_max, self.entropy, self.target, self.side = (
            runs,
            states,
            q_max,
            ent,
            target,
            side,
        )

    def inputs(self, state: bool, q: bool, target: bool = False) -> torch.Tensor:
        """[C, K, F]: the estimator's inputs at every step."""
        parts = [self.target[:, None, :].expand(-1, CAP, -1)] if target else []
        if q:
            t = (torch.arange(CAP, dtype=torch.float32) / CAP).expand_as(self.q_max)
            parts.append(torch.stack([self.q_max.clamp_min(1e-6).log(), self.entropy, t], -1))
        if state:
            parts.append(self.states)
        return torch.cat(parts, -1)

    def labelled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask [C, K]: steps up to the first disagreement, label [C, K]: the step's draft agreed)."""
        t = torch.arange(CAP)[None, :]
        return t <= self.runs[:, None], (t < self.runs[:, None]).float()


def _side(resp: data.Response) -> int:
    return int(hashlib.sha256(str(resp.prompt_ids).encode()).hexdigest(), 16) % 2


@torch.no_grad()
def all_chains(path: Path, side: int | None) -> list[Chains]:
    """The bundled head's greedy chain from every position of each response (side None: split by hash)."""
    target_lm = data.load_causal_lm(TARGET)
    head, head_cfg = load_hf_dir(EAGLE3_HEAD, target_lm.get_input_embeddings().weight)
    head.eval()
    out = []
    for r in data.load_responses(path):
        if r.mode != "greedy" or len(r.response_ids) <= 2:
            continue
        states, runs = response_chains(head, target_lm, r, CAP, head_cfg.aux_layer_ids)
        logp = torch.log_softmax(head.logits(states), dim=-1, dtype=torch.float32)  # [C, K, V]
        # chain i starts at position c = len(prompt) - 1 + i, whose target distribution drew its first token
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        target_logp = torch.log_softmax(target_lm(input_ids=ids).logits[0].float(), dim=-1)  # [L, V]
        starts = torch.arange(len(r.prompt_ids) - 1, len(r.prompt_ids) - 1 + len(runs))
        conf = torch.stack([target_logp[starts].amax(-1), entropy(target_logp[starts])], -1)  # [C, 2]
        out.append(
            Chains(runs, states.float(), logp.amax(-1).exp(), entropy(logp), conf, _side(r) if side is None else side)
        )
    return out


def fit(train: list[Chains], state: bool, q: bool, target: bool, hidden: int, epochs: int = 8):
    """An acceptance estimator fitted by BCE on the training chains -> (chains -> p [C, K])."""
    torch.manual_seed(0)
    xs, ys = [], []
    for c in train:
        mask, label = c.labelled()
        xs.append(c.inputs(state, q, target)[mask])
        ys.append(label[mask])
    x, y = torch.cat(xs), torch.cat(ys)
    mu, sd = x.mean(0), x.std(0) + 1e-4
    width = x.shape[1]
    model = nn.Sequential(nn.Linear(width, hidden), nn.SiLU(), nn.Linear(hidden, 1)) if hidden else nn.Linear(width, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-3)
    for _ in range(epochs):
        for idx in torch.randperm(len(y)).split(1024):
            loss = nn.functional.binary_cross_entropy_with_logits(model((x[idx] - mu) / sd).squeeze(-1), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()

    @torch.no_grad()
    def predict(c: Chains) -> torch.Tensor:
        return torch.sigmoid(model((c.inputs(state, q, target) - mu) / sd).squeeze(-1))

    return predict


def heldout_bce(predict, test: list[Chains]) -> float:
    total, n = 0.0, 0
    for c in test:
        mask, label = c.labelled()
        p = predict(c)[mask].clamp(1e-6, 1 - 1e-6)
        total += float(-(label[mask] * p.log() + (1 - label[mask]) * (1 - p).log()).sum())
        n += int(mask.sum())
    return total / max(n, 1)


def compare(train: list[Chains], test: list[Chains], cfg: TuneConfig) -> dict:
    """Every rule's threshold chosen on `train`, scored on `test`."""
    base = baselines(test, cfg)
    fixed, oracle = base["best_fixed"]["speedup"], base["oracle"]["speedup"]

    def score(signal) -> dict:  # signal: chains -> [C, K] (stop after y_t once below the threshold)
        sig_train, sig_test = [signal(c) for c in train], [signal(c) for c in test]
        chosen = max(
            GRID, key=lambda a: replay_rule(train, [stop_lengths(s < a) for s in sig_train], cfg, {})["speedup"]
        )
        s = replay_rule(test, [stop_lengths(x < chosen) for x in sig_test], cfg, {})["speedup"]
        return {"threshold": chosen, "S": round(s, 4), "oracle_gain_share": round((s - fixed) / (oracle - fixed), 4)}

    rules = {"confidence": score(lambda c: c.q_max), "cumulative confidence": score(lambda c: c.q_max.cumprod(-1))}
    bce = {}
    for name, (state, q, target, hidden) in ESTIMATORS.items():
        predict = fit(train, state, q, target, hidden)
        bce[name] = round(heldout_bce(predict, test), 4)
        rules[f"{name}, step"] = score(predict)
        rules[f"{name}, running product"] = score(lambda c, f=predict: f(c).cumprod(-1))
    return {"best_fixed": base["best_fixed"], "oracle": base["oracle"], "test_bce": bce, "rules": rules}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responses", type=Path, required=True, help="greedy training responses (tune --responses)")
    ap.add_argument("--test-responses", type=Path, help="score on these instead of the other half")
    ap.add_argument("--cost-ratio", type=float, default=4.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cfg = TuneConfig(cap=CAP, cost_ratio=args.cost_ratio)
    if args.test_responses:
        splits = [(all_chains(args.responses, 0), all_chains(args.test_responses, 1))]
    else:
        chains = all_chains(args.responses, None)
        halves = [[c for c in chains if c.side == s] for s in (0, 1)]
        splits = [(halves[0], halves[1]), (halves[1], halves[0])]
    runs = [compare(train, test, cfg) | {"train_responses": len(train), "test_responses": len(test)}
            for train, test in splits]  # fmt: skip
    mean = {k: round(sum(r["rules"][k]["oracle_gain_share"] for r in runs) / len(runs), 4) for k in runs[0]["rules"]}
    for name, share in mean.items():
        print(f"{name:40s} {100 * share:5.1f}% of the oracle's gain")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {k: str(v) for k, v in vars(args).items()} | {"cap": CAP, "mean_share": mean, "runs": runs}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
