"""Messages between the stages of one rank's pipeline, and the trajectory record for sinks.

Token ids and log-probs travel as raw tensor frames beside these headers (see TensorSpec); the
fields named ``*_len`` give their lengths so a header alone is enough for accounting.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocols.base import Message, TensorSpec


class MediaRef(msgspec.Struct, frozen=True, kw_only=True):
    """A row's media file by reference: messages carry this, never pixels or samples. The receiver reads
    ``path`` and checks ``sha256`` (streamrft.data.media.read_ref), so a file changed mid-run is an error."""

    path: str  # absolute path readable by every process of the run (shared filesystem)
    sha256: str  # hex digest of the file's bytes at admission
    kind: str  # "image" | "video_frame" (one frame of a frame-list video) | "video" (a video file) | "audio"
    field: str = ""  # dataset row field it came from (for error messages)
    group: int = 0  # video_frame / video: which video of the row this is (frames in order)


class PromptGroup(Message, kw_only=True):
    """One prompt admitted by the Generator, to be sampled ``n_samples`` times.

    Frames: ``prompt_ids`` int64 (prompt_len,).
    """

    group_id: str  # unique per run: "s{step}-p{prompt_index}" (+ "-r{n}" for refills)
    step: int  # the train step this group was admitted for
    prompt_index: int  # global index of the prompt within the step (seeds sampling)
    prompt_text: str
    reference: str = ""  # ground-truth answer for rule rewards; "" when none
    label: str = "default"  # task label: picks the reward sources
    n_samples: int
    prompt_len: int
    data_row: int = -1  # row of the dataset file this prompt came from
    tensors: list[TensorSpec] = []
    media: list[MediaRef] = []  # the row's images / video frames / audio clips, in placeholder order; [] = text
    columns: dict[str, Any] = {}  # the row's other JSON-like fields, for reward functions (RewardItem.columns)


class Completion(Message, kw_only=True):
    """One finished sample from the engine.

    Frames: ``prompt_ids`` int64 (prompt_len,), ``response_ids`` int64 (response_len,),
    ``behaviour_logprobs`` float32 (response_len,): log-probs of the sampled tokens under the
    distribution actually sampled from (after temperature / top-p / top-k).
    """

    sample_id: str  # "{group_id}-{sample_index}"
    group_id: str
    step: int
    prompt_index: int
    sample_index: int
    prompt_text: str
    response_text: str
    reference: str = ""
    label: str = "default"
    n_samples: int
    finish_reason: str  # "stop" (EOS or stop token) | "length" (max_new_tokens)
    policy_version: int  # learner version whose weights generated it
    prompt_len: int
    response_len: int
    generate_seconds: float = 0.0
    tensors: list[TensorSpec] = []
    media: list[MediaRef] = []  # as PromptGroup.media: the learner re-decodes the prompt's media from these
    columns: dict[str, Any] = {}  # as PromptGroup.columns
    # Multi-turn episodes (env.name set; docs/agents.md). turns=0: a single-turn sample, none of these apply.
    # Otherwise the response is every turn after the prompt as one sequence, and a frame ``loss_mask`` uint8
    # (response_len,) is 1 on the model's tokens (trained) and 0 on observation tokens (never trained).
    turns: int = 0  # model turns
    turn_starts: list[int] = []  # response offset of each model turn's first token
    turn_rewards: list[float] = []  # the environment's reward per model turn (summed into the sample's reward)
    observation_roles: list[str] = []  # chat role of each observation span, in order ("tool" | "user")
    env_info: dict[str, float] = {}  # EnvStep.info summed over the episode: tool_calls, tool_errors, tool_seconds
    tool_error_reasons: list[str] = []  # EnvStep.info["tool_error_reason"] of each failed tool call
    error: str = ""  # non-empty: the sample failed before scoring (e.g. "env_error: ..."); it is counted, never trained


class ScoredSample(Message, kw_only=True):
    """A completion with its reward; frames as in Completion, plus ``teacher_logprobs`` float32
    (response_len,) when a teacher is configured."""

    completion: Completion
    reward: float  # aggregated scalar; NaN never travels (a NaN reward fails the sample)
    reward_components: dict[str, float] = {}
    status: str = "ok"  # "ok" | "failed"
    fail_reason: str = ""  # why, when failed
    score_seconds: float = 0.0
    tensors: list[TensorSpec] = []


class MicrobatchHeader(Message, kw_only=True):
    """Header of a learner microbatch: the samples it packs, in order.

    Frames: ``input_ids`` int64 (n_seqs, max_len), ``attention_mask``, ``response_mask``,
    ``behaviour_logprobs``, ``advantages`` float32 (n_seqs, max_len), right-padded.
    """

    step: int
    sample_ids: list[str]
    n_tokens: int  # response tokens (the loss tokens) in this microbatch
    tensors: list[TensorSpec] = []


class TrajectoryRecord(Message, kw_only=True):
    """One trained (or filtered / failed) sample, as written by the trajectory sinks."""

    run_id: str
    rank: int
    step: int
    sample_id: str
    group_id: str
    policy_version: int
    prompt: str
    response: str
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    policy_logprobs: list[float] = []
    entropy: list[float] = []  # per response token, nats
    reward: float = 0.0
    reward_components: dict[str, float] = {}
    advantage: float = 0.0  # sequence-level (first response token's) advantage
    status: str = "trained"  # "trained" | "filtered" | "failed"
    reason: str = ""
    finish_reason: str = ""
    timings: dict[str, float] = {}  # seconds: generate, score, ...
    media: list[MediaRef] = []  # the prompt's media by reference; [] = text-only
    token_versions: list[int] = []  # per response token: the policy version that sampled it
    learner_version: int = -1  # the learner version whose update trained this sample; -1 = not trained
    # multi-turn episodes (Completion.turns > 0); [] for single-turn samples
    loss_mask: list[int] = []  # per response token: 1 = the model's (trained), 0 = an observation's
    turn_starts: list[int] = []  # response offset of each model turn's first token
    turn_rewards: list[float] = []  # the environment's reward per model turn
    observation_roles: list[str] = []  # chat role of each observation span ("tool" | "user")


class Control(Message, kw_only=True):
    """An in-band signal on a stage channel: ``"end_of_step"`` (no more samples for ``step`` from
    this sender), ``"group_done"`` (AdvantageStage -> Generator: a prompt group was kept or filtered,
    so the Generator can refill) or ``"stop"`` (shut down; ``reason`` says why)."""

    signal: str  # "end_of_step" | "group_done" | "stop"
    step: int = -1
    reason: str = ""  # group_done: "kept" or "filtered:<why>"; stop: why
    tensors: list[TensorSpec] = []
    group_id: str = ""  # group_done: which group
    # end_of_step from an engine process (rollout.placement=async), on its copy to learner rank 0: what the
    # engine settled itself since its last report ("admitted", "generated_tokens", "filtered/<reason>",
    # "failed/<reason>") and when it was generating (wall-clock [start, end, start, end, ...] seconds)
    counts: dict[str, int] = {}
    busy: list[float] = []
    first_failures: dict[str, str] = {}  # failure kind -> the first full reason of the step (the failure policy)
