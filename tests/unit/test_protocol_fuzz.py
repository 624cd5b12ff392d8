"""Issue 16 item 6 and "Fuzzing in CI": every decoder of bytes that come off a wire gives a valid
message or its documented error, whatever the bytes (property-based, each test bounded to seconds)."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protocols
from protocols import ProtocolError, TensorSpec
from protocols.base import MAX_DEPTH, check_frame
from protocols.schema import all_message_types
from streamrft.rewards.remote import peek_request_id
from streamrft.rewards.service import _request_from_json
from streamrft.runtime.frames import DTYPES_BY_NAME, frames_to_tensors

TYPES = all_message_types()
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# One valid message of each type: the seeds that mutation starts from.
SEEDS = [
    protocols.PromptGroup(group_id="s1-p0", step=1, prompt_index=0, prompt_text="1+1=", n_samples=2, prompt_len=4,
                          tensors=[TensorSpec("prompt_ids", "int64", (4,))]),
    protocols.Completion(sample_id="s1-p0-0", group_id="s1-p0", step=1, prompt_index=0, sample_index=0,
                         prompt_text="1+1=", response_text="2", n_samples=2, finish_reason="stop",
                         policy_version=3, prompt_len=4, response_len=1),
    protocols.Control(signal="end_of_step", step=2, counts={"admitted": 4}, busy=[0.0, 1.5]),
    protocols.MicrobatchHeader(step=1, sample_ids=["a", "b"], n_tokens=7),
    protocols.TrajectoryRecord(run_id="r", rank=0, step=1, sample_id="a", group_id="g", policy_version=1,
                               prompt="p", response="q", prompt_ids=[1, 2], response_ids=[3],
                               behaviour_logprobs=[-0.5], reward_components={"arith": 1.0}),
    protocols.RewardRequest(request_id="r1", items=[protocols.RewardItem(sample_id="0", prompt="2+1=",
                                                                         response="3", reference="3")]),
    protocols.RewardReply(request_id="r1", rewards=[1.0], components={"arith": [1.0]}),
    protocols.TeacherRequest(request_id="t1", token_ids=[[1, 2, 3]], prompt_lens=[1]),
    protocols.TeacherReply(request_id="t1", logprobs=[[-0.1, -0.2]]),
]
SEED_BYTES = [protocols.encode(m) for m in SEEDS]

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=40,
)


def _encode_any(value) -> bytes:
    # Integers outside the msgpack range cannot be encoded at all; they never reach a decoder.
    try:
        return msgspec.msgpack.encode(value)
    except OverflowError:
        return msgspec.msgpack.encode(None)


def assert_decodes_or_protocol_error(data: bytes) -> None:
    """The property: for every message type, a message of that type or ProtocolError, nothing else."""
    for type_ in TYPES:
        try:
            msg = protocols.decode(data, type_)
        except ProtocolError:
            continue
        assert isinstance(msg, type_)


def nested(depth: int, container: bytes = b"\x91") -> bytes:
    return container * depth + b"\xc0"


# --- deterministic reproductions of the issue --------------------------------------------------------


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 990, 5000, 200_000])
def test_item6_decode_of_a_deeply_nested_frame_is_protocol_error_for_every_type(depth):
    for frame in (nested(depth), nested(depth, b"\x81\xa1k"),
                  # a valid head, then an unknown field nested deep (msgspec skips unknown fields recursively)
                  b"\x83\xa4kind\xadRewardRequest\xb0protocol_version\x01\xa1x" + nested(depth)):
        for type_ in TYPES:
            with pytest.raises(ProtocolError, match=f"nests deeper than {MAX_DEPTH} levels"):
                protocols.decode(frame, type_)


def test_item6_a_frame_over_the_size_limit_is_protocol_error_before_decoding():
    frame = protocols.encode(protocols.RewardRequest(request_id="big", items=[]))
    with pytest.raises(ProtocolError, match=f"frame of {len(frame)} bytes exceeds the limit of 10 bytes"):
        protocols.decode(frame, protocols.RewardRequest, max_bytes=10)
    assert protocols.decode(frame, protocols.RewardRequest, max_bytes=len(frame)).request_id == "big"


def test_item6_messages_as_deep_as_the_protocol_nests_still_decode():
    sample = protocols.ScoredSample(completion=SEEDS[1], reward=1.0,
                                    tensors=[TensorSpec("teacher_logprobs", "float32", (1,))])
    assert protocols.decode(protocols.encode(sample), protocols.ScoredSample) == sample
    nested_ok = nested(MAX_DEPTH)  # exactly at the limit: reaches msgspec, which rejects the shape
    with pytest.raises(ProtocolError, match="malformed frame"):
        protocols.decode(nested_ok, protocols.Control)


def test_item6_peek_request_id_of_any_frame_is_a_string():
    assert peek_request_id(nested(5000, b"\x81\xa1k")) == ""
    assert peek_request_id(SEED_BYTES[5]) == "r1"


def test_item6_http_body_nested_deeply_is_a_value_error_naming_the_body():
    with pytest.raises(ValueError, match="body is not JSON"):
        _request_from_json(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ValueError, match="body is not JSON"):
        _request_from_json(b'{"queries": ' + b"[" * 5000 + b"]" * 5000 + b"}")


@pytest.mark.parametrize(
    "shape, frame, expected",
    [
        ((0, 2**63 - 1), b"", "dimension above 2\\*\\*62"),
        ((0, 2**62, 2**62), b"", "cannot be built"),
        ((2**62, 2**62), b"\0" * 8, f"needs {4 * 2**124} bytes, its frame has 8"),
        ((3, -1), b"", "negative dimension"),
    ],
)
def test_item6_frames_to_tensors_with_zero_and_huge_dimensions_is_protocol_error(shape, frame, expected):
    with pytest.raises(ProtocolError, match=expected):
        frames_to_tensors([TensorSpec("x", "float32", shape)], [memoryview(frame)])


def test_item6_frames_to_tensors_zero_size_tensors_with_large_dimensions_are_valid():
    out = frames_to_tensors([TensorSpec("x", "int64", (0, 2**40)), TensorSpec("y", "bfloat16", ())],
                            [memoryview(b""), memoryview(b"\x80\x3f")])
    assert out["x"].shape == (0, 2**40) and out["x"].dtype == torch.int64
    assert out["y"].shape == () and out["y"].item() == 1.0


def test_item6_channel_recv_of_a_deeply_nested_header_is_protocol_error_and_the_channel_keeps_working():
    from tests.unit.test_channels import DATA, WAIT, Harness, raw_handshake

    harness = Harness()

    async def body():
        rx = harness.receiver(harness.address("inproc"), 1)
        raw = await raw_handshake(harness, rx.address)
        await raw.send_multipart([DATA, nested(5000, b"\x81\xa1k")])
        with pytest.raises(ProtocolError) as caught:
            await rx.recv(WAIT)
        tx = harness.sender(rx.address)
        await tx.send(protocols.Control(signal="valid"), timeout=WAIT)
        return str(caught.value), (await rx.recv(WAIT))[0].signal

    try:
        message, next_signal = harness.run(body)
    finally:
        harness.close_all()
        harness.ctx.term()
    assert "'inbox' rank 0" in message and "nests deeper than" in message
    assert next_signal == "valid"


# --- property-based fuzzing --------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=600))
def test_fuzz_any_bytes_decode_to_a_message_or_protocol_error(data):
    assert_decodes_or_protocol_error(data)


@FUZZ
@given(msgpack_values, st.sampled_from([t.__name__ for t in TYPES]), st.sampled_from([1, 0, 2, -1]))
def test_fuzz_any_msgpack_value_tagged_as_any_message_decodes_or_is_protocol_error(value, kind, version):
    assert_decodes_or_protocol_error(_encode_any(value))
    fields = value if isinstance(value, dict) else {"x": value}
    assert_decodes_or_protocol_error(_encode_any({**fields, "kind": kind, "protocol_version": version}))


@FUZZ
@given(
    st.sampled_from(SEED_BYTES),
    st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete", "truncate", "nest"]),
                       st.integers(0, 10_000), st.binary(min_size=1, max_size=8)), min_size=1, max_size=4),
)
def test_fuzz_mutated_valid_messages_decode_or_are_protocol_error(seed, mutations):
    data = bytearray(seed)
    for op, pos, chunk in mutations:
        pos %= max(1, len(data))
        if op == "flip" and data:
            data[pos] ^= chunk[0] or 0xFF
        elif op == "insert":
            data[pos:pos] = chunk
        elif op == "delete":
            del data[pos:pos + len(chunk)]
        elif op == "truncate":
            del data[pos:]
        else:
            data[pos:pos] = bytes([0x91]) * (chunk[0] * 20)
    assert_decodes_or_protocol_error(bytes(data))


@FUZZ
@given(st.binary(max_size=400), st.integers(0, 64))
def test_fuzz_check_frame_agrees_with_a_recursive_depth_count(data, max_depth):
    """check_frame's iterative walk against an independent reference: msgspec's own decode of a
    frame it accepts never exceeds the depth (counted recursively on the decoded value)."""
    def depth(v) -> int:
        if isinstance(v, (list, dict)) and v:
            return 1 + max(depth(x) for x in (v.values() if isinstance(v, dict) else v))
        return 0

    try:
        check_frame(data, max_depth=max_depth)
    except ProtocolError:
        return
    try:
        value = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return  # check_frame is a bound on depth and size, not a full validator
    assert depth(value) <= max_depth


dims = st.one_of(st.integers(0, 4), st.sampled_from([0, 2**31, 2**40, 2**62, 2**63 - 1]))


@FUZZ
@given(
    st.lists(st.tuples(st.sampled_from([*DTYPES_BY_NAME, "int4", ""]), st.lists(dims, max_size=4),
                       st.sampled_from(["a", "b", "c"])), max_size=3),
    st.lists(st.binary(max_size=40), max_size=4),
)
def test_fuzz_frames_to_tensors_gives_valid_tensors_or_protocol_error(specs, frames):
    spec_objs = [TensorSpec(name, dtype, tuple(shape)) for dtype, shape, name in specs]
    if len(frames) == len(spec_objs):  # also try the frame each spec would need, so valid paths run too
        frames = [f if i % 2 else b"\1" * (math.prod(s.shape) * DTYPES_BY_NAME[s.dtype].itemsize)
                  if s.dtype in DTYPES_BY_NAME and math.prod(s.shape) < 64 else f
                  for i, (s, f) in enumerate(zip(spec_objs, frames))]
    try:
        out = frames_to_tensors(spec_objs, [memoryview(f) for f in frames])
    except ProtocolError:
        return
    assert list(out) == [s.name for s in spec_objs]
    for spec, frame in zip(spec_objs, frames):
        tensor = out[spec.name]
        assert tuple(tensor.shape) == spec.shape and tensor.dtype == DTYPES_BY_NAME[spec.dtype]
        assert tensor.numel() * tensor.element_size() == len(frame)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["queries", "prompts", "references", "labels", "images", "request_id", "x"]), inner,
        max_size=5),
    max_leaves=30,
)


@FUZZ
@given(st.one_of(st.binary(max_size=300), json_values.map(lambda v: json.dumps(v).encode())), st.booleans())
def test_fuzz_http_body_parser_gives_a_request_or_value_error(raw, needs_reference):
    try:
        request = _request_from_json(raw, needs_reference=needs_reference)
    except ValueError:
        return
    assert isinstance(request, protocols.RewardRequest)
    # What the service would put on the wire encodes and decodes back unchanged.
    assert protocols.decode(protocols.encode(request), protocols.RewardRequest) == request
    if needs_reference:
        assert all(item.reference for item in request.items)


@pytest.mark.parametrize("reply", [b"[" * 100_000 + b"]" * 100_000, b'{"rewards": [1e400]}',
                                   b'{"rewards": [' + b"9" * 400 + b"]}", b'{"rewards": "x"}', b"\xff\xfe"])
def test_item6_a_bad_http_reply_fails_that_remote_reward_call_with_remote_reward_error(reply):
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from streamrft.rewards.remote import RemoteRewardClient, RemoteRewardError

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            return None

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    async def call():
        client = RemoteRewardClient(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=5.0, retries=0)
        try:
            return await client.score([protocols.RewardItem(sample_id="s", prompt="", response="3", reference="3")])
        finally:
            await client.close()

    try:
        out = asyncio.run(call())
    finally:
        server.shutdown()
        server.server_close()
    assert len(out) == 1 and isinstance(out[0], RemoteRewardError), out
    # inf is a number JSON may spell (1e400): that sample fails as non-finite; the others are malformed
    assert ("gave no finite reward" if reply.startswith(b'{"rewards": [1e') else "malformed reply") in str(out[0])
