"""Running the generated CUDA kernels without a GPU: stand-ins for what MLX wraps around a body.

`mx.fast.cuda_kernel` turns (header, body, input/output names) into one translation unit
(mlx/backend/cuda/custom_kernel.cpp: MLX's device header, the kernel header, then
`namespace mlx::core::cu { __global__ void custom_kernel_<name>(const <type>* <input>, ...,
<type>* <output>, ...) { using T = ...; <body> } }`) and compiles it with NVRTC. Two stand-ins for
that wrapper, both fed the very text `kernels/gpu.py` generates:

- `cuda_translation_unit` + `nvcc_resources`: the same unit compiled by the machine's nvcc for an
  H200 (sm_90), reporting registers, spills and shared memory: syntax, types and register pressure;
- `EmulatedCudaKernels`: a drop-in for `mx.fast.cuda_kernel` that compiles the unit as host C++
  (g++) with the CUDA intrinsics the kernels use emulated (one OS thread per GPU thread, a
  threadgroup's threads run together; shuffles, warp and block barriers through std::barrier) and
  runs the launch on numpy copies of the inputs. A collective that only some lanes of a warp reach
  either hangs (the run times out) or is reported; results are compared with the reference.

Both need a compiler and skip without one. They check the CUDA text only (the Metal text differs in
its macros and prologue alone, which `test_one_body_two_backends` holds to).
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

CUDA_TYPES = {mx.float32: "float", mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.int32: "int32_t"}
NVCC = shutil.which("nvcc")
# The emulation's fibers are glibc's ucontext: Linux only.
GXX = shutil.which("g++") if sys.platform.startswith("linux") else None
_BUILD = Path(tempfile.gettempdir()) / f"metal_cluster_kernel_standin_{os.getuid()}"


def cuda_translation_unit(name, header, source, inputs, outputs, template, device_header):
    """The unit MLX's build_kernel makes: `inputs`/`outputs` are [(name, mx dtype)], `template`
    [(name, mx dtype)] becomes `using name = <type>;` at the top of the body."""
    params = [f"    const {CUDA_TYPES[dtype]}* {n}" for n, dtype in inputs]
    params += [f"    {CUDA_TYPES[dtype]}* {n}" for n, dtype in outputs]
    usings = "".join(f"  using {n} = {CUDA_TYPES[dtype]};\n" for n, dtype in template)
    return (device_header + header + "namespace mlx::core::cu {\n\n"
            + f"__global__ void custom_kernel_{name}(\n" + ",\n".join(params) + ") {\n"
            + usings + "\n" + source + "\n}\n\n} // namespace mlx::core::cu\n")


# What MLX's default header (mlx/backend/cuda/device/utils.cuh) gives the kernels here: the CUDA
# scalar types; the bodies use nothing else of it.
NVCC_DEVICE_HEADER = "#include <cstdint>\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n\n"


def nvcc_resources(unit: str, arch: str = "sm_90") -> dict:
    """Compile one unit for `arch` (H200: sm_90); {registers, spill_stores, spill_loads, smem} of
    its kernel, from ptxas. Raises CalledProcessError (with nvcc's message) if it does not compile."""
    work = _workdir(unit, "nvcc")
    cu = work / "k.cu"
    cu.write_text(unit)
    done = subprocess.run([NVCC, "-std=c++17", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", str(work / "k.cubin"),
                           str(cu)], capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"nvcc failed on the generated unit:\n{done.stdout}{done.stderr}")
    log = done.stdout + done.stderr
    used = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    smem = re.search(r"(\d+) bytes smem", log)
    return dict(registers=int(used.group(1)), spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)),
                smem=int(smem.group(1)) if smem else 0, log=log)


def nvcc_ptx(unit: str, arch: str = "sm_90") -> str:
    """The unit's PTX with the kernel's name blanked, for comparing two generated sources."""
    work = _workdir(unit, "ptx")
    (work / "k.cu").write_text(unit)
    done = subprocess.run([NVCC, "-std=c++17", f"-arch={arch}", "-ptx", "-o", str(work / "k.ptx"), str(work / "k.cu")],
                          capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"nvcc failed on the generated unit:\n{done.stderr}")
    return re.sub(r"custom_kernel_\w+", "KERNEL", (work / "k.ptx").read_text())


# --- host emulation ---------------------------------------------------------------------------

_EMU_PRELUDE = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ucontext.h>

