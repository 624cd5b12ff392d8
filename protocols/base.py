"""Message base, version check and the one encoder/decoder pair per type."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

# Bump only for an incompatible change; additive changes keep the version (fields get defaults).
PROTOCOL_VERSION = 1


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


def decode(data: bytes | memoryview, type_: type[M] | Any) -> M:
    """Decode ``data`` as ``type_`` (a Message subclass or a Union of them), checking the version first.

    Raises ProtocolVersionError on a version mismatch and ProtocolError on a malformed frame, both
    naming what was expected and what arrived.
    """
    try:
        probe = _probe_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
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
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
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
