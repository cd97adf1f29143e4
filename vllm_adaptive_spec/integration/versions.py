"""Release numbers of the vLLM we run on (a leaf module: it imports nothing of the package)."""

from __future__ import annotations

import re


def release_of(version: str) -> str:
    """'0.32.0+cpu' -> '0.32.0': the release part, without local or dev tags."""
    match = re.match(r"\d+(\.\d+)*", version)
    return match.group(0) if match else version
