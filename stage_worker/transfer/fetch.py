"""Fetch from the coordinator's model store what one stage needs, into the worker's cache, and
give back a model folder that loads like a local one.

The stage needs the small files (config, tokenizer) whole, and of the weight files only the tensors
of its layers (plus the embedding and head where it holds them), each kept as the checkpoint
stores it (`tensor_cache.py`). Tensors already in the cache, and matching their hash, are not
fetched again; a transfer cut off part way leaves what arrived, to the byte, and is tried again
from there (a few times, then by the next fetch).
"""

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.proto import cluster_pb2_grpc as pb_grpc
from metal_cluster.stage_worker.transfer import bulk, chunk_wire, stage_folder
from metal_cluster.stage_worker.net import cluster_tls
from metal_cluster.stage_worker.transfer import manifest as manifests
from metal_cluster.stage_worker.errors import ModelLoadError, NoRoomError
from metal_cluster.stage_worker.model.model_source import cache_dir, text_config
from metal_cluster.stage_worker.transfer.tensor_cache import TensorStore, Wanted
from metal_cluster.stage_worker.transfer.weights_cache import BlobStore

log = logging.getLogger("metal_cluster.worker")
MAX_MESSAGE = 64 * 2**20
# gRPC reads the socket in small pieces by default; bigger reads cut its receive cost by a quarter
# (bench/README.md, "Weights over the model store").
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE),
                   ("grpc.experimental.tcp_read_chunk_size", 4 * 2**20),
                   ("grpc.experimental.tcp_min_read_chunk_size", 2**20),
                   ("grpc.experimental.tcp_max_read_chunk_size", 8 * 2**20)]
BATCH_BYTES = 256 * 2**20  # tensors asked for in one Read
DISK_FULL = "this worker's disk filled up while fetching its layers: free space or set METAL_CLUSTER_CACHE"
AHEAD_BYTES = 16 * 2**20  # received and written, not yet hashed


@dataclass
class FetchProgress:
    """What Health reports while a stage loads: this load's bytes, and all bytes received."""

    total: int = 0
    done: int = 0
    received: int = 0


@dataclass
class Fetched:
    folder: Path
    tensors: set[str] = field(default_factory=set)  # the tensors this stage holds, as the files name them
    received: int = 0  # bytes that came over the wire for this load
    seconds: float = 0.0  # of which moving the bytes took this long (no manifest, no small files)


def fetch_stage(address: str, manifest_sha: str, start: int, end: int, token: str | None,
                progress: FetchProgress | None = None, root: Path | None = None,
                cache_limit: int = 0, mtp: bool = False) -> Fetched:
    """`cache_limit` (bytes, 0: none): cached tensors no stage here needs now (other models', and
    this model's other layers), least recently used first, are removed to keep the cache within it.
    `mtp`: a last stage fetches the checkpoint's MTP layers too."""
    root = root or cache_dir()
    with _session(address, manifest_sha, token) as (client, manifest):
        return _Fetch(client, manifest, root, progress or FetchProgress(), cache_limit).run(start, end, mtp)


def weights_room(address: str, manifest_sha: str, start: int, end: int, token: str | None,
                 root: Path | None = None, cache_limit: int = 0, mtp: bool = False) -> pb.WeightsRoomResponse:
    """Whether the cache can hold layers [start, end), asked before a plan runs: the small files are
    fetched (config.json tells which tensors those are), no weights. Short of room is an answer, not
    an error: the coordinator leaves this worker out of the plan."""
    root = root or cache_dir()
    with _session(address, manifest_sha, token) as (client, manifest):
        fetch = _Fetch(client, manifest, root, FetchProgress(), cache_limit)
        need = 0
        try:
            wanted, _ = fetch.plan(start, end, mtp)
            need = fetch.tensors.unarrived_bytes(wanted)
            if need:  # as a fetch: one with nothing to fetch adds nothing to the cache
                fetch.make_room(need, {w.key for w in wanted})
        except NoRoomError as e:
            return pb.WeightsRoomResponse(need_bytes=need, refusal=str(e))
        return pb.WeightsRoomResponse(need_bytes=need)


