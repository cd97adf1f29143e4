"""S per engine step at c = 4 for a harness run, with and without the policy's own time.

    .venv/bin/python -m benchmarks.per_step benchmarks/results/batched_eagle3_steady_flat_c4

The report's "S per step (c=4)" column charges each plugin row its measured policy share f
(`report.step_speedup`). Printed beside it, the same with f = 0: the rule's decisions alone, apart
from what its per-step work costs on this CPU. Per cell, the best adaptive row against the best fixed K.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.harness.report import policy_share, step_speedup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="a harness output folder (its raw/)")
    ap.add_argument("--c", type=float, default=4.0)
    args = ap.parse_args()
    results = [json.loads(p.read_text()) for p in sorted((args.out / "raw").glob("*.json"))]
    base = {row["cell"]["key"]: row for res in results if res["config"]["kind"] == "nospec" for row in res["cells"]}
    s: dict[str, dict[str, tuple[float, float]]] = {}  # config -> cell -> (f = 0, f charged)
    for res in results:
        cfg = res["config"]
        for row in res["cells"]:
            ref = base.get(row["cell"]["key"])
            alone = step_speedup(row, ref, cfg, args.c, 0.0)
            if cfg["kind"] != "nospec" and alone is not None:
                charged = step_speedup(row, ref, cfg, args.c, policy_share(row))
                s.setdefault(cfg["name"], {})[row["cell"]["key"]] = (alone, charged)
    for cell in sorted(base):
        print(cell)
        for name, by_cell in s.items():
            if cell in by_cell:
                print(f"  {name:32s} {by_cell[cell][0]:.3f} (f = 0)  {by_cell[cell][1]:.3f} (f charged)")
        fixed = max(((v[cell][0], n) for n, v in s.items() if n.startswith("vLLM K=") and cell in v), default=None)
        plugin = {n: v[cell] for n, v in s.items() if not n.startswith(("vLLM", "vllm_av")) and cell in v}
        if plugin and fixed:
            alone, charged = max((v[0], n) for n, v in plugin.items()), max((v[1], n) for n, v in plugin.items())
            print(
                f"  best fixed K: {fixed[1]} {fixed[0]:.3f}; best adaptive {alone[1]} {alone[0] / fixed[0]:.3f}x"
                f" (f = 0), {charged[1]} {charged[0] / fixed[0]:.3f}x (f charged)"
            )


if __name__ == "__main__":
    main()
