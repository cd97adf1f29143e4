"""PEARL's parallel draft (seed 002): a batch-1 draft model that drafts in a process or thread of its own.

Host-free (PyTorch only). `integration/pearl.py` drives it from inside vLLM:
while the target verifies round r's drafts, a draft worker (`DraftProcess` on
CPU, `DraftThread` on GPU) runs `DenseDraft.continue_greedy` on the tokens the
target is verifying, assuming all of them are accepted, and so drafts round
r+1 before round r ends: token after token until the engine asks for them (at
most a cap), so the draft length follows how long the target takes. With
`branches`, a job that reaches its cap before the engine asks spends the rest
of the target's time on second guesses (`draft_round`): the draft's runner-up
token where the verified drafts most likely part from the target, and its
greedy drafts after it, on a cache line of their own. When the target's token
is that runner-up, the next round verifies those drafts at once instead of
waiting for a draft after the rejection.

Why a model of our own instead of vLLM's draft model: vLLM's CPU kernels
(paged attention, the oneDNN linears) share one process-wide scratch buffer
(`cpu_utils::ScratchPadManager`), so two host threads must never run them at
the same time. The parallel draft therefore runs the draft checkpoint with
PyTorch's own (thread-safe) ops and a dense KV cache of its own, for one
sequence. Rollback is vLLM's: the cache remembers which tokens it holds,
`sync` keeps the longest prefix shared with the sequence it is given and
overwrites the rest (rejected drafts simply fall off the end).
"""

from __future__ import annotations

import copy
import json
import math
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from vllm_adaptive_spec.heads.eagle3 import rope_cos_sin, rope_theta

SUPPORTED_MODEL_TYPES = ("qwen3",)


def check_draft_dir(model_dir: str | Path) -> dict[str, Any]:
    """The draft's HF config; ValueError naming what does not fit the parallel draft."""
    path = Path(model_dir)
    conf_file = path / "config.json"
    if not conf_file.is_file():
        raise ValueError(f"{str(path)!r} has no config.json")
    conf = json.loads(conf_file.read_text())
    if conf.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {conf.get('model_type')!r} (supported: {list(SUPPORTED_MODEL_TYPES)})")
    rope_theta(conf)  # only default RoPE
    if not (path / "model.safetensors").is_file() and not (path / "model.safetensors.index.json").is_file():
        raise ValueError(f"{str(path)!r} has no model.safetensors")
    return conf


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(path / "model.safetensors")
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        weights.update(load_file(path / shard))
    return weights


@dataclass
class _Layer:
    qkv: torch.Tensor  # [(nh + 2 nkv) d, H]
    o: torch.Tensor  # [H, nh d]
    qk_norm: torch.Tensor  # [nh + nkv, d]: q_norm's weight per query head, then k_norm's per kv head
    in_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]


