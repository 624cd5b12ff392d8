"""Media fields of dataset rows: images, videos, audio, references and remote-reward encoding."""

import base64
import hashlib
import sys

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from streamrft.data.media import (
    MediaError,
    MediaRef,
    decode_audio,
    decode_image,
    decode_video,
    encode_images_once,
    make_ref,
    read_ref,
    resample,
    where,
)

LOC = where("train.jsonl", 3, "image")


@pytest.fixture
def png(tmp_path):
    arr = (np.arange(12 * 10 * 3) % 251).astype(np.uint8).reshape(12, 10, 3)
    path = tmp_path / "a.png"
    Image.fromarray(arr).save(path)
    return path, arr


def test_an_image_decodes_identically_from_path_bytes_data_uri_and_dict(png):
    path, arr = png
    data = path.read_bytes()
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    for value in (str(path), data, uri, {"path": str(path)}, {"bytes": data, "path": None}):
        np.testing.assert_array_equal(np.asarray(decode_image(value, LOC)), arr)


def test_a_missing_image_file_names_file_row_and_field(tmp_path):
    with pytest.raises(MediaError) as e:
        decode_image(str(tmp_path / "nope.png"), LOC)
    assert str(e.value) == (f"train.jsonl row 3 field 'image': image file '{tmp_path / 'nope.png'}' does not exist; "
                            "fix the path or drop the row")


def test_a_corrupt_image_file_is_reported_with_its_path(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image at all")
    with pytest.raises(MediaError) as e:
        decode_image(str(bad), LOC)
    assert str(e.value) == (f"train.jsonl row 3 field 'image': cannot decode '{bad}' as an image "
                            "(UnidentifiedImageError); re-encode it as PNG or JPEG")


def test_a_wrong_media_type_in_an_image_field_is_rejected():
    with pytest.raises(MediaError) as e:
        decode_image(42, LOC)
    assert str(e.value) == ("train.jsonl row 3 field 'image': expected an image (path, bytes, base64 data URI or "
                            "{'path'|'bytes': ...}), got int")


def test_a_video_of_frame_paths_decodes_and_mixed_frame_sizes_are_rejected(tmp_path, png):
    path, arr = png
    frames = decode_video([str(path), str(path), str(path)], LOC, max_frames=2)
    assert len(frames) == 2 and frames[0].size == (10, 12)
    other = tmp_path / "b.png"
    Image.new("RGB", (5, 5)).save(other)
    with pytest.raises(MediaError, match=r"video frames have different sizes \[\(5, 5\), \(10, 12\)\]"):
        decode_video([str(path), str(other)], LOC)


def test_a_video_file_without_a_decoder_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # as if the video extra (PyAV) were not installed
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"\x00" * 16)
    with pytest.raises(MediaError) as e:
        decode_video(str(clip), LOC)
    assert str(e.value) == (f"train.jsonl row 3 field 'image': decoding the video file '{clip}' needs PyAV, which is "
                            "not installed; pip install 'streamrft[video]' (PyAV), or give the video as a list of "
                            "frame images")


def test_resampling_a_sine_keeps_its_frequency():
    t8 = np.arange(8000) / 8000
    out = resample(np.sin(2 * np.pi * 300 * t8).astype(np.float32), 8000, 16000)
    assert len(out) == 16000
    expected = np.sin(2 * np.pi * 300 * np.arange(16000) / 16000)
    assert np.abs(out[:-2] - expected[:-2]).max() < 0.02  # linear interpolation error at 300 Hz / 8 kHz


def test_stereo_wav_audio_is_mixed_to_mono_and_resampled(tmp_path):
    left = np.linspace(-0.5, 0.5, 800, dtype=np.float32)
    path = tmp_path / "a.wav"
    sf.write(path, np.stack([left, 0 * left], axis=1), 8000, subtype="FLOAT")
    wave = decode_audio(str(path), 16000, where("train.jsonl", 0, "audio"))
    assert wave.shape == (1600,)
    np.testing.assert_allclose(wave[::2], left / 2, atol=1e-6)


def test_a_corrupt_audio_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF garbage")
    with pytest.raises(MediaError) as e:
        decode_audio(str(bad), 16000, where("x.jsonl", 1, "audio"))
    assert str(e.value) == (f"x.jsonl row 1 field 'audio': cannot decode '{bad}' as audio (LibsndfileError); "
                            "convert it to wav or flac")


def test_a_media_ref_carries_the_content_hash_and_detects_a_changed_file(png):
    path, _ = png
    ref = make_ref(str(path), "image")
    assert ref.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert MediaRef.from_dict(ref.to_dict()) == ref
    assert read_ref(ref) == path.read_bytes()
    path.write_bytes(path.read_bytes() + b"x")
    with pytest.raises(MediaError, match="changed since it was referenced"):
        read_ref(ref)


def test_encode_images_once_encodes_each_distinct_image_once_and_skips_audio(tmp_path, png):
    path, _ = png
    other = tmp_path / "c.png"
    Image.new("RGB", (4, 4), "red").save(other)
    wav = tmp_path / "a.wav"
    sf.write(wav, np.zeros(10, dtype=np.float32), 8000)
    refs = [make_ref(str(path), "image"), make_ref(str(wav), "audio"), make_ref(str(other), "image"),
            make_ref(str(path), "image")]
    out = encode_images_once(refs)
    assert out == [base64.b64encode(path.read_bytes()).decode(), base64.b64encode(other.read_bytes()).decode()]
