"""Worker for test_fsdp2_torchrun.py, run under torchrun: python fsdp2_worker.py MODEL_DIR OUT_DIR [RESHARD].

RESHARD: train.reshard_after_forward (auto | true | false); result files of a setting other than auto carry
it in their names.

1. equivalence: the global batch is split round-robin over ranks; each rank's loss is normalised by the
   global token count; writes the summed loss, the grad norm and the updated full weights (rank 0).
2. rollout: after unshard_for_rollout, rank r runs 3 + 4 * r forwards with no collectives; then trains
   one more step to show the group is still in sync.
3. timeout (world size > 1): rank 1 skips a barrier; rank 0 must fail with an error naming it.
"""

import json
import os
import sys
import time
import types

import torch

from streamrft.learner.fsdp2 import FSDP2Strategy
from streamrft.learner.microbatch import SequenceSample, make_microbatches, padding_microbatch
from streamrft.runtime.distributed import (CollectiveError, all_reduce_max, all_reduce_sum, barrier,
                                           destroy_distributed, init_distributed)

T = 0.8


def configs(path, reshard="auto"):
    t = dict(reshard_after_forward={"auto": "auto", "true": True, "false": False}[reshard], lr=1e-2, lr_schedule="constant", warmup_steps=0, min_lr_ratio=0.0, weight_decay=0.01,
             adam_betas=[0.9, 0.999], adam_eps=1e-8, grad_clip=0.05, strategy="fsdp2")
    m = dict(path=path, dtype="float32", attn_implementation="sdpa", gradient_checkpointing=False,
             freeze_prefix=[], reference_path="")
    try:
        from streamrft.config.model import ModelConfig
        from streamrft.config.train import TrainConfig
        return ModelConfig(**m), TrainConfig(**t)
    except TypeError:  # config tree broken in this checkout
        return types.SimpleNamespace(**m), types.SimpleNamespace(**t)


def global_batch():
    g = torch.Generator().manual_seed(7)
    lens = [(3, 5), (6, 2), (2, 7), (4, 4), (5, 3), (2, 2)]
    return [SequenceSample(torch.randint(3, 30, (p,), generator=g).tolist(),
                           torch.randint(3, 30, (r,), generator=g).tolist(),
                           {"adv": torch.randn(r, generator=g)}) for p, r in lens]


def main(model_dir: str, out_dir: str, reshard: str = "auto") -> None:
    dist = init_distributed(timeout_s=60)
    rank, world = dist.rank, dist.world_size
    mcfg, tcfg = configs(model_dir, reshard)
    tag = f"world{world}" if reshard == "auto" else f"world{world}_reshard_{reshard}"
    strat = FSDP2Strategy(mcfg, tcfg, dist, total_steps=10)

    # 1. equivalence
    samples = global_batch()
    n_tokens = float(sum(len(s.response_ids) for s in samples))
    mine = samples[rank::world]
    mbs = make_microbatches(mine, token_budget=20)
    n_mb = int(all_reduce_max(torch.tensor([len(mbs)]), stage="count_microbatches"))
    mbs += [padding_microbatch(["adv"]) for _ in range(n_mb - len(mbs))]

    def loss_fn(mb, logp_BL, entropy_BL):
        return -(logp_BL * mb["adv"] * mb["response_mask"]).sum() / n_tokens, {}

    local_loss = sum(strat.forward_backward(mb, loss_fn, T)["loss"] for mb in mbs)
    loss = float(all_reduce_sum(torch.tensor([local_loss], dtype=torch.float64), stage="sum_loss"))
    out = strat.step()
    weights = {n: t.clone() for bucket in strat.full_state_for_engine(1 << 16) for n, t in bucket}
    if rank == 0:
        torch.save(weights, os.path.join(out_dir, f"weights_{tag}.pt"))
        with open(os.path.join(out_dir, f"result_{tag}.json"), "w") as f:
            json.dump({"loss": loss, "grad_norm": out["grad_norm"], "n_microbatches": n_mb}, f)

    # 2. rollout: different numbers of forwards per rank, no collectives
    strat.unshard_for_rollout()
    n_forwards = 3 + 4 * rank
    with torch.no_grad():
        for i in range(n_forwards):
            ids = torch.randint(3, 30, (1, 4 + i))
            strat.module(input_ids=ids)
    strat.reshard_after_rollout()
    strat.forward_backward(mbs[0], loss_fn, T)
    after = strat.step()
    with open(os.path.join(out_dir, f"rollout_{tag}_rank{rank}.json"), "w") as f:
        json.dump({"n_forwards": n_forwards, "grad_norm": after["grad_norm"]}, f)

    # 3. a skipped barrier ends in an error naming the stage and the rank
    if world > 1 and reshard == "auto":
        barrier("before_timeout_check", timeout_s=30)
        if rank == 1:
            time.sleep(4.0)  # outlive rank 0's timeout, then leave without joining
        else:
            try:
                barrier("skipped_by_rank1", timeout_s=2.0)
                message = "no error"
            except CollectiveError as exc:
                message = str(exc)
            with open(os.path.join(out_dir, "timeout_rank0.txt"), "w") as f:
                f.write(message)
        sys.stdout.flush()
        os._exit(0)  # the group is unusable after a failed collective; skip its teardown
    # the gloo group torn down before the interpreter's teardown: left to it, a rank sometimes aborted after its work
    # was done ("terminate called without an active exception", exit -6: a clean-clone CI run, 2026-12-07)
    destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
