"""train.optimizer_offload (streamrft/learner/host_adamw.py): AdamW with its moments in host memory gives
torch AdamW's numbers bitwise (plain tensors and an FSDP2-sharded model), keeps AdamW's state keys so a checkpoint
loads into either optimizer, and its moments stay put when the learner offloads/reloads (DeepSpeed's refusal:
tests/unit/test_config_variants.py)."""

import torch

from streamrft.config.model import ModelConfig
from streamrft.config.train import TrainConfig
from streamrft.learner.host_adamw import HostAdamW
from streamrft.learner.optim import ShardLocalAdamW, build_optimizer
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2


def _steps(opt, params, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_same_numbers_as_torch_adamw():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    kw = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    mine = build_optimizer(a, TrainConfig(optimizer_offload=True, lr=kw["lr"], adam_betas=kw["betas"],
                                          adam_eps=kw["eps"], weight_decay=kw["weight_decay"]))
    assert isinstance(mine, HostAdamW)
    _steps(mine, a)
    _steps(torch.optim.AdamW(b, foreach=False, **kw), b)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_state_dict_is_adamw_compatible_both_ways():
    torch.manual_seed(1)
    a = [torch.nn.Parameter(torch.randn(4, 4))]
    b = [torch.nn.Parameter(a[0].detach().clone())]
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    host, ref = HostAdamW(a, **kw), torch.optim.AdamW(b, foreach=False, **kw)
    _steps(host, a, 2)
    _steps(ref, b, 2)
    sd = host.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"} and float(sd["state"][0]["step"]) == 2.0
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(sd["state"][0][key], ref.state_dict()["state"][0][key])
    # torch AdamW's checkpoint into HostAdamW and on: the same as AdamW continuing
    c = [torch.nn.Parameter(b[0].detach().clone())]
    cont = HostAdamW(c, **kw)
    cont.load_state_dict(ref.state_dict())
    _steps(cont, c, 2, seed=5)
    _steps(ref, b, 2, seed=5)
    assert torch.equal(c[0], b[0])


def test_fsdp2_full_finetune_matches_adamw_and_moments_stay_on_host(dist, tmp_path):
    from streamrft.learner.fsdp2 import FSDP2Strategy

    tok = build_char_tokenizer(str(tmp_path), "0123456789abcdef")
    path = build_tiny_qwen2(str(tmp_path), tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, max_position_embeddings=64)
    mcfg = ModelConfig(path=path, dtype="float32")
    strategies = [FSDP2Strategy(mcfg, TrainConfig(lr=1e-2, weight_decay=0.01, optimizer_offload=off), dist, 10)
                  for off in (True, False)]
    assert isinstance(strategies[0].optimizer, HostAdamW)
    # torch's AdamW update, on each DTensor's local shard (learner/optim.py)
    assert type(strategies[1].optimizer) is ShardLocalAdamW and isinstance(strategies[1].optimizer, torch.optim.AdamW)
    ids = torch.tensor([[3, 5, 7, 9, 11, 4, 6, 8]])
    for s in strategies:
        for _ in range(3):
            out = s.module(input_ids=ids).logits.float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()
            (-out).backward()
            s.step()
        s.offload()  # learner/memory.py: a no-op on a CPU learner, and never moves HostAdamW's moments
        s.reload()
    host_sd = strategies[0].module.state_dict()
    for k, v in strategies[1].module.state_dict().items():
        assert torch.equal(v.full_tensor(), host_sd[k].full_tensor()), k
    flat0 = strategies[0].optimizer._flat["exp_avg_sq"]
    for st in strategies[0].optimizer.state.values():  # every moment is a view of the one host buffer
        loc = st["exp_avg_sq"].to_local()
        assert loc.device.type == "cpu" and float(st["step"]) == 3.0
        assert flat0.data_ptr() <= loc.data_ptr() < flat0.data_ptr() + flat0.numel() * 4
    ref_st = strategies[1].optimizer.state
    for (p, s_host), (q, s_ref) in zip(strategies[0].optimizer.state.items(), ref_st.items()):
        assert torch.equal(s_host["exp_avg_sq"].full_tensor(), s_ref["exp_avg_sq"].full_tensor())
    # a DCP checkpoint of the host optimizer loads into a fresh one: same moments, in its own flat host buffers
    strategies[0].save(str(tmp_path / "ck"))
    fresh = FSDP2Strategy(mcfg, TrainConfig(lr=1e-2, weight_decay=0.01, optimizer_offload=True), dist, 10)
    fresh.load(str(tmp_path / "ck"))
    flat = fresh.optimizer._flat["exp_avg"]
    for (p, a), (q, b) in zip(strategies[0].optimizer.state.items(), fresh.optimizer.state.items()):
        assert float(b["step"]) == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a[key].full_tensor(), b[key].full_tensor()), key
        loc = b["exp_avg"].to_local()
        assert flat.data_ptr() <= loc.data_ptr() < flat.data_ptr() + flat.numel() * 4  # a view of the buffer
