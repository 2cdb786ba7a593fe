#!/usr/bin/env bash
# Run a command on the GPU machine (the `device` tool) with MLX's CUDA build and this checkout
# importable as metal_cluster.*; see bench/README.md, "On the GPU machine", for the whole recipe.
#
#   bash bench/gpu_machine.sh a            first call, carrying .whlA (MLX, mlx-lm, half of mlx-cuda-13)
#   bash bench/gpu_machine.sh b CMD...     second call, right after, carrying .whlB: install, then CMD
#   bash bench/gpu_machine.sh c CMD...     for `serve` there: vLLM and its deps, carrying .whlC (built here
#                                          by bench/gpu_vllm_bundle.sh); d, e, ... the same for .whlD, ...
#                                          where it made more parts: the last to arrive installs, then CMD
#   bash bench/gpu_machine.sh run CMD...   later calls while the machine is still warm
#
# The mlx-cuda-13 wheel (~90 MB) is over what one call may carry, hence the two halves; the
# machine keeps /tmp between calls only while it stays warm. GPU_MACHINE_TMP (default /tmp) and
# PYTHON (default python3) move a rehearsal elsewhere.
set -euo pipefail
step=$1
shift
T=${GPU_MACHINE_TMP:-/tmp}
PYTHON=${PYTHON:-python3}
install_wheels() { "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$T/site" "$@"; }
case "$step" in
  a) mkdir -p "$T/w" && cp .whlA/* "$T/w/" && echo "gpu_machine: part A in $T/w"; exit 0 ;;
  b) cp .whlB/* "$T/w/"
     cat "$T"/w/cuda13.part.* > "$T/w/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl"
     rm "$T"/w/cuda13.part.*
     install_wheels "$T"/w/*.whl
     echo "gpu_machine: installed $(ls "$T/w" | wc -l) wheels into $T/site" ;;
  c|d|e|f|g|h)
     part=${step^^}
     [ -f ".whl$part/vllm-parts.txt" ] || { echo "gpu_machine: .whl$part was not carried (or not built: bash bench/gpu_vllm_bundle.sh)" >&2; exit 2; }
     [ -d "$T/site/mlx" ] || { echo "gpu_machine: install MLX first (a, then b), then the vLLM parts" >&2; exit 2; }
     mkdir -p "$T/wv" && cp ".whl$part"/* "$T/wv/" && touch "$T/wv/.arrived-$part"
     for p in $(cat "$T/wv/vllm-parts.txt"); do
       [ -f "$T/wv/.arrived-$p" ] || { echo "gpu_machine: vLLM part $part in $T/wv; next: carry .whl$p, step ${p,,}"; exit 0; }
     done
     install_wheels "$T"/wv/*.whl
     echo "gpu_machine: installed $(ls "$T"/wv/*.whl | wc -l) wheels (vLLM and its serve path) into $T/site"
     rm -f "$T"/wv/*.whl ;;
  run) [ -d "$T/site/mlx" ] || { echo "gpu_machine: MLX is not installed here (the machine went cold): run a, then b" >&2; exit 2; } ;;
  *) echo "gpu_machine: unknown step $step (a, b, c..h or run)" >&2; exit 2 ;;
esac
# The project imports as metal_cluster.<folder>: a folder of links stands in for installing it, and
# a dist-info beside it carries pyproject's entry points, by which vLLM finds our platform plugin.
mkdir -p "$T/pkg/metal_cluster"
for d in coordinator stage_worker proto kernels; do ln -sfn "$PWD/$d" "$T/pkg/metal_cluster/$d"; done
touch "$T/pkg/metal_cluster/__init__.py"
"$PYTHON" - "$T/pkg" <<'EOF'
import sys, tomllib
from pathlib import Path

project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
info = Path(sys.argv[1]) / f"metal_cluster-{project['version']}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: metal-cluster\nVersion: {project['version']}\n")
groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items()) + "\n"
    for group, points in groups.items()))
EOF
export PYTHONPATH=$T/site:$T/pkg
"$PYTHON" -c "import mlx.core as mx; print('gpu_machine:', mx.default_device(), 'mlx', mx.__version__)"
if [ -d "$T/site/vllm" ]; then
  "$PYTHON" -c "import importlib.metadata as m; print('gpu_machine: vllm', m.version('vllm'), 'torch', m.version('torch'))"
fi
if [ $# -gt 0 ]; then exec bash -c "$*"; fi
