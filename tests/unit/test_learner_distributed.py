"""World-size-1 distributed helpers, in process."""

import pytest
import torch

from streamrft.runtime.distributed import (all_reduce_max, all_reduce_sum, barrier, destroy_distributed,
                                           init_distributed)


@pytest.fixture
def no_torchrun_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_without_torchrun_env_a_one_rank_gloo_group_is_created_and_collectives_are_identities(no_torchrun_env):
    try:
        info = init_distributed(timeout_s=30)
        assert (info.rank, info.world_size, info.local_rank, info.backend) == (0, 1, 0, "gloo")
        assert info.device == torch.device("cpu")
        assert init_distributed(timeout_s=30) == info, "a second call returns the same group"
        t = torch.tensor([1.5, -2.0])
        s, m = all_reduce_sum(t), all_reduce_max(t)
        assert torch.equal(s, t) and torch.equal(m, t) and s is not t
        barrier("solo", timeout_s=1)
    finally:
        destroy_distributed()


def test_bad_timeout_or_env_is_a_value_error_naming_the_fix(no_torchrun_env, monkeypatch):
    with pytest.raises(ValueError, match="timeout_s=0"):
        init_distributed(timeout_s=0)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x'"):
        init_distributed()


def test_with_cuda_the_group_sends_cpu_tensors_over_gloo_and_cuda_tensors_over_nccl(no_torchrun_env, monkeypatch):
    """The driver's agreements and step statistics are CPU tensors; a NCCL-only group (what ``"nccl"`` gives:
    torch maps it to CUDA alone) rejects them at world size > 1, so with CUDA both backends are named. No GPU
    here: torch's init is replaced by a recorder (its documented ``device:backend`` string is the contract)."""
    import torch.distributed as dist

    seen = []

    class Stop(Exception):
        pass

    def record(backend, **kwargs):
        seen.append(backend)
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(dist, "init_process_group", record)
    for env in ({}, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}):  # alone, then under torchrun
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(Stop):
            init_distributed(timeout_s=30)
    pairs = [dict(pair.split(":") for pair in backend.split(",")) for backend in seen]
    assert pairs == [{"cpu": "gloo", "cuda": "nccl"}] * 2
