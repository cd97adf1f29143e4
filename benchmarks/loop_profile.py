"""cProfile of the draft side in one process: the plugin's loop against vLLM's, at the same K.

    .venv/bin/python -m benchmarks.loop_profile --method eagle3 --k 1 --batch 4
    .venv/bin/python -m benchmarks.loop_profile --ab --repeats 11 --out DIR   # timing, no profiler

With `--ab`, no profiler: every engine of `AB_ENGINES` lives in this process at once, and they take
turns serving the same 32 prompts (order rotated each repeat); prints and saves (DIR/ab.json) each
engine's median seconds and its per-repeat speed ratios to the first engine (vLLM's own loop at
`--k`). One process with no engine-core or worker processes beside it is the quietest setting this
machine has for a few-percent difference. `--engines FILE` replaces `AB_ENGINES` (JSON: name ->
[cap K, 0 for --k, null for no speculation; adaptive_spec or null]), `--prompts N --family F` the
workload, and `--multiprocess` gives every engine its own engine-core process, as the harness runs
them. Plugin engines with `time_policy` also report their draft side per round and forwards per round.

    VLLM_ADAPTIVE_SPEC_BENCH_EAGLE3=heads/toy/eagle3-mixed .venv/bin/python -m benchmarks.loop_profile --ab \
        --batch 1 --k 3 --repeats 9 --prompts 16 --family code_heldout \
        --engines benchmarks/results/loop_ab_eagle3_mixed_b1/engines.json \
        --out benchmarks/results/loop_ab_eagle3_mixed_b1/code

Runs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the worker's Python is
profiled), once with `adaptive_spec` {"policy": "fixed"} and once without the plugin, serving 32
held-out code prompts x 64 tokens at `--batch` concurrency (greedy, ignore_eos) after a warm-up.
Prints, per engine, the wall time and the cumulative time of the runner's propose_draft_token_ids
per engine step: what the plugin's loop costs above vLLM's at equal work. Each engine runs twice,
in the order plugin, vLLM, vLLM, plugin: a profile, not an interleaved speed figure.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
from pathlib import Path

# --ab: name -> (cap K or None for no speculation, adaptive_spec or None); the first is the baseline
AB_ENGINES: dict[str, tuple[int | None, dict | None]] = {
    "vLLM K": (0, None),  # 0: --k
    "vLLM K=2": (2, None),
    "plugin fixed K": (0, {"policy": "fixed"}),
    "batch gate alone (cap 16)": (16, {"policy": "fixed", "batch_aware": True}),
    "confidence 0.4 (cap 16)": (16, {"policy": "confidence"}),
    "no speculation": (None, None),
}


def _workload(n_prompts: int = 32, family: str = "code_heldout"):
    """What every engine serves: n held-out prompts x 64 tokens, greedy, ignore_eos."""
    from vllm import SamplingParams

    from benchmarks.paths import load_prompts

    return load_prompts(family, n_prompts), SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def profile(method: str, k: int, batch: int, plugin: bool) -> dict:
    from benchmarks import vllm_run

    llm = vllm_run.make_llm(k, {"policy": "fixed"} if plugin else None, method=method, max_num_seqs=batch)
    prompts, params = _workload()
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - start
    vllm_run.close_llm(llm)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    calls, cum = 0, 0.0
    for (path, _, name), (_, ncalls, _, cumtime, _) in stats.items():
        if name == "propose_draft_token_ids" and path.endswith("gpu_model_runner.py") and cumtime > cum:
            calls, cum = ncalls, cumtime
    return {"wall_s": round(wall, 3), "steps": calls, "propose_ms_per_step": round(1e3 * cum / max(calls, 1), 3)}


def ab(
    method: str,
    k: int,
    batch: int,
    repeats: int,
    configs: dict[str, tuple[int | None, dict | None]] = AB_ENGINES,
    n_prompts: int = 32,
    family: str = "code_heldout",
) -> dict:
    """The engines of `configs` (AB_ENGINES) side by side in this process (see the module doc)."""
    from benchmarks import vllm_run

    prompts, params = _workload(n_prompts, family)
    engines, plugin = {}, {}
    for name, (cap, adaptive) in configs.items():
        if cap == 0:  # at --k
            name, cap = name.replace("K", f"K={k}"), k
        if name not in engines:  # (--k 2: one vLLM K=2)
            engines[name] = vllm_run.make_llm(cap, adaptive, method=method, max_num_seqs=batch)
            plugin[name] = adaptive is not None
            engines[name].generate(prompts[:8], params, use_tqdm=False)  # warm-up
    names = list(engines)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            outs = engines[name].generate(prompts, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
            tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
    loops = {n: _loop_stats(engines[n]) for n in names if plugin[n]}
    for llm in engines.values():
        vllm_run.close_llm(llm)
    base = seconds[names[0]]
    return {
        "settings": {
            "method": method,
            "k": k,
            "batch": batch,
            "repeats": repeats,
            "prompts": f"{n_prompts} {family}",
            "max_tokens": 64,
        },
        "engines": {
            n: {
                "median_s": statistics.median(seconds[n]),
                "speed_vs_first": statistics.median(b / s for b, s in zip(base, seconds[n])),
                "per_repeat": [round(b / s, 4) for b, s in zip(base, seconds[n])],
                "same_tokens_as_first": tokens[n] == tokens[names[0]],
                **({"loop": loops[n]} if n in loops else {}),
            }
            for n in names
        },
    }


def _loop_stats(llm) -> dict:
    """A plugin engine's draft forwards and the row computations compact_drafts left out (whole life)."""
    from vllm_adaptive_spec.integration.runtime import get_stats

    stats = get_stats(llm)[0]
    forwards = sum(int(f) * n for f, n in stats["forwards_per_step"].items())
    out = {"draft_forwards": forwards, "rows_saved": stats.get("rows_saved", 0)}
    timing = stats.get("timing")  # with time_policy: the draft side's own clock
    if timing and timing["rounds"]:
        out["draft_ms_per_round"] = round(1e3 * timing["propose_s"] / timing["rounds"], 4)
        out["policy_ms_per_round"] = round(1e3 * timing["policy_s"] / timing["rounds"], 4)
        out["forwards_per_round"] = round(forwards / timing["rounds"], 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ab", action="store_true", help="time AB_ENGINES side by side instead of profiling")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--out", type=Path, help="--ab: folder for ab.json")
    ap.add_argument("--engines", type=Path, help="--ab: JSON name -> [cap K, adaptive_spec] instead of AB_ENGINES")
    ap.add_argument("--prompts", type=int, default=32, help="--ab: held-out prompts served per repeat")
    ap.add_argument("--family", default="code_heldout", help="--ab: the prompt family")
    ap.add_argument("--multiprocess", action="store_true", help="--ab: each engine its own engine-core process")
    args = ap.parse_args()
    # before vLLM is imported: the worker in this process (or, --multiprocess, as the harness runs engines)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"
    if args.multiprocess:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # get_stats: collective_rpc with a function
    if args.ab:
        engines = AB_ENGINES
        if args.engines:
            engines = {name: (cap, adaptive) for name, (cap, adaptive) in json.loads(args.engines.read_text()).items()}
        result = ab(args.method, args.k, args.batch, args.repeats, engines, args.prompts, args.family)
        result["settings"]["multiprocess"] = args.multiprocess
        for name, row in result["engines"].items():
            loop = row.get("loop", {})
            draft = (
                f"; draft side {loop['draft_ms_per_round']:.3f} ms a round at {loop['forwards_per_round']:.3f} forwards"
                if "draft_ms_per_round" in loop
                else ""
            )
            print(f"{name}: median {row['median_s']:.3f} s, {row['speed_vs_first']:.3f}x the first{draft}", flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "ab.json").write_text(json.dumps(result, indent=1) + "\n")
        return
    for plugin in (True, False, False, True):  # each twice, the order reversed: one run each is noisy
        got = profile(args.method, args.k, args.batch, plugin)
        print("plugin fixed" if plugin else "vLLM", f"K={args.k}", got, flush=True)


if __name__ == "__main__":
    main()
