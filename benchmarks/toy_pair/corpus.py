"""The toy pair's corpus: the running Python's own standard library source.

Every machine with CPython has it, so the pair can be rebuilt anywhere without
a download. The file list is deterministic (sorted relative paths, test and
demo packages left out) and a fixed hash of each module's relative path puts
about 1 in 16 modules in the held-out split, which supplies evaluation prompts
and the held-out loss.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Demos, a GUI and a retired tool; the test suites stay in (more code to learn from).
_SKIP_PARTS = {"idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__"}
HELDOUT_BUCKETS = 16  # one bucket of 16 is held out


@dataclass(frozen=True)
class SourceFile:
    rel: str  # path relative to the stdlib root, with "/" separators
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def bucket(rel: str) -> int:
    """A module's fixed bucket in 0..HELDOUT_BUCKETS-1 (bucket 0 is held out)."""
    return hashlib.sha256(rel.encode()).digest()[0] % HELDOUT_BUCKETS


def is_heldout(rel: str) -> bool:
    return bucket(rel) == 0


def list_sources(root: Path | None = None) -> list[SourceFile]:
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in _SKIP_PARTS for part in rel.split("/")):
            continue
        files.append(SourceFile(rel, path.read_text(encoding="utf-8", errors="replace")))
    return files


def split_sources(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_heldout(f.rel)]
    heldout = [f for f in files if is_heldout(f.rel)]
    return train, heldout


def code_prompts(heldout: list[SourceFile], n: int, seed: int = 0, max_chars: int = 1200) -> list[dict]:
    """Function signatures with their docstrings from held-out modules.

    The prompt ends right after the docstring, so a model continues with the
    function body.
    """
    found = []
    for f in heldout:
        if f.rel.split("/")[0] in ("test", "unittest"):
            continue  # prompts come from library code, not test suites
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        lines = f.text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = node.body[0] if node.body else None
            if not (
                isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
                and len(node.body) > 1  # there is a body to continue with
            ):
                continue
            text = "\n".join(lines[node.lineno - 1 : doc.end_lineno]) + "\n"
            if len(text) > max_chars:
                continue
            found.append({"id": f"{f.rel}:{node.lineno}", "prompt": text})
    found.sort(key=lambda p: p["id"])
    random.Random(seed).shuffle(found)
    return found[:n]


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with path.open() as fh:
        return [json.loads(line) for line in fh if line.strip()]
