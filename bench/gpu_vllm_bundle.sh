#!/usr/bin/env bash
# Build the git-ignored parts .whlC/, .whlD/, ... (each <= 60 MiB, one `device` call each) that carry
# vLLM and what its serve path and our coordinator import onto the GPU machine, as wheels for its
# Python (3.12, manylinux x86_64); bench/gpu_machine.sh installs them there (steps c, d, ...).
#
#   bash bench/gpu_vllm_bundle.sh                 here, in the checkout's root, once
#   BUNDLE_PY=3.11 BUNDLE_DEST=/tmp/b311 bash bench/gpu_vllm_bundle.sh
#                                                 the same set for this machine's Python (a local rehearsal)
#
# vLLM is this checkout's empty-target build (VLLM_TARGET_DEVICE=empty: pure Python, our platform
# plugin stands in for the device), retagged py3-none-any so pip on 3.12 takes it. The list below is
# vLLM 0.33's and this project's requirements, pinned to the versions .venv was tested with, less:
#   - what the GPU machine has: torch, numpy, triton, grpcio, protobuf, transformers 5.17 and its
#     requirements (huggingface-hub's httpx stack, tokenizers, safetensors, regex, pyyaml, tqdm, typer,
#     packaging, filelock, jinja2, ...);
#   - what .whlA/.whlB bring: mlx, mlx-lm, psutil, zeroconf, ifaddr, rich, cryptography, cffi, ...;
#   - what the serve path never imports (seen with PYTHONPROFILEIMPORTTIME over `serve`, requests
#     and `vllm bench serve`): opencv-python-headless (~60 MB), xgrammar/llguidance/outlines_core
#     (structured output, imported per request that asks for it), the OTLP exporters, fastapi[standard]'s
#     CLI and cloud parts, ninja, supervisor, ...
# huggingface-hub, pydantic and typing-inspection are carried although the machine may have them:
# vLLM needs huggingface-hub >= 1.31 and pydantic >= 2.12, newer than transformers asks for.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${BUNDLE_PY:-3.12}
DEST=${BUNDLE_DEST:-$PWD}
PYTHON=${PYTHON:-.venv/bin/python}
PART_MIB=60
WORK=$(mktemp -d /tmp/gpu-vllm-bundle.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
say() { echo "gpu_vllm_bundle: $*"; }

PACKAGES=(
  # vLLM's API server: HTTP, OpenAI/Anthropic protocol types, streaming, metrics
  fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 uvloop==0.23.0 httptools==0.9.0 h11==0.16.0
  websockets==17.4 watchfiles==1.3.0 python-dotenv==1.2.4 python-multipart==0.0.34
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  pydantic-settings==2.16.3 pydantic-extra-types==2.11.1 email-validator==2.4.0 dnspython==2.9.2
  openai==3.57.0 jiter==0.19.0 sniffio==1.3.1
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 anyio==4.16.0 httpx==0.28.1 httpcore==1.0.9 idna==3.20
  certifi==2026.10.19.post1
  prometheus_client==0.26.0 prometheus-fastapi-instrumentator==8.1.0 sse-starlette==3.7.0
  mcp==2.3.0 mcp-types==2.3.0 PyJWT==2.15.1 model-hosting-container-standards==0.1.16 jmespath==1.1.0
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
  multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
  requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3
  # vLLM's engine: EngineCore IPC, configs, tokenizers' helpers, request parsing
  pyzmq==27.3.0 msgspec==0.23.0 cloudpickle==3.1.3 cbor2==6.3.0 blake3==1.0.11 cachetools==8.0.2
  pybase64==1.5.1 orjson==3.13.0 ijson==3.6.0 setproctitle==1.3.8 py-cpuinfo==9.0.0
  python-json-logger==4.2.0 partial-json-parser==0.2.1.1.post7 einops==0.8.2 six==1.17.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  lark==1.2.2 lm-format-enforcer==0.11.3 interegular==0.3.3
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 llguidance==1.7.6 outlines_core==0.2.14
  compressed-tensors==0.17.0 loguru==0.7.3 depyf==0.20.0 astor==0.8.1 dill==0.4.1
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-semantic-conventions-ai==0.5.1
  pillow==13.0.0 tiktoken==0.14.0 sentencepiece==0.2.3 oss-harmony==0.0.11
  huggingface_hub==1.33.0
  # this project (the rest of pyproject's list is on the machine or in .whlA/.whlB)
  gguf==0.19.0
)

# --- vLLM: the empty-target wheel, from pip's cache or built from the sdist install.sh pins ---------
VLLM_SDIST=$(grep -o 'https://files.pythonhosted.org/[^"]*vllm-0.33.0.tar.gz[^"]*' deploy/install.sh)
wheel=$(find ~/.cache/pip/wheels -name 'vllm-0.33.0+empty-*.whl' 2>/dev/null | head -1)
if [ -z "$wheel" ]; then
  say "building vLLM 0.33.0 (VLLM_TARGET_DEVICE=empty) from its sdist"
  VLLM_TARGET_DEVICE=empty "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/build" "vllm @ $VLLM_SDIST"
  wheel=$(ls "$WORK"/build/vllm-0.33.0+empty-*.whl)
fi
if unzip -l "$wheel" | grep -qE '\.so$'; then
  echo "gpu_vllm_bundle: $wheel holds compiled code: not the empty-target build" >&2; exit 1
fi
mkdir -p "$WORK/whl"
cp "$wheel" "$WORK/whl/"
"$PYTHON" -m wheel tags --remove --python-tag py3 --abi-tag none --platform-tag any "$WORK"/whl/vllm-*.whl >/dev/null
say "vLLM: $(basename "$(ls "$WORK"/whl/vllm-*.whl)")"

# --- the rest, for the target's Python, binary only, exactly this list -------------------------------
# pip takes a --platform literally: every manylinux tag up to the machine's glibc (MLX's wheel is 2_35).
PLATFORMS=()
for v in $(seq 35 -1 5); do PLATFORMS+=(--platform "manylinux_2_${v}_x86_64"); done
for t in manylinux2014 manylinux2010 manylinux1; do PLATFORMS+=(--platform "${t}_x86_64"); done
say "downloading ${#PACKAGES[@]} wheels for cp${PY/./} manylinux x86_64"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  "${PLATFORMS[@]}" -d "$WORK/whl" "${PACKAGES[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
n=$(ls "$WORK"/whl/*.whl | wc -l)
[ "$n" -eq $(( ${#PACKAGES[@]} + 1 )) ] || { echo "gpu_vllm_bundle: $n wheels for $(( ${#PACKAGES[@]} + 1 )) packages" >&2; exit 1; }

# --- into parts of at most PART_MIB, largest first; each part lists them all -------------------------
rm -rf "$DEST"/.whl[C-H]
"$PYTHON" - "$WORK/whl" "$DEST" "$PART_MIB" <<'EOF'
import shutil, sys
from pathlib import Path

src, dest, limit = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) << 20
parts = []  # first fit, largest first
for f in sorted(src.glob("*.whl"), key=lambda f: -f.stat().st_size):
    size = f.stat().st_size
    if size > limit:
        sys.exit(f"gpu_vllm_bundle: {f.name} is over {limit >> 20} MiB: split it as .whlA/.whlB do")
    fit = next((p for p in parts if p[0] + size <= limit), None)
    if fit is None:
        fit = [0, []]
        parts.append(fit)
    fit[0] += size
    fit[1].append(f)
names = "CDEFGH"[: len(parts)]
if len(parts) > len("CDEFGH"):
    sys.exit("gpu_vllm_bundle: more than 6 parts")
for name, (size, files) in zip(names, parts):
    folder = dest / f".whl{name}"
    folder.mkdir()
    for f in files:
        shutil.copy(f, folder)
    # gpu_machine.sh installs once every listed part has arrived.
    (folder / "vllm-parts.txt").write_text(" ".join(names) + "\n")
    print(f"gpu_vllm_bundle: .whl{name}: {len(files)} wheels, {size / 2**20:.1f} MiB")
EOF

# --- git-ignored (only in the checkout itself, not in a rehearsal's folder) -----------------------
if [ "$DEST" = "$PWD" ]; then
  for d in "$DEST"/.whl[C-H]; do
    line="/$(basename "$d")/"
    grep -qxF "$line" .git/info/exclude || echo "$line" >> .git/info/exclude
  done
fi
say "done: carry each part in its own call after a and b: bash bench/gpu_machine.sh c, then d, ..."
