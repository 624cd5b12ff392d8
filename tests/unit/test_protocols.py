"""The wire contract: version-checked decode, JSON Schema, and no torch needed to speak it."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

import protocols
from protocols import Completion, ProtocolError, ProtocolVersionError, RewardReply, RewardRequest, decode, encode


def test_a_message_round_trips_and_keeps_every_field():
    req = RewardRequest(request_id="r1", items=[protocols.RewardItem(sample_id="s", prompt="1+1=", response="2", images=["aGk="])])
    assert decode(encode(req), RewardRequest) == req


def test_another_protocol_version_is_refused_naming_both_versions():
    frame = msgspec.msgpack.encode({"kind": "RewardReply", "protocol_version": 7, "request_id": "x"})
    with pytest.raises(ProtocolVersionError, match="peer sent version 7 .*this side speaks version 1"):
        decode(frame, RewardReply)


def test_a_frame_that_is_not_msgpack_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="malformed frame"):
        decode(b"\xc1\xff not msgpack", RewardReply)


def test_a_message_of_the_wrong_kind_is_a_protocol_error_naming_it():
    frame = encode(RewardReply(request_id="x"))
    with pytest.raises(ProtocolError, match="invalid RewardReply message"):
        decode(frame, Completion)


def test_json_schema_covers_every_wire_message():
    from protocols.schema import all_message_types

    schema = protocols.json_schema(all_message_types())
    assert schema["protocol_version"] == protocols.PROTOCOL_VERSION
    assert {t.__name__ for t in all_message_types()} <= set(schema["$defs"])
    json.dumps(schema)  # serialisable for non-Python peers


def test_protocols_import_without_torch_or_streamrft():
    code = "import sys, protocols, protocols.schema; print('torch' in sys.modules, 'streamrft' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
