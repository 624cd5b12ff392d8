"""Cross-section checks. Each ``validate_*`` only raises ConfigError naming the key and the fix."""

from __future__ import annotations

from pathlib import Path

from streamrft.config.base import ConfigError
from streamrft.config.train import HEAD_KERNELS


def validate_rollout(cfg, world_size: int) -> None:
    r = cfg.rollout
    if r.n_samples_per_prompt < 1:
        raise ConfigError(f"rollout.n_samples_per_prompt={r.n_samples_per_prompt} must be >= 1")
    if r.prompts_per_step < 1:
        raise ConfigError(f"rollout.prompts_per_step={r.prompts_per_step} must be >= 1")
    if r.prompts_per_step % world_size != 0:
        raise ConfigError(
            f"rollout.prompts_per_step={r.prompts_per_step} is not divisible by world_size={world_size}; "
            f"set rollout.prompts_per_step to a multiple of {world_size}"
        )
    if r.channel_capacity < r.n_samples_per_prompt:
        raise ConfigError(
            f"rollout.channel_capacity={r.channel_capacity} is smaller than one prompt group "
            f"(rollout.n_samples_per_prompt={r.n_samples_per_prompt}); raise rollout.channel_capacity"
        )
    if r.stage_timeout_s <= 0:
        raise ConfigError(f"rollout.stage_timeout_s={r.stage_timeout_s} must be > 0")
    if r.channel_transport not in ("inproc", "ipc", "tcp"):
        raise ConfigError(f"rollout.channel_transport={r.channel_transport!r}: choose inproc, ipc or tcp")
    from streamrft.config.rollout import validate_rollout_runtime

    validate_rollout_runtime(cfg, world_size)


def validate_sampling(e) -> None:
    """Sampling settings no engine can run (every engine calls this on its EngineConfig)."""
    if e.temperature <= 0:
        raise ConfigError(f"engine.temperature={e.temperature} must be > 0; use engine.top_k=1 for greedy")
    if not 0.0 < e.top_p <= 1.0:
        raise ConfigError(f"engine.top_p={e.top_p} must be in (0, 1]")
    if e.top_k < 0:
        raise ConfigError(f"engine.top_k={e.top_k} must be >= 0 (0 = off)")
    if e.max_new_tokens < 1:
        raise ConfigError(f"engine.max_new_tokens={e.max_new_tokens} must be >= 1")
    if e.max_batch_size < 1:
        raise ConfigError(f"engine.max_batch_size={e.max_batch_size} must be >= 1")
    if e.first_token_temperature < 0:
        raise ConfigError(f"engine.first_token_temperature={e.first_token_temperature} must be >= 0 (0 = off)")


def validate_engine(cfg) -> None:
    """Engine settings that no run can use (the engines check them again when built, for direct users)."""
    e = cfg.engine
    validate_sampling(e)
    if e.cuda_graphs and not e.static_cache:
        raise ConfigError("engine.cuda_graphs=true needs engine.static_cache=true (graphs replay a decode step "
                          "over the preallocated KV cache)")
    if e.kernel_warmup is True:
        import torch

        from streamrft.config.engine import kernel_warmup_enabled

        device = "cuda" if torch.cuda.is_available() else "cpu"  # the engine's device, as the learner's
        if not kernel_warmup_enabled(e, device):
            raise ConfigError(
                "engine.kernel_warmup=true compiles the hf engine's Triton decode kernels ahead, and this run "
                f"launches none (engine.type={e.type}, engine.static_cache={e.static_cache}, engine.decode_kernels="
                f"{e.decode_kernels}, device {device}; they run with engine.type=hf, static_cache=true and "
                "decode_kernels auto or triton on a GPU): leave engine.kernel_warmup at auto")
    if e.sleep_level not in (1, 2):
        raise ConfigError(f"engine.sleep_level={e.sleep_level} must be 1 (free the KV cache) or 2 (also release weights)")
    if e.sync_every < 1:
        raise ConfigError(f"engine.sync_every={e.sync_every} must be >= 1")
    if e.request_timeout_s <= 0:
        raise ConfigError(f"engine.request_timeout_s={e.request_timeout_s} must be > 0")
    if e.type == "vllm":
        if e.first_token_temperature > 0:
            raise ConfigError(f"engine.first_token_temperature={e.first_token_temperature} is not supported by "
                              "engine.type=vllm (no per-step temperature); set it to 0 or use engine.type=hf")
        if e.tensor_parallel_size < 1:
            raise ConfigError(f"engine.tensor_parallel_size={e.tensor_parallel_size} must be >= 1")
        if not 0.0 < e.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"engine.gpu_memory_utilization={e.gpu_memory_utilization} must be in (0, 1]")
        if e.kv_cache_memory_bytes < 0 or e.max_model_len < 0:
            raise ConfigError("engine.kv_cache_memory_bytes and engine.max_model_len must be >= 0 (0 = derive)")
    if e.type == "sglang":
        if not e.address.startswith(("http://", "https://")):
            raise ConfigError(f"engine.address={e.address!r}: engine.type=sglang is a client of a running SGLang "
                              "server; set engine.address to its URL, e.g. http://127.0.0.1:30000")
        if e.top_k > 1 or e.top_p < 1.0:
            raise ConfigError(f"engine.top_k={e.top_k}, engine.top_p={e.top_p}: SGLang reports log-probs before "
                              "top-k/top-p truncation; set engine.top_k=0 (or 1 for greedy) and engine.top_p=1")
        if e.weight_group_server_ranks < 1:
            raise ConfigError(f"engine.weight_group_server_ranks={e.weight_group_server_ranks} must be >= 1")
    if e.type == "vllm" and e.address and not e.address.startswith(("http://", "https://")):
        raise ConfigError(f"engine.address={e.address!r} must be a vLLM server URL (http://host:port) or empty "
                          "(vLLM in process)")


