"""The coordinator's model store and a worker's fetch, in-process over a real gRPC server on loopback:
only a stage's tensors travel and the cache holds only them, as the checkpoint stores them; tensors
in the cache are reused, a corrupted or truncated one is fetched again, a transfer cut off part way
resumes at its last byte, a re-plan to fewer layers leaves the rest to the cache limit, and a
changed model, a wrong token or manifest are refused; the weights' plaintext port takes only its
own tickets, and bytes changed on it are refused."""

import json
import logging
import os
import struct

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from metal_cluster.coordinator.cluster import model_store
from metal_cluster.stage_worker.transfer import manifest as manifests
from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.transfer.fetch import FetchProgress, fetch_stage, weights_room
from metal_cluster.stage_worker.model.model_source import resolve_model
from metal_cluster.stage_worker.model.shard import load_shard

TOKEN = "store-test-token"


@pytest.fixture
def model(llama_model, tmp_path):
    """A private copy: some tests change it."""
    import shutil

    return shutil.copytree(llama_model, tmp_path / "model")


@pytest.fixture
def store(model, tmp_path):
    running = _start(model, tmp_path)
    yield running
    running.stop()


def _start(model, tmp_path):
    os.environ["METAL_CLUSTER_CACHE"] = str(tmp_path / "coordinator-cache")
    try:
        return model_store.start(resolve_model(model), "tiny", "127.0.0.1", TOKEN)
    finally:
        del os.environ["METAL_CLUSTER_CACHE"]


