"""FSDP2 on a vision-language model (world size 1, gloo): the vision tower's blocks and merger are FSDP units
of their own, and ``model.freeze_prefix: [visual.]`` keeps the tower fixed through a real train step while
the language model moves."""

import numpy as np
import pytest
import torch
from PIL import Image

from streamrft.config.model import ModelConfig
from streamrft.config.train import TrainConfig
from streamrft.learner.fsdp2 import FSDP2Strategy, fsdp_unit_names
from streamrft.models.media_inputs import load_processor
from streamrft.models.vl import build_tiny_qwen2_vl, vl_inputs


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_tiny_qwen2_vl(str(tmp_path_factory.mktemp("vl")), "0123456789abc ", num_layers=2, vision_depth=2)


def _strategy(path, dist, freeze):
    mcfg = ModelConfig(path=path, freeze_prefix=list(freeze))
    tcfg = TrainConfig(lr=1e-2, lr_schedule="constant", warmup_steps=0, grad_clip=0.0, strategy="fsdp2")
    return FSDP2Strategy(mcfg, tcfg, dist, total_steps=2)


def _media_microbatch(path):
    """One prompt with a 16x16 image plus a 3-token response, in the learner's microbatch layout."""
    processor = load_processor(path)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8))
    inp = vl_inputs(processor, "1+2", [img], [])
    prompt = inp["input_ids"][0]
    ids = torch.cat([prompt, torch.tensor([5, 6, 7])])[None]
    L, P = ids.shape[1], prompt.shape[0]
    mask = torch.zeros(1, L)
    mask[0, P:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(L)[None],
            "response_mask": mask, "sample_index": torch.tensor([0]), "adv": mask.clone(),
            "pixel_values": inp["pixel_values"], "image_grid_thw": inp["image_grid_thw"]}


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def test_vision_blocks_and_merger_are_fsdp_units_and_visual_prefix_freezes_the_tower(dist, vl_dir):
    strat = _strategy(vl_dir, dist, ["visual."])
    assert fsdp_unit_names(strat.module) == ["", "model.visual.blocks.0", "model.visual.blocks.1",
                                             "model.visual.merger", "model.language_model.layers.0",
                                             "model.language_model.layers.1"]
    named = dict(strat.module.named_parameters())
    frozen = sorted(n for n, p in named.items() if not p.requires_grad)
    assert frozen == sorted(n for n in named if n.startswith("model.visual."))  # the whole tower, nothing else
    before = {n: _full(p) for n, p in named.items()}

    def loss_fn(mb, logp_BL, entropy_BL):
        return -(logp_BL * mb["adv"]).sum() / mb["response_mask"].sum(), {}

    strat.forward_backward(_media_microbatch(vl_dir), loss_fn, temperature=1.0)
    assert all(named[n].grad is None for n in frozen)
    assert named["model.language_model.layers.0.self_attn.q_proj.weight"].grad is not None
    strat.step()
    after = {n: _full(p) for n, p in strat.module.named_parameters()}
    for n in frozen:
        torch.testing.assert_close(after[n], before[n], atol=0, rtol=0)
    moved = [n for n in named if n not in frozen and not torch.equal(after[n], before[n])]
    assert "model.language_model.layers.1.mlp.up_proj.weight" in moved


def test_an_unfrozen_tower_trains_through_its_own_units(dist, vl_dir):
    strat = _strategy(vl_dir, dist, [])
    named = dict(strat.module.named_parameters())
    before = _full(named["model.visual.blocks.0.attn.qkv.weight"])
    strat.forward_backward(_media_microbatch(vl_dir),
                           lambda mb, lp, ent: (-(lp * mb["adv"]).sum(), {}), temperature=1.0)
    assert named["model.visual.blocks.1.mlp.fc1.weight"].grad is not None
    assert named["model.visual.merger.mlp.0.weight"].grad is not None
    strat.step()
    assert not torch.equal(_full(strat.module.get_parameter("model.visual.blocks.0.attn.qkv.weight")), before)
