"""A vLLM worker extension that reports the plugin's statistics by name.

vLLM's `worker_extension_cls` (`--worker-extension-cls` on the server,
`LLM(worker_extension_cls=...)` offline) mixes this class into every
worker, so `collective_rpc("adaptive_spec_stats")` works without pickled
functions (no VLLM_ALLOW_INSECURE_SERIALIZATION), including through the
server's development endpoint `POST /collective_rpc` (VLLM_SERVER_DEV_MODE=1).
"""

from __future__ import annotations

from vllm_adaptive_spec.integration.runtime import worker_stats

WORKER_EXTENSION = f"{__name__}.AdaptiveSpecWorkerExtension"


class AdaptiveSpecWorkerExtension:
    def adaptive_spec_stats(self) -> list[dict]:
        """Snapshots of this worker's adaptive proposers (see runtime.worker_stats)."""
        return worker_stats(self.model_runner)
