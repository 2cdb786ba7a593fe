"""How the size of MLX's command buffers moves a decode step's cost on a GPU, ours and mlx-lm's.

MLX cuts the ops of an evaluation into command buffers (on CUDA: graphs). A buffer is committed
(on CUDA: its graph updated or instantiated, then launched) once it holds MLX_MAX_OPS_PER_BUFFER
ops or MLX_MAX_MB_PER_BUFFER megabytes of inputs. A step of Qwen3-8B in bf16 reads 15 GB of
weights, so at the H200's defaults (100 ops, 1000 MB) it is ~16 commits; in 4-bit the op limit
cuts it. MLX reads both once per process, so each setting runs `bench/step_profile.py` in a
process of its own, on the folders `bench/gpu_serving.py` writes (Qwen3-8B's shape, bf16 and
4-bit), with mlx-lm's own loop beside ours.

  python3 bench/gpu_buffers.py [--settings default,400x8000,nographs] [--steps 64] [--json out.json]
  .venv/bin/python bench/gpu_buffers.py --small --settings default,400x4000 --steps 4   (the CPU: a smoke test)

A setting is `default`, `OPSxMB` (both limits) or `nographs` (MLX_USE_CUDA_GRAPHS=0: every kernel
launched on its own).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import gpu_serving  # noqa: E402

COLUMNS = ("step", "launch", "prepare", "graph", "submit", "wait")


def environment(setting: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_MAX_") and k != "MLX_USE_CUDA_GRAPHS"}
    if setting == "nographs":
        env["MLX_USE_CUDA_GRAPHS"] = "0"
    elif setting != "default":
        ops, mb = setting.split("x")
        env["MLX_MAX_OPS_PER_BUFFER"], env["MLX_MAX_MB_PER_BUFFER"] = str(int(ops)), str(int(mb))
    return env


def profile(setting: str, folders: list[Path], steps: int) -> list[dict]:
    """step_profile's rows (ms per step and per phase) under one setting."""
    cmd = [sys.executable, str(ROOT / "step_profile.py"), *map(str, folders), "--mlx-lm", "--steps", str(steps)]
    done = subprocess.run(cmd, env=environment(setting), capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{setting}: step_profile failed:\n{done.stderr[-2000:]}")
    rows = []
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 + len(COLUMNS) or cells[0] in ("model", "---"):
            continue
        try:
            values = [float(c) for c in cells[2:]]
        except ValueError:
            continue
        rows.append(dict(setting=setting, model=cells[0], loop=cells[1], **dict(zip(COLUMNS, values))))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="default,40x300,400x4000,1000x20000,nographs")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/gpu-serving"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--small", action="store_true", help="gpu_serving's tiny shape: a smoke test of the script")
    args = ap.parse_args()
    config = gpu_serving.SHAPES["qwen3-8b"][1 if args.small else 0]
    folders = gpu_serving.ensure_folders(args.work_dir, config, gpu_serving.FORMATS, args.small)
    rows = []
    print("| setting | model | loop | " + " | ".join(COLUMNS) + " |")
    print("|---|---|---|" + "---:|" * len(COLUMNS))
    for setting in args.settings.split(","):
        for r in profile(setting, [folders[f] for f in gpu_serving.FORMATS], args.steps):
            rows.append(r)
            print(f"| {setting} | {r['model']} | {r['loop']} | " + " | ".join(f"{r[c]:.2f}" for c in COLUMNS) + " |",
                  flush=True)
        if args.json:
            args.json.write_text(json.dumps(dict(device=gpu_serving.device_info(), rows=rows), indent=2))


if __name__ == "__main__":
    main()