def validate_engine_packages(cfg) -> None:
    """An engine that runs in this process needs its package installed (found without importing it)."""
    import importlib.util

    e = cfg.engine
    if e.type == "vllm" and not e.address and importlib.util.find_spec("vllm") is None:
        raise ConfigError("engine.type=vllm runs vLLM in this process, but the vllm package is not installed; "
                          "install the extra (pip install 'streamrft[vllm]', see docs/engines.md) or set "
                          "engine.address to a running vLLM server")


def validate_train(cfg) -> None:
    t = cfg.train
    if t.max_steps < 0:
        raise ConfigError(f"train.max_steps={t.max_steps} must be >= 0")
    if t.lr <= 0:
        raise ConfigError(f"train.lr={t.lr} must be > 0")
    if len(t.adam_betas) != 2 or not all(0 <= b < 1 for b in t.adam_betas):
        raise ConfigError(f"train.adam_betas={t.adam_betas} must be two numbers in [0, 1)")
    if t.micro_batch_tokens < 1:
        raise ConfigError(f"train.micro_batch_tokens={t.micro_batch_tokens} must be >= 1")
    if not 0.0 <= t.activation_memory_budget <= 1.0:
        raise ConfigError(f"train.activation_memory_budget={t.activation_memory_budget} must be in [0, 1] (1 = off)")
    if t.activation_memory_budget < 1.0 and t.compile_layers == "auto":
        import torch

        if not torch.cuda.is_available():  # the learner runs on the CPU: auto leaves its layers eager
            raise ConfigError(
                f"train.activation_memory_budget={t.activation_memory_budget} applies to the compiled decoder layers, "
                "and train.compile_layers=auto compiles them on a GPU only (this machine has none): set "
                "train.compile_layers=true to compile them on the CPU, or leave the budget at 1")
    if t.compile_warmup is True:
        import torch

        from streamrft.config.train import compile_warmup_enabled

        device = "cuda" if torch.cuda.is_available() else "cpu"  # the learner's device (runtime/distributed.py)
        if not compile_warmup_enabled(t, device):
            raise ConfigError(
                f"train.compile_warmup=true warms the learner's compiles, and this learner compiles nothing on {device} "
                f"(train.compile_layers={t.compile_layers}, train.compile_head={t.compile_head}: the head compiles on a "
                "GPU only, the layers with train.compile_layers=true or auto on a GPU): set train.compile_layers=true "
                "or leave train.compile_warmup at auto")
    if t.mini_batches_per_step < 1 or t.ppo_epochs < 1:
        raise ConfigError("train.mini_batches_per_step and train.ppo_epochs must be >= 1")
    if t.head_kernel not in HEAD_KERNELS:
        raise ConfigError(f"train.head_kernel={t.head_kernel!r} must be one of: {', '.join(HEAD_KERNELS)}")
    if t.head_chunk_tokens != "auto" and (isinstance(t.head_chunk_tokens, bool) or t.head_chunk_tokens < 1):
        raise ConfigError(f"train.head_chunk_tokens={t.head_chunk_tokens!r} must be auto or an integer >= 1")
    if cfg.rollout.prompts_per_step % t.mini_batches_per_step != 0:
        raise ConfigError(
            f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} is not divisible by "
            f"train.mini_batches_per_step={t.mini_batches_per_step}"
        )


