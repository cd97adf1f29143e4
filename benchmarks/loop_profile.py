"""cProfile of the draft side in one process: the plugin's loop against vLLM's, at the same K.

    .venv/bin/python -m benchmarks.loop_profile --method eagle3 --k 1 --batch 4

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
import os
import pstats
import time


def profile(method: str, k: int, batch: int, plugin: bool) -> dict:
    from vllm import SamplingParams

    from benchmarks import vllm_run
    from benchmarks.paths import load_prompts

    llm = vllm_run.make_llm(k, {"policy": "fixed"} if plugin else None, method=method, max_num_seqs=batch)
    prompts = load_prompts("code_heldout", 32)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported: the worker in this process
    for plugin in (True, False, False, True):  # each twice, the order reversed: one run each is noisy
        got = profile(args.method, args.k, args.batch, plugin)
        print("plugin fixed" if plugin else "vLLM", f"K={args.k}", got, flush=True)


if __name__ == "__main__":
    main()
