"""Prose prompts: held-out code cut so that the model continues with English.

    .venv/bin/python -m benchmarks.toy_pair.prose_prompts          # writes benchmarks/prompts/prose_heldout.jsonl
    .venv/bin/python -m benchmarks.toy_pair.prose_prompts --stats  # counts only, writes nothing
    .venv/bin/python -m benchmarks.toy_pair.prose_prompts --split train  # benchmarks/prompts/prose_train.jsonl

`--split train` cuts the same kinds of prompts from one bucket of the
corpus's training split instead (modules the toy pair trained on, none of the
held-out ones): prompts to tune thresholds on (`vllm-adaptive-spec tune`),
never the ones a benchmark reports.

A second workload next to `code_heldout.jsonl` (whose prompts end after a
docstring, so the model writes code). Here every prompt ends inside prose,
cut from the same held-out split of the toy pair's corpus (the modules that
`corpus.is_heldout` puts aside). Unlike the code prompts, test modules of the
held-out split count too: its library modules alone give only about 130
usable docstrings and comment blocks. Two kinds:

- docstring: a function's, class's or module's code up to and including the
  opening quotes and the docstring's first text line. When that line is a
  summary followed by a blank line (PEP 257), the prompt also takes the blank
  line and the first line of the next paragraph, so it always ends in the
  middle of a paragraph. Kept when at least `MIN_REST_CHARS` of docstring
  text follow the cut.
- comment: a block of 3 or more consecutive full-line `#` comments at one
  indentation that reads as English (not commented-out code, not a licence
  header). The prompt is the code before it, from the enclosing function or
  class (or the latest statement start that keeps the prompt within the token
  budget), plus the block's first line.

Prompts end at the end of a line without its newline: the byte-level BPE
pre-tokenizer keeps a newline together with the next line's indentation
(one "\\n" + spaces token), so a trailing "\\n" would force a token boundary
the models never saw in training. The continuation starts with that
newline-and-indent token.

Every prompt is at most `MAX_PROMPT_TOKENS` tokens with the toy pair's
tokenizer (BOS included), leaving room for 128 generated tokens far below the
engine's max_model_len of 1024. Each kind's candidates are deduplicated,
sorted by id and shuffled with a fixed seed; docstrings (the scarcer kind)
fill up to half the set and comment blocks the rest, with at most
`MAX_PER_FILE` prompts per module so that no module dominates; the result is
shuffled again.
"""

from __future__ import annotations

import argparse
import ast
import io
import random
import re
import tokenize
from collections import Counter
from pathlib import Path

from benchmarks.toy_pair import corpus

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "benchmarks" / "prompts" / "prose_heldout.jsonl"
TOKENIZER = REPO / "benchmarks" / "models" / "toy-target"

SEED = 1234
N_PROMPTS = 200
MAX_PROMPT_TOKENS = 300
MIN_REST_CHARS = 120  # docstring text after the cut
MIN_COMMENT_LINES = 3
MIN_COMMENT_REST_CHARS = 80  # comment text after the first line
MAX_PER_FILE = 20

_QUOTE_OPEN = re.compile(r"""^(?P<prefix>[rRuUbB]{0,2})(?P<q>\"\"\"|'''|"|')""")
_BOILERPLATE = re.compile(r"copyright|licen[cs]e|all rights reserved|author|-\*-|\bvim?:|coding[:=]", re.I)


def _proseness(text: str) -> float:
    """Share of letters and spaces among non-newline characters."""
    chars = [c for c in text if c != "\n"]
    if not chars:
        return 0.0
    return sum(c.isalpha() or c == " " for c in chars) / len(chars)


def _docstring_nodes(tree: ast.Module):
    yield tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node


def docstring_candidates(f: corpus.SourceFile, tree: ast.Module, lines: list[str]) -> list[dict]:
    found = []
    for node in _docstring_nodes(tree):
        doc = node.body[0] if node.body else None
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        if doc.lineno == doc.end_lineno:
            continue  # one-line docstring: nothing to continue
        first = lines[doc.lineno - 1]
        m = _QUOTE_OPEN.match(first[doc.col_offset :])
        if m is None or len(m.group("q")) != 3:
            continue  # implicit concatenation or a one-quote string spanning lines
        q = m.group("q")
        doc_lines = lines[doc.lineno - 1 : doc.end_lineno]  # the literal's source lines
        # The docstring's text lines, the opening quotes cut off the first.
        texts = [first[doc.col_offset + m.end() :], *doc_lines[1:]]
        i = 0 if texts[0].strip() else 1  # the first line with text
        if i >= len(texts) or not texts[i].strip() or q in texts[i]:
            continue  # blank first line or a docstring that closes on it
        # A summary line followed by a blank line: take the next paragraph's first line too.
        if i + 2 < len(texts) and not texts[i + 1].strip() and texts[i + 2].strip():
            i += 2
        if q in texts[i]:
            continue  # the docstring closes on the cut line
        rest = "\n".join(doc_lines[i + 1 :])
        rest = rest[: rest.rfind(q)] if q in rest else rest
        if len(rest.strip()) < MIN_REST_CHARS or _proseness(rest[:400]) < 0.75:
            continue
        if ">>>" in rest[:200]:
            continue  # doctest right after the cut: code, not prose
        start = 1 if isinstance(node, ast.Module) else node.lineno
        head = lines[start - 1 : doc.lineno - 1]
        prompt = "\n".join([*head, *doc_lines[: i + 1]])
        found.append({"id": f"{f.rel}:{start if start > 1 else doc.lineno}:doc", "prompt": prompt})
    return found


