"""PEARL's parallel draft (seed 002): a batch-1 draft model that drafts in a process or thread of its own.

Host-free (PyTorch only). `integration/pearl.py` drives it from inside vLLM:
while the target verifies round r's drafts, a draft worker (`DraftProcess` on
CPU, `DraftThread` on GPU) runs `DenseDraft.continue_greedy` on the tokens the
target is verifying, assuming all of them are accepted, and so drafts round
r+1 before round r ends: token after token until the engine asks for them (at
most a cap), so the draft length follows how long the target takes.

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

import json
import logging
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

from vllm_adaptive_spec.heads.cuda_graph import bucket, capture
from vllm_adaptive_spec.heads.eagle3 import rope_cos_sin, rope_theta

logger = logging.getLogger(__name__)
SUPPORTED_MODEL_TYPES = ("qwen3",)
GRAPH_MIN_KEYS = 256  # the shortest cache length a decode graph attends over (then powers of two)
GRAPH_CATCH_UP = 8  # a longer new suffix runs as one forward before the graphs take over
GRAPH_SCRATCH = 2  # cache positions past max_len where a decode graph's capture warms up


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


class _NoGraph(RuntimeError):
    """A decode graph could not be captured."""


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
        shape = (len(self.layers), self.nkv, max_len + GRAPH_SCRATCH, self.d)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)  # [L, nkv, max_len + scratch, d]
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.tokens: list[int] = []  # what the cache holds, position by position
        self.device = torch.device(device)
        # RoPE tables for every position: x * cos + roll(x, d/2) * sin_signed is rotate-half RoPE
        cos, sin = rope_cos_sin(torch.arange(max_len + GRAPH_SCRATCH, device=device), self.d, self.theta)
        half = self.d // 2
        self.cos = cos.to(dtype)[:, None]  # [max_len + scratch, 1, d]
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(dtype)[:, None]
        self._capture = None  # use_graphs: decode from CUDA graphs

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
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            self.k_cache[i, :, start:end], self.v_cache[i, :, start:end] = k, v
            x = self._finish(layer, x, self._attend(q, i, end, mask))
        return self._logits(x[-1])

    def _qkv(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, H], RoPE tables [T, 1, d] -> q [nh, T, d], k [nkv, T, d] (both RoPE'd), v [nkv, T, d]."""
        t, nh, nkv, d, eps = x.shape[0], self.nh, self.nkv, self.d, self.eps
        qkv = F.linear(F.rms_norm(x, x.shape[-1:], layer.in_norm, eps), layer.qkv)  # [T, (nh + 2 nkv) d]
        qk = F.rms_norm(qkv[:, : (nh + nkv) * d].view(t, nh + nkv, d), (d,), eps=eps) * layer.qk_norm
        qk = qk * cos + qk.roll(d // 2, dims=-1) * sin  # [T, nh + nkv, d], RoPE'd
        v = qkv[:, (nh + nkv) * d :].view(t, nkv, d).transpose(0, 1)
        return qk[:, :nh].transpose(0, 1), qk[:, nh:].transpose(0, 1), v

    def _attend(self, q: torch.Tensor, i: int, keys: int, mask: torch.Tensor | None) -> torch.Tensor:
        """q [nh, T, d] against layer i's first `keys` cached positions (mask [T | 1, keys] or None) -> [nh, T, d]."""
        return F.scaled_dot_product_attention(
            q,
            self.k_cache[i, :, :keys],  # [nkv, keys, d]
            self.v_cache[i, :, :keys],
            attn_mask=mask,
            scale=1.0 / math.sqrt(self.d),
            enable_gqa=self.nh != self.nkv,
        )

    def _finish(self, layer: _Layer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The rest of a layer: x [T, H] and its attention output o [nh, T, d] -> [T, H]."""
        x = x + F.linear(o.transpose(0, 1).reshape(x.shape[0], self.nh * self.d), layer.o)
        gate, up = F.linear(F.rms_norm(x, x.shape[-1:], layer.post_norm, self.eps), layer.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down)

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """The last position's hidden state [H] -> logits [V] float32."""
        return F.linear(F.rms_norm(last, last.shape[-1:], self.norm, self.eps), self.lm_head).float()

    # -- one token a step from CUDA graphs (GPU): the draft's own launches, not its arithmetic, bound it --

    def use_graphs(self, capture: Callable[[Callable[[], Any], torch.device], Callable[[], Any]]) -> None:
        """Decode one token at a time from captured graphs (`capture`: heads.cuda_graph.capture on CUDA),
        one per bucket of cache length; `continue_greedy` then replays them, token after token on the
        device (each step puts its greedy token where the next one reads its input)."""
        self._capture = capture
        self._graphs: dict[int, Callable[[], Any]] = {}  # keys (a power of two) -> replay
        self._ids = torch.zeros(1, dtype=torch.long, device=self.device)  # the token the next step reads
        self._pos = torch.zeros(1, dtype=torch.long, device=self.device)  # its position
        self._key_pos = torch.arange(self.max_len, device=self.device)  # [max_len]

    def _decode_step(self, keys: int) -> torch.Tensor:
        """One token with static shapes: reads _ids and _pos (< keys), writes its K/V at _pos, attends to
        the cache's first `keys` positions with those past _pos masked out; then puts its greedy token
        into _ids and advances _pos. -> logits [V] float32."""
        x = self.embed.index_select(0, self._ids)  # [1, H]
        cos, sin = self.cos.index_select(0, self._pos), self.sin_signed.index_select(0, self._pos)  # [1, 1, d]
        mask = (self._key_pos[:keys] <= self._pos)[None, :]  # [1, keys]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            self.k_cache[i].index_copy_(1, self._pos, k)  # [nkv, max_len + scratch, d] at _pos
            self.v_cache[i].index_copy_(1, self._pos, v)
            x = self._finish(layer, x, self._attend(q, i, keys, mask))
        logits = self._logits(x[-1])
        self._ids.copy_(logits.argmax().view(1))
        self._pos.add_(1)
        return logits

    def _replay(self, position: int) -> None:
        """One decode step (its input at `position`) from the graph whose cache length covers it."""
        if position >= self.max_len:
            raise ValueError(f"position {position} is past the draft cache's max_len {self.max_len}")
        keys = min(self.max_len, bucket(max(position + 1, GRAPH_MIN_KEYS)))
        if keys not in self._graphs:
            # capturing runs the step twice first (a graph's warm-up): at the scratch positions past
            # max_len, so that it overwrites no cached token; then the step's inputs are restored
            ids, pos = self._ids.clone(), self._pos.clone()
            self._pos.fill_(self.max_len)
            try:
                self._graphs[keys] = self._capture(lambda: self._decode_step(keys), self.device)
            except RuntimeError as exc:
                raise _NoGraph(str(exc)) from exc
            self._ids.copy_(ids)
            self._pos.copy_(pos)
        self._graphs[keys]()

    def _greedy_graphed(self, tokens: Sequence[int], n: int, stop: Callable[[], bool] | None) -> list[int]:
        """continue_greedy from the graphs: a long new suffix (a prompt) runs as one forward first; the
        rest of it and the drafts run a step each, chained on the device. With `stop`, waits for each
        draft before asking it (the drafts are never ahead of what the device has computed)."""
        common = self._common_prefix(tokens)
        if len(tokens) - common > GRAPH_CATCH_UP:
            self.forward(tokens[common:-1], common)
            common = len(tokens) - 1
        self._pos.fill_(common)
        for j in range(common, len(tokens)):  # the suffix the cache lacks; its last step drafts token 1
            self._ids.fill_(tokens[j])
            self._replay(j)
        drafts = [self._ids.clone()]  # each [1], on the device
        while len(drafts) < n:
            if stop is not None:
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                if stop():
                    break
            self._replay(len(tokens) + len(drafts) - 1)
            drafts.append(self._ids.clone())
        out = torch.cat(drafts).tolist()
        self.tokens = list(tokens) + out[:-1]
        return out

    def sync(self, tokens: Sequence[int]) -> torch.Tensor:
        """Make the cache hold `tokens` (reusing the longest common prefix) -> the last position's logits [V].

        At least the last token is recomputed, since its logits are the answer."""
        common = self._common_prefix(tokens)
        logits = self.forward(tokens[common:], common)
        self.tokens = list(tokens)
        return logits

    def _common_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens the cache holds already (never all: the last is always recomputed)."""
        held, common = self.tokens, 0
        limit = min(len(held), len(tokens) - 1)
        while common < limit and held[common] == tokens[common]:
            common += 1
        return common

    def continue_greedy(self, tokens: Sequence[int], n: int, stop: Callable[[], bool] | None = None) -> list[int]:
        """The draft's greedy tokens after `tokens`: n of them, or fewer (at least one) once `stop()` says
        so between two tokens. The cache then also holds all but the last."""
        if self._capture is not None:
            try:
                return self._greedy_graphed(tokens, n, stop)
            except _NoGraph as exc:  # the cache's positions from the common prefix on are rewritten below
                logger.warning("vllm-adaptive-spec: the parallel draft's CUDA graph failed (%s); it runs eagerly", exc)
                self._capture = None
        out = [int(self.sync(tokens).argmax())]
        while len(out) < n and not (stop is not None and stop()):
            logits = self.forward(out[-1:], len(self.tokens))
            self.tokens.append(out[-1])
            out.append(int(logits.argmax()))
        return out


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
    last_join: float | None = field(default=None, repr=False)

    def record(self, started: float, finished: float, asked: float, joined: float, same_request: bool) -> None:
        self.steps += 1
        if same_request and self.last_join is not None:
            self.timed_steps += 1
            self.step_s += joined - self.last_join
        self.last_join = joined
        self.draft_busy_s += finished - started
        self.target_wait_s += joined - asked

    def add_wait(self, started: float, finished: float, asked: float, joined: float) -> None:
        """A job inside an engine step that already has one (pearl's pre_draft): busy and wait only."""
        self.draft_busy_s += finished - started
        self.target_wait_s += joined - asked

    def as_dict(self) -> dict[str, float | int]:
        sums = {
            k: getattr(self, k)
            for k in ("steps", "skipped", "timed_steps", "step_s", "draft_busy_s", "target_wait_s", "pre_drafted")
        }
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

    def __init__(self, draft: DenseDraft, cpus: set[int] | None, device: torch.device):
        self.draft = draft
        self.cpus = cpus
        self.device = torch.device(device)
        self.timeline = Timeline()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if device.type == "cuda":  # one launch a token instead of a dozen per layer
            draft.use_graphs(capture)
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

    def submit(self, seq: np.ndarray, n: int, until_asked: bool = True) -> None:
        """Draft up to n tokens after seq ([L] token ids) on the thread, until collected (all n when not
        `until_asked`); a job not collected is collected (and dropped) first."""
        if self._job is not None:
            self.collect()
        self._stop.clear()
        stop = self._stop.is_set if until_asked else None
        self._job = self._pool.submit(self._run, self.draft.continue_greedy, (seq.tolist(), n, stop))

    def collect(self, same_request: bool = True, step: bool = True) -> list[int] | None:
        """Wait for the submitted job -> its drafts (None when nothing was submitted); records the timeline
        (`same_request`: the previous step served the same request, so the step's length is known;
        `step`: the job is the engine step's own, not an extra one inside it)."""
        job, self._job = self._job, None
        if job is None:
            self.timeline.skipped += 1
            self.timeline.last_join = None
            return None
        asked = time.perf_counter()
        self._stop.set()
        value, started, finished = job.result()
        times = (started, finished, asked, time.perf_counter())
        self.timeline.record(*times, same_request) if step else self.timeline.add_wait(*times)
        return value

    @property
    def pending(self) -> bool:
        return self._job is not None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# OpenMP placement the engine's environment carries (vLLM binds its threads to its cores): a draft
# process must not inherit it, or its one thread lands on the engine's core.
_OMP_PLACEMENT = ("OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY", "GOMP_CPU_AFFINITY")
# a job: suffix length, common prefix length, most tokens to draft (negative: all of them, never stopping
# early); then the suffix (int32). The engine then sends one byte when it wants the drafts: the process
# stops between two tokens and answers.
_REQ = struct.Struct("<3i")
_REP = struct.Struct("<i2d")  # tokens drafted (-1: error), started, finished (CLOCK_MONOTONIC); then the tokens


def _read_exact(fd: int, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError("the draft process closed its pipe")
        buf += chunk
    return buf


class DraftProcess:
    """The draft in a process of its own, pinned to `cpus`: no interpreter lock shared with the engine.

    Same interface as DraftThread (submit/collect/pending/timeline). Each job sends only what changed
    since the sequence the process holds (`_held`: the last sequence plus the drafts it cached), so a
    step costs three small pipe messages (the job, the engine's "now", the drafts)."""

    def __init__(self, model_dir: str | Path, max_len: int, dtype: torch.dtype, cpus: set[int] | None):
        env = {k: v for k, v in os.environ.items() if k not in _OMP_PLACEMENT} | {"OMP_NUM_THREADS": "1"}
        args = [str(model_dir), str(max_len), str(dtype).removeprefix("torch."), ",".join(map(str, sorted(cpus or ())))]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_adaptive_spec.parallel_draft", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._in, self._out = self._proc.stdout.fileno(), self._proc.stdin.fileno()
        self.timeline = Timeline()
        self._held = np.zeros(0, dtype=np.int32)
        self._pending = False
        self.thread_cpus = set(self._reply()) or None  # the ready message: the CPUs it runs on

    def _reply(self) -> list[int]:
        count, started, finished = _REP.unpack(_read_exact(self._in, _REP.size))
        if count < 0:
            raise RuntimeError(f"draft process: {_read_exact(self._in, -count).decode()}")
        self._times = (started, finished)
        return np.frombuffer(_read_exact(self._in, 4 * count), dtype=np.int32).tolist() if count else []

    def submit(self, seq: np.ndarray, n: int, until_asked: bool = True) -> None:
        """Draft up to n tokens after seq ([L] token ids) in the process, until collected (all n when
        not `until_asked`)."""
        if self._pending:
            self.collect()
        seq = np.ascontiguousarray(seq, dtype=np.int32)  # kept until collect: the caller must not change it
        m = min(len(seq) - 1, len(self._held))
        diff = np.flatnonzero(seq[:m] != self._held[:m])
        common = int(diff[0]) if len(diff) else m
        count = n if until_asked else -n  # negative: draft all n, whenever the engine asks
        os.write(self._out, _REQ.pack(len(seq) - common, common, count) + seq[common:].tobytes())
        self._seq, self._pending = seq, True

    def collect(self, same_request: bool = True, step: bool = True) -> list[int] | None:
        """As DraftThread.collect."""
        if not self._pending:
            self.timeline.skipped += 1
            self.timeline.last_join = None
            return None
        self._pending = False
        asked = time.perf_counter()
        os.write(self._out, b"s")  # stop drafting, answer now
        try:
            ahead = self._reply()
        except Exception:
            self._held = np.zeros(0, dtype=np.int32)  # resend everything next time
            raise
        times = (*self._times, asked, time.perf_counter())
        self.timeline.record(*times, same_request) if step else self.timeline.add_wait(*times)
        self._held = np.concatenate([self._seq, np.asarray(ahead[:-1], dtype=np.int32)])
        return ahead

    @property
    def pending(self) -> bool:
        return self._pending

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=10)


def serve(model_dir: str, max_len: int, dtype: str, cpus: str) -> None:
    """The draft process (DraftProcess): answers draft jobs on its pipes until the engine closes them."""
    reply, requests = os.dup(1), 0
    os.dup2(2, 1)  # stray prints go to stderr, never into the replies
    try:
        if cpus:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        torch.set_num_threads(1)
        draft = DenseDraft.load(model_dir, max_len, dtype=getattr(torch, dtype))
        ready = sorted(os.sched_getaffinity(0))
        os.write(reply, _REP.pack(len(ready), 0.0, 0.0) + np.asarray(ready, dtype=np.int32).tobytes())
    except Exception as e:
        msg = f"{type(e).__name__}: {e}".encode()
        os.write(reply, _REP.pack(-len(msg), 0.0, 0.0) + msg)
        return

    def stop() -> bool:  # the engine's collect has arrived
        return bool(select.select([requests], [], [], 0)[0])

    while True:
        try:
            m, common, n = _REQ.unpack(_read_exact(requests, _REQ.size))
            suffix = np.frombuffer(_read_exact(requests, 4 * m), dtype=np.int32).tolist()
        except EOFError:
            return
        started = time.perf_counter()
        try:
            ahead = draft.continue_greedy(draft.tokens[:common] + suffix, abs(n), stop if n > 0 else None)
            body, count = np.asarray(ahead, dtype=np.int32).tobytes(), len(ahead)
        except Exception as e:
            draft.tokens = []
            body = f"{type(e).__name__}: {e}".encode()
            count = -len(body)
        finished = time.perf_counter()
        try:
            _read_exact(requests, 1)  # the engine asks for the drafts (the byte `stop` saw)
        except EOFError:
            return
        os.write(reply, _REP.pack(count, started, finished) + body)


def free_cpus(busy: set[int], ncpu: int | None = None) -> set[int]:
    """CPUs of this machine outside `busy` (the engine's OpenMP threads)."""
    return set(range(ncpu or os.cpu_count() or 1)) - busy


__all__ = ["DenseDraft", "DraftProcess", "DraftThread", "Timeline", "check_draft_dir", "fractions", "free_cpus"]

if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: python -m vllm_adaptive_spec.parallel_draft MODEL_DIR MAX_LEN DTYPE CPUS")
    serve(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
