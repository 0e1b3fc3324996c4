#!/usr/bin/env bash
# Set up EasyDeL's eSurge for `jaxserve bench --backend esurge`, in its own venv:
#   bash scripts/esurge/setup.sh            -> ~/.cache/jaxserve/esurge-venv (or $ESURGE_VENV)
# EasyDeL pins jax, flax and transformers at versions jaxserve's own venv does not use, so it
# lives apart; the bench talks to it through jaxserve/bench/esurge_driver.py over a pipe.
# Python 3.11: easydel imports torch (transformers' model classes, at import time) and the CPU
# torch wheel at hand is built for 3.11; easydel itself takes 3.11-3.13. Idempotent: a second
# run reinstalls nothing that is already at its pinned version.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${ESURGE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/jaxserve/esurge-venv}"

find_python() {
  if command -v pyenv >/dev/null 2>&1; then
    local p; p="$(pyenv root)/versions/$(pyenv versions --bare 2>/dev/null | grep -E '^3\.11(\.|$)' | sort -V | tail -1)/bin/python3"
    [ -x "$p" ] && { echo "$p"; return; }
  fi
  for p in python3.11 python3; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      command -v "$p"; return
    fi
  done
  echo "the eSurge venv needs Python 3.11 (pyenv install 3.11, or python3.11 on PATH); none found" >&2
  exit 1
}

if [ -x "$venv/bin/python" ] && ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "$venv has Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'), not 3.11: recreating it"
  rm -rf "$venv"
fi
if [ ! -x "$venv/bin/python" ]; then
  py="$(find_python)"
  echo "creating $venv with $py ($("$py" --version))"
  mkdir -p "$(dirname "$venv")"
  "$py" -m venv "$venv"
else
  echo "using the existing venv $venv"
fi
echo "installing $here/requirements.txt (first time: several minutes, ~2 GB)"
"$venv/bin/python" -m pip install --quiet --progress-bar off -r "$here/requirements.txt"
echo "checking that easydel's eSurge imports"
JAX_PLATFORMS=cpu "$venv/bin/python" - <<'PY'
import importlib.metadata as md
import easydel.inference.esurge  # noqa: F401  (imports torch, transformers, flax, ejkernel)
print("  " + ", ".join(f"{n} {md.version(n)}" for n in ("easydel", "jax", "flax", "transformers", "torch")))
PY
echo "eSurge is set up in $venv: jaxserve bench ... --backend jaxserve,esurge"
