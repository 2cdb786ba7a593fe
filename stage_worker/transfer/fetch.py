"""Fetch from the coordinator's model store what one stage needs, into the worker's cache, and
give back a model folder that loads like a local one.

The stage needs the small files (config, tokenizer) whole, and of the weight files their headers
and the tensors of its layers (plus the embedding and head where it holds them). Pieces already
in the cache, and matching their hash, are not fetched again; a transfer cut off part way leaves
the pieces that arrived, so the next one fetches only the rest.
"""

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.proto import cluster_pb2_grpc as pb_grpc
from metal_cluster.stage_worker.transfer import bulk, chunk_wire
from metal_cluster.stage_worker.net import cluster_tls
from metal_cluster.stage_worker.transfer import manifest as manifests
from metal_cluster.stage_worker.errors import ModelLoadError, NoRoomError
from metal_cluster.stage_worker.model.model_source import cache_dir, text_config
from metal_cluster.stage_worker.transfer.weights_cache import BlobStore

log = logging.getLogger("metal_cluster.worker")
MAX_MESSAGE = 64 * 2**20
# gRPC reads the socket in small pieces by default; bigger reads cut its receive cost by a quarter
# (bench/README.md, "Weights over the model store").
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE),
                   ("grpc.experimental.tcp_read_chunk_size", 4 * 2**20),
                   ("grpc.experimental.tcp_min_read_chunk_size", 2**20),
                   ("grpc.experimental.tcp_max_read_chunk_size", 8 * 2**20)]
BATCH_BYTES = 256 * 2**20  # pieces asked for in one Read: a cut-off stream loses little
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
    """`cache_limit` (bytes, 0: none): blobs of other models, least recently used first, are removed
    to keep the cache within it. `mtp`: a last stage fetches the checkpoint's MTP layers too."""
    root = root or cache_dir()
    with _session(address, manifest_sha, token) as (client, manifest):
        return _Fetch(client, manifest, BlobStore(root / "blobs"), root, progress or FetchProgress(),
                      cache_limit).run(start, end, mtp)


def weights_room(address: str, manifest_sha: str, start: int, end: int, token: str | None,
                 root: Path | None = None, cache_limit: int = 0, mtp: bool = False) -> pb.WeightsRoomResponse:
    """Whether the cache can hold layers [start, end), asked before a plan runs: the small files are
    fetched (config.json tells which tensors those are), no weights. Short of room is an answer, not
    an error: the coordinator leaves this worker out of the plan."""
    root = root or cache_dir()
    with _session(address, manifest_sha, token) as (client, manifest):
        fetch = _Fetch(client, manifest, BlobStore(root / "blobs"), root, FetchProgress(), cache_limit)
        need = 0
        try:
            wanted, _ = fetch.plan(start, end, mtp)
            need = fetch.blobs.unrecorded_bytes(wanted.values())
            if need:  # as a fetch: one with nothing to fetch adds nothing to the cache
                fetch.make_room(need)
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

    def read_into(self, fd: int, manifest_sha: str, path: str, pieces: list[pb.Piece]):
        """Write the pieces' bytes into `fd` at their offsets, and yield each chunk once written as
        (offset, its bytes, release), in order, in chunks that never straddle two pieces; call
        `release()` once a chunk is hashed."""
        req = pb.ReadRequest(version=PROTO_VERSION, manifest_sha256=manifest_sha, path=path,
                             pieces=[pb.Piece(offset=p.offset, length=p.length) for p in pieces])
        try:
            conn = self._bulk_connection(req)
            if conn is None:
                yield from self._streamed(req, fd, pieces)
                return
        except grpc.RpcError as e:
            raise ModelLoadError(f"fetching {path} from {self.address} failed: {e.details() or e.code().name}") from None
        try:
            yield from bulk.receive_into(conn, [(p.offset, p.length) for p in pieces], fd, self.buffers)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise NoRoomError(DISK_FULL) from None
            raise ModelLoadError(f"fetching {path} from {self.address} (weights port {self.bulk_port}) "
                                 f"failed: {e}") from None
        except EOFError as e:
            raise ModelLoadError(f"fetching {path} from {self.address} (weights port {self.bulk_port}) "
                                 f"failed: {e}") from None

    def _streamed(self, req: pb.ReadRequest, fd: int, pieces: list[pb.Piece]):
        """Read over TLS: each chunk is checked to be the next bytes asked for before it is written."""
        ranges = iter(pieces)
        piece, at = next(ranges), 0
        try:
            for offset, data in self.read_raw(req):
                if piece is None or offset != piece.offset + at or at + len(data) > piece.length:
                    raise ModelLoadError(f"the model store sent bytes of {req.path} out of order")
                _write(fd, data, offset)
                yield offset, data, _nothing
                at += len(data)
                if at == piece.length:
                    piece, at = next(ranges, None), 0
        except grpc.RpcError as e:
            raise ModelLoadError(f"fetching {req.path} from {self.address} failed: {e.details() or e.code().name}") from None

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


