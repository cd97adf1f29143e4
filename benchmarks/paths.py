"""Where the bundled toy pair and prompt sets live, shared by scripts and tests."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "benchmarks" / "models"
TARGET = MODELS / "toy-target"
DRAFT = MODELS / "toy-draft"
PROMPTS = REPO / "benchmarks" / "prompts"


def load_prompts(name: str = "code_heldout", n: int | None = None) -> list[str]:
    """Held-out prompts in a fixed order; `n` takes the first n."""
    with (PROMPTS / f"{name}.jsonl").open() as fh:
        rows = [json.loads(line)["prompt"] for line in fh if line.strip()]
    return rows if n is None else rows[:n]
