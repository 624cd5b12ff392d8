"""A train step out of device memory: the error names the rank, the microbatch and the settings that lower the
learner's peak which the run has not set (learner/memory.out_of_memory_advice, ActorUpdate.train_step)."""

import pytest
import torch

from streamrft.config import load_config
from streamrft.learner.actor import ActorUpdate
from streamrft.learner.fsdp2 import FSDP2Strategy
from streamrft.learner.memory import out_of_memory_advice
from streamrft.learner.synthetic import synthetic_batch
from streamrft.runtime.distributed import all_reduce_sum

GIB = 1024 ** 3


def _cfg(*extra, model_dir="unused"):
    return load_config(None, [f"model.path={model_dir}", "model.dtype=float32", "train.micro_batch_tokens=48", *extra])


def test_the_advice_names_the_rank_microbatch_peak_and_every_setting_not_yet_taken():
    msg = out_of_memory_advice(_cfg(), rank=3, world_size=1, device_type="cuda", largest_microbatch_tokens=24576,
                               peak_bytes=int(72.4 * GIB), total_bytes=int(79.2 * GIB))
    assert msg.startswith("rank 3: the train step ran out of cuda memory in a microbatch of up to 24576 tokens "
                          "(peak 72.4 GiB allocated of the device's 79.2 GiB)")
    for setting in ("train.micro_batch_tokens (now 48;", "train.head_chunk_tokens=2048 (now 4096;",
                    "train.activation_memory_budget=0.5",
                    "train.reshard_after_forward=true", "model.gradient_checkpointing=true",
                    "train.optimizer_offload=true"):
        assert setting in msg, setting


def test_the_advice_leaves_out_what_the_run_already_set_or_cannot_use():
    taken = _cfg("train.activation_memory_budget=0.5", "train.reshard_after_forward=true",
                 "model.gradient_checkpointing=true", "train.optimizer_offload=true", "train.head_chunk_tokens=1024")
    msg = out_of_memory_advice(taken, 0, 1, "cuda", 10, 0, 0)
    assert msg.endswith("Settings that lower the learner's peak: train.micro_batch_tokens (now 48; the peak's "
                        "activations scale with it).")
    # several ranks reshard by default; on a CPU the layers are not compiled, so no activation budget; deepspeed
    # has neither FSDP2 setting nor the FSDP2 optimizer offload
    assert "reshard_after_forward" not in out_of_memory_advice(_cfg(), 0, 2, "cuda", 10, 0, 0)
    assert "activation_memory_budget" not in out_of_memory_advice(_cfg(), 0, 1, "cpu", 10, 0, 0)
    # the checkpoint head kernel's own chunk is 1024 already; a chunk set above it is halved from there
    assert "head_chunk_tokens" not in out_of_memory_advice(_cfg("train.head_kernel=checkpoint"), 0, 1, "cuda", 10, 0, 0)
    assert "train.head_chunk_tokens=1536 (now 3072;" in out_of_memory_advice(
        _cfg("train.head_kernel=checkpoint", "train.head_chunk_tokens=3072"), 0, 1, "cuda", 10, 0, 0)
    deepspeed = out_of_memory_advice(_cfg("train.strategy=deepspeed"), 0, 1, "cuda", 10, 0, 0)
    assert "reshard_after_forward" not in deepspeed and "optimizer_offload" not in deepspeed


def test_a_train_step_out_of_memory_raises_the_advice_chained_to_the_allocators_error(dist, model_dir, monkeypatch):
    cfg = _cfg(model_dir=model_dir)
    strategy = FSDP2Strategy(cfg.model, cfg.train, dist, total_steps=2)
    actor = ActorUpdate(strategy, None, cfg, all_reduce_sum)
    batch = synthetic_batch(6, 5, 11, strategy.module.config.vocab_size, 3, seed=1)
    largest = max(mb["input_ids"].numel() for mb in actor._microbatches(batch))
    real = strategy.forward_backward
    calls = []

    def second_microbatch_fails(mb, *args, **kwargs):  # a CUDA allocator cannot fail here: its error, stood in for
        calls.append(mb["input_ids"].numel())
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 420.00 MiB.")
        return real(mb, *args, **kwargs)

    monkeypatch.setattr(strategy, "forward_backward", second_microbatch_fails)
    with pytest.raises(torch.OutOfMemoryError) as info:
        actor.train_step(batch)
    assert len(calls) == 2 and largest > 0
    assert str(info.value).startswith(f"rank 0: the train step ran out of cpu memory in a microbatch of up to "
                                      f"{largest} tokens")
    assert "train.micro_batch_tokens (now 48;" in str(info.value)
    assert str(info.value.__cause__) == "CUDA out of memory. Tried to allocate 420.00 MiB."
