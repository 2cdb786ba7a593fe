#!/usr/bin/env bash
# Run a command on the GPU machine (the `device` tool) with MLX's CUDA build and this checkout
# importable as metal_cluster.*; see bench/README.md, "On the GPU machine", for the whole recipe.
#
#   bash bench/gpu_machine.sh a            first call, carrying .whlA (MLX, mlx-lm, half of mlx-cuda-13)
#   bash bench/gpu_machine.sh b CMD...     second call, right after, carrying .whlB: install, then CMD
#   bash bench/gpu_machine.sh run CMD...   later calls while the machine is still warm
#
# The mlx-cuda-13 wheel (~90 MB) is over what one call may carry, hence the two halves; the
# machine keeps /tmp between calls only while it stays warm.
set -euo pipefail
step=$1
shift
case "$step" in
  a) mkdir -p /tmp/w && cp .whlA/* /tmp/w/ && echo "gpu_machine: part A in /tmp/w"; exit 0 ;;
  b) cp .whlB/* /tmp/w/
     cat /tmp/w/cuda13.part.* > /tmp/w/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
     rm /tmp/w/cuda13.part.*
     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl
     echo "gpu_machine: installed $(ls /tmp/w | wc -l) wheels into /tmp/site" ;;
  run) [ -d /tmp/site/mlx ] || { echo "gpu_machine: MLX is not installed here (the machine went cold): run a, then b" >&2; exit 2; } ;;
  *) echo "gpu_machine: unknown step $step (a, b or run)" >&2; exit 2 ;;
esac
# The project imports as metal_cluster.<folder>: a folder of links stands in for installing it.
mkdir -p /tmp/pkg/metal_cluster
for d in coordinator stage_worker proto kernels; do ln -sfn "$PWD/$d" "/tmp/pkg/metal_cluster/$d"; done
touch /tmp/pkg/metal_cluster/__init__.py
export PYTHONPATH=/tmp/site:/tmp/pkg
python3 -c "import mlx.core as mx; print('gpu_machine:', mx.default_device(), 'mlx', mx.__version__)"
[ $# -gt 0 ] && exec bash -c "$*"
