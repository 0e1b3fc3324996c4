#!/usr/bin/env bash
# Set up (with the test extras) and run the test suite; arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export HF_HUB_OFFLINE=1
exec .venv/bin/pytest "$@"
