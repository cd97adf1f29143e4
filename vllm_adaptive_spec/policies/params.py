"""Declared parameters of a policy: type and allowed range, for validation."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    kind: type  # float or int
    low: float = -math.inf  # inclusive
    high: float = math.inf  # inclusive

    def check(self, field: str, value: object) -> str | None:
        """An error message naming field and value, or None when valid."""
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not numeric or (self.kind is int and not isinstance(value, int)):
            return f"{field}: expected {self.kind.__name__}, got {value!r}"
        if not math.isfinite(value) or not self.low <= value <= self.high:
            return f"{field}: {value!r} is out of range [{self.low}, {self.high}]"
        return None