struct EmuBf16 {
  uint16_t bits;
  EmuBf16() = default;
  explicit EmuBf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even, as the GPU's conversion does
    bits = uint16_t(u >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
#define __nv_bfloat16 EmuBf16

// A threadgroup's GPU threads are fibers on one OS thread, switched only at barriers: a barrier
// is a wait until every participant (the warp's 32 lanes, or the whole group) has arrived.
struct EmuIdx { int x, y, z; };
static EmuIdx blockIdx, threadIdx;
struct EmuBarrier { int count, arrived, gen; };
struct EmuWarp { EmuBarrier bar; float val[32]; int line[32]; int mask[32]; };
static EmuWarp emu_warps[32];
static EmuBarrier emu_block;
static ucontext_t emu_sched;
static ucontext_t* emu_fiber_ctx;
static long emu_events = 0;
static int emu_divergent = 0;

static void emu_wait(EmuBarrier& b) {
  const int gen = b.gen;
  ++emu_events;
  if (++b.arrived == b.count) {
    b.arrived = 0;
    ++b.gen;
    return;
  }
  while (b.gen == gen) swapcontext(&emu_fiber_ctx[threadIdx.x], &emu_sched);
}

static float emu_shfl_xor(float x, int m, int line) {
  EmuWarp& w = emu_warps[threadIdx.x / 32];
  const int lane = threadIdx.x % 32;
  w.val[lane] = x;
  w.line[lane] = line;
  w.mask[lane] = m;
  emu_wait(w.bar);
  const float y = w.val[lane ^ m];
  if (w.line[0] != line || w.mask[0] != m) emu_divergent++;  // lanes at different collectives
  emu_wait(w.bar);
  return y;
}
#define __shfl_xor_sync(mask, x, m) emu_shfl_xor((x), (m), __LINE__)
#define __syncthreads() emu_wait(emu_block)
#define __syncwarp() emu_wait(emu_warps[threadIdx.x / 32].bar)
#define __expf(x) expf(x)
#define rsqrtf(x) (1.0f / std::sqrt(x))
#define __shared__ static
#define __device__
#define __forceinline__ inline
#define __global__
"""

_EMU_MAIN = r"""
static void* emu_read(const char* path, size_t* size) {
  FILE* f = std::fopen(path, "rb");
  if (!f) { std::perror(path); std::exit(2); }
  std::fseek(f, 0, SEEK_END);
  *size = size_t(std::ftell(f));
  std::fseek(f, 0, SEEK_SET);
  void* p = std::aligned_alloc(64, (*size + 63) / 64 * 64 + 64);
  if (std::fread(p, 1, *size, f) != *size) { std::exit(2); }
  std::fclose(f);
  return p;
}

static void* ins[NUM_IN];
static void* outs[NUM_OUT];
static int emu_group;
static bool* emu_done;

static void emu_run_thread(int t) {
  threadIdx = EmuIdx{t, 0, 0};
  blockIdx = EmuIdx{emu_group, 0, 0};
  mlx::core::cu::CALL;
  emu_done[t] = true;
  ++emu_events;
}

int main(int argc, char** argv) {
  // argv: groups threads in_0 ... in_{N-1} out_0 ... out_{M-1} out_bytes_0 ... out_bytes_{M-1}
  const int groups = std::atoi(argv[1]);
  const int threads = std::atoi(argv[2]);
  size_t sz;
  for (int i = 0; i < NUM_IN; ++i) ins[i] = emu_read(argv[3 + i], &sz);
  size_t out_bytes[NUM_OUT];
  for (int i = 0; i < NUM_OUT; ++i) {
    out_bytes[i] = size_t(std::atoll(argv[3 + NUM_IN + NUM_OUT + i]));
    outs[i] = std::aligned_alloc(64, (out_bytes[i] + 63) / 64 * 64 + 64);
    std::memset(outs[i], 0xff, out_bytes[i]);  // NaN: a value the kernel never writes shows
  }
  const size_t stack = 1 << 18;
  emu_fiber_ctx = new ucontext_t[threads];
  char* stacks = static_cast<char*>(std::malloc(stack * threads));
  emu_done = new bool[threads];
  for (int g = 0; g < groups; ++g) {
    emu_group = g;
    for (int w = 0; w < (threads + 31) / 32; ++w) emu_warps[w].bar = EmuBarrier{32, 0, 0};
    emu_block = EmuBarrier{threads, 0, 0};
    for (int t = 0; t < threads; ++t) {
      emu_done[t] = false;
      getcontext(&emu_fiber_ctx[t]);
      emu_fiber_ctx[t].uc_stack.ss_sp = stacks + stack * t;
      emu_fiber_ctx[t].uc_stack.ss_size = stack;
      emu_fiber_ctx[t].uc_link = &emu_sched;
      makecontext(&emu_fiber_ctx[t], (void (*)())emu_run_thread, 1, t);
    }
    for (int live = threads; live > 0;) {
      const long before = emu_events;
      live = 0;
      for (int t = 0; t < threads; ++t) {
        if (emu_done[t]) continue;
        threadIdx = EmuIdx{t, 0, 0};
        blockIdx = EmuIdx{g, 0, 0};
        swapcontext(&emu_sched, &emu_fiber_ctx[t]);
        live += !emu_done[t];
      }
      if (live > 0 && emu_events == before) {  // everyone waits on a barrier some never reach
        std::fprintf(stderr, "deadlock in threadgroup %d: a collective or barrier that not every thread reaches\n", g);
        return 4;
      }
    }
  }
  for (int i = 0; i < NUM_OUT; ++i) {
    FILE* f = std::fopen(argv[3 + NUM_IN + i], "wb");
    std::fwrite(outs[i], 1, out_bytes[i], f);
    std::fclose(f);
  }
  if (emu_divergent) { std::fprintf(stderr, "divergent warp collectives: %d\n", emu_divergent); return 3; }
  return 0;
}
"""

_NP = {mx.float32: np.float32, mx.int32: np.int32, mx.bfloat16: np.uint16}


def _host_bytes(a: mx.array) -> bytes:
    a = mx.contiguous(a)
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16)).tobytes()
    return np.array(a).tobytes()


def _from_host(data: bytes, shape, dtype) -> mx.array:
    arr = np.frombuffer(data, dtype=_NP[dtype]).reshape(shape)
    return mx.array(arr).view(mx.bfloat16) if dtype == mx.bfloat16 else mx.array(arr)


def real_or_emulated(monkeypatch, backend: str | None, kernel_cache):
    """A kernel test fixture's body: the real kernels where MLX runs on a GPU (`backend`), else
    `mx.fast.cuda_kernel` emulated on the CPU (yields "cuda"; skips without g++). `kernel_cache`,
    the module's lru-cached kernel builder, is cleared around the emulation so that no emulated
    kernel stays behind for a real GPU run."""
    if backend is not None:
        yield backend
        return
    if GXX is None:
        import pytest

        pytest.skip("no GPU, and the CUDA emulation needs g++ on Linux")
    monkeypatch.setattr(mx.fast, "cuda_kernel", EmulatedCudaKernels())
    kernel_cache.cache_clear()
    yield "cuda"
    kernel_cache.cache_clear()


class EmulatedCudaKernels:
    """A stand-in for `mx.fast.cuda_kernel` (same arguments, same call) that runs the kernel on the
    CPU as described above. `launches` records (name, groups, threads) of every call."""

    def __init__(self, timeout: float = 300.0):
        self.timeout = timeout
        self.launches = []

    def __call__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False):
        def launch(inputs, output_shapes, output_dtypes, grid, threadgroup, template=(), init_value=None,
                   verbose=False, stream=None):
            threads = threadgroup[0]
            assert grid[1:] == (1, 1) and threadgroup[1:] == (1, 1) and grid[0] % threads == 0
            groups = grid[0] // threads
            self.launches.append((name, groups, threads))
            inputs = [mx.array(x) if not isinstance(x, mx.array) else x for x in inputs]
            unit = cuda_translation_unit(name, header, source, list(zip(input_names, (x.dtype for x in inputs))),
                                         list(zip(output_names, output_dtypes)), list(template), "")
            binary = self._build(unit, name, input_names, output_names)
            work = Path(tempfile.mkdtemp(dir=_BUILD))
            try:
                in_paths, out_paths = [], []
                for n, x in zip(input_names, inputs):
                    (work / f"in_{n}").write_bytes(_host_bytes(x))
                    in_paths.append(str(work / f"in_{n}"))
                sizes = []
                for n, shape, dtype in zip(output_names, output_shapes, output_dtypes):
                    out_paths.append(str(work / f"out_{n}"))
                    sizes.append(str(int(np.prod(shape)) * dtype.size))
                done = subprocess.run([str(binary), str(groups), str(threads), *in_paths, *out_paths, *sizes],
                                      capture_output=True, text=True, timeout=self.timeout)
                if done.returncode:
                    raise RuntimeError(f"emulated kernel {name} failed ({done.returncode}): {done.stderr.strip()}")
                return [_from_host(Path(p).read_bytes(), shape, dtype)
                        for p, shape, dtype in zip(out_paths, output_shapes, output_dtypes)]
            finally:
                shutil.rmtree(work, ignore_errors=True)

        return launch

    @staticmethod
    def _build(unit, name, input_names, output_names) -> Path:
        # Cast each void* to the parameter's own type, read off the generated signature.
        signature = re.search(r"__global__ void (custom_kernel_\w+)\((.*?)\) \{", unit, re.S)
        params = [p.strip() for p in signature.group(2).split(",\n")]
        casts = []
        for i, p in enumerate(params):
            ctype = p.rsplit(" ", 1)[0]
            casts.append(f"({ctype})" + (f"ins[{i}]" if i < len(input_names) else f"outs[{i - len(input_names)}]"))
        program = (_EMU_PRELUDE + unit + _EMU_MAIN).replace("NUM_IN", str(len(input_names))).replace(
            "NUM_OUT", str(len(output_names))).replace("CALL", f"{signature.group(1)}({', '.join(casts)})")
        work = _workdir(program, "emu")
        binary = work / "k"
        if not binary.exists():
            (work / "k.cpp").write_text(program)
            done = subprocess.run([GXX, "-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas", "-o", str(binary),
                                   str(work / "k.cpp")], capture_output=True, text=True, timeout=300)
            if done.returncode:
                raise RuntimeError(f"g++ failed on the emulated unit {work / 'k.cpp'}:\n{done.stderr[-4000:]}")
        return binary


def _workdir(text: str, kind: str) -> Path:
    work = _BUILD / f"{kind}_{hashlib.sha1(text.encode()).hexdigest()[:16]}"
    work.mkdir(parents=True, exist_ok=True)
    return work
