"""Video files (PyAV, the ``video`` extra): frame sampling by timestamp, a file and its frame list giving the
same model inputs, and truncated / missing-decoder errors that name file, row and field."""

import io
import sys
import types

import numpy as np
import pytest
from PIL import Image

av = pytest.importorskip("av")

from streamrft.config.base import ConfigError  # noqa: E402
from streamrft.config.data import DataConfig  # noqa: E402
from streamrft.config.validate import validate_video  # noqa: E402
from streamrft.data.media import MediaError, decode_video_file, sample_frame_times, split_videos  # noqa: E402
from streamrft.models.media_inputs import MediaCodec, load_processor  # noqa: E402
from streamrft.models.vl import build_tiny_qwen2_vl  # noqa: E402

FPS = 4  # source frame rate of the written clips: frame i at t = i / 4 s
N = 6


def _frames():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(N)]


def _encode(frames, fmt, codec, options, pix_fmt):
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=FPS)
        s.width, s.height, s.pix_fmt, s.options = 16, 16, pix_fmt, options
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """A lossless (libx264rgb, qp 0) mp4 of known frames, and the same frames as PNG files."""
    d = tmp_path_factory.mktemp("video")
    frames = _frames()
    mp4 = d / "clip.mp4"
    mp4.write_bytes(_encode(frames, "mp4", "libx264rgb", {"qp": "0", "preset": "ultrafast"}, "rgb24"))
    pngs = []
    for i, f in enumerate(frames):
        pngs.append(str(d / f"f{i}.png"))
        Image.fromarray(f).save(pngs[-1])
    return mp4, pngs, frames


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(build_tiny_qwen2_vl(str(tmp_path_factory.mktemp("vl")), "0123456789abc "))


def test_sampling_by_fps_keeps_the_first_frame_at_or_after_each_tick():
    times = [i / 30 for i in range(31)]  # 1 s at 30 fps
    assert sample_frame_times(times, 2.0) == [0, 15, 30]
    assert sample_frame_times(times, 0.0) == list(range(31))
    assert sample_frame_times([0.0, 0.25, 0.5, 0.75], 10.0) == [0, 1, 2, 3]  # faster than the source: each frame once
    assert sample_frame_times([0.1, 0.5, 0.9, 1.3], 1.0) == [0, 3]  # ticks 0.1, 1.1 (from the first frame time), 2.1 past the end


def test_a_video_field_splits_into_one_value_per_video():
    assert split_videos("a.mp4") == ["a.mp4"]
    assert split_videos(["f0.png", "f1.png"]) == [["f0.png", "f1.png"]]
    assert split_videos(["a.mp4", "b.WEBM"]) == ["a.mp4", "b.WEBM"]
    assert split_videos([["f0.png"], "b.mp4"]) == [["f0.png"], "b.mp4"]


def test_a_lossless_mp4_decodes_to_its_frames_sampled_by_fps_then_capped(clip):
    mp4, _, frames = clip
    data = mp4.read_bytes()
    got = [np.asarray(f) for f in decode_video_file(data, str(mp4), "loc")]
    assert len(got) == N and all((g == f).all() for g, f in zip(got, frames))
    at_2fps = [np.asarray(f) for f in decode_video_file(data, str(mp4), "loc", fps=2.0)]
    assert [next(i for i, f in enumerate(frames) if (f == g).all()) for g in at_2fps] == [0, 2, 4]
    capped = [np.asarray(f) for f in decode_video_file(data, str(mp4), "loc", max_frames=2)]
    assert (capped[0] == frames[0]).all() and (capped[1] == frames[5]).all()


def _row(value):
    return types.SimpleNamespace(row=3, extra={"video": value})


@pytest.mark.parametrize("fps,cap,kept", [(0.0, 0, [0, 1, 2, 3, 4, 5]), (2.0, 0, [0, 2, 4]), (0.0, 2, [0, 5])])
def test_a_video_file_and_its_frame_list_give_the_same_model_inputs(clip, processor, fps, cap, kept):
    mp4, pngs, _ = clip
    codec = MediaCodec(processor, video_field="video", max_video_frames=cap, video_fps=fps)
    file_refs = codec.refs(_row(str(mp4)), "train.jsonl")
    assert [(r.kind, r.group) for r in file_refs] == [("video", 0)]
    from_file = codec.inputs("what moves?", file_refs, "train.jsonl row 3")
    frame_codec = MediaCodec(processor, video_field="video")
    from_frames = frame_codec.inputs("what moves?", frame_codec.refs(_row([pngs[i] for i in kept]), "train.jsonl"),
                                     "train.jsonl row 3")
    assert sorted(from_file) == sorted(from_frames) and "pixel_values_videos" in from_file
    for key in from_file:
        assert from_file[key].equal(from_frames[key]), key
    t = from_file["video_grid_thw"][0, 0].item()
    assert t == (len(kept) + 1) // 2  # temporal patch 2: frames pair up, an odd last frame repeats


def test_a_webm_file_gives_the_inputs_of_its_own_decoded_frames(tmp_path, processor):
    webm = tmp_path / "clip.webm"
    webm.write_bytes(_encode(_frames(), "webm", "libvpx-vp9", {"lossless": "1"}, "yuv444p"))
    decoded = decode_video_file(webm.read_bytes(), str(webm), "loc")  # yuv444p: equal to the source up to rounding
    assert len(decoded) == N
    assert max(np.abs(np.asarray(d, int) - f.astype(int)).max() for d, f in zip(decoded, _frames())) <= 3
    pngs = []
    for i, f in enumerate(decoded):
        pngs.append(str(tmp_path / f"d{i}.png"))
        f.save(pngs[-1])
    codec = MediaCodec(processor, video_field="video")
    a = codec.inputs("x", codec.refs(_row(str(webm)), "t.jsonl"), "t.jsonl row 3")
    b = codec.inputs("x", codec.refs(_row(pngs), "t.jsonl"), "t.jsonl row 3")
    assert all(a[k].equal(b[k]) for k in a)


