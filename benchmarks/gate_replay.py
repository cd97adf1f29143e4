"""The batch gate at batch 1 on the training replay: does it add to a rule, and which estimator serves it?

    .venv/bin/python -m benchmarks.gate_replay --out benchmarks/results/gate_replay/draft_model.json

For each prompt family (the first --n prompts of its training file; the toy target's greedy responses,
128 tokens, generated through vLLM into --cache, an ignored folder, when missing), the bundled draft model's rounds are
replayed teacher-forced at cap 16, one request at a time, through the real `BatchGate`: each rule alone,
and each rule with the gate on its bundled cost curves, once with the estimator the gate uses
(`BinnedAcceptanceEstimator`, refitted every 50 rounds) and once with vLLM's (`OnlineAcceptanceEstimator`,
one damped Newton step every 100 rounds, what the gate used before). The gate starts cold, as in a new
engine, and sees the responses in order. Rules: copy 0.7 (its repeat evidence handed to the gate as
`CopyPolicy.gate_top` hands it) and confidence 0.4 / 0.6. Prints and saves S at --cost-ratio, S priced
on the gate's bundled curves, and tau; no policy or gate time is charged (the gate's own work is extra
on a real engine).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from benchmarks.copy_signal import CAP, draft_model_chains
from benchmarks.paths import DRAFT, TARGET
from vllm_adaptive_spec.metrics import modeled_speedup, priced_speedup
from vllm_adaptive_spec.policies.acceptance import OnlineAcceptanceEstimator
from vllm_adaptive_spec.policies.batch_gate import BatchGate
from vllm_adaptive_spec.policies.copy import REPEAT_LOG_Q
from vllm_adaptive_spec.policies.costs import DEFAULT_COSTS
from vllm_adaptive_spec.training import data
from vllm_adaptive_spec.training.tune import batch1_prices

FAMILIES = {"code": "benchmarks/prompts/code_train.jsonl", "prose": "benchmarks/prompts/prose_train.jsonl"}
RULES = {  # name -> (threshold, the repeat counts as confident for the gate)
    "copy 0.7": (0.7, True),
    "confidence 0.4": (0.4, False),
    "confidence 0.6": (0.6, False),
}


def new_gate(estimator: str) -> BatchGate | None:
    if estimator == "none":
        return None
    if estimator == "binned":
        return BatchGate(DEFAULT_COSTS)
    gate = BatchGate(DEFAULT_COSTS, refit_interval=100)
    gate.estimator = OnlineAcceptanceEstimator(CAP + 1)
    return gate


def replay(chains: list[tuple], rule: str, gate: BatchGate | None, c: float) -> dict:
    """Greedy speculation over each response, one request at a time; chains: (runs [C], q_max [C, cap],
    repeats [C, cap]) per response."""
    threshold, copies = RULES[rule]
    n_gen = n_target = drawn = 0
    passes: dict[int, int] = {0: 0}
    for r, (runs, q, rep) in enumerate(chains):
        runs, q, rep = runs.tolist(), q.tolist(), rep.tolist()
        n = len(runs) + 1
        n_gen, n_target, passes[0] = n_gen + n, n_target + 1, passes[0] + 1  # the prefill: token 0
        i = 1
        while i < n:
            cap, chain = min(CAP, n - i - 1), i - 1
            if cap == 0:  # the last token: a pass with no draft
                n_target, passes[0], i = n_target + 1, passes[0] + 1, i + 1
                continue
            req = [f"r{r}"]
            if gate is not None:
                gate.start_round(req, cap)
            for t in range(cap):
                repeats = copies and rep[chain][t]
                log_q = math.log(max(q[chain][t], 1e-30))
                top = max(log_q, REPEAT_LOG_Q) if repeats else log_q
                drafting = t + 1 < cap and (repeats or q[chain][t] >= threshold)
                pays = gate.after_step([top], [True], [drafting], [t + 1], t) if gate is not None else True
                if not (drafting and pays):
                    break
            length = t + 1
            accepted = min(runs[chain], length)
            if gate is not None:
                gate.finish_round()
                gate.end_round(req, [length], [accepted])
            n_target, drawn = n_target + 1, drawn + length
            passes[length] = passes.get(length, 0) + 1
            i += accepted + 1
    verify, draft = batch1_prices(None, CAP)
    return {
        "speedup": round(modeled_speedup(n_gen, n_target, drawn, c), 4),
        "speedup_priced": round(priced_speedup(n_gen, passes, drawn, verify, draft), 4),
        "tau": round(n_gen / n_target, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=75, help="training prompts per family (the first n)")
    ap.add_argument("--cost-ratio", type=float, default=5.6)
    ap.add_argument("--cache", type=Path, default=Path("benchmarks/results/_runs/gate_replay"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = data.load_causal_lm(DRAFT)
    result = {"settings": vars(args) | {"cache": str(args.cache), "out": str(args.out)}, "families": {}}
    for family, prompts_file in FAMILIES.items():
        path = args.cache / f"{family}_{args.n}.jsonl"
        if not path.exists():
            from vllm_adaptive_spec.integration.datagen import generate_responses

            lines = Path(prompts_file).read_text().splitlines()[: args.n]
            prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
            path.parent.mkdir(parents=True, exist_ok=True)
            data.save_responses(generate_responses(TARGET, prompts, 128, ("greedy",), 1.0, 0), path)
        resps = [r for r in data.load_responses(path) if r.mode == "greedy" and len(r.response_ids) > 2]
        chains = []
        for resp in resps:
            feats, rep = draft_model_chains(lm, resp)
            chains.append((feats.runs, feats.q_max, rep))
        rows = {}
        for rule in RULES:
            alone = replay(chains, rule, None, args.cost_ratio)
            rows[rule] = {"alone": alone}
            for estimator in ("binned", "vllm"):
                got = replay(chains, rule, new_gate(estimator), args.cost_ratio)
                got["vs_alone"] = round(got["speedup"] / alone["speedup"], 4)
                rows[rule][f"gate, {estimator} estimator"] = got
            print(
                f"{family} {rule}: alone S {alone['speedup']:.3f} tau {alone['tau']:.2f}; "
                + "; ".join(
                    f"{k} {v['speedup']:.3f} ({v['vs_alone']:.3f}x) tau {v['tau']:.2f}"
                    for k, v in rows[rule].items()
                    if k != "alone"
                ),
                flush=True,
            )
        result["families"][family] = {"responses": len(resps), "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