def tensor_bytes(model, start, end, num_layers=4, tied=False):
    """What the stage's tensors take in the checkpoint, from its header, read here independently."""
    with open(model / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(i["data_offsets"][1] - i["data_offsets"][0] for name, i in header.items()
               if name != "__metadata__" and manifests.stage_keeps(name, start, end, num_layers, tied))


def assert_same_parameters(mine, full):
    """A fetched stage holds the very parameters of the same stage loaded from the full folder."""
    pairs = list(zip(tree_flatten(mine.model.parameters()), tree_flatten(full.model.parameters())))
    assert pairs and all(n1 == n2 and mx.array_equal(a, b) for (n1, a), (n2, b) in pairs)


def small_files_bytes(model):
    return sum(p.stat().st_size for p in model.iterdir() if p.suffix != ".safetensors")


def fetch(store, cache, start, end, token=TOKEN, progress=None, cache_limit=0):
    return fetch_stage(store.address, store.manifest.sha256, start, end, token, progress, root=cache,
                       cache_limit=cache_limit)


def disk_bytes(cache):
    """The bytes of the worker's cache files, links not followed (a stage's folder is links). Its
    files have no holes, so this is what they hold; the disk rounds each tiny tensor up to a block."""
    total = 0
    for folder, _, names in os.walk(cache):
        total += sum(os.lstat(p).st_size for p in (os.path.join(folder, n) for n in names) if not os.path.islink(p))
    return total


def tensor_file(cache, name):
    """The cache file of the tensor `name` (its one-tensor safetensors header names it)."""
    for p in (cache / "tensors").iterdir():
        if not p.name.startswith(".") and not p.name.endswith(".part") and f'"{name}"'.encode() in p.read_bytes()[:400]:
            return p
    raise AssertionError(f"{name} is not in the cache")


def test_manifest_ranges_and_hashes(store, model):
    import hashlib

    import blake3

    (weights,) = [f for f in store.manifest.files if f.format == "safetensors"]
    data = (model / "model.safetensors").read_bytes()
    assert weights.size == len(data) and weights.sha256 == hashlib.sha256(data).hexdigest()
    for p in weights.pieces:
        assert blake3.blake3(data[p.offset:p.offset + p.length]).hexdigest() == p.blake3
    assert sum(p.length for p in weights.pieces) == len(data)
    arrays = mx.load(str(model / "model.safetensors"))
    for t in weights.tensors:  # each range holds exactly that tensor's bytes
        assert bytes(memoryview(arrays[t.name])) == data[t.offset:t.offset + t.length]
    names = {f.path for f in store.manifest.files}
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= names


def test_a_stage_fetches_only_its_layers_and_loads_like_the_full_folder(store, model, tmp_path):
    cache = tmp_path / "worker-cache"
    first = fetch(store, cache, 0, 2)
    share, total = tensor_bytes(model, 0, 2), (model / "model.safetensors").stat().st_size
    assert first.received == share + small_files_bytes(model)
    # The cache holds the stage's tensors, a header each and the small files: not the checkpoint.
    assert share < 0.75 * total and disk_bytes(cache) <= share + 0.1 * total
    mine = load_shard(resolve_model(first.folder), 0, 2, first.tensors)
    full = load_shard(resolve_model(model), 0, 2)
    assert_same_parameters(mine, full)

    again = fetch(store, cache, 0, 2)  # everything is in the cache: nothing travels
    assert again.received == 0
    last = fetch(store, cache, 1, 4)  # a re-plan to more layers: only the tensors the cache lacks
    assert last.received == tensor_bytes(model, 2, 4)
    shard = load_shard(resolve_model(last.folder), 1, 4, last.tensors)
    assert shard.is_last and "lm_head" in shard.model
    full = load_shard(resolve_model(model), 1, 4)
    assert_same_parameters(shard, full)


def test_fewer_layers_leave_the_rest_to_the_cache_limit_and_cache_lists_and_prunes(store, model, tmp_path):
    """A re-plan to fewer layers under --cache-limit: the tensors of the layers given away are
    removed (least recently used first) to make room; `metal-cluster cache` lists what is left and
    `cache prune` frees it."""
    from typer.testing import CliRunner

    from metal_cluster.coordinator.cli import app

    cache = tmp_path / "worker-cache"
    fetch(store, cache, 0, 4)
    everything = disk_bytes(cache / "tensors")
    limit = tensor_bytes(model, 0, 2) + everything // 2  # room for layers [0, 2) and a little more
    again = fetch(store, cache, 0, 2, cache_limit=limit + small_files_bytes(model))
    assert again.received == 0
    left = disk_bytes(cache / "tensors")
    assert left < everything and left <= limit + small_files_bytes(model)
    assert tensor_file(cache, "model.layers.0.mlp.up_proj.weight")  # the stage's own stay
    env = {"METAL_CLUSTER_CACHE": str(cache)}
    listed = CliRunner().invoke(app, ["cache"], env=env)
    assert listed.exit_code == 0, listed.output
    assert "tiny" in listed.output and "layers [0, 2)" in listed.output
    pruned = CliRunner().invoke(app, ["cache", "prune", "--max-size", "0"], env=env)
    assert pruned.exit_code == 0 and "freed" in pruned.output, pruned.output
    assert "no stage" in CliRunner().invoke(app, ["cache"], env=env).output
    assert disk_bytes(cache / "tensors") == 0
    assert fetch(store, cache, 0, 2).received == tensor_bytes(model, 0, 2) + small_files_bytes(model)  # again


def test_a_corrupted_or_truncated_tensor_is_fetched_again_never_loaded(store, model, tmp_path, caplog):
    cache = tmp_path / "worker-cache"
    fetch(store, cache, 0, 4)
    weights = next(f for f in store.manifest.files if f.format == "safetensors")
    flipped, cut = (next(t for t in weights.tensors if t.name == n)
                    for n in ("model.layers.1.mlp.up_proj.weight", "model.layers.2.self_attn.q_proj.weight"))
    with open(tensor_file(cache, flipped.name), "r+b") as f:
        f.seek(-7, os.SEEK_END)
        byte = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    path = tensor_file(cache, cut.name)
    os.truncate(path, path.stat().st_size - 5)
    header = tensor_file(cache, "model.norm.weight")  # its own header, which the hash does not cover
    header.write_bytes(header.read_bytes().replace(b'"F32"', b'"F16"', 1))
    with caplog.at_level(logging.WARNING, logger="metal_cluster.worker"):
        again = fetch(store, cache, 0, 4)
    norm = next(t for t in weights.tensors if t.name == "model.norm.weight")
    assert again.received == flipped.length + cut.length + norm.length
    assert caplog.text.count("failed its hash") == 3
    data = (model / "model.safetensors").read_bytes()
    for t in (flipped, cut, norm):
        assert tensor_file(cache, t.name).read_bytes().endswith(data[t.offset:t.offset + t.length])
    mine = load_shard(resolve_model(again.folder), 0, 4, again.tensors)
    full = load_shard(resolve_model(model), 0, 4)
    assert_same_parameters(mine, full)


class CutOff(FetchProgress):
    """Stops the store once `after` bytes have arrived and breaks the worker's connection there (what
    the socket's buffers still held would arrive otherwise): a transfer killed part way."""

    def __init__(self, store, after):
        self.__dict__.update(store=store, after=after)
        super().__init__()

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "received" and value >= self.after:
            if self.store.sender:
                self.store.sender.stop()
            self.store.server.stop(grace=0)
            raise ConnectionResetError("the link broke")


def test_a_cut_off_transfer_resumes_without_sending_again_what_arrived(model, tmp_path, monkeypatch):
    """The link breaks in the middle of a tensor: what arrived of it stays, and the next fetch asks
    only for the rest of it (and the tensors after it)."""
    from metal_cluster.stage_worker.transfer import bulk, tensor_cache
    from metal_cluster.stage_worker.transfer import fetch as fetch_module

    monkeypatch.setattr(fetch_module, "BATCH_BYTES", 4096)  # several reads per file, as with a big model
    monkeypatch.setattr(bulk, "SPLICE_CHUNK_BYTES", 4096)  # a tensor arrives in several chunks
    monkeypatch.setattr(bulk, "CHUNK_BYTES", 4096)
    cache = tmp_path / "worker-cache"
    store = _start(model, tmp_path)
    total = tensor_bytes(model, 0, 4) + small_files_bytes(model)
    weights = next(f for f in store.manifest.files if f.format == "safetensors")
    big = max(weights.tensors, key=lambda t: t.length)  # the link breaks in its middle
    cut = CutOff(store, after=small_files_bytes(model) + big.offset - weights.tensors[0].offset + big.length // 2)
    with pytest.raises(ConnectionResetError):
        fetch(store, cache, 0, 4, progress=cut)
    store.stop()
    arrived = cut.received
    assert 0 < arrived < total
    (half,) = (cache / "tensors").glob("*.part")  # the tensor cut in the middle
    assert big.length // 2 <= half.stat().st_size - len(tensor_cache.header("safetensors", big)) < big.length
    store = _start(model, tmp_path)  # the coordinator back, on another port
    try:
        rest = fetch(store, cache, 0, 4)
    finally:
        store.stop()
    assert rest.received == total - arrived  # nothing is sent twice
    weights = next(f for f in store.manifest.files if f.format == "safetensors")
    data = (model / "model.safetensors").read_bytes()
    for t in weights.tensors:
        assert tensor_file(cache, t.name).read_bytes().endswith(data[t.offset:t.offset + t.length])
    assert not list((cache / "tensors").glob("*.part"))


def test_a_link_that_breaks_mid_tensor_is_resumed_by_the_same_fetch(store, model, tmp_path, monkeypatch, caplog):
    """The weights connection drops in the middle of a tensor (the store itself stays): the fetch
    tries again and asks only for the bytes that had not come."""
    import socket

    from metal_cluster.stage_worker.transfer import bulk
    from metal_cluster.stage_worker.transfer import fetch as fetch_module

    monkeypatch.setattr(fetch_module, "RETRY_SECONDS", (0.1,))
    monkeypatch.setattr(bulk, "SPLICE_CHUNK_BYTES", 4096)
    monkeypatch.setattr(bulk, "CHUNK_BYTES", 4096)
    weights = next(f for f in store.manifest.files if f.format == "safetensors")
    big = max(weights.tensors, key=lambda t: t.length)
    conns, connect = [], bulk.connect
    monkeypatch.setattr(bulk, "connect", lambda *a: conns.append(connect(*a)) or conns[-1])

    class Drop(FetchProgress):
        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            if name == "received" and value >= small_files_bytes(model) + big.offset - weights.tensors[0].offset + \
                    big.length // 2 and not getattr(self, "dropped", False):
                super().__setattr__("dropped", True)
                conns[-1].shutdown(socket.SHUT_RDWR)  # the worker's end: what the buffers held is lost

    cache = tmp_path / "worker-cache"
    with caplog.at_level(logging.WARNING, logger="metal_cluster.worker"):
        got = fetch(store, cache, 0, 4, progress=Drop())
    assert "trying again" in caplog.text
    total = tensor_bytes(model, 0, 4) + small_files_bytes(model)
    assert total - 4096 <= got.received <= total  # nothing sent twice (a last chunk may land uncounted)
    data = (model / "model.safetensors").read_bytes()
    for t in weights.tensors:
        assert tensor_file(cache, t.name).read_bytes().endswith(data[t.offset:t.offset + t.length])


def test_refusals(store, model, tmp_path):
    cache = tmp_path / "worker-cache"
    with pytest.raises(ModelLoadError, match="not from this cluster's token"):  # the TLS handshake refuses it
        fetch(store, cache, 0, 2, token="wrong")
    with pytest.raises(ModelLoadError, match="another model version"):
        fetch_stage(store.address, "0" * 64, 0, 2, TOKEN, root=cache)
    with pytest.raises(ModelLoadError, match="outside the model's 4 layers"):
        fetch(store, cache, 2, 9)
    os.utime(model / "model.safetensors", ns=(1, 1))  # the coordinator's copy changed under the cluster
    with pytest.raises(ModelLoadError, match=r"model.safetensors changed on the coordinator"):
        fetch(store, cache, 0, 2)


def test_the_manifest_is_cached(model, tmp_path, monkeypatch):
    calls = []
    describe = manifests.describe
    monkeypatch.setattr(manifests, "describe", lambda *a, **k: calls.append(a[0]) or describe(*a, **k))
    source = resolve_model(model)
    first = manifests.build(source, "tiny", cache=tmp_path / "m")
    assert calls
    calls.clear()
    assert manifests.build(source, "tiny", cache=tmp_path / "m") == first and not calls
    (model / "config.json").write_text((model / "config.json").read_text() + " ")
    assert manifests.build(source, "tiny", cache=tmp_path / "m").sha256 != first.sha256


def test_chunks_by_hand_are_protobuf_read_chunks():
    from metal_cluster.proto import pb
    from metal_cluster.stage_worker.transfer import chunk_wire

    for offset, data in ((0, b"abc"), (300, b""), (2**40 + 5, bytes(range(256)) * 3)):
        assert pb.ReadChunk.FromString(chunk_wire.encode(offset, data)) == pb.ReadChunk(offset=offset, data=data)
        got = chunk_wire.decode(pb.ReadChunk(offset=offset, data=data).SerializeToString())
        assert (got[0], bytes(got[1])) == (offset, data)
    with pytest.raises(ValueError, match="cut short"):
        chunk_wire.decode(chunk_wire.encode(7, b"abcdef")[:-2])


def test_cut_covers_files_in_pieces():
    from metal_cluster.proto import pb

    tensors = [pb.TensorRange(name="a", offset=10, length=25), pb.TensorRange(name="b", offset=40, length=5)]
    # Tensors whole (a worker caches them one by one), the gaps in parts.
    assert manifests.cut(50, tensors, piece_bytes=10) == [(0, 10), (10, 25), (35, 5), (40, 5), (45, 5)]
    assert manifests.cut(60, tensors + [pb.TensorRange(name="empty", offset=45, length=0)], piece_bytes=10) == [
        (0, 10), (10, 25), (35, 5), (40, 5), (45, 0), (45, 10), (55, 5)]


def test_a_gguf_stage_fetches_its_tensors_only(tmp_path):
    """The embedded SmolLM2 GGUF: tensor ranges from its tensor table; a stage's blob is sparse."""
    source = resolve_model(None)
    os.environ["METAL_CLUSTER_CACHE"] = str(tmp_path / "coordinator-cache")
    try:
        store = model_store.start(source, "smollm", "127.0.0.1", TOKEN)
    finally:
        del os.environ["METAL_CLUSTER_CACHE"]
    try:
        got = fetch(store, tmp_path / "worker-cache", 10, 20)  # a middle stage: no embedding
    finally:
        store.stop()
    (weights,) = [f for f in store.manifest.files if f.format == "gguf"]
    mine = sum(t.length for t in weights.tensors if t.name in got.tensors)
    small = sum(f.size for f in store.manifest.files if f.format == "other")
    assert got.received == mine + small and mine < 0.3 * weights.size
    # The Q4_1 blocks as they came, one file a tensor: the cache is the stage's share, not the file.
    cache = tmp_path / "worker-cache"
    assert disk_bytes(cache) <= mine + 0.1 * weights.size
    data = source.gguf.read_bytes()
    for t in weights.tensors:
        if t.name in got.tensors:
            cached = json.loads((got.folder / "gguf_tensors.json").read_text())["tensors"][t.name]["path"]
            assert open(cached, "rb").read() == data[t.offset:t.offset + t.length]
    shard = load_shard(resolve_model(got.folder), 10, 20, got.tensors)
    full = load_shard(source, 10, 20)
    assert_same_parameters(shard, full)


def test_progress_lines_and_status_cell():
    from metal_cluster.coordinator.commands import load_progress, status

    assert load_progress.line("10.0.0.2:7760", 50 * 2**20, 200 * 2**20, 10.0) == (
        "stage 10.0.0.2:7760: fetched 50.0 of 200.0 MiB of weights (25%, 5.0 MiB/s, 30s left)")
    assert status._fetched({"weights_fetched_bytes": 0}) == "-"
    assert status._fetched({"weights_fetched_bytes": 2**20, "fetch_bytes_done": 2**20,
                            "fetch_bytes_total": 4 * 2**20}) == "1.0 MiB (loading 1.0/4.0 MiB)"


def test_a_cache_limit_evicts_other_models_least_recently_used_first(model, tmp_path):
    import shutil

    other = shutil.copytree(model, tmp_path / "other")
    (other / "config.json").write_text((other / "config.json").read_text() + " ")  # another manifest
    cache = tmp_path / "worker-cache"
    size = (model / "model.safetensors").stat().st_size
    first = _start(model, tmp_path)
    try:
        fetch_stage(first.address, first.manifest.sha256, 0, 4, TOKEN, root=cache, cache_limit=10 * size)
    finally:
        first.stop()
    weights = next(f for f in first.manifest.files if f.format == "safetensors").sha256
    second = _start(other, tmp_path)
    try:
        # Asked before a plan runs: too small a limit is an answer (the worker is left out), not an error.
        room = weights_room(second.address, second.manifest.sha256, 0, 4, TOKEN, root=cache, cache_limit=size // 2)
        assert "--cache-limit" in room.refusal
        with pytest.raises(ModelLoadError, match="--cache-limit"):
            fetch_stage(second.address, second.manifest.sha256, 0, 4, TOKEN, root=cache, cache_limit=size // 2)
        # Room for one model: the first one's files go, except those the second shares (same hash).
        got = fetch_stage(second.address, second.manifest.sha256, 0, 4, TOKEN, root=cache,
                          cache_limit=int(1.5 * size))
        room = weights_room(second.address, second.manifest.sha256, 0, 4, TOKEN, root=cache, cache_limit=size // 2)
        assert (room.need_bytes, room.refusal) == (0, "")  # all in the cache: nothing to make room for
    finally:
        second.stop()
    # The weights did not change: their tensors are used in place, not fetched again; only the
    # changed config.json travelled.
    assert 0 < got.received == (other / "config.json").stat().st_size
    shared = {f.sha256 for f in second.manifest.files if f.format == "other"}
    assert weights in {f.sha256 for f in second.manifest.files}
    left = {p.name for p in (cache / "blobs").iterdir() if "." not in p.name}
    assert shared <= left


@pytest.mark.parametrize("family, start, end", [("qwen3_moe", 2, 4), ("deepseek_v3", 2, 4), ("qwen3_5_moe", 4, 6),
                                                ("qwen3_5", 4, 6)])
def test_a_fetched_stage_of_a_family_that_renames_its_tensors_loads(family, start, end, tmp_path):
    """MoE experts stacked by sanitize, MLA's kv_b_proj split into two, Qwen3.5's fused experts
    inside model.language_model: parameters with no name of their own in the checkpoint load from
    the fetched layer's tensors, and equal the full folder's. Qwen3.5's last stage fetches its head
    (the embedding when tied, as the dense fixture is) but not the vision tower or the MTP head
    (mlx-lm drops them)."""
    import tiny_models

    folder = tiny_models.build_tiny_model(family, tmp_path / family, num_layers=6)
    running = _start(folder, tmp_path)
    try:
        got = fetch(running, tmp_path / "worker-cache", start, end)
    finally:
        running.stop()
    assert got.received < (folder / "model.safetensors").stat().st_size / 2
    if family in tiny_models.NESTED_FAMILIES:
        tied = resolve_model(folder).config["tie_word_embeddings"]
        head = "model.language_model.embed_tokens.weight" if tied else "lm_head.weight"
        assert head in got.tensors and f"model.language_model.layers.{start}.post_attention_layernorm.weight" in got.tensors
        assert not [n for n in got.tensors if n.startswith(("mtp.", "model.visual."))], got.tensors
    mine = load_shard(resolve_model(got.folder), start, end, got.tensors)
    full = load_shard(resolve_model(folder), start, end)
    assert_same_parameters(mine, full)
    if family != "qwen3_5":  # dense: its parameters were renamed only out of model.language_model
        assert any(".switch_mlp." in n or "embed_q" in n for n, _ in tree_flatten(mine.model.parameters()))


def test_a_classifiers_last_stage_fetches_its_score_head_not_the_embedding(tmp_path):
    """A tied Qwen3 sequence classifier: its last stage holds the score head, so the embedding its
    config ties to an lm_head does not travel; the fetched stage loads like the full folder's."""
    import tiny_models

    folder = tiny_models.build_tiny_classifier("qwen3", tmp_path / "reranker")
    running = _start(folder, tmp_path)
    try:
        got = fetch(running, tmp_path / "worker-cache", 2, 4)
    finally:
        running.stop()
    assert got.received == tensor_bytes(folder, 2, 4) + small_files_bytes(folder)
    mine = load_shard(resolve_model(got.folder), 2, 4, got.tensors)
    full = load_shard(resolve_model(folder), 2, 4)
    assert mine.classifies and "embed_tokens" not in mine.model.model
    assert_same_parameters(mine, full)


def test_weights_come_over_the_bulk_port_and_over_tls_only_when_asked(store, model, tmp_path, caplog, monkeypatch):
    """The bytes of a default store cross its plaintext port (by splice(2) where there is one, as on
    Linux, else copied as on macOS); `weights_over_tls` has none; a worker that cannot reach the
    port fetches over TLS."""
    got = fetch(store, tmp_path / "bulk-cache", 0, 4)
    assert store.manifest.bulk_port and store.sender.sent == got.received > tensor_bytes(model, 0, 4)

    def cached(cache):
        return {p.name: p.read_bytes() for p in (cache / "tensors").iterdir() if not p.name.startswith(".")}

    spliced = cached(tmp_path / "bulk-cache")
    monkeypatch.delattr("os.splice", raising=False)
    assert fetch(store, tmp_path / "copied-cache", 0, 4).received == got.received
    assert cached(tmp_path / "copied-cache") == spliced
    monkeypatch.undo()
    tls = model_store.start(resolve_model(model), "tiny", "127.0.0.1", TOKEN, weights_over_tls=True)
    try:
        assert tls.sender is None and tls.manifest.bulk_port == 0
        assert fetch(tls, tmp_path / "tls-cache", 0, 4).received == got.received
    finally:
        tls.stop()
    store.sender.stop()  # the port closed: as if a firewall dropped it
    with caplog.at_level(logging.WARNING, logger="metal_cluster.worker"):
        again = fetch(store, tmp_path / "fallback-cache", 0, 4)
    assert again.received == got.received and "fetching over TLS instead" in caplog.text


def test_a_bulk_ticket_is_good_once_and_a_forged_one_gets_nothing(store, model):
    from metal_cluster.stage_worker.transfer import bulk

    def take(ticket):
        with bulk.connect("127.0.0.1", store.sender.port, ticket) as conn:
            conn.settimeout(10)
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            return data

    path = model / "model.safetensors"
    ticket = store.sender.grant(path, [(8, 100), (0, 8)], lambda: None)
    assert take(ticket) == path.read_bytes()[8:108] + path.read_bytes()[:8]
    assert take(ticket) == b""  # used
    assert take(b"\0" * bulk.TICKET_BYTES) == b""


def test_bytes_changed_on_the_way_are_refused_and_not_kept(store, model, tmp_path):
    """What a LAN attacker could do to the plaintext port: other bytes than the manifest's. Here
    the coordinator's file changes under the store with its size and mtime kept (so the store's own
    check passes): the worker refuses the piece and records nothing of it."""
    weights = next(f for f in store.manifest.files if f.format == "safetensors")
    piece = next(p for p in weights.pieces if p.offset >= weights.tensors[0].offset and p.length > 1)
    path = model / "model.safetensors"
    stat = path.stat()
    with open(path, "r+b") as f:
        f.seek(piece.offset + 1)
        byte = f.read(1)
        f.seek(piece.offset + 1)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    cache = tmp_path / "worker-cache"
    with pytest.raises(ModelLoadError, match="wrong hash"):
        fetch(store, cache, 0, 4)
    from metal_cluster.stage_worker.transfer.tensor_cache import Wanted

    key = Wanted(weights, next(t for t in weights.tensors if t.offset == piece.offset), piece).key
    assert not (cache / "tensors" / key).exists() and not (cache / "tensors" / f"{key}.part").exists()


def test_a_last_stage_that_runs_mtp_layers_fetches_them(mtp_model, tmp_path):
    """Speculative decoding's `mtp`: the last stage fetches the MTP layer (past num_hidden_layers)
    beside its own, and it loads like the full folder's; a last stage without MTP and the other
    stages leave it behind."""
    from metal_cluster.stage_worker.step.speculative.mtp import MTPDrafter

    running = _start(mtp_model, tmp_path)
    try:
        room = [weights_room(running.address, running.manifest.sha256, 2, 4, TOKEN, root=tmp_path / "room", mtp=mtp)
                for mtp in (False, True)]
        plain = fetch(running, tmp_path / "plain-cache", 2, 4)
        first = fetch_stage(running.address, running.manifest.sha256, 0, 2, TOKEN, root=tmp_path / "first", mtp=True)
        got = fetch_stage(running.address, running.manifest.sha256, 2, 4, TOKEN, root=tmp_path / "cache", mtp=True)
        assigned = _assign_fetching_last_stage(running, tmp_path / "host-cache")
    finally:
        running.stop()
    mtp_tensors = {n for n in got.tensors if n.startswith("model.layers.4.")}
    assert mtp_tensors and "model.layers.4.eh_proj.weight" in mtp_tensors
    assert not [n for n in plain.tensors | first.tensors if n.startswith("model.layers.4.")]
    assert got.received > plain.received
    assert room[1].need_bytes - room[0].need_bytes == got.received - plain.received  # asked before a plan
    assert assigned.spec_draft_weights_bytes > 0 and assigned.spec_draft_bytes_per_block > 0
    mine = MTPDrafter.load(resolve_model(got.folder), load_shard(resolve_model(got.folder), 2, 4, got.tensors), 2)
    full = MTPDrafter.load(resolve_model(mtp_model), load_shard(resolve_model(mtp_model), 2, 4), 2)
    pairs = list(zip(tree_flatten(mine.layer.parameters()), tree_flatten(full.layer.parameters())))
    assert pairs and all(n1 == n2 and mx.array_equal(a, b) for (n1, a), (n2, b) in pairs)


def _assign_fetching_last_stage(running, cache) -> "pb.AssignResponse":
    """A worker's last stage assigned with MTP from the store, as `up` assigns a remote one."""
    from metal_cluster.proto import PROTO_VERSION, pb
    from metal_cluster.stage_worker.host import StageHost

    os.environ["METAL_CLUSTER_CACHE"] = str(cache)
    try:
        return StageHost(token=TOKEN).assign(pb.AssignRequest(
            version=PROTO_VERSION, model="tiny", layer_start=2, layer_end=4, block_size=16, max_num_batched_tokens=16,
            memory_utilization=0.05, model_store=running.address, manifest_sha256=running.manifest.sha256,
            spec_mtp=True, spec_num_draft_tokens=2))
    finally:
        del os.environ["METAL_CLUSTER_CACHE"]
