"""Where the bundled toy pair and prompt sets live, shared by scripts and tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "benchmarks" / "models"
# The harness points its workers at cost-scaled copies (benchmarks/scaled_models.py) through these.
TARGET_ENV, DRAFT_ENV = "VLLM_ADAPTIVE_SPEC_BENCH_TARGET", "VLLM_ADAPTIVE_SPEC_BENCH_DRAFT"
TARGET = Path(os.environ.get(TARGET_ENV) or MODELS / "toy-target")
DRAFT = Path(os.environ.get(DRAFT_ENV) or MODELS / "toy-draft")
# The EAGLE-3 head trained for the toy target on code; EAGLE3_ENV points the harness and its workers at another
# (heads/toy/eagle3-mixed: trained on code and prose). The files trained or tuned for a head sit beside it, named
# after it (benchmarks.harness.plan: eagle3-specdecpp.safetensors, eagle3-mixed.tune.json, ...).
EAGLE3_ENV = "VLLM_ADAPTIVE_SPEC_BENCH_EAGLE3"
EAGLE3_HEAD = Path(os.environ.get(EAGLE3_ENV) or REPO / "heads" / "toy" / "eagle3").resolve()
DFLASH_HEAD = REPO / "heads" / "toy" / "dflash"  # the DFlash drafter (D-PACE) trained for the toy target
# speculative_config.method -> the bundled drafter it runs
DRAFTERS = {"draft_model": DRAFT, "eagle3": EAGLE3_HEAD, "dflash": DFLASH_HEAD}
PROMPTS = REPO / "benchmarks" / "prompts"


def load_prompts(name: str = "code_heldout", n: int | None = None) -> list[str]:
    """Held-out prompts in a fixed order; `n` takes the first n."""
    with (PROMPTS / f"{name}.jsonl").open() as fh:
        rows = [json.loads(line)["prompt"] for line in fh if line.strip()]
    return rows if n is None else rows[:n]


def beside(head: Path, suffix: str) -> Path:
    """A file made for a drafter directory, next to it and named after it: heads/toy/eagle3 + ".tune.json"."""
    return head.with_name(head.name + suffix)