# (key, lowest allowed value, whether the lowest is excluded): numeric settings whose other checks live nowhere else.
# A value below would fail late (log_every=0 divides by zero at the first step's log, after the model load) or
# silently (eval_size=-1 would drop the last held-out row, a negative weight decay grow the weights).
_LOWER_BOUNDS = (
    ("data.max_prompt_tokens", 1, False), ("data.eval_size", 0, False),
    ("train.warmup_steps", 0, False), ("train.weight_decay", 0.0, False), ("train.adam_eps", 0.0, True),
    ("train.grad_clip", 0.0, False), ("train.eval_every", 0, False), ("train.log_every", 1, False),
    ("metrics.port", 0, False), ("metrics.progress_log_every_s", 0.0, False),
    ("warmup.steps", 0, False), ("warmup.lr", 0.0, True), ("warmup.batch_size", 1, False),
)


def validate_lower_bounds(cfg) -> None:
    for key, low, exclusive in _LOWER_BOUNDS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value < low or (exclusive and value == low):
            raise ConfigError(f"{key}={value} must be {'>' if exclusive else '>='} {low}")
    if cfg.metrics.port > 65535:
        raise ConfigError(f"metrics.port={cfg.metrics.port} must be a TCP port (0 = off, at most 65535)")


def validate_model(cfg) -> None:
    """Every model path is a local Hugging Face directory or a hub id in the local cache (streamrft.models.hub)."""
    from streamrft.models.hub import resolve_model_dir

    if not cfg.model.path:
        raise ConfigError("model.path is empty; set it to a Hugging Face model directory or a cached hub id "
                          "(for the arith demo, `make demo` or pipelines/arith/prepare.py builds one in runs/arith/sft)")
    for key in ("path", "reference_path", "critic_path"):
        value = getattr(cfg.model, key)
        if value:
            try:
                resolve_model_dir(value, f"model.{key}")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None


def validate_data(cfg) -> None:
    from streamrft.data.chat import check_chat_setting
    from streamrft.data.rows import datasets_missing_error, is_datasets_source

    d = cfg.data
    if not d.train_path:
        raise ConfigError("data.train_path is empty; set it to a jsonl, parquet or arrow file of prompts (or a datasets "
                          "save_to_disk directory)")
    for key in ("train_path", "eval_path"):
        value = getattr(d, key)
        if value and is_datasets_source(value):
            if datasets_missing_error(value):
                raise ConfigError(f"data.{key}: {datasets_missing_error(value)}")
        elif value and not Path(value).exists():
            raise ConfigError(f"data.{key}={value} does not exist")
    try:
        check_chat_setting(d.chat_template)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if d.system_prompt and d.chat_template == "none":
        raise ConfigError("data.system_prompt is set but data.chat_template=none; a system prompt is rendered into "
                          "message prompts with a chat template: set data.chat_template=auto or clear data.system_prompt")
    validate_video(cfg)
    validate_chat_template_present(cfg)


def validate_video(cfg) -> None:
    """Video settings, and PyAV present when the first training row's video field names a video file (a frame
    list needs no decoder): told before start, not when the first group is admitted."""
    from streamrft.data.media import VIDEO_EXTRA_HINT, have_video_decoder, split_videos
    from streamrft.data.rows import first_row, needs_datasets_library

    d = cfg.data
    if d.max_video_frames < 0:
        raise ConfigError(f"data.max_video_frames={d.max_video_frames} must be >= 0 (0 keeps every frame)")
    if d.video_fps < 0:
        raise ConfigError(f"data.video_fps={d.video_fps} must be >= 0 (0 keeps every decoded frame)")
    if not d.video_field or needs_datasets_library(d.train_path) or have_video_decoder():
        return
    row = first_row(d.train_path)
    value = row.get(d.video_field) if isinstance(row, dict) else None
    files = [v for v in split_videos(value) if isinstance(v, str)]
    if files:
        raise ConfigError(f"data.train_path={d.train_path}: row 0 field {d.video_field!r} holds the video file "
                          f"{files[0]!r}, and decoding video files needs PyAV, which is not installed; "
                          f"{VIDEO_EXTRA_HINT}, or give each video as a list of frame images")


