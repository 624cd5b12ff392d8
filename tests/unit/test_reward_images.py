"""Reward requests carry a sample's images: base64, each distinct image once, in every transport."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io

from PIL import Image

from protocols import Completion, MediaRef, RewardItem
from streamrft.rewards.custom import RewardFunction
from streamrft.rewards.service import _request_from_json as parse_http_body
from streamrft.runtime.scoring import _images_of


def png(path, colour) -> MediaRef:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), colour).save(buf, format="PNG")
    path.write_bytes(buf.getvalue())
    return MediaRef(path=str(path), sha256=hashlib.sha256(buf.getvalue()).hexdigest(), kind="image")


def completion(media) -> Completion:
    return Completion(sample_id="s", group_id="g", step=0, prompt_index=0, sample_index=0, prompt_text="p",
                      response_text="r", n_samples=1, finish_reason="stop", policy_version=0, prompt_len=1,
                      response_len=1, media=media)


def test_a_completions_images_are_encoded_once_each_and_decode_to_the_files(tmp_path):
    red, blue = png(tmp_path / "r.png", "red"), png(tmp_path / "b.png", "blue")
    images = _images_of(completion([red, blue, red]))
    assert [base64.b64decode(b) for b in images] == [(tmp_path / "r.png").read_bytes(), (tmp_path / "b.png").read_bytes()]
    assert _images_of(completion([])) == []


def test_a_custom_function_that_asks_for_images_receives_them():
    seen = []

    def fn(response, reference, images):
        seen.append(images)
        return float(len(images))

    item = RewardItem(sample_id="s", prompt="p", response="r", images=["aGk=", "aG8="])
    assert asyncio.run(RewardFunction(fn, "img").score([item])) == [2.0]
    assert seen == [["aGk=", "aG8="]]


def test_the_http_body_carries_one_list_of_images_per_query():
    body = b'{"queries": ["p1r", "p2r"], "prompts": ["p1", "p2"], "images": [["aGk="], []]}'
    request = parse_http_body(body)
    assert [it.images for it in request.items] == [["aGk="], []]