def test_a_truncated_video_fails_its_sample_naming_file_row_and_field(clip, processor, tmp_path):
    mp4 = clip[0]
    data = mp4.read_bytes()
    codec = MediaCodec(processor, video_field="video")
    for cut, cause in ((len(data) - 200, "'{bad}' is truncated: its stream declares 6 frames but only 0 decode; "),
                       (len(data) // 2, "cannot decode '{bad}' as a video (InvalidDataError")):
        bad = tmp_path / f"cut{cut}.mp4"
        bad.write_bytes(data[:cut])
        refs = codec.refs(_row(str(bad)), "train.jsonl")  # admission hashes the bytes; decoding fails
        with pytest.raises(MediaError) as e:
            codec.inputs("q", refs, "train.jsonl row 3")
        msg = str(e.value)
        assert msg.startswith(f"train.jsonl row 3 field 'video' (media file '{bad}'): " + cause.format(bad=bad)), msg


def test_the_generator_fails_a_truncated_videos_samples_naming_file_row_and_field_and_admits_the_rest(
        clip, tmp_path, caplog):
    """The runtime path: the Generator admits a row whose mp4 is cut short as n failed samples (media_error)
    with the file, row and field in the reason, and the next row's video as a normal group."""
    from streamrft.config import load_config
    from streamrft.data import PromptDataset
    from streamrft.runtime.accounting import Accounting
    from streamrft.runtime.generator import Generator
    from streamrft.runtime.stage import StageContext

    mp4 = clip[0]
    bad = tmp_path / "cut.mp4"
    bad.write_bytes(mp4.read_bytes()[:-200])
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(f'{{"prompt": "what moves?", "reference": "r", "video": "{v}"}}\n' for v in (mp4, bad)))
    vl = build_tiny_qwen2_vl(str(tmp_path / "vl"), "0123456789abc ")
    cfg = load_config(None, [f"model.path={vl}", f"data.train_path={rows}", "data.video_field=video",
                             "data.shuffle=false", "rollout.n_samples_per_prompt=3"])
    ctx = StageContext(rank=0, stage_timeout_s=5.0, accounting=Accounting())
    gen = Generator(ctx, None, None, types.SimpleNamespace(supports_media=True), None,
                    PromptDataset.from_config(rows, cfg.data), cfg, 1, None)
    group, ids = gen._admit(0, 0, None)
    assert [r.kind for r in group.media] == ["video"] and len(ids) == group.prompt_len
    assert gen._admit(0, 1, None) is None
    reason = (f"media_error: {rows} row 1 field 'video' (media file '{bad}'): '{bad}' is truncated: its stream "
              "declares 6 frames but only 0 decode; re-download or re-encode it")
    counts, first = ctx.accounting.take_step_failures(0)
    assert counts == {"media_error": 3} and first == {"media_error": reason}
    # settled at once: admitted and failed (the good group's samples are counted when the step sends them)
    assert ctx.accounting.admitted == 3 and ctx.accounting.failed == {"media_error": 3}
    assert reason.removeprefix("media_error: ") in caplog.text


def test_without_pyav_a_video_file_is_refused_at_validation_and_at_decode(clip, tmp_path, monkeypatch):
    mp4, pngs, _ = clip
    monkeypatch.setitem(sys.modules, "av", None)  # import av -> ImportError
    monkeypatch.setattr("streamrft.data.media.have_video_decoder", lambda: False)
    with pytest.raises(MediaError) as e:
        decode_video_file(mp4.read_bytes(), str(mp4), "train.jsonl row 0 field 'video'")
    assert str(e.value) == (f"train.jsonl row 0 field 'video': decoding the video file '{mp4}' needs PyAV, which is "
                            "not installed; pip install 'streamrft[video]' (PyAV), or give the video as a list of "
                            "frame images")
    rows = tmp_path / "train.jsonl"
    rows.write_text(f'{{"prompt": "p", "video": "{mp4}"}}\n')
    cfg = types.SimpleNamespace(data=DataConfig(train_path=str(rows), video_field="video"))
    with pytest.raises(ConfigError) as e:
        validate_video(cfg)
    assert str(e.value) == (f"data.train_path={rows}: row 0 field 'video' holds the video file '{mp4}', and decoding "
                            "video files needs PyAV, which is not installed; pip install 'streamrft[video]' (PyAV), "
                            "or give each video as a list of frame images")
    rows.write_text('{"prompt": "p", "video": ' + str(pngs).replace("'", '"') + "}\n")
    validate_video(cfg)  # frame lists need no decoder
    with pytest.raises(ConfigError, match=r"data.video_fps=-1.0 must be >= 0"):
        validate_video(types.SimpleNamespace(data=DataConfig(train_path=str(rows), video_field="video", video_fps=-1.0)))


def test_the_codec_built_from_config_samples_as_configured(processor):
    codec = MediaCodec.from_config(processor, DataConfig(video_field="video", max_video_frames=3, video_fps=1.5))
    assert (codec.max_video_frames, codec.video_fps) == (3, 1.5)