def _comment_lines(text: str) -> dict[int, tuple[int, str]]:
    """Full-line comments: {lineno: (column, text after '#')}."""
    out = {}
    lines = text.splitlines()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                row, col = tok.start
                if not lines[row - 1][:col].strip():
                    out[row] = (col, tok.string[1:])
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return {}
    return out


def _looks_like_code(body: str) -> bool:
    s = body.strip()
    return bool(
        re.match(r"^(import |from \S+ import |def |class |return\b|if .*:$|for .*:$|print\(|[\w.\[\]]+ ?= )", s)
        or s.endswith((":", "(", ")", ",", "]", "{", "}"))
        and _proseness(s) < 0.8
    )


def _stmt_starts(tree: ast.Module) -> list[int]:
    starts = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            deco = getattr(node, "decorator_list", None)
            starts.add(min([node.lineno] + [d.lineno - 1 for d in deco or []]))
    return sorted(starts)


def _enclosing_start(tree: ast.Module, lineno: int) -> int:
    best = 1
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.lineno <= lineno <= (node.end_lineno or 0) and node.lineno > best:
                best = node.lineno
    return best


def comment_candidates(f: corpus.SourceFile, tree: ast.Module, lines: list[str], count_tokens) -> list[dict]:
    comments = _comment_lines(f.text)
    found = []
    starts = _stmt_starts(tree)
    row = 1
    n = len(lines)
    while row <= n:
        if row not in comments:
            row += 1
            continue
        col = comments[row][0]
        block = [row]
        while block[-1] + 1 in comments and comments[block[-1] + 1][0] == col:
            block.append(block[-1] + 1)
        row = block[-1] + 1
        bodies = [comments[r][1] for r in block]
        if len(block) < MIN_COMMENT_LINES:
            continue
        if bodies[0].startswith("!") or not bodies[0].strip() or block[0] == 1:
            continue  # shebang, empty lead line, file header
        text = "\n".join(bodies)
        if _BOILERPLATE.search(text) or _proseness(text) < 0.75:
            continue
        if sum(_looks_like_code(b) for b in bodies) > len(bodies) // 3:
            continue
        if len(" ".join(b.strip() for b in bodies[1:])) < MIN_COMMENT_REST_CHARS:
            continue
        if len(bodies[0].split()) < 3:
            continue  # a heading such as "# Helpers", not the start of prose
        first = block[0]
        # Longest context from the enclosing def/class, or a later statement start, within budget.
        lo = _enclosing_start(tree, first)
        options = [lo] + [s for s in starts if lo < s < first]
        prompt = None
        for s in options:
            cand = "\n".join(lines[s - 1 : first])
            if count_tokens(cand) <= MAX_PROMPT_TOKENS:
                prompt = cand
                break
        if prompt is None:
            continue
        found.append({"id": f"{f.rel}:{first}:comment", "prompt": prompt})
    return found


def build(n: int = N_PROMPTS, seed: int = SEED, split: str = "heldout") -> tuple[list[dict], dict]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))  # its post-processor adds BOS

    def count_tokens(text: str) -> int:
        return len(tok.encode(text).ids)

    train, heldout = corpus.split_sources(corpus.list_sources())
    docs, comments = [], []
    # train: one training bucket, the held-out split's size (cutting the whole training split takes an hour)
    for f in heldout if split == "heldout" else [f for f in train if corpus.bucket(f.rel) == 1]:
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        lines = f.text.splitlines()
        docs += [d for d in docstring_candidates(f, tree, lines) if count_tokens(d["prompt"]) <= MAX_PROMPT_TOKENS]
        comments += comment_candidates(f, tree, lines, count_tokens)
    stats = {"docstring_candidates": len(docs), "comment_candidates": len(comments)}

    rng = random.Random(seed)
    pools = []
    for pool in (docs, comments):
        pool = sorted({p["prompt"]: p for p in pool}.values(), key=lambda p: p["id"])  # dedupe, fixed order
        rng.shuffle(pool)
        pools.append(pool)
    docs, comments = pools
    # Docstrings are the scarcer kind: all of them up to half the set, comments fill the rest.
    picked, per_file = [], Counter()
    n_docs = min(len(docs), n // 2)
    for pool, want in ((docs, n_docs), (comments, n - n_docs)):
        got = 0
        for p in pool:
            if got == want:
                break
            rel = p["id"].split(":")[0]
            if per_file[rel] >= MAX_PER_FILE:
                continue
            per_file[rel] += 1
            picked.append({"id": p["id"], "prompt": p["prompt"]})
            got += 1
    rng.shuffle(picked)
    lengths = sorted(count_tokens(p["prompt"]) for p in picked)
    stats.update(
        picked=len(picked),
        picked_comments=sum(p["id"].endswith(":comment") for p in picked),
        files=len({p["id"].split(":")[0] for p in picked}),
        tokens_min=lengths[0] if lengths else 0,
        tokens_median=lengths[len(lengths) // 2] if lengths else 0,
        tokens_max=lengths[-1] if lengths else 0,
    )
    return picked, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=N_PROMPTS)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--split", choices=("heldout", "train"), default="heldout", help="the corpus split to cut from")
    ap.add_argument("--out", type=Path, help=f"default {OUT.name}, or prose_train.jsonl with --split train")
    ap.add_argument("--stats", action="store_true", help="print counts, write nothing")
    args = ap.parse_args()
    args.out = args.out or OUT.with_name(f"prose_{args.split}.jsonl")
    rows, stats = build(args.n, args.seed, args.split)
    print(stats)
    if len(rows) < args.n and args.split == "heldout":  # tuning takes what one training bucket gives
        raise SystemExit(f"only {len(rows)} prose prompts found, wanted {args.n}")
    if not args.stats:
        corpus.write_jsonl(rows, args.out)
        print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
