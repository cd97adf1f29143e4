"""The grammar stop and mask under structured outputs: the same policy with each grammar setting, side by side.

    .venv/bin/python -m benchmarks.grammar_stop --repeats 3 --out benchmarks/results/grammar_stop

Engines, all alive at once (one process each, vLLM's default): no speculation, and for the draft model and
the EAGLE-3 head the policy (`--policy`, default svip) with each of SETTINGS: the grammar off, the grammar
stop alone (`grammar_mask` false) and the stop with the mask (the default). They take turns, order rotated
each repeat, serving 16 held-out code prompts x 64 tokens one at a time (batch 1, greedy; `--batch B`: all
16 at once, at most B running) under each structured output of the lossless tests (benchmarks/vllm_run.py:
a regex and a JSON schema). Per engine and kind: the median wall time of the 16 requests and the
per-repeat paired speed ratio to the same drafter with the grammar off, and from the plugin's own records
the target passes, accepted drafts and draft forwards (the first pass of each round included; steps after
it separately), and whether every output equals no speculation's. Prints a table and writes
DIR/grammar_stop.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # get_stats: collective_rpc with a function

KINDS = ("json", "regex")
DRAFTERS = ("draft_model", "eagle3")
SETTINGS = {
    "off": {"grammar_stop": False},
    "stop": {"grammar_stop": True, "grammar_mask": False},
    "stop+mask": {"grammar_stop": True, "grammar_mask": True},
}


def _params(kind: str):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from benchmarks.vllm_run import STRUCTURED_JSON, STRUCTURED_REGEX

    so = (
        StructuredOutputsParams(json=STRUCTURED_JSON)
        if kind == "json"
        else StructuredOutputsParams(regex=STRUCTURED_REGEX)
    )
    return SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=so)


def _engines(policy: str, cap: int, batch: int) -> dict:
    from benchmarks import vllm_run

    def make_llm(**kwargs):  # float32, as the lossless tests: outputs must equal no speculation's exactly
        return vllm_run.make_llm(dtype="float32", max_num_seqs=batch, **kwargs)

    engines = {"no speculation": make_llm()}
    for method in DRAFTERS:
        for setting, fields in SETTINGS.items():
            engines[_name(method, policy, setting)] = make_llm(
                speculative_config=vllm_run.spec_config(cap, method),
                additional_config={"adaptive_spec": {"policy": policy} | fields},
            )
    return engines


def _name(method: str, policy: str, setting: str) -> str:
    return f"{method} {policy} grammar {setting}"


def _counts(llm) -> dict:
    from vllm_adaptive_spec.integration.runtime import get_stats

    (snap,) = get_stats(llm)
    forwards = sum(int(n) * steps for n, steps in snap["forwards_per_step"].items())
    rounds = sum(snap["forwards_per_step"].values())
    w = snap["workload"]
    return {
        "n_target": w["n_target"],
        "n_accepted": w["n_accepted"],
        "forwards": forwards,
        "steps_after_first_pass": forwards - rounds,
        "grammar_stops": snap.get("grammar_stops", 0),
        "grammar_masked": snap.get("grammar_masked", 0),
    }


def run(repeats: int, policy: str, cap: int, batch: int = 1) -> dict:
    from benchmarks.paths import load_prompts

    prompts = load_prompts("code_heldout", 16)
    engines = _engines(policy, cap, batch)
    names = list(engines)
    for llm in engines.values():  # warm-up: compiles every grammar once
        for kind in KINDS:
            llm.generate(prompts[:1], _params(kind), use_tqdm=False)
    seconds = {(n, k): [] for n in names for k in KINDS}
    tokens: dict = {}
    counts: dict = {}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for kind in KINDS:
            for name in order:
                llm = engines[name]
                before = _counts(llm) if name != "no speculation" else None
                start = time.perf_counter()
                if batch == 1:
                    outs = [llm.generate([p], _params(kind), use_tqdm=False)[0] for p in prompts]
                else:
                    outs = llm.generate(prompts, _params(kind), use_tqdm=False)
                seconds[name, kind].append(time.perf_counter() - start)
                tokens.setdefault((name, kind), [list(o.outputs[0].token_ids) for o in outs])
                if before is not None and r == 0:
                    after = _counts(llm)
                    counts[name, kind] = {k: after[k] - before[k] for k in after}
        print(f"repeat {r + 1}/{repeats} done", flush=True)
    result = {"repeats": repeats, "policy": policy, "cap": cap, "batch": batch, "prompts": len(prompts)}
    result |= {"max_tokens": 64, "rows": []}
    for kind in KINDS:
        base = seconds["no speculation", kind]
        for name in names:
            row = {
                "kind": kind,
                "engine": name,
                "median_s": statistics.median(seconds[name, kind]),
                "speed_vs_no_spec": statistics.median(b / s for b, s in zip(base, seconds[name, kind])),
                "same_tokens_as_no_spec": tokens[name, kind] == tokens["no speculation", kind],
            } | counts.get((name, kind), {})
            if name != "no speculation" and not name.endswith(" off"):
                off = seconds[name.rsplit(" ", 1)[0] + " off", kind]
                row["speed_vs_off"] = statistics.median(o / s for o, s in zip(off, seconds[name, kind]))
                row["speed_vs_off_per_repeat"] = [round(o / s, 3) for o, s in zip(off, seconds[name, kind])]
            result["rows"].append(row)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policy", default="svip")
    ap.add_argument("--cap", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1, help="requests running at once (1: one at a time)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = run(args.repeats, args.policy, args.cap, args.batch)
    for row in result["rows"]:
        extra = (
            ""
            if "forwards" not in row
            else (
                f" passes {row['n_target']} accepted {row['n_accepted']} forwards {row['forwards']}"
                f" (after first pass {row['steps_after_first_pass']}) grammar stops {row['grammar_stops']}"
                f" masked {row['grammar_masked']}"
            )
        )
        on_off = f" vs off {row['speed_vs_off']:.3f}x {row['speed_vs_off_per_repeat']}" if "speed_vs_off" in row else ""
        print(
            f"{row['kind']:5} {row['engine']:36} {row['median_s']:.2f} s, {row['speed_vs_no_spec']:.3f}x no spec,"
            f" same {row['same_tokens_as_no_spec']}{extra}{on_off}",
            flush=True,
        )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "grammar_stop.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