@contextlib.contextmanager
def _session(address: str, manifest_sha: str, token: str | None):
    """A client of the model store at `address`, and its manifest, checked to be the plan's."""
    channel = cluster_tls.channel(address, token, options=CHANNEL_OPTIONS, common_name="stage-fetch")
    try:
        client = _Client(pb_grpc.ModelStoreStub(channel), address,
                         channel.unary_stream(chunk_wire.READ_METHOD, request_serializer=pb.ReadRequest.SerializeToString,
                                              response_deserializer=chunk_wire.decode))
        manifest = client.manifest()
        if manifest_sha and manifest.sha256 != manifest_sha:
            raise ModelLoadError(f"the model store at {address} serves another model version than the plan's "
                                 f"({manifest.sha256[:12]}, not {manifest_sha[:12]}): the model changed; re-plan")
        yield client, manifest
    finally:
        channel.close()


@dataclass
class _Part:
    """A byte range of a file of the store, and where it goes: `fd` at `dst`. `h` is fed its bytes;
    `done(digest)` is called once all of them are written and hashed."""

    src: int
    length: int
    fd: int
    dst: int
    h: object
    done: Callable[[str], None]


class _Client:
    def __init__(self, stub, address: str, read_raw):
        self.stub, self.address = stub, address
        self.read_raw = read_raw  # Read, its answers as (offset, a view of the data): chunk_wire.py
        self.bulk_port = 0  # the store's plaintext port for weights (bulk.py); 0: Read over TLS
        # The hasher holds at most AHEAD_BYTES and one chunk more; one more is being filled.
        self.buffers = bulk.Buffers(AHEAD_BYTES // bulk.CHUNK_BYTES + 2)

    def manifest(self) -> pb.ManifestResponse:
        try:
            manifest = self.stub.Manifest(pb.ManifestRequest(version=PROTO_VERSION), timeout=60)
        except grpc.RpcError as e:
            why = cluster_tls.refusal(e.details()) or e.details() or e.code().name
            raise ModelLoadError(f"cannot get the model's manifest from {self.address}: {why}") from None
        self.bulk_port = manifest.bulk_port
        return manifest

    def read_into(self, manifest_sha: str, path: str, parts: list[_Part]):
        """Write the parts' bytes where they go, and yield each chunk once written as (its bytes,
        release), in order, in chunks that never straddle two parts; call `release()` once a chunk
        is hashed."""
        req = pb.ReadRequest(version=PROTO_VERSION, manifest_sha256=manifest_sha, path=path,
                             pieces=[pb.Piece(offset=p.src, length=p.length) for p in parts])
        try:
            conn = self._bulk_connection(req)
            if conn is None:
                yield from self._streamed(req, parts)
                return
        except grpc.RpcError as e:
            raise _rpc_failed(e, f"fetching {path} from {self.address} failed") from None
        try:
            yield from bulk.receive_into(conn, [(p.fd, p.dst, p.length) for p in parts], self.buffers)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise NoRoomError(DISK_FULL) from None
            raise LinkBroken(f"fetching {path} from {self.address} (weights port {self.bulk_port}) "
                             f"failed: {e}") from None
        except EOFError as e:
            raise LinkBroken(f"fetching {path} from {self.address} (weights port {self.bulk_port}) "
                             f"failed: {e}") from None

    def _streamed(self, req: pb.ReadRequest, parts: list[_Part]):
        """Read over TLS: each chunk is checked to be the next bytes asked for before it is written."""
        ranges = iter(parts)
        part, at = next(ranges), 0
        try:
            for offset, data in self.read_raw(req):
                if part is None or offset != part.src + at or at + len(data) > part.length:
                    raise ModelLoadError(f"the model store sent bytes of {req.path} out of order")
                _write(part.fd, data, part.dst + at)
                yield data, _nothing
                at += len(data)
                if at == part.length:
                    part, at = next(ranges, None), 0
        except grpc.RpcError as e:
            raise _rpc_failed(e, f"fetching {req.path} from {self.address} failed") from None

    def _bulk_connection(self, req: pb.ReadRequest):
        """A connection to the store's weights port holding a ticket for `req`; None to use Read
        (the store sends over TLS only, or its port cannot be reached from here: then from now on)."""
        if not self.bulk_port:
            return None
        ticket = self.stub.Grant(req, timeout=60).ticket
        host = bulk.host_of(self.address)
        try:
            return bulk.connect(host, self.bulk_port, ticket)
        except OSError as e:
            log.warning("the model store's weights port %s:%d cannot be reached (%s): fetching over TLS instead",
                        host, self.bulk_port, e)
            self.bulk_port = 0
            return None


def _nothing() -> None:
    pass


class LinkBroken(ModelLoadError):
    """The link to the model store broke part way: what arrived stays, and another try resumes there."""


# A link that drops (the store's host restarting, Wi-Fi roaming) answers one of these.
_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
RETRY_SECONDS = (1.0, 2.0, 4.0)  # the waits before each new try of a broken transfer


def _rpc_failed(e: grpc.RpcError, what: str) -> ModelLoadError:
    why = f"{what}: {e.details() or e.code().name}"
    return LinkBroken(why) if e.code() in _TRANSIENT else ModelLoadError(why)


class _Fetch:
    def __init__(self, client: _Client, manifest: pb.ManifestResponse, root: Path, progress: FetchProgress,
                 cache_limit: int = 0):
        self.client, self.manifest, self.progress = client, manifest, progress
        self.blobs = BlobStore(root / "blobs")  # the small files, whole
        self.tensors = TensorStore(root / "tensors")
        self.cache_limit = cache_limit
        self.models = root / "models"
        self.folder = self.models / manifest.sha256[:16]  # the small files: config.json picks the tensors
        self.received = 0
        self.seconds = 0.0

    def run(self, start: int, end: int, mtp: bool = False) -> Fetched:
        wanted, kept = self.plan(start, end, mtp)
        self._get_tensors(wanted, f"layers [{start}, {end})")
        small = {f.path: self.blobs.path(f.sha256) for f in self.manifest.files if f.format == "other"}
        name = f"{self.manifest.sha256[:16]}-{start}-{end}{'-mtp' if mtp else ''}"
        folder = stage_folder.write(self.models / name, small, wanted, self.tensors, self.manifest.name, (start, end))
        return Fetched(folder, kept, self.received, self.seconds)

    def plan(self, start: int, end: int, mtp: bool = False) -> tuple[list[Wanted], set[str]]:
        """The small files, fetched; and the tensors the stage reads, with their names."""
        small = [f for f in self.manifest.files if f.format == "other"]
        weights = [f for f in self.manifest.files if f.format != "other"]
        self._get_files(small, "config and tokenizer files")
        self._link(small)
        config = text_config(json.loads((self.folder / "config.json").read_text()))
        num_layers = config["num_hidden_layers"]
        if not 0 <= start < end <= num_layers:
            raise ModelLoadError(f"layer range [{start}, {end}) is outside the model's {num_layers} layers")
        # A sequence classifier's head is its score layer (classifier.py): no tied embedding on its last stage.
        classifier = any(t.name.startswith("score.") for f in weights for t in f.tensors)
        tied = ties_embeddings(config) and not classifier
        kept = {t.name for f in weights for t in f.tensors if manifests.stage_keeps(t.name, start, end, num_layers, tied)}
        if mtp and end == num_layers:
            names = [t.name for f in weights for t in f.tensors]
            own = any(manifests.mtp_keeps(n, num_layers, True) and n.endswith(".embed_tokens.weight") for n in names)
            kept |= {n for n in names if manifests.mtp_keeps(n, num_layers, own)}
        return wanted_tensors(weights, kept), kept

    def _get_files(self, files: list[pb.ModelFile], what: str) -> None:
        """Small files whole, as blobs (`weights_cache.py`)."""
        missing = {}
        for entry in files:
            with self.blobs.locked(entry.sha256):
                missing[entry.path] = (entry, self.blobs.missing(entry, list(entry.pieces)))
                os.close(self.blobs.open_for_write(entry))
        need = sum(p.length for _, ps in missing.values() for p in ps)
        if not need:
            return
        # Before the tensors are picked: this model's are all kept while the small files come.
        weights = [f for f in self.manifest.files if f.format != "other"]
        self.make_room(need, {w.key for w in wanted_tensors(weights, {t.name for f in weights for t in f.tensors})})
        log.info("fetching %d bytes of %s for %s from %s", need, self.manifest.name, what, self.client.address)
        began = time.monotonic()
        for entry, pieces in missing.values():
            if not pieces:
                continue
            with self.blobs.locked(entry.sha256):
                fd = self.blobs.open_for_write(entry)
                try:
                    self._receive(entry, [_Part(p.offset, p.length, fd, p.offset, manifests.piece_hash(),
                                                self._blob_done(entry, p)) for p in pieces])
                finally:
                    os.close(fd)
        took = max(time.monotonic() - began, 1e-6)
        self.seconds += took
        log.info("fetched %d bytes for %s in %.2fs (%.1f MB/s)", need, what, took, need / took / 1e6)

    def _blob_done(self, entry: pb.ModelFile, piece: pb.Piece) -> Callable[[str], None]:
        def done(digest: str) -> None:
            _check_hash(entry, piece.offset, digest, piece.blake3)
            self.blobs.record(entry.sha256, piece)
        return done

    def _get_tensors(self, wanted: list[Wanted], what: str) -> None:
        """The stage's tensors into the tensor cache: those there and whole are used as they are,
        a cut-off one is resumed at its last byte, the others fetched."""
        with self.tensors.locked():
            missing = [(w, self.tensors.arrived(w)) for w in wanted if not self.tensors.ready(w)]
            need = sum(w.piece.length - have for w, have in missing)
            cached = sum(w.piece.length for w in wanted) - need
            self.progress.total, self.progress.done = need, 0
            if not missing:
                log.info("%s of %s: all %d bytes already in the cache", what, self.manifest.name, cached)
                self.tensors.touch(w.key for w in wanted)
                self._within_limit(0, {w.key for w in wanted}, refuse=False)  # fewer layers: the rest may go
                return
            self.make_room(need, {w.key for w in wanted})
            log.info("fetching %d bytes of %s for %s from %s (%d bytes already in the cache)",
                     need, self.manifest.name, what, self.client.address, cached)
            began = time.monotonic()
            by_file: dict[str, list] = {}
            for w, have in missing:
                by_file.setdefault(w.file.path, []).append((w, have))
            for group in by_file.values():
                for batch in _batches(group):
                    self._read_tensors_retried(batch)
            took = max(time.monotonic() - began, 1e-6)
            self.seconds += took
            self.tensors.touch(w.key for w in wanted)
        log.info("fetched %d bytes for %s in %.2fs (%.1f MB/s)", need, what, took, need / took / 1e6)

    def _read_tensors_retried(self, batch: list[tuple[Wanted, int]]) -> None:
        """A batch of tensors; when the link breaks, again a few times, from the byte it broke at."""
        for wait in (*RETRY_SECONDS, None):
            try:
                return self._read_tensors(batch)
            except LinkBroken as e:
                if wait is None:
                    raise
                log.warning("%s: trying again in %.0f s, from where it broke", e, wait)
                time.sleep(wait)
                batch = [(w, self.tensors.arrived(w)) for w, _ in batch if not self.tensors.ready(w)]
                if not batch:
                    return

    def _read_tensors(self, batch: list[tuple[Wanted, int]]) -> None:
        entry, fds, parts = batch[0][0].file, [], []
        try:
            for w, have in batch:
                fd = self.tensors.open_part(w, have)
                fds.append(fd)
                h = self.tensors.prefix_hash(w, have) if have else manifests.piece_hash()
                part = _Part(w.piece.offset + have, w.piece.length - have, fd, len(w.prefix) + have, h,
                             self._tensor_done(w))
                if part.length:
                    parts.append(part)
                else:  # all of it had arrived before the link broke
                    part.done(h.hexdigest())
            if parts:
                self._receive(entry, parts)
        finally:
            for fd in fds:
                os.close(fd)

    def _tensor_done(self, w: Wanted) -> Callable[[str], None]:
        def done(digest: str) -> None:
            if not self.tensors.finish(w, digest):
                _check_hash(w.file, w.piece.offset, digest, w.piece.blake3)
        return done

    def _receive(self, entry: pb.ModelFile, parts: list[_Part]) -> None:
        """Receive and write on this thread, hash on another: the socket, the write and the hash all
        release the GIL, so they overlap (writing on the hashing thread instead halved the rate:
        bench/README.md). A part is done once all of it is written and hashed."""
        hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fetch-hash")  # one: in order
        pending, ahead = [], 0  # (future, bytes) of chunks not yet hashed
        try:
            queue = iter(parts)
            part, at = next(queue), 0
            for data, release in self.client.read_into(self.manifest.sha256, entry.path, parts):
                n = len(data)  # before the hasher may release `data`
                at += n  # the chunk is the next bytes of `part`: read_into checks that
                done = part if at == part.length else None
                pending.append((hasher.submit(_hash_chunk, data, part.h, done, release), n))
                self.received += n
                self.progress.received += n
                self.progress.done += n
                if done:
                    part, at = next(queue, None), 0
                ahead += n
                while ahead > AHEAD_BYTES or (pending and pending[0][0].done()):
                    done_chunk, size = pending.pop(0)
                    done_chunk.result()
                    ahead -= size
            if part is not None:
                raise ModelLoadError(f"the model store ended {entry.path} early (at byte {part.src + at})")
        finally:
            hasher.shutdown(wait=True)  # what arrived is hashed and kept, even when the stream broke
        for f, _ in pending:
            f.result()

    def make_room(self, need: int, keep: set[str]) -> None:
        """Room for `need` more bytes in the cache, or NoRoomError. Within --cache-limit the tensors
        the stage does not need (other models', other layers') are evicted first, least recently
        used first; the stage's own tensors alone too big for it, or for the disk, are refused."""
        self._within_limit(need, keep)
        self._check_disk(need)

    def _within_limit(self, need: int, keep: set[str], refuse: bool = True) -> None:
        if not self.cache_limit:
            return
        mine = {f.sha256 for f in self.manifest.files if f.format == "other"}
        for sha in mine:
            self.blobs.touch(sha)
        self.blobs.evict(self.cache_limit - need - self.tensors.disk_bytes(), keep=mine)
        removed, freed = self.tensors.evict(self.cache_limit - need - self.blobs.total_bytes(), keep)
        if removed:
            log.info("cache limit %.2f GiB: removed %d cached tensor(s) (%s) no stage here needs now",
                     self.cache_limit / 2**30, removed, _size(freed))
        held = self.tensors.disk_bytes() + self.blobs.total_bytes()
        if refuse and held + need > self.cache_limit:
            raise NoRoomError(f"this stage needs {_size(held + need)} in the cache, over the worker's "
                              f"--cache-limit of {_size(self.cache_limit)}: raise it")

    def _check_disk(self, need: int) -> None:
        self.blobs.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.blobs.root).free
        if free < need:
            raise NoRoomError(f"this worker's disk has {_size(free)} free at {self.blobs.root}, and its layers need "
                              f"{_size(need)} more: free space or set METAL_CLUSTER_CACHE")

    def _link(self, files: list[pb.ModelFile]) -> None:
        for f in files:
            stage_folder.link(self.folder / f.path, self.blobs.path(f.sha256))