class _Fetch:
    def __init__(self, client: _Client, manifest: pb.ManifestResponse, blobs: BlobStore, root: Path,
                 progress: FetchProgress, cache_limit: int = 0):
        self.client, self.manifest, self.blobs, self.progress = client, manifest, blobs, progress
        self.cache_limit = cache_limit
        self.folder = root / "models" / manifest.sha256[:16]
        self.received = 0
        self.seconds = 0.0

    def run(self, start: int, end: int, mtp: bool = False) -> Fetched:
        wanted, kept = self.plan(start, end, mtp)
        self._get(wanted, f"layers [{start}, {end})")
        weights = [entry for entry, _ in wanted.values()]
        self._link(weights)
        self._write_gguf_source(weights)
        return Fetched(self.folder, kept, self.received, self.seconds)

    def plan(self, start: int, end: int,
             mtp: bool = False) -> tuple[dict[str, tuple[pb.ModelFile, list[pb.Piece]]], set[str]]:
        """The small files, fetched; and the pieces of the weight files the stage reads, with the
        names of its tensors."""
        small = [f for f in self.manifest.files if f.format == "other"]
        weights = [f for f in self.manifest.files if f.format != "other"]
        self._get({f.path: (f, list(f.pieces)) for f in small}, "config and tokenizer files")
        self._link(small)  # config.json is read from the folder to pick the tensors
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
        return {f.path: (f, wanted_pieces(f, kept)) for f in weights}, kept

    def _get(self, wanted: dict[str, tuple[pb.ModelFile, list[pb.Piece]]], what: str) -> None:
        with_locks = sorted(wanted.items())
        missing = {}
        for name, (entry, pieces) in with_locks:
            with self.blobs.locked(entry.sha256):
                missing[name] = (entry, self.blobs.missing(entry, pieces))
        for entry, _ in wanted.values():  # every file exists, at its size, even one with nothing to fetch
            with self.blobs.locked(entry.sha256):
                os.close(self.blobs.open_for_write(entry))
        need = sum(p.length for _, ps in missing.values() for p in ps)
        cached = sum(p.length for _, ps in wanted.values() for p in ps) - need
        self.progress.total, self.progress.done = need, 0
        if not need:
            log.info("%s of %s: all %d bytes already in the cache", what, self.manifest.name, cached)
            return
        self.make_room(need)
        log.info("fetching %d bytes of %s for %s from %s (%d bytes already in the cache)",
                 need, self.manifest.name, what, self.client.address, cached)
        began = time.monotonic()
        for name, (entry, pieces) in missing.items():
            with self.blobs.locked(entry.sha256):  # another stage on this host may write it too
                for batch in _batches(pieces):
                    self._read_into(entry, batch)
        took = max(time.monotonic() - began, 1e-6)
        self.seconds += took
        log.info("fetched %d bytes for %s in %.2fs (%.1f MB/s)", need, what, took, need / took / 1e6)

    def _read_into(self, entry: pb.ModelFile, pieces: list[pb.Piece]) -> None:
        """Receive and write on this thread, hash on another: the socket, the write and the hash all
        release the GIL, so they overlap (writing on the hashing thread instead halved the rate:
        bench/README.md). A piece is recorded once all of it is written and matches."""
        fd = self.blobs.open_for_write(entry)
        hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fetch-hash")  # one: in order
        pending, ahead = [], 0  # (future, bytes) of chunks not yet hashed
        try:
            queue = iter(pieces)
            piece, h, at = next(queue), manifests.piece_hash(), 0
            for offset, data, release in self.client.read_into(fd, self.manifest.sha256, entry.path, pieces):
                n = len(data)  # before the hasher may release `data`
                at += n  # the chunk is the next bytes of `piece`: read_into checks that
                done = piece if at == piece.length else None
                pending.append((hasher.submit(self._hash_chunk, entry, data, h, done, release), n))
                self.received += n
                self.progress.received += n
                self.progress.done += n
                if done:
                    piece, h, at = next(queue, None), manifests.piece_hash(), 0
                ahead += n
                while ahead > AHEAD_BYTES or (pending and pending[0][0].done()):
                    done_chunk, size = pending.pop(0)
                    done_chunk.result()
                    ahead -= size
            if piece is not None:
                raise ModelLoadError(f"the model store ended {entry.path} early (at byte {piece.offset + at})")
        finally:
            hasher.shutdown(wait=True)  # what arrived is hashed and recorded, even when the stream broke
            os.close(fd)
        for f, _ in pending:
            f.result()

    def _hash_chunk(self, entry: pb.ModelFile, data: memoryview, h, piece: pb.Piece | None, release) -> None:
        try:
            h.update(data)
        finally:
            release()
        if piece is None:
            return
        if h.hexdigest() != piece.blake3:
            raise ModelLoadError(f"a piece of {entry.path} at byte {piece.offset} arrived with the wrong "
                                 "hash: the coordinator's copy changed or the link corrupts data")
        self.blobs.record(entry.sha256, piece)

    def make_room(self, need: int) -> None:
        """Room for `need` more bytes in the cache, or NoRoomError. Within --cache-limit other models'
        blobs are evicted first; this model alone too big for it, or for the disk, is refused."""
        self._within_limit(need)
        self._check_disk(need)

    def _within_limit(self, need: int) -> None:
        if not self.cache_limit:
            return
        mine = {f.sha256 for f in self.manifest.files}
        for sha in mine:
            self.blobs.touch(sha)
        removed = self.blobs.evict(self.cache_limit - need, keep=mine)
        if removed:
            log.info("cache limit %.2f GiB: removed %d file(s) of models no plan here uses",
                     self.cache_limit / 2**30, len(removed))
        held = sum(self.blobs.disk_bytes(sha) for sha in mine)
        if held + need > self.cache_limit:
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
            link = self.folder / f.path
            link.parent.mkdir(parents=True, exist_ok=True)
            tmp = link.with_name(f".{link.name}.{os.getpid()}")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(self.blobs.path(f.sha256))
            tmp.replace(link)

    def _write_gguf_source(self, weights: list[pb.ModelFile]) -> None:
        ggufs = [f for f in weights if f.format == "gguf"]
        if ggufs:
            text = json.dumps({"gguf": str(self.folder / ggufs[0].path)}, indent=2)
            tmp = self.folder / f".{manifests.GGUF_SOURCE}.{os.getpid()}"
            tmp.write_text(text)
            tmp.replace(self.folder / manifests.GGUF_SOURCE)


def ties_embeddings(config: dict) -> bool:
    """Whether the model's head is its embedding matrix, as the mlx-lm model class decides."""
    from mlx_lm.utils import _get_classes

    from metal_cluster.stage_worker.families import family_of

    model_class, args_class = _get_classes(config)
    # Built with lazy weights (nothing is allocated): whether its text model has an lm_head of its own.
    model = model_class(args_class.from_dict(config))
    return "lm_head" not in family_of(config, "config.json").language_model(model)


def wanted_pieces(entry: pb.ModelFile, kept: set[str]) -> list[pb.Piece]:
    """The pieces of a weight file a stage reads: those of its tensors, and those outside every
    tensor (the header, padding), which the file's reader parses."""
    spans = [(t.offset, t.offset + t.length) for t in entry.tensors]
    mine = [(t.offset, t.offset + t.length) for t in entry.tensors if t.name in kept]

    def overlaps(p, ranges):
        return any(a < p.offset + p.length and p.offset < b for a, b in ranges)

    return [p for p in entry.pieces if overlaps(p, mine) or not overlaps(p, spans)]


def _batches(pieces: list[pb.Piece]):
    batch, size = [], 0
    for p in pieces:
        if batch and size + p.length > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(p)
        size += p.length
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
