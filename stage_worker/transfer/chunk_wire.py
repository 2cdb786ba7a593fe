"""ReadChunk (proto/cluster.proto) to and from its wire bytes, without protobuf's copies of `data`.

Weights are most of what a cluster sends, and protobuf copies a bytes field each time it is set,
serialized, parsed, and (upb) each time it is read: five or six copies of every byte, on a path
whose goal is the rate of a plain TCP stream. These write and read the same wire format (field 1:
offset, a varint; field 2: data, length-delimited), so the proto stays the contract; anything
else in a message is left to protobuf.
"""

from metal_cluster.proto import pb

_OFFSET_TAG = 0x08  # field 1, varint
_DATA_TAG = 0x12  # field 2, length-delimited
READ_METHOD = "/{}/Read".format(pb.DESCRIPTOR.services_by_name["ModelStore"].full_name)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def encode(offset: int, data: bytes) -> bytes:
    """A ReadChunk's wire bytes: one copy of `data`, into the message."""
    head = bytes([_OFFSET_TAG]) + _varint(offset) if offset else b""  # proto3 omits a zero
    return b"".join((head, bytes([_DATA_TAG]), _varint(len(data)), data))


def decode(wire: bytes) -> tuple[int, memoryview]:
    """(offset, data) of a ReadChunk; `data` a view into `wire`, not a copy."""
    view, at, offset, data = memoryview(wire), 0, 0, memoryview(b"")
    try:
        while at < len(view):
            tag, at = _read_varint(view, at)
            if tag == _OFFSET_TAG:
                offset, at = _read_varint(view, at)
            elif tag == _DATA_TAG:
                n, at = _read_varint(view, at)
                data, at = view[at:at + n], at + n
            else:  # a field this reader does not know: protobuf's parse
                chunk = pb.ReadChunk.FromString(wire)
                return chunk.offset, memoryview(chunk.data)
    except IndexError:
        raise ValueError("a ReadChunk cut short") from None
    if at != len(view):
        raise ValueError("a ReadChunk cut short")
    return offset, data
