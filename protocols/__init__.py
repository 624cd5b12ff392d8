"""StreamRFT wire contract: every message that crosses a channel or a process.

Importable with msgspec alone (no torch), so a reward microservice needs msgspec + pyzmq only.

Rules (msgspec schema evolution): structs are append-only; a new field gets a default; a field's
type never changes. Every message carries ``protocol_version``; :func:`decode` rejects a version it
does not speak with :class:`ProtocolVersionError` before reading anything else.

Whatever the bytes, :func:`decode` returns a message or raises :class:`ProtocolError`, nothing else: a
frame over ``max_bytes`` or nested deeper than ``MAX_DEPTH`` (32) is refused before msgspec reads it.
"""

from protocols.base import (
    PROTOCOL_VERSION,
    Message,
    ProtocolError,
    ProtocolVersionError,
    TensorSpec,
    decode,
    encode,
    json_schema,
)
from protocols.pipeline import (
    Completion,
    MediaRef,
    Control,
    MicrobatchHeader,
    PromptGroup,
    ScoredSample,
    TrajectoryRecord,
)
from protocols.env import EnvClose, EnvReply, EnvRequest, EnvReset, EnvStep
from protocols.reward import RewardItem, RewardReply, RewardRequest
from protocols.teacher import TeacherReply, TeacherRequest

__all__ = [
    "PROTOCOL_VERSION",
    "Message",
    "ProtocolError",
    "ProtocolVersionError",
    "TensorSpec",
    "decode",
    "encode",
    "json_schema",
    "PromptGroup",
    "Completion",
    "MediaRef",
    "Control",
    "ScoredSample",
    "MicrobatchHeader",
    "TrajectoryRecord",
    "RewardItem",
    "RewardRequest",
    "RewardReply",
    "TeacherRequest",
    "TeacherReply",
    "EnvReset",
    "EnvStep",
    "EnvClose",
    "EnvReply",
    "EnvRequest",
]
