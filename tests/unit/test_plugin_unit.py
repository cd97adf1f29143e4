"""Version pin, idempotent registration and the core/integration split."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from vllm_adaptive_spec import SUPPORTED_VLLM_VERSION
from vllm_adaptive_spec.integration import plugin


@pytest.mark.parametrize("found", [SUPPORTED_VLLM_VERSION, SUPPORTED_VLLM_VERSION + "+cpu"])
def test_supported_version_passes(found):
    plugin.check_vllm_version(found)


def test_other_version_fails_with_clear_message(monkeypatch):
    monkeypatch.delenv(plugin.ALLOW_ANY_VLLM_ENV, raising=False)
    with pytest.raises(RuntimeError) as err:
        plugin.check_vllm_version("0.31.1")
    msg = str(err.value)
    assert "built for vLLM " + SUPPORTED_VLLM_VERSION in msg and "0.31.1" in msg
    assert plugin.ALLOW_ANY_VLLM_ENV in msg


def test_override_turns_mismatch_into_warning(monkeypatch, caplog):
    monkeypatch.setenv(plugin.ALLOW_ANY_VLLM_ENV, "1")
    logger = logging.getLogger("vllm_adaptive_spec")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger="vllm_adaptive_spec"):
        plugin.check_vllm_version("0.99.0")
    assert "0.99.0" in caplog.text


def test_register_is_idempotent():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    plugin.register()
    first = (EngineArgs.create_engine_config, GPUModelRunner.__init__)
    plugin._registered = False  # even a second full pass must not wrap twice
    plugin.register()
    plugin.register()
    assert (EngineArgs.create_engine_config, GPUModelRunner.__init__) == first
    assert not hasattr(first[0].__wrapped__, "__wrapped__")


def test_core_never_imports_vllm():
    code = (
        "import sys, vllm_adaptive_spec, vllm_adaptive_spec.config\n"
        "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
