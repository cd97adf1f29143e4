"""Measure the toy pair through vLLM for its model card.

    .venv/bin/python -m benchmarks.toy_pair.measure            # ~10 min on 2 cores

Writes benchmarks/models/measurements.json and measurements.md:
- the target's greedy output on held-out prompts and one greedy sample;
- the draft's greedy prediction at every position of that output, teacher
  forced (vLLM prompt logprobs on the draft), which fixes the greedy run of
  any stopping rule, the oracle's included (ALGORITHMS.md);
- vLLM's own acceptance counters with fixed K = 8, checked against that
  replay;
- the cost ratio c = t_T / t_D from timed batch-1 runs (prefill time taken
  off): t_T is a decode step of the target alone, engine overhead included;
  t_D is the slope of the speculative step time over K, i.e. one more draft
  step in the loop;
- modeled speedup of fixed K = 1..16 and of the oracle at the measured c and
  at c = 4.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

import numpy as np

from benchmarks import vllm_run
from benchmarks.paths import DRAFT, MODELS, load_prompts
from vllm_adaptive_spec.metrics import SpecCounts, simulate_workload

log = logging.getLogger("measure_toy_pair")


def target_outputs(prompts: list[str], max_tokens: int) -> tuple[list[list[int]], list[list[int]], str]:
    llm = vllm_run.make_llm()
    outs = llm.generate(prompts, vllm_run.greedy_params(max_tokens), use_tqdm=False)
    vllm_run.close_llm(llm)
    prompt_ids = [list(o.prompt_token_ids) for o in outs]
    gen_ids = [list(o.outputs[0].token_ids) for o in outs]
    return prompt_ids, gen_ids, outs[0].outputs[0].text


def draft_matches(prompt_ids: list[list[int]], gen_ids: list[list[int]]) -> list[list[bool]]:
    """match[r][i]: the draft's greedy token after prompt + gen[:i] equals gen[i]."""
    from vllm import SamplingParams

    llm = vllm_run.make_llm(model=str(DRAFT), enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    seqs = [{"prompt_token_ids": p + g} for p, g in zip(prompt_ids, gen_ids)]
    outs = llm.generate(seqs, params, use_tqdm=False)
    vllm_run.close_llm(llm)
    matches = []
    for p, g, out in zip(prompt_ids, gen_ids, outs):
        row = []
        for i, tok in enumerate(g):
            dist = out.prompt_logprobs[len(p) + i]  # {token: Logprob} for position len(p)+i
            top = min(dist.items(), key=lambda kv: kv[1].rank)[0]
            row.append(top == tok)
        matches.append(row)
    return matches


def timed_runs(prompts: list[str], max_tokens: int, ks: list[int], repeats: int) -> dict:
    """Batch-1 timings of no speculation and of fixed K, with vLLM's step counters.

    Each run's prefill time (the same prompts with max_tokens=1) is taken off,
    leaving decode time. t_T is the decode time per token without
    speculation; a speculative step's decode time is fit as a + b * K over
    all runs, and b is t_D, the cost of one more draft step.
    """
    runs = []
    for k in [None, *ks]:
        llm = vllm_run.make_llm(k=k)
        vllm_run.timed_generate(llm, prompts[:2], max_tokens, batch=1)  # warm-up
        prefill = statistics.median(vllm_run.timed_generate(llm, prompts, 1, batch=1)[0] for _ in range(repeats))
        for rep in range(repeats):
            before = vllm_run.spec_metrics(llm) if k else None
            seconds, n_gen = vllm_run.timed_generate(llm, prompts, max_tokens, batch=1)
            row = {"k": k, "repeat": rep, "seconds": seconds, "prefill_s": prefill, "n_gen": n_gen,
                   "n_req": len(prompts)}  # fmt: skip
            if k:
                delta = vllm_run.spec_metrics(llm) - before
                row.update(n_target=delta.drafts, n_draft=delta.draft_tokens, n_accepted=delta.accepted)
            runs.append(row)
            log.info("timing %s", row)
        vllm_run.close_llm(llm)
    base = [r for r in runs if r["k"] is None]
    t_target = statistics.median((r["seconds"] - r["prefill_s"]) / (r["n_gen"] - r["n_req"]) for r in base)
    spec = [r for r in runs if r["k"]]
    ks_arr = np.array([r["k"] for r in spec], dtype=float)
    step_s = np.array([(r["seconds"] - r["prefill_s"]) / r["n_target"] for r in spec])  # decode s per spec step
    (t_fixed, t_draft), *_ = np.linalg.lstsq(np.stack([np.ones_like(ks_arr), ks_arr], 1), step_s, rcond=None)
    fit_err = float(np.median(np.abs(t_fixed + t_draft * ks_arr - step_s) / step_s))
    base_tps = statistics.median(r["n_gen"] / r["seconds"] for r in base)
    per_k = {}
    for k in ks:
        rows = [r for r in spec if r["k"] == k]
        rates = [r["n_gen"] / r["seconds"] for r in rows]
        per_k[k] = {
            "tokens_per_s": statistics.median(rates),
            "tokens_per_s_spread": [min(rates), max(rates)],
            "speedup_vs_no_spec": statistics.median(rates) / base_tps,
            "tau": rows[0]["n_gen"] / rows[0]["n_target"],
            "step_ms": 1e3 * statistics.median((r["seconds"] - r["prefill_s"]) / r["n_target"] for r in rows),
        }
    return {
        "runs": runs,
        "t_target_step_s": float(t_target),
        "t_spec_step_fixed_s": float(t_fixed),
        "t_draft_step_s": float(t_draft),
        "c": float(t_target / t_draft),
        "fit_median_rel_error": fit_err,
        "no_spec_tokens_per_s": base_tps,
        "per_k": per_k,
    }


def summarize(counts: SpecCounts, c: float) -> dict:
    return {
        "tau": counts.mean_acceptance_length,
        "discard_rate": counts.discard_rate,
        "verification_rate": counts.verification_rate,
        "draft_per_token": counts.n_draft / counts.n_gen,
        "speedup_measured_c": counts.modeled_speedup(c),
        "speedup_c4": counts.modeled_speedup(4.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--render-only", action="store_true", help="rewrite measurements.md from the JSON")
    ap.add_argument("--n-prompts", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--timing-prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=MODELS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.render_only:
        result = json.loads((args.out / "measurements.json").read_text())
        (args.out / "measurements.md").write_text(render(result))
        return

    prompts = load_prompts("code_heldout", args.n_prompts)
    prompt_ids, gen_ids, sample = target_outputs(prompts, args.max_tokens)
    matches = draft_matches(prompt_ids, gen_ids)

    # vLLM's own counters with K = 8 on the same prompts, and the replay's.
    llm = vllm_run.make_llm(k=8)
    spec_tokens = vllm_run.generate_tokens(llm, prompts, args.max_tokens)
    k8 = vllm_run.spec_metrics(llm)
    vllm_run.close_llm(llm)
    replay8 = simulate_workload(matches, 8)

    timing = timed_runs(
        load_prompts("code_heldout", args.timing_prompts), args.max_tokens, [1, 2, 3, 4, 6, 8], args.repeats
    )
    c = timing["c"]

    ks = list(range(1, 17))
    fixed = {k: summarize(simulate_workload(matches, k), c) for k in ks}
    oracle = {k: summarize(simulate_workload(matches, k, oracle=True), c) for k in ks}
    best = {name: max(ks, key=lambda k, n=name: fixed[k][n]) for name in ("speedup_measured_c", "speedup_c4")}
    result = {
        "n_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "n_generated": sum(len(g) for g in gen_ids),
        "greedy_sample": {"prompt": prompts[0], "continuation": sample},
        "spec_k8_output_equals_reference": spec_tokens == gen_ids,
        "vllm_k8": {
            "tau": k8.mean_acceptance_length,
            "steps": k8.drafts,
            "accepted": k8.accepted,
            "accepted_per_pos": list(k8.accepted_per_pos),
        },
        "replay_k8": {
            "tau": replay8.mean_acceptance_length,
            "steps": replay8.n_target,
            "accepted": replay8.n_accepted,
            "accepted_per_pos": replay8.accepted_per_pos,
            "accepted_length_hist": {str(n): replay8.accepted_hist[n] for n in range(9)},
        },
        "timing": timing,
        "fixed": fixed,
        "oracle": oracle,
        "best_fixed_k": best,
        "oracle_gain": {
            key: max(o[name] for o in oracle.values()) / fixed[best[name]][name]
            for key, name in (("measured_c", "speedup_measured_c"), ("c4", "speedup_c4"))
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "measurements.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "measurements.md").write_text(render(result))
    print(render(result))


def render(r: dict) -> str:
    t = r["timing"]
    lines = [
        "# Toy pair measurements (through vLLM)",
        "",
        f"{r['n_prompts']} held-out code prompts, greedy, max_tokens={r['max_tokens']}, "
        f"{r['n_generated']} generated tokens. Written by `python -m benchmarks.toy_pair.measure`.",
        "",
        "## Cost ratio (batch 1)",
        "",
        f"- t_T (one target decode step without speculation, engine overhead included) = "
        f"{t['t_target_step_s'] * 1e3:.2f} ms",
        f"- t_D (one more draft step: slope of the speculative step time over K) = "
        f"{t['t_draft_step_s'] * 1e3:.2f} ms; **c = t_T / t_D = {t['c']:.2f}**",
        f"- fixed cost of a speculative step (intercept: target verification, the draft's first pass, "
        f"rejection sampling, bookkeeping) = {t['t_spec_step_fixed_s'] * 1e3:.2f} ms = "
        f"{t['t_spec_step_fixed_s'] / t['t_target_step_s']:.2f} t_T; the modeled speedup below does not "
        f"charge the part above t_T, the wall-clock column does (fit median relative error "
        f"{t['fit_median_rel_error']:.1%})",
        f"- no speculation: {t['no_spec_tokens_per_s']:.1f} tokens/s (prefill included)",
        "",
        "| K | tokens/s (median) | spread | wall-clock vs no spec | tau | decode ms per step |",
        "|---|---|---|---|---|---|",
    ]
    for k, row in t["per_k"].items():
        lo, hi = row["tokens_per_s_spread"]
        lines.append(
            f"| {k} | {row['tokens_per_s']:.1f} | {lo:.1f}-{hi:.1f} | {row['speedup_vs_no_spec']:.2f}x "
            f"| {row['tau']:.2f} | {row['step_ms']:.2f} |"
        )
    v, s = r["vllm_k8"], r["replay_k8"]
    lines += [
        "",
        "## Greedy acceptance with fixed K = 8",
        "",
        f"- vLLM counters: mean acceptance length **{v['tau']:.2f}** over {v['steps']} steps; "
        f"replay from the teacher-forced draft pass: {s['tau']:.2f} over {s['steps']} steps; "
        f"speculative output equals the reference: {r['spec_k8_output_equals_reference']}",
        "",
        "| position | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 |",
        "|---|---|---|---|---|---|---|---|---|",
        "| accepted (vLLM) | " + " | ".join(str(x) for x in v["accepted_per_pos"]) + " |",
        "| accepted (replay) | " + " | ".join(str(x) for x in s["accepted_per_pos"]) + " |",
        "",
        "Accepted length per step (replay):",
        "",
        "| accepted | " + " | ".join(s["accepted_length_hist"]) + " |",
        "|---" * (len(s["accepted_length_hist"]) + 1) + "|",
        "| steps | " + " | ".join(str(x) for x in s["accepted_length_hist"].values()) + " |",
        "",
        "## Modeled speedup: fixed K against the oracle stop",
        "",
        f"| K | tau fixed | discard fixed | S fixed (c={t['c']:.2f}) | S fixed (c=4) "
        f"| tau oracle | S oracle (c={t['c']:.2f}) | S oracle (c=4) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, f in r["fixed"].items():
        o = r["oracle"][k]
        lines.append(
            f"| {k} | {f['tau']:.2f} | {f['discard_rate']:.2f} | {f['speedup_measured_c']:.3f} | "
            f"{f['speedup_c4']:.3f} | {o['tau']:.2f} | {o['speedup_measured_c']:.3f} | "
            f"{o['speedup_c4']:.3f} |"
        )
    b = r["best_fixed_k"]
    g = r["oracle_gain"]
    lines += [
        "",
        f"Best fixed K: {b['speedup_measured_c']} at c={t['c']:.2f}, {b['speedup_c4']} at c=4. "
        f"Best oracle cap over best fixed K: **{g['measured_c']:.2f}x** at c={t['c']:.2f}, "
        f"**{g['c4']:.2f}x** at c=4.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