def _hash_chunk(data: memoryview, h, part: _Part | None, release) -> None:
    try:
        h.update(data)
    finally:
        release()
    if part is not None:
        part.done(h.hexdigest())


def _check_hash(entry: pb.ModelFile, offset: int, digest: str, expected: str) -> None:
    if digest != expected:
        raise ModelLoadError(f"a piece of {entry.path} at byte {offset} arrived with the wrong "
                             "hash: the coordinator's copy changed or the link corrupts data")


def ties_embeddings(config: dict) -> bool:
    """Whether the model's head is its embedding matrix, as the mlx-lm model class decides."""
    from mlx_lm.utils import _get_classes

    from metal_cluster.stage_worker.families import family_of

    model_class, args_class = _get_classes(config)
    # Built with lazy weights (nothing is allocated): whether its text model has an lm_head of its own.
    model = model_class(args_class.from_dict(config))
    return "lm_head" not in family_of(config, "config.json").language_model(model)


def wanted_tensors(weights: list[pb.ModelFile], kept: set[str]) -> list[Wanted]:
    """The kept tensors of the weight files, each with its piece (a tensor is one piece whole)."""
    out = []
    for entry in weights:
        pieces = {(p.offset, p.length): p for p in entry.pieces}
        for t in entry.tensors:
            if t.name in kept:
                piece = pieces.get((t.offset, t.length))
                if piece is None:
                    raise ModelLoadError(f"the model store's manifest cuts tensor {t.name} of {entry.path} in "
                                         "parts: it runs another metal-cluster version; run the same on every host")
                out.append(Wanted(entry, t, piece))
    return out


def _batches(items: list[tuple[Wanted, int]]):
    batch, size = [], 0
    for w, have in items:
        if batch and size + w.piece.length > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append((w, have))
        size += w.piece.length - have
    if batch:
        yield batch


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def _write(fd: int, data: memoryview, offset: int) -> None:
    try:
        view = data
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise NoRoomError(DISK_FULL) from None
        raise
