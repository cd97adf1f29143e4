"""The OpenAI-compatible server (`vllm serve`) with the plugin on: OpenAI-compatible API on a loopback port.

Concurrent requests, one streamed, one aborted mid-stream; outputs equal the
offline no-speculation reference; the server shuts down cleanly. All traffic
stays on 127.0.0.1 and every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.paths import TARGET, load_prompts
from tests.conftest import spec_config
from vllm_adaptive_spec.integration.worker_ext import WORKER_EXTENSION

pytestmark = pytest.mark.e2e

N_PROMPTS = 12
MAX_TOKENS = 32
STARTUP_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 120):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="vas-serve-", suffix=".log", delete=False)
    cmd = [
        # the README's command, as a user types it (on CPU it needs the set-up's vllm alias)
        str(Path(sys.executable).parent / "vllm"), "serve", str(TARGET),
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "1024", "--max-num-seqs", "16", "--enforce-eager", "--seed", "0",
        "--dtype", "float32",  # as the reference engine (tests/conftest.make_llm says why)
        "--speculative-config", json.dumps(spec_config(8)),
        "--additional-config", json.dumps({"adaptive_spec": {"policy": "svip"}}),
        "--worker-extension-cls", WORKER_EXTENSION,
    ]  # fmt: skip
    # dev mode: POST /collective_rpc reads the plugin's statistics from the worker; the engine core in
    # its own process, as users run the server (the test session runs its own engines in-process)
    env = os.environ | {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while True:
        assert proc.poll() is None, f"server exited early; log: {open(log.name).read()[-3000:]}"
        try:
            if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy in time"
        time.sleep(1)
    yield base, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("server did not shut down within 60 s of SIGINT")


@pytest.fixture(scope="module")
def reference_texts(ref_llm) -> list[str]:
    from vllm import SamplingParams

    outs = ref_llm.generate(
        load_prompts("code_heldout", N_PROMPTS), SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    return [o.outputs[0].text for o in outs]


def _complete(base: str, prompt: str) -> str:
    body = {"model": str(TARGET), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    with _post(base + "/v1/completions", body) as resp:
        return json.load(resp)["choices"][0]["text"]


def _stream(base: str, prompt: str, max_tokens: int = MAX_TOKENS, stop_after: int | None = None) -> str:
    body = {"model": str(TARGET), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, chunks = "", 0
    with _post(base + "/v1/completions", body) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            text += json.loads(line[5:])["choices"][0]["text"]
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                break  # closing the connection aborts the request
    return text


def test_concurrent_streamed_and_aborted_requests(server, reference_texts):
    base, proc = server
    prompts = load_prompts("code_heldout", N_PROMPTS)
    with ThreadPoolExecutor(max_workers=N_PROMPTS + 2) as pool:
        aborted = pool.submit(_stream, base, prompts[0], 400, 3)
        streamed = pool.submit(_stream, base, prompts[1])
        plain = [pool.submit(_complete, base, p) for p in prompts]
        texts = [f.result(timeout=300) for f in plain]
        assert streamed.result(timeout=300) == reference_texts[1]
        assert len(aborted.result(timeout=300)) > 0
    assert texts == reference_texts
    # still healthy, still correct after the abort
    assert urllib.request.urlopen(base + "/health", timeout=10).status == 200
    assert _complete(base, prompts[2]) == reference_texts[2]
    metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    assert "vllm:spec_decode_num_draft_tokens" in metrics
    assert "adaptive_spec:draft_length_bucket" in metrics
    assert "adaptive_spec:mean_acceptance_length" in metrics
    assert proc.poll() is None


N_LOAD = 200  # requests in flight at once
N_ABORT = 10


def _server_rss_mb(proc) -> float:
    import psutil

    root = psutil.Process(proc.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20


def _worker_stats(base: str) -> list[dict]:
    with _post(base + "/collective_rpc", {"method": "adaptive_spec_stats"}, timeout=30) as resp:
        return [snap for per_worker in json.load(resp)["results"] for snap in per_worker]


def _load_request(base: str, i: int, prompt: str) -> tuple[str, str, str | None]:
    """Request i of the load: greedy or sampled, streamed or not, short or long, some aborted."""
    max_tokens = (8, 96, 33)[i % 3]
    body = {"model": str(TARGET), "prompt": prompt, "max_tokens": max_tokens}
    body |= {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": i}
    if i < N_ABORT:
        return "aborted", _stream(base, prompt, 400, stop_after=2), None
    if i % 4 in (0, 1):
        with _post(base + "/v1/completions", body, timeout=300) as resp:
            choice = json.load(resp)["choices"][0]
            return "done", choice["text"], choice["finish_reason"]
    text, finish = "", None
    with _post(base + "/v1/completions", body | {"stream": True}, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                choice = json.loads(line[5:])["choices"][0]
                text += choice["text"]
                finish = choice.get("finish_reason") or finish
    return "done", text, finish


def test_load_of_200_concurrent_requests(server, ref_llm):
    """Issue 7: 200 requests at once (greedy and sampled, streamed or not, short and long,
    10 aborted mid-stream): none lost, greedy ones equal the reference, state back to empty,
    memory flat."""
    from vllm import SamplingParams

    base, proc = server
    prompts = load_prompts("code_heldout", N_LOAD)
    greedy_ids = [i for i in range(N_ABORT, N_LOAD) if i % 2 == 0]
    refs = ref_llm.generate(
        [prompts[i] for i in greedy_ids],
        [SamplingParams(temperature=0, max_tokens=(8, 96, 33)[i % 3]) for i in greedy_ids],
        use_tqdm=False,
    )
    want = {i: o.outputs[0].text for i, o in zip(greedy_ids, refs)}
    before_stats = _worker_stats(base)[0]["n_finished"]
    rss = [_server_rss_mb(proc)]
    for wave in range(2):  # the first wave warms the server up; the second must not grow it
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=N_LOAD) as pool:
            futures = [pool.submit(_load_request, base, i, p) for i, p in enumerate(prompts)]
            results = [f.result(timeout=600) for f in futures]
        elapsed = time.monotonic() - start
        assert [kind for kind, _, _ in results] == ["aborted"] * N_ABORT + ["done"] * (N_LOAD - N_ABORT)
        assert all(finish in ("length", "stop") for _, _, finish in results[N_ABORT:]), "every request completed"
        wrong = [i for i in greedy_ids if results[i][1] != want[i]]
        assert not wrong, f"wave {wave}: greedy completions differ from the reference: {wrong}"
        assert urllib.request.urlopen(base + "/health", timeout=10).status == 200

        deadline = time.monotonic() + 30
        while True:  # finished ids reach the worker with the engine's next step
            (snap,) = _worker_stats(base)
            if snap["requests"] == {} and snap["tracked"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert snap["requests"] == {} and snap["tracked"] == 0, "per-request state left behind"
        assert snap["n_finished"] - before_stats >= (wave + 1) * (N_LOAD - N_ABORT)
        rss.append(_server_rss_mb(proc))
        print(f"\nload wave {wave}: {N_LOAD} requests ({N_ABORT} aborted) in {elapsed:.1f} s; RSS {rss[-1]:.0f} MiB")
    print(f"server RSS: before {rss[0]:.0f} MiB, after wave 1 {rss[1]:.0f}, after wave 2 {rss[2]:.0f}")
    assert rss[2] < rss[1] * 1.02 + 20, rss
    assert proc.poll() is None


def test_structured_outputs_through_the_server(server, ref_llm):
    """JSON-schema and regex completions (the request's `structured_outputs`), concurrent, one aborted
    mid-stream: the grammar stop (on for svip) keeps them equal to the offline reference, and its
    per-request matchers are released with the requests."""
    from vllm.sampling_params import StructuredOutputsParams

    from benchmarks.vllm_run import STRUCTURED_JSON, STRUCTURED_REGEX, greedy_params

    base, proc = server
    prompts = load_prompts("code_heldout", 8)
    kinds = [{"json": STRUCTURED_JSON}, {"regex": STRUCTURED_REGEX}]
    jobs = [(p, kinds[i % 2]) for i, p in enumerate(prompts)]
    refs = ref_llm.generate(
        [p for p, _ in jobs],
        [greedy_params(MAX_TOKENS, structured_outputs=StructuredOutputsParams(**kind)) for _, kind in jobs],
        use_tqdm=False,
    )

    def complete(prompt: str, kind: dict) -> str:
        body = {"model": str(TARGET), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        with _post(base + "/v1/completions", body | {"structured_outputs": kind}) as resp:
            return json.load(resp)["choices"][0]["text"]

    def aborted() -> None:  # a structured request whose client goes away after two chunks
        body = {"model": str(TARGET), "prompt": prompts[0], "max_tokens": 400, "temperature": 0, "stream": True}
        with _post(base + "/v1/completions", body | {"structured_outputs": kinds[0]}) as resp:
            for i, _ in enumerate(resp):
                if i >= 2:
                    break

    with ThreadPoolExecutor(max_workers=len(jobs) + 1) as pool:
        gone = pool.submit(aborted)
        texts = [f.result(timeout=300) for f in [pool.submit(complete, p, kind) for p, kind in jobs]]
        gone.result(timeout=300)
    assert texts == [o.outputs[0].text for o in refs]
    deadline = time.monotonic() + 30
    while True:  # finished and aborted ids reach the worker with the engine's next step
        (snap,) = _worker_stats(base)
        if snap["grammar_tracked"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert snap["grammar_tracked"] == 0, "grammar matchers left behind"
    assert proc.poll() is None