def validate_chat_template_present(cfg) -> None:
    """Message prompts (judged by the first training row): with data.chat_template=auto the tokenizer must have a
    chat template, and no media field may be set (the processor path takes text): told now, from the tokenizer
    files alone, not after the model is loaded."""
    from streamrft.data.chat import is_messages
    from streamrft.data.formats import field_mapping, get_field, written_roles
    from streamrft.data.rows import first_row, needs_datasets_library
    from streamrft.models.hub import resolve_model_dir

    d = cfg.data
    if not cfg.model.path or needs_datasets_library(d.train_path):
        return
    row = first_row(d.train_path)  # one row, not the whole file
    if row is None:
        return
    try:
        _, fields = field_mapping(d.format, row, d.prompt_field, d.reference_field, d.label_field,
                                  written_roles(getattr(cfg, "_written", None)))
    except ValueError:
        return
    if not is_messages(get_field(row, fields["prompt"], None)):
        return
    media = [f"data.{k}" for k in ("image_field", "video_field", "audio_field") if getattr(d, k)]
    if media:  # message prompts carry their media as content parts; refused now rather than group by group
        raise ConfigError(f"data.train_path={d.train_path}: row 0 field {fields['prompt']!r} is a list of messages, "
                          f"which take their media as content parts ({{'type': 'image', 'image': PATH}}, ...), not "
                          f"{', '.join(media)}; clear {', '.join(media)} or give the prompts as text")
    from streamrft.data.chat import has_media_parts

    parts = has_media_parts(get_field(row, fields["prompt"], None))
    try:
        model_dir = Path(resolve_model_dir(cfg.model.path, "model.path"))
    except ValueError:  # reported by validate_model
        return
    if parts:
        where = f"data.train_path={d.train_path}: row 0 field {fields['prompt']!r} has image / video / audio message parts"
        if cfg.rollout.placement == "async":  # as with data.*_field media (config.rollout)
            raise ConfigError(f"{where}; rollout.placement=async does not carry media prompts yet; use "
                              "placement=colocated")
        if cfg.env.name:  # as with data.*_field media (config.env)
            raise ConfigError(f"{where}; env.name with media prompts is not supported yet: episodes render text "
                              "observations after text prompts")
        model_type = _model_type(model_dir)
        if model_type is not None and model_type not in ("qwen2_vl", "qwen2_audio"):
            raise ConfigError(f"{where}, but model.path={cfg.model.path} is a text-only model "
                              f"({model_type}); set model.path to a Qwen2-VL or Qwen2-Audio model, or drop the media")
    if d.chat_template != "auto":
        return
    if parts and any((model_dir / name).is_file() for name in ("chat_template.json", "chat_template.jinja")):
        return  # the processor's own template renders the media parts
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (ValueError, OSError):  # a bad row or model path: reported with its row by the loaders
        return
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"data.train_path={d.train_path}: row 0 field {fields['prompt']!r} is a list of messages, "
                          f"but the tokenizer of model.path={cfg.model.path} has no chat template; set "
                          "data.chat_template to a Jinja template file, or give text prompts")


def _model_type(model_dir: Path) -> str | None:
    """config.json's model_type, None when it cannot be read (the model loader reports that)."""
    import json

    try:
        return json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def validate_all(cfg, world_size: int, check_paths: bool = True) -> None:
    """Settings first (they need nothing on disk), then files and packages (model, data, reward
    models and custom reward functions, the engine's package)."""
    from streamrft.algorithms.validate import validate_algorithm
    from streamrft.config.checkpoint import validate_checkpoint
    from streamrft.learner.lora import validate_lora
    from streamrft.rewards.validate import validate_reward, validate_reward_paths

    from streamrft.config.variants import validate_variants

    validate_rollout(cfg, world_size)
    validate_engine(cfg)
    validate_checkpoint(cfg)
    validate_train(cfg)
    validate_lower_bounds(cfg)
    try:
        validate_lora(cfg.model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.model.critic_path and cfg.algorithm.advantage_estimator != "gae":
        raise ConfigError(
            f"model.critic_path={cfg.model.critic_path} is set but algorithm.advantage_estimator="
            f"{cfg.algorithm.advantage_estimator} does not use a critic; set advantage_estimator=gae or clear critic_path"
        )
    if cfg.train.critic_lr <= 0:
        raise ConfigError(f"train.critic_lr={cfg.train.critic_lr} must be > 0")
    validate_algorithm(cfg)
    validate_reward(cfg)
    # After the value checks, whose messages are more specific (engine_ranks=0 must be >= 1).
    validate_variants(cfg, getattr(cfg, "_written", None))
    if check_paths:
        validate_engine_packages(cfg)
        validate_model(cfg)
        validate_data(cfg)
        validate_reward_paths(cfg)
        validate_reward_functions(cfg)


def validate_reward_functions(cfg) -> None:
    """Import each custom reward function's module or file and look its name up now, not after the
    model is loaded (the import runs the module's top-level code, as the scorer's would)."""
    from streamrft.rewards.custom import load_reward_function

    for i, src in enumerate(cfg.reward.sources):
        if src.type != "custom":
            continue
        try:
            load_reward_function(src.fn)
        except ValueError as exc:  # malformed spec, missing module or file, missing name
            raise ConfigError(f"reward.sources[{i}] ({src.name!r}): {exc}") from None
        except Exception as exc:  # the module's own code failed while importing: as fatal as a missing name
            raise ConfigError(f"reward.sources[{i}] ({src.name!r}): importing {src.fn.rpartition(':')[0]} for "
                              f"{src.fn!r} failed: {type(exc).__name__}: {exc}") from None
        from streamrft.rewards.sources import load_source_function

        load_source_function(src)  # its signature fits reward.sources[].convention (ConfigError naming the source)
