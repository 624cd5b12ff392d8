"""Message base, version check and the one encoder/decoder pair per type."""

from __future__ import annotations

import struct
from typing import Any, TypeVar

import msgspec

# Bump only for an incompatible change; additive changes keep the version (fields get defaults).
PROTOCOL_VERSION = 1

# Limits checked before msgspec reads a frame. No message of this protocol nests deeper than ~6
# (ScoredSample > Completion > tensors > TensorSpec > shape); msgspec itself recurses once per level
# when it skips an unknown field, so a hostile frame nested 1,000 deep would end in RecursionError.
MAX_DEPTH = 32
# Channel headers are small (tensors travel as separate frames); services pass their own, smaller limit.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class ProtocolError(ValueError):
    """A frame that is not a valid message of the expected type."""


class ProtocolVersionError(ProtocolError):
    """A peer speaks another protocol version."""


class Message(msgspec.Struct, kw_only=True, tag_field="kind", forbid_unknown_fields=False):
    """Base of every wire message. ``kind`` (the class name) tags it; ``protocol_version`` is checked."""

    protocol_version: int = PROTOCOL_VERSION


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """Describes one raw tensor frame that travels beside a header (frame order = spec order).

    dtype is a torch/numpy dtype name ("int64", "float32", "bfloat16"); shape in elements.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]


class _VersionProbe(msgspec.Struct, forbid_unknown_fields=False):
    protocol_version: int = -1
    kind: str = "?"


_probe_decoder = msgspec.msgpack.Decoder(_VersionProbe)
_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}

M = TypeVar("M")


def encode(msg: Message) -> bytes:
    """msgpack bytes of one message (never pickle)."""
    return _encoder.encode(msg)


# msgpack type byte -> bytes to skip after it: (fixed payload, width of a big-endian length field).
# Containers (fixmap/fixarray, array16/32, map16/32) are handled apart; 0xc1 is never used.
_SKIP: dict[int, tuple[int, int]] = {
    0xC0: (0, 0), 0xC2: (0, 0), 0xC3: (0, 0),
    0xC4: (0, 1), 0xC5: (0, 2), 0xC6: (0, 4),  # bin 8/16/32
    0xC7: (1, 1), 0xC8: (1, 2), 0xC9: (1, 4),  # ext 8/16/32 (+1 type byte)
    0xCA: (4, 0), 0xCB: (8, 0),  # float 32/64
    0xCC: (1, 0), 0xCD: (2, 0), 0xCE: (4, 0), 0xCF: (8, 0),  # uint 8..64
    0xD0: (1, 0), 0xD1: (2, 0), 0xD2: (4, 0), 0xD3: (8, 0),  # int 8..64
    0xD4: (2, 0), 0xD5: (3, 0), 0xD6: (5, 0), 0xD7: (9, 0), 0xD8: (17, 0),  # fixext 1..16 (+type)
    0xD9: (0, 1), 0xDA: (0, 2), 0xDB: (0, 4),  # str 8/16/32
}  # fmt: skip
_LEN_FORMAT = {1: ">B", 2: ">H", 4: ">I"}
# every msgpack type byte that can open a nesting level: fixmap and fixarray with at least one entry, array16/32,
# map16/32. The empty fixmap/fixarray (0x80, 0x90; a pipeline header has ~9 of them) open none, and leaving them
# out keeps a ScoredSample header with five tensors under the fast bound (v16 in benchmarks/NOTES.md).
_CONTAINER_BYTES = bytes([*range(0x81, 0x90), *range(0x91, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])


def check_frame(data: bytes | memoryview, max_bytes: int = MAX_MESSAGE_BYTES, max_depth: int = MAX_DEPTH) -> None:
    """ProtocolError unless ``data`` is at most ``max_bytes`` long and nests at most ``max_depth`` levels.

    Runs before any msgspec call, without recursion, so no frame can reach msgspec's recursion limit.
    """
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > max_bytes:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {max_bytes} bytes")
    raw = data.tobytes() if isinstance(data, memoryview) else bytes(data)
    # Nesting N deep needs N container type bytes. Counting every byte that could be one (in C: one
    # translate pass deleting them, ~20x faster than one bytes.count per type byte, which cost every
    # pipeline message ~20 us) is an upper bound that clears the usual small header without the Python walk below.
    if len(raw) - len(raw.translate(None, _CONTAINER_BYTES)) <= max_depth:
        return
    remaining = [1]  # items still to read at each open nesting level
    pos = 0
    while remaining:
        if remaining[-1] == 0:
            remaining.pop()
            continue
        remaining[-1] -= 1
        if pos >= size:
            raise ProtocolError(f"truncated frame: {size} bytes end inside a value")
        b = raw[pos]
        pos += 1
        if b <= 0x7F or b >= 0xE0:  # positive / negative fixint
            continue
        if b <= 0x9F or 0xDC <= b <= 0xDF:
            if b <= 0x8F:
                count = (b & 0x0F) * 2
            elif b <= 0x9F:
                count = b & 0x0F
            else:
                width = 2 if b in (0xDC, 0xDE) else 4
                if pos + width > size:
                    raise ProtocolError(f"truncated frame: {size} bytes end inside a value")
                count = struct.unpack_from(_LEN_FORMAT[width], raw, pos)[0] * (2 if b >= 0xDE else 1)
                pos += width
            if count:
                if len(remaining) > max_depth:
                    raise ProtocolError(f"message nests deeper than {max_depth} levels")
                remaining.append(count)
            continue
        if b <= 0xBF:  # fixstr
            pos += b & 0x1F
            continue
        skip = _SKIP.get(b)
        if skip is None:
            raise ProtocolError(f"invalid msgpack type byte 0x{b:02x} at offset {pos - 1}")
        fixed, width = skip
        if width:
            if pos + width > size:
                raise ProtocolError(f"truncated frame: {size} bytes end inside a value")
            fixed += struct.unpack_from(_LEN_FORMAT[width], raw, pos)[0]
            pos += width
        pos += fixed


def decode(data: bytes | memoryview, type_: type[M] | Any, max_bytes: int = MAX_MESSAGE_BYTES) -> M:
    """Decode ``data`` as ``type_`` (a Message subclass or a Union of them), checking the version first.

    Raises ProtocolVersionError on a version mismatch and ProtocolError on anything else that is not
    a valid message (too large, nested deeper than MAX_DEPTH, not msgpack, wrong fields), both naming
    what was expected and what arrived. Nothing else escapes, whatever the bytes.
    """
    check_frame(data, max_bytes)
    try:
        probe = _probe_decoder.decode(data)
    except Exception as exc:  # DecodeError, ValidationError; anything else is equally a bad frame
        raise ProtocolError(f"malformed frame (not a msgpack message): {exc}") from None
    if probe.protocol_version != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"protocol version mismatch: peer sent version {probe.protocol_version} "
            f"({probe.kind}), this side speaks version {PROTOCOL_VERSION}; "
            "upgrade the older side so both run the same streamrft protocols"
        )
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.msgpack.Decoder(type_)
    try:
        return dec.decode(data)
    except Exception as exc:  # DecodeError, ValidationError; anything else is equally a bad frame
        raise ProtocolError(f"invalid {probe.kind} message: {exc}") from None


def json_schema(types: list[type]) -> dict[str, Any]:
    """JSON Schema (draft 2020-12) for non-Python peers; see ``python -m protocols.schema``."""
    schemas, components = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "protocol_version": PROTOCOL_VERSION,
        "anyOf": list(schemas),
        "$defs": components,
    }