class DenseDraft:
    """A Qwen3 causal LM for one sequence, with a dense KV cache that remembers its tokens."""

    def __init__(self, conf: dict[str, Any], weights: dict[str, torch.Tensor], max_len: int, device, dtype):
        self.nh = conf["num_attention_heads"]
        self.nkv = conf.get("num_key_value_heads", self.nh)
        self.d = conf.get("head_dim") or conf["hidden_size"] // self.nh
        self.eps = conf.get("rms_norm_eps", 1e-6)
        self.theta = rope_theta(conf)
        self.max_len = max_len

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        p = "model.layers.{}."
        self.layers = [
            _Layer(
                qkv=torch.cat([w((p + f"self_attn.{n}_proj.weight").format(i)) for n in "qkv"]),
                o=w((p + "self_attn.o_proj.weight").format(i)),
                qk_norm=torch.cat(
                    [
                        w((p + "self_attn.q_norm.weight").format(i)).expand(self.nh, -1),
                        w((p + "self_attn.k_norm.weight").format(i)).expand(self.nkv, -1),
                    ]
                ),
                in_norm=w((p + "input_layernorm.weight").format(i)),
                post_norm=w((p + "post_attention_layernorm.weight").format(i)),
                gate_up=torch.cat([w((p + f"mlp.{n}_proj.weight").format(i)) for n in ("gate", "up")]),
                down=w((p + "mlp.down_proj.weight").format(i)),
            )
            for i in range(conf["num_hidden_layers"])
        ]
        self.embed = w("model.embed_tokens.weight")  # [V, H]
        self.lm_head = self.embed if "lm_head.weight" not in weights else w("lm_head.weight")  # [V, H]
        self.norm = w("model.norm.weight")
        shape = (len(self.layers), self.nkv, max_len, self.d)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)  # [L, nkv, max_len, d]
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.tokens: list[int] = []  # what the cache holds, position by position
        # position -> (top token, its probability, runner-up, its probability) of the draft's prediction
        # there, for the positions this cache predicted (None: not recorded; `branches` turns it on)
        self.guess: dict[int, tuple[int, float, int, float]] | None = None
        self.device = device
        # RoPE tables for every position: x * cos + roll(x, d/2) * sin_signed is rotate-half RoPE
        cos, sin = rope_cos_sin(torch.arange(max_len, device=device), self.d, self.theta)  # [max_len, d]
        half = self.d // 2
        self.cos = cos.to(dtype)[:, None]  # [max_len, 1, d]
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(dtype)[:, None]

    def fork(self) -> DenseDraft:
        """Another cache line for the same weights (a branch of pearl's second guesses)."""
        line = copy.copy(self)
        line.k_cache, line.v_cache = torch.zeros_like(self.k_cache), torch.zeros_like(self.v_cache)
        line.tokens = []
        line.guess = None if self.guess is None else {}
        return line

    @classmethod
    def load(
        cls, model_dir: str | Path, max_len: int, device: str | torch.device = "cpu", dtype=torch.float32
    ) -> DenseDraft:
        conf = check_draft_dir(model_dir)
        return cls(conf, _load_weights(Path(model_dir)), max_len, device, dtype)

    def forward(self, ids: Sequence[int], start: int) -> torch.Tensor:
        """Run `ids` at positions start.. (the cache must hold positions < start) -> last position's logits [V] float32.

        Few, large ops: on CPU the per-op cost dominates a small draft, and the draft thread shares
        the interpreter with the engine's."""
        t = len(ids)
        end = start + t
        if end > self.max_len:
            raise ValueError(f"position {end - 1} is past the draft cache's max_len {self.max_len}")
        x = self.embed[torch.tensor(ids, device=self.device)]  # [T, H]
        cos, sin = self.cos[start:end], self.sin_signed[start:end]  # [T, 1, d]
        mask = None
        if t > 1:  # query i (position start + i) sees keys 0..start + i
            mask = torch.arange(end, device=self.device) <= torch.arange(start, end, device=self.device)[:, None]
        nh, nkv, d, eps = self.nh, self.nkv, self.d, self.eps
        for i, layer in enumerate(self.layers):
            qkv = F.linear(F.rms_norm(x, x.shape[-1:], layer.in_norm, eps), layer.qkv)  # [T, (nh + 2 nkv) d]
            qk = F.rms_norm(qkv[:, : (nh + nkv) * d].view(t, nh + nkv, d), (d,), eps=eps) * layer.qk_norm
            qk = qk * cos + qk.roll(d // 2, dims=-1) * sin  # [T, nh + nkv, d], RoPE'd
            self.k_cache[i, :, start:end] = qk[:, nh:].transpose(0, 1)
            self.v_cache[i, :, start:end] = qkv[:, (nh + nkv) * d :].view(t, nkv, d).transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qk[:, :nh].transpose(0, 1),  # [nh, T, d]
                self.k_cache[i, :, :end],  # [nkv, S, d]
                self.v_cache[i, :, :end],
                attn_mask=mask,
                scale=1.0 / math.sqrt(d),
                enable_gqa=nh != nkv,
            )  # [nh, T, d]
            x = x + F.linear(o.transpose(0, 1).reshape(t, nh * d), layer.o)
            gate, up = F.linear(F.rms_norm(x, x.shape[-1:], layer.post_norm, eps), layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return F.linear(F.rms_norm(x[-1], x.shape[-1:], self.norm, eps), self.lm_head).float()  # [V]

    def sync(self, tokens: Sequence[int]) -> torch.Tensor:
        """Make the cache hold `tokens` (reusing the longest common prefix) -> the last position's logits [V].

        At least the last token is recomputed, since its logits are the answer."""
        held = self.tokens
        common = 0
        limit = min(len(held), len(tokens) - 1)
        while common < limit and held[common] == tokens[common]:
            common += 1
        logits = self.forward(tokens[common:], common)
        self.tokens = list(tokens)
        if self.guess is not None:  # a guess at position p depends on tokens[:p]: those up to `common` hold
            self.guess = {p: g for p, g in self.guess.items() if common - 64 <= p <= common}
            self._note(len(tokens), logits)
        return logits

    def _note(self, pos: int, logits: torch.Tensor) -> None:
        """Record the prediction for position `pos` (logits [V]) when guesses are on."""
        if self.guess is not None:
            top = logits.topk(2)
            p = (top.values - logits.logsumexp(0)).exp().tolist()
            ids = top.indices.tolist()
            self.guess[pos] = (ids[0], p[0], ids[1], p[1])

    def continue_greedy(self, tokens: Sequence[int], n: int, stop: Callable[[], bool] | None = None) -> list[int]:
        """The draft's greedy tokens after `tokens`: n of them, or fewer (at least one) once `stop()` says
        so between two tokens. The cache then also holds all but the last."""
        out = [int(self.sync(tokens).argmax())]
        while len(out) < n and not (stop is not None and stop()):
            logits = self.forward(out[-1:], len(self.tokens))
            self.tokens.append(out[-1])
            self._note(len(self.tokens), logits)
            out.append(int(logits.argmax()))
        return out


@dataclass
class Branch:
    """A second guess: the draft's runner-up `alt` after the first `at` of the verified drafts (at = k:
    in place of the target's own next token), and the draft's greedy tokens after it."""

    at: int
    alt: int
    tokens: list[int]


def branch_points(guess: dict[int, tuple[int, float, int, float]], seq: Sequence[int], k: int, m: int) -> list:
    """The m likeliest places for the target to part from the draft's chain, by the draft's own odds.

    seq [L] ends with the k drafts the target verifies; the chain is those drafts, then the draft's next
    token at position L. Parting after `at` drafts with the runner-up there has the draft's probability
    p_top(L-k) ... p_top(L-k+at-1) p_runner_up(L-k+at) -> [(at, runner-up)], likeliest first."""
    n = len(seq)
    prefix, found = 1.0, []
    for at in range(k + 1):
        g = guess.get(n - k + at)
        if g is None:
            break
        top, p_top, alt, p_alt = g
        found.append((prefix * p_alt, at, alt))
        if at < k:
            if top != seq[n - k + at]:  # not the draft's own chain past here
                break
            prefix *= p_top
    found.sort(key=lambda f: -f[0])
    return [(at, alt) for _, at, alt in found[:m]]


def pick_line(held: Sequence[Sequence[int]], seq: Sequence[int]) -> tuple[int, int]:
    """The cache line sharing the longest prefix with seq (ties: the first) -> (line, prefix length);
    the prefix stops short of seq's last token, whose logits a job needs."""
    best, common = 0, -1
    target = np.asarray(seq)
    for i, h in enumerate(held):
        m = min(len(target) - 1, len(h))
        diff = np.flatnonzero(np.asarray(h[:m]) != target[:m])
        c = int(diff[0]) if len(diff) else m
        if c > common:
            best, common = i, c
    return best, max(common, 0)


LATE = -1  # Pace's key for late jobs (pearl: drafts after a rejection, taken when the scheduler needs them)


class Pace:
    """When the engine will ask for a job's drafts, from when it asked in the last jobs that verified as
    many drafts (the target's forward takes about as long again): a second guess starts a draft forward
    only when the forward fits before then, so that it never keeps the engine waiting."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self.asked_after: dict[int, list[float]] = {}  # drafts verified -> seconds from job start to ask
        self.forward_s: float | None = None  # a draft forward, running mean

    def job_done(self, k: int, started: float, asked: float) -> None:
        hist = self.asked_after.setdefault(k, [])
        hist.append(asked - started)
        del hist[: -self.keep]

    def forwards(self, seconds: float, count: int) -> None:
        if count:
            one = seconds / count
            self.forward_s = one if self.forward_s is None else 0.8 * self.forward_s + 0.2 * one

    def fits(self, k: int, started: float, forwards: float = 1.0) -> bool:
        """Do `forwards` draft forwards, started now, end before the engine asks (the earliest ask of the
        recent jobs verifying k drafts, or of any step's job when none did; k = LATE: late jobs)?"""
        hist = self.asked_after.get(k) or (
            [] if k < 0 else [t for i, h in self.asked_after.items() if i >= 0 for t in h]
        )
        if not hist or self.forward_s is None:
            return False
        return time.perf_counter() + forwards * self.forward_s <= started + min(hist)


def draft_round(
    lines: list[DenseDraft],
    line: int,
    seq: list[int],
    k: int,
    n: int,
    stop: Callable[[], bool] | None,
    pace: Pace | None = None,
    least: int = 0,
) -> tuple[list[int], list[Branch]]:
    """One job of a pearl worker on cache line `line`: the draft's greedy tokens after seq (n, or fewer once
    `stop()` says so); then one second guess (`branch_points`) per other line, each drafted up to n - 1
    tokens (what the next round can verify), one forward at a time while `pace` says it ends before the
    engine asks. seq ends with the k drafts being verified.

    A late job (`least` > 0: drafts after a rejection, which the engine takes when its scheduler needs
    them) drafts `least` tokens whatever the time, then more only while `pace` says a forward ends before
    the engine asks; no second guess."""
    started = time.perf_counter()
    main = lines[line]
    if least:
        paced, made = pace or Pace(), [0]

        def enough() -> bool:  # asked before each token after the first
            made[0] += 1
            return made[0] >= least and (stop is None or stop() or not paced.fits(LATE, started))

        return main.continue_greedy(seq, n, enough), []
    ahead = main.continue_greedy(seq, n, stop)
    branches: list[Branch] = []
    if pace is None or stop is None:
        return ahead, branches
    pace.forwards(time.perf_counter() - started, len(ahead))
    others = lines[:line] + lines[line + 1 :]
    if not others or main.guess is None or len(ahead) < n:
        return ahead, branches

    def halt() -> bool:
        return stop() or not pace.fits(k, started)

    for (at, alt), other in zip(branch_points(main.guess, seq, k, len(others)), others):
        if stop() or not pace.fits(k, started, 1.5):  # a branch's first forward runs a few tokens
            break
        branch_seq = seq[: len(seq) - k + at] + [alt]
        branches.append(Branch(at, alt, other.continue_greedy(branch_seq, max(1, n - 1), halt)))
    return ahead, branches


# the sums a Timeline keeps (and the harness adds up over workers)
TIMELINE_SUMS = (
    "steps",
    "skipped",
    "timed_steps",
    "step_s",
    "draft_busy_s",
    "target_wait_s",
    "pre_drafted",
    "branches",
    "branch_drafts",
    "branch_hits",
)


@dataclass
class Timeline:
    """Engine steps that ran a draft job: sums in seconds (per-step means in `as_dict`)."""

    steps: int = 0
    skipped: int = 0  # engine steps with no job (a prefill chunk, no request)
    timed_steps: int = 0  # steps whose previous step served the same request: their length is known
    step_s: float = 0.0  # those steps, join to join
    draft_busy_s: float = 0.0  # the draft thread computing
    target_wait_s: float = 0.0  # the engine's thread blocked on the draft (it asked before the job ended)
    pre_drafted: int = 0  # drafts made while the engine waited (pearl's pre_draft), not beside the target
    branches: int = 0  # second guesses drafted (pearl's `branches`)
    branch_drafts: int = 0  # the drafts made on them
    branch_hits: int = 0  # steps that verified a second guess's drafts (the target chose its runner-up)
    last_join: float | None = field(default=None, repr=False)

    def record(self, started: float, finished: float, asked: float, joined: float, same_request: bool) -> None:
        self.steps += 1
        if same_request and self.last_join is not None:
            self.timed_steps += 1
            self.step_s += joined - self.last_join
        self.last_join = joined
        self.draft_busy_s += finished - started
        self.target_wait_s += joined - asked

    def add_branches(self, branches: list[Branch]) -> None:
        self.branches += len(branches)
        self.branch_drafts += sum(len(b.tokens) for b in branches)

    def add_wait(self, started: float, finished: float, asked: float, joined: float) -> None:
        """A job inside an engine step that already has one (pearl's pre_draft): busy and wait only."""
        self.draft_busy_s += finished - started
        self.target_wait_s += joined - asked

    def as_dict(self) -> dict[str, float | int]:
        sums = {k: getattr(self, k) for k in TIMELINE_SUMS}
        return sums | fractions(sums)


def fractions(t: dict[str, float]) -> dict[str, float]:
    """Per-step means of Timeline sums: step length, and the share of a step each side waits for the other:
    the draft idles whenever it is not computing, the target while its thread blocks on the draft."""
    step = t["step_s"] / t["timed_steps"] if t.get("timed_steps") else 0.0
    busy = t["draft_busy_s"] / t["steps"] if t.get("steps") else 0.0
    wait = t["target_wait_s"] / t["steps"] if t.get("steps") else 0.0
    return {
        "step_ms": 1e3 * step,
        "draft_busy_ms": 1e3 * busy,
        "target_wait_ms": 1e3 * wait,
        "draft_idle_frac": max(0.0, 1.0 - busy / step) if step else 0.0,
        "target_wait_frac": wait / step if step else 0.0,
    }


class DraftThread:
    """The draft on a worker thread of the engine's process: pinned to `cpus` with one intra-op
    thread (CPU), or on its own CUDA stream (GPU), so that it overlaps the target's forward. On CPU
    it shares the interpreter lock with the engine (DraftProcess does not)."""

    def __init__(self, draft: DenseDraft, cpus: set[int] | None, device: torch.device, branches: int = 0):
        self.draft = draft
        if branches:
            draft.guess = {}
        self.lines = [draft] + [draft.fork() for _ in range(branches)]  # cache lines: the chain, second guesses
        self.branches: list[Branch] = []  # the last collected job's second guesses
        self.pace = Pace()
        self.cpus = cpus
        self.device = device
        self.timeline = Timeline()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pearl-draft", initializer=self._setup)
        self._job: Future | None = None
        self._stop = threading.Event()  # set when the engine asks for the drafts
        self.thread_cpus: set[int] | None = None  # as the worker thread reports it
        self._pool.submit(lambda: None).result()  # start the thread now: a set-up error fails start-up

    def _setup(self) -> None:
        if self.device.type == "cpu":
            if self.cpus:
                os.sched_setaffinity(0, self.cpus)  # this thread only (Linux: pid 0 is the caller)
            torch._C.set_num_threads(
                1
            )  # this thread's intra-op threads (vLLM's CPU worker stubs out torch.set_num_threads)
            self.thread_cpus = os.sched_getaffinity(0)

    def _run(self, fn: Callable[..., Any], args: tuple) -> tuple[Any, float, float]:
        started = time.perf_counter()
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                value = fn(*args)
            self._stream.synchronize()
        else:
            value = fn(*args)
        return value, started, time.perf_counter()

    def submit(self, seq: np.ndarray, n: int, until_asked: bool = True, k: int = 0, least: int = 0) -> None:
        """Draft up to n tokens after seq ([L] token ids, ending with the k drafts the target verifies) on
        the thread, until collected (all n, and no second guess, when not `until_asked`; a late job when
        `least`, see draft_round); a job not collected is collected (and dropped) first."""
        if self._job is not None:
            self.collect()
        self._stop.clear()
        stop = self._stop.is_set if until_asked else None
        line, _ = pick_line([x.tokens for x in self.lines], seq)
        job = (self.lines, line, seq.tolist(), k, n, stop, self.pace, least)
        self._job, self._key = self._pool.submit(self._run, draft_round, job), (LATE if least else k)
        self._until_asked = until_asked

    def collect(self, same_request: bool = True, step: bool = True) -> list[int] | None:
        """Wait for the submitted job -> its drafts (None when nothing was submitted); records the timeline
        (`same_request`: the previous step served the same request, so the step's length is known;
        `step`: the job is the engine step's own, not an extra one inside it)."""
        job, self._job = self._job, None
        if job is None:
            self.timeline.skipped += 1
            self.timeline.last_join = None
            return None
        self.branches = []
        asked = time.perf_counter()
        self._stop.set()
        (ahead, self.branches), started, finished = job.result()
        if self._until_asked:
            self.pace.job_done(self._key, started, asked)
        times = (started, finished, asked, time.perf_counter())
        self.timeline.record(*times, same_request) if step else self.timeline.add_wait(*times)
        self.timeline.add_branches(self.branches)
        return ahead

    @property
    def pending(self) -> bool:
        return self._job is not None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# OpenMP placement the engine's environment carries (vLLM binds its threads to its cores): a draft
# process must not inherit it, or its one thread lands on the engine's core.
_OMP_PLACEMENT = ("OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY", "GOMP_CPU_AFFINITY")
# a job: suffix length, common prefix length, most tokens to draft (negative: all of them, never stopping
# early, no second guess), the drafts the target verifies at the end of the sequence, the cache line the
# prefix is on, `least` (> 0: a late job, draft_round); then the suffix (int32). The engine then sends one
# byte when it wants the drafts: the process stops between two tokens and answers.
_REQ = struct.Struct("<6i")
# tokens drafted (negative: the length of an error message), int32s after them (per second guess: at, alt,
# length, tokens), started, finished (perf_counter); then the tokens
_REP = struct.Struct("<2i2d")


def _read_exact(fd: int, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError("the draft process closed its pipe")
        buf += chunk
    return buf


def _pack_branches(branches: list[Branch]) -> list[int]:
    return [x for b in branches for x in (b.at, b.alt, len(b.tokens), *b.tokens)]


def _unpack_branches(ints: list[int]) -> list[Branch]:
    out, i = [], 0
    while i < len(ints):
        at, alt, n = ints[i : i + 3]
        out.append(Branch(at, alt, ints[i + 3 : i + 3 + n]))
        i += 3 + n
    return out


class DraftProcess:
    """The draft in a process of its own, pinned to `cpus`: no interpreter lock shared with the engine.

    Same interface as DraftThread (submit/collect/pending/timeline/branches). Each job sends only what
    changed since the sequence the process holds on the line sharing most of it (`_held`: per cache
    line, its last sequence plus the drafts it cached), so a step costs three small pipe messages
    (the job, the engine's "now", the drafts)."""

    def __init__(
        self, model_dir: str | Path, max_len: int, dtype: torch.dtype, cpus: set[int] | None, branches: int = 0
    ):
        env = {k: v for k, v in os.environ.items() if k not in _OMP_PLACEMENT} | {"OMP_NUM_THREADS": "1"}
        dtype_name = str(dtype).removeprefix("torch.")
        args = [str(model_dir), str(max_len), dtype_name, ",".join(map(str, sorted(cpus or ()))), str(branches)]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_adaptive_spec.parallel_draft", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._in, self._out = self._proc.stdout.fileno(), self._proc.stdin.fileno()
        self.timeline = Timeline()
        self._held = [np.zeros(0, dtype=np.int32) for _ in range(1 + branches)]
        self.branches: list[Branch] = []  # the last collected job's second guesses
        self._pending = False
        self.thread_cpus = set(self._reply()[0]) or None  # the ready message: the CPUs it runs on

    def _reply(self) -> tuple[list[int], list[Branch]]:
        count, extra, started, finished = _REP.unpack(_read_exact(self._in, _REP.size))
        if count < 0:
            raise RuntimeError(f"draft process: {_read_exact(self._in, -count).decode()}")
        self._times = (started, finished)
        n = count + extra
        ints = np.frombuffer(_read_exact(self._in, 4 * n), dtype=np.int32).tolist() if n else []
        return ints[:count], _unpack_branches(ints[count:])

    def submit(self, seq: np.ndarray, n: int, until_asked: bool = True, k: int = 0, least: int = 0) -> None:
        """As DraftThread.submit, in the process."""
        if self._pending:
            self.collect()
        seq = np.ascontiguousarray(seq, dtype=np.int32)  # kept until collect: the caller must not change it
        line, common = pick_line(self._held, seq)
        count = n if until_asked else -n  # negative: draft all n, whenever the engine asks
        os.write(self._out, _REQ.pack(len(seq) - common, common, count, k, line, least) + seq[common:].tobytes())
        self._seq, self._k, self._line, self._pending = seq, k, line, True

    def collect(self, same_request: bool = True, step: bool = True) -> list[int] | None:
        """As DraftThread.collect."""
        if not self._pending:
            self.timeline.skipped += 1
            self.timeline.last_join = None
            return None
        self._pending = False
        self.branches = []
        asked = time.perf_counter()
        os.write(self._out, b"s")  # stop drafting, answer now
        try:
            ahead, self.branches = self._reply()
        except Exception:
            self._held = [np.zeros(0, dtype=np.int32) for _ in self._held]  # resend everything next time
            raise
        times = (*self._times, asked, time.perf_counter())
        self.timeline.record(*times, same_request) if step else self.timeline.add_wait(*times)
        self.timeline.add_branches(self.branches)
        seq, k = self._seq, self._k
        self._held[self._line] = np.concatenate([seq, np.asarray(ahead[:-1], dtype=np.int32)])
        others = [i for i in range(len(self._held)) if i != self._line]
        for b, i in zip(self.branches, others):  # draft_round drafts second guesses on the other lines, in order
            self._held[i] = np.concatenate([seq[: len(seq) - k + b.at], np.asarray([b.alt, *b.tokens[:-1]], np.int32)])
        return ahead

    @property
    def pending(self) -> bool:
        return self._pending

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=10)


def serve(model_dir: str, max_len: int, dtype: str, cpus: str, branches: int) -> None:
    """The draft process (DraftProcess): answers draft jobs on its pipes until the engine closes them."""
    reply, requests = os.dup(1), 0
    os.dup2(2, 1)  # stray prints go to stderr, never into the replies
    try:
        if cpus:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        torch.set_num_threads(1)
        draft = DenseDraft.load(model_dir, max_len, dtype=getattr(torch, dtype))
        if branches:
            draft.guess = {}
        lines = [draft] + [draft.fork() for _ in range(branches)]
        pace = Pace()
        ready = sorted(os.sched_getaffinity(0))
        os.write(reply, _REP.pack(len(ready), 0, 0.0, 0.0) + np.asarray(ready, dtype=np.int32).tobytes())
    except Exception as e:
        msg = f"{type(e).__name__}: {e}".encode()
        os.write(reply, _REP.pack(-len(msg), 0, 0.0, 0.0) + msg)
        return

    def stop() -> bool:  # the engine's collect has arrived
        return bool(select.select([requests], [], [], 0)[0])

    while True:
        try:
            m, common, n, k, line, least = _REQ.unpack(_read_exact(requests, _REQ.size))
            suffix = np.frombuffer(_read_exact(requests, 4 * m), dtype=np.int32).tolist()
        except EOFError:
            return
        started = time.perf_counter()
        try:
            seq = lines[line].tokens[:common] + suffix
            ahead, found = draft_round(lines, line, seq, k, abs(n), stop if n > 0 else None, pace, least)
            extra = _pack_branches(found)
            body, count, n_extra = np.asarray(ahead + extra, dtype=np.int32).tobytes(), len(ahead), len(extra)
        except Exception as e:
            for x in lines:
                x.tokens = []
            body = f"{type(e).__name__}: {e}".encode()
            count, n_extra = -len(body), 0
        finished = time.perf_counter()
        try:
            _read_exact(requests, 1)  # the engine asks for the drafts (the byte `stop` saw)
        except EOFError:
            return
        if n > 0:  # a job drafting until asked: when the engine asked (late by the forward it may have waited on)
            pace.job_done(LATE if least else k, started, time.perf_counter())
        os.write(reply, _REP.pack(count, n_extra, started, finished) + body)


def free_cpus(busy: set[int], ncpu: int | None = None) -> set[int]:
    """CPUs of this machine outside `busy` (the engine's OpenMP threads)."""
    return set(range(ncpu or os.cpu_count() or 1)) - busy


__all__ = [
    "LATE",
    "Branch",
    "DenseDraft",
    "DraftProcess",
    "DraftThread",
    "TIMELINE_SUMS",
    "Pace",
    "Timeline",
    "branch_points",
    "check_draft_dir",
    "draft_round",
    "fractions",
    "free_cpus",
    "pick_line",
]

if __name__ == "__main__":
    if len(sys.argv) != 6:
        sys.exit("usage: python -m vllm_adaptive_spec.parallel_draft MODEL_DIR MAX_LEN DTYPE CPUS BRANCHES")
    serve(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
