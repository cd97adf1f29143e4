"""Training-free stopping rules beyond svip and confidence, replayed on an EAGLE-3 head's chains.

    .venv/bin/python -m benchmarks.rule_variants --responses /tmp/prose.jsonl --val-frac 1.0 \\
        --out benchmarks/results/rule_variants/prose.json

Asks whether another rule over the same per-step signals (q_t's max
probability and entropy) captures more of the oracle's gain than the
confidence rule. Same exact greedy replay as `vllm-adaptive-spec tune`
(`training/tune.py`: the head's own chain from every position of the
held-out *training* responses, cap 16, S at --cost-ratio), each rule at its
best setting on a grid:
- confidence: stop after y_t once q_t(y_t) < a (the policy);
- svip: once H(q_t) > h^2 / 0.15 (the policy);
- cumulative confidence: once prod_{j<=t} q_j(y_j) < a (SpecDec++'s rule with
  the draft's own confidence as the acceptance estimate);
- the same with a depth factor: prod_{j<=t} q_j(y_j) * g^t < a;
- confidence with one threshold for the first draft and another after;
- confidence or entropy: q_t(y_t) < a or H(q_t) > b.
Every rule keeps y_t and only stops after it, so each would be lossless as a
policy. The responses file is the one `tune --responses FILE` writes.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.paths import EAGLE3_HEAD, TARGET
from vllm_adaptive_spec.training import data
from vllm_adaptive_spec.training.tune import (
    SVIP_ENTROPY_SCALE,
    ChainFeatures,
    TuneConfig,
    baselines,
    heldout_features,
    replay_rule,
    stop_lengths,
)

CAP = 16
Rule = Callable[[ChainFeatures, tuple], torch.Tensor]  # (features, setting) -> stop after step t [C, K]

RULES: dict[str, tuple[Rule, list[tuple]]] = {
    "confidence": (lambda f, s: f.q_max < s[0], [(round(0.05 * i, 2),) for i in range(1, 19)]),
    "svip": (
        lambda f, s: f.entropy > s[0] ** 2 / SVIP_ENTROPY_SCALE,
        [(round(0.05 * i, 2),) for i in range(1, 25)],
    ),
    "cumulative confidence": (
        lambda f, s: f.q_max.cumprod(-1) < s[0],
        [(round(0.025 * i, 3),) for i in range(1, 36)],
    ),
    "cumulative confidence x g^t": (
        lambda f, s: f.q_max.cumprod(-1) * s[0] ** torch.arange(1, CAP + 1) < s[1],
        list(itertools.product((0.8, 0.9, 0.95, 1.0, 1.05, 1.1), (0.3, 0.4, 0.5, 0.6, 0.7, 0.8))),
    ),
    "confidence, first / later": (
        lambda f, s: torch.cat([f.q_max[:, :1] < s[0], f.q_max[:, 1:] < s[1]], 1),
        list(itertools.product((0.3, 0.4, 0.5, 0.6, 0.7, 0.8), (0.6, 0.65, 0.7, 0.75, 0.8, 0.85))),
    ),
    "confidence or entropy": (
        lambda f, s: (f.q_max < s[0]) | (f.entropy > s[1]),
        list(itertools.product((0.5, 0.6, 0.65, 0.7, 0.75, 0.8), (0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5))),
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responses", type=Path, required=True, help="greedy target responses (tune --responses)")
    ap.add_argument("--val-frac", type=float, default=0.1, help="held-out share (tune's --val-frac)")
    ap.add_argument("--replay-responses", type=int, default=200)
    ap.add_argument("--cost-ratio", type=float, default=4.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = TuneConfig(
        cap=CAP, cost_ratio=args.cost_ratio, val_frac=args.val_frac, replay_responses=args.replay_responses
    )
    feats, held = heldout_features(TARGET, EAGLE3_HEAD, data.load_responses(args.responses), cfg)
    base = baselines(feats, cfg)
    fixed, oracle = base["best_fixed"], base["oracle"]
    best = {}
    for name, (rule, grid) in RULES.items():
        rows = [replay_rule(feats, [stop_lengths(rule(f, s)) for f in feats], cfg, {"setting": list(s)}) for s in grid]
        top = max(rows, key=lambda r: r["speedup"])
        share = (top["speedup"] - fixed["speedup"]) / (oracle["speedup"] - fixed["speedup"])
        best[name] = top | {"oracle_gain_share": round(share, 4)}
        print(f"{name}: {top['setting']} S {top['speedup']} tau {top['tau']} ({100 * share:.1f}% of the oracle's gain)")
    print(f"best fixed K: {fixed}\noracle: {oracle}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {**{k: str(v) for k, v in vars(args).items()}, "responses_replayed": len(held), "cap": CAP}
    doc |= {"best_fixed": fixed, "oracle": oracle, "rules": best}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
