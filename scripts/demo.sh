#!/usr/bin/env bash
# Set up (idempotent) and run the main job on the bundled toy pair.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m benchmarks.harness "$@"
