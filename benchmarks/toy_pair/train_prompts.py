"""Training prompts for trained stopping heads (SpecDec++, Pacer), cut like the
held-out evaluation prompts (`corpus.code_prompts`: a function signature with
its docstring) but from the corpus's training split, so no head ever trains on
a module the evaluation prompts come from.

    .venv/bin/python -m benchmarks.toy_pair.train_prompts   # writes benchmarks/prompts/code_train.jsonl
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from benchmarks.paths import PROMPTS
from benchmarks.toy_pair import corpus

log = logging.getLogger(__name__)


def train_prompts(n: int, seed: int = 1) -> list[dict]:
    train_files, _ = corpus.split_sources(corpus.list_sources())
    return corpus.code_prompts(train_files, n, seed=seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=PROMPTS / "code_train.jsonl")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = train_prompts(args.n, args.seed)
    corpus.write_jsonl(rows, args.out)
    log.info("%d training prompts -> %s", len(rows), args.out)


if __name__ == "__main__":
    main()
