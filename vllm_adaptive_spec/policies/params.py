"""Declared parameters of a policy: type and allowed range, for validation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Param:
    kind: type  # float, int, or str (a path to an existing file, or one of `choices`)
    low: float = -math.inf  # inclusive (numbers only)
    high: float = math.inf  # inclusive (numbers only)
    required: bool = False  # the policy cannot run without it
    choices: tuple[str, ...] = ()  # str only: the allowed words (then not a path)

    def check(self, field: str, value: object) -> str | None:
        """An error message naming field and value, or None when valid."""
        if self.kind is str and self.choices:
            if value not in self.choices:
                return f"{field}: {value!r} is not one of {list(self.choices)}"
            return None
        if self.kind is str:
            if not isinstance(value, str) or not value:
                return f"{field}: expected a non-empty path string, got {value!r}"
            if not Path(value).is_file():
                return f"{field}: {value!r} is not an existing file"
            return None
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not numeric or (self.kind is int and not isinstance(value, int)):
            return f"{field}: expected {self.kind.__name__}, got {value!r}"
        if not math.isfinite(value) or not self.low <= value <= self.high:
            return f"{field}: {value!r} is out of range [{self.low}, {self.high}]"
        return None
