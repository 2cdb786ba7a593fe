"""A stage that runs a quarter of the layers reads only those tensors: its peak memory shows it."""

import json
import subprocess
import sys

import tiny_models

PROBE = """
import json, sys
from metal_cluster.stage_worker.model.model_source import resolve_model
from metal_cluster.stage_worker.model.shard import load_shard
import mlx.core as mx
def resident_mb():
    # VmRSS, not ru_maxrss: a child's ru_maxrss starts at its parent's (pytest's) peak.
    status = open("/proc/self/status").read()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024
before = resident_mb()
shard = load_shard(resolve_model(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
print(json.dumps({"before": before, "after": resident_mb(), "mlx_peak": mx.get_peak_memory() / 2**20, "layers": len(shard.layers)}))
"""


def memory_growth(folder, start, end):
    out = subprocess.run([sys.executable, "-c", PROBE, str(folder), str(start), str(end)],
                         capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["layers"] == end - start
    return result["after"] - result["before"], result["mlx_peak"]


def test_quarter_stage_reads_a_quarter(tmp_path):
    # ~17 MB of float32 weights per layer, so the difference stands well above allocator noise.
    folder = tiny_models.build_tiny_model("llama", tmp_path / "m", num_layers=8, hidden_size=512,
                                          intermediate_size=2048, num_heads=8, num_kv_heads=4)
    full, full_peak = memory_growth(folder, 0, 8)
    quarter, quarter_peak = memory_growth(folder, 2, 4)  # no embedding, no lm_head: layers only
    assert full > 100, f"full load grew only {full:.0f} MB: the probe measures nothing"
    assert quarter < 0.4 * full, f"quarter stage grew {quarter:.0f} MB resident vs {full:.0f} MB for all layers"
    assert quarter_peak < 0.3 * full_peak, f"quarter stage peaked at {quarter_peak:.0f} MB of MLX memory vs {full_peak:.0f} MB"
