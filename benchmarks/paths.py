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
EAGLE3_HEAD = REPO / "heads" / "toy" / "eagle3"  # the EAGLE-3 head trained for the toy target
DFLASH_HEAD = REPO / "heads" / "toy" / "dflash"  # the DFlash drafter (D-PACE) trained for the toy target
# speculative_config.method -> the bundled drafter it runs
DRAFTERS = {"draft_model": DRAFT, "eagle3": EAGLE3_HEAD, "dflash": DFLASH_HEAD}
PROMPTS = REPO / "benchmarks" / "prompts"


def load_prompts(name: str = "code_heldout", n: int | None = None) -> list[str]:
    """Held-out prompts in a fixed order; `n` takes the first n."""
    with (PROMPTS / f"{name}.jsonl").open() as fh:
        rows = [json.loads(line)["prompt"] for line in fh if line.strip()]
    return rows if n is None else rows[:n]
