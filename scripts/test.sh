#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit tests, then the
# end-to-end tests through real vLLM on the bundled toy pair.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
