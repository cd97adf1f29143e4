"""vllm-adaptive-spec: adaptive draft length for vLLM's speculative decoding.

The top-level package is the host-free core (config, policies, heads,
training, metrics): it imports torch but never vLLM. Everything that touches
vLLM lives in `vllm_adaptive_spec.integration`, which vLLM loads through the
`vllm.general_plugins` entry point.
"""

from vllm_adaptive_spec.config import AdaptiveSpecConfig, ConfigError, parse_additional_config

__version__ = "0.1.0"
# The vLLM release this plugin is built and tested against. The integration
# refuses to start on another one unless VLLM_ADAPTIVE_SPEC_ALLOW_ANY_VLLM=1.
SUPPORTED_VLLM_VERSION = "0.32.0"

__all__ = [
    "AdaptiveSpecConfig",
    "ConfigError",
    "SUPPORTED_VLLM_VERSION",
    "__version__",
    "parse_additional_config",
]
