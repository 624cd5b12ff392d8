"""RL on the arith task with the trained SRM as the only reward; reports held-out exact-match accuracy.

    python pipelines/srm/rl_demo.py [key=value ...]     (overrides of pipelines/srm/rl.yaml)

Steps (each skipped when its output exists): the SRM data and backbone (pipelines/srm/prepare.py,
runs/srm), the SRM (`train-rm pipelines/srm/config.yaml`, runs/srm/rm), the arith policy
(pipelines/arith/prepare.py, runs/srm/policy), then GRPO with ``reward.sources = [srm]``.
The reported accuracy is greedy exact match against the references of the held-out eval prompts
(``pipelines.arith.task.greedy_accuracy``), measured on the policy module before and after RL; the
driver's own ``heldout_accuracy`` would count SRM rewards >= 1 instead, since the SRM is the only
reward source. The RM never sees references. The last line is machine-readable:
    srm-rl: rm_pairwise_accuracy=0.xx exact_match_before=0.xx exact_match_after=0.yy steps=N seconds=S
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pipelines.arith.prepare import prepare_from_config  # noqa: E402
from pipelines.srm.prepare import prepare as prepare_srm  # noqa: E402
from streamrft.config import load_config  # noqa: E402
from streamrft.rm.config import load_rm_config  # noqa: E402

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    rm_cfg = load_rm_config(HERE / "config.yaml")
    prepare_srm(str(Path(rm_cfg.output_dir).parent))
    if not (Path(rm_cfg.output_dir) / "rm.json").is_file():
        from streamrft.rm.train import train_srm

        train_srm(rm_cfg)
    from streamrft.rm.cli import evaluate_rm

    rm_acc = evaluate_rm(rm_cfg.output_dir, rm_cfg.data.eval_path)["pairwise_accuracy"]
    config = str(HERE / "rl.yaml")
    prepare_from_config(config, argv)
    cfg = load_config(config, ["checkpoint.resume=false", *argv])
    from pipelines.arith.task import greedy_accuracy
    from streamrft.data import read_rows
    from streamrft.config import validate_config
    from streamrft.runtime.distributed import destroy_distributed, init_distributed
    from streamrft.compose import build_run
    from streamrft.runtime.driver import train_loop

    eval_rows = read_rows(cfg.data.eval_path)
    dist = init_distributed(timeout_s=cfg.rollout.stage_timeout_s)
    try:
        validate_config(cfg, dist.world_size)
        run = build_run(cfg, dist)
        tokenizer = run.strategy.tokenizer
        before = greedy_accuracy(run.engine.module, tokenizer, eval_rows, max_new_tokens=6)
        summary = asyncio.run(train_loop(run))
        after = greedy_accuracy(run.engine.module, tokenizer, eval_rows, max_new_tokens=6)
    finally:
        destroy_distributed()
    print(json.dumps({k: v for k, v in summary.items() if "reward" in k}), flush=True)
    print(f"srm-rl: rm_pairwise_accuracy={rm_acc:.3f} exact_match_before={before:.3f} exact_match_after={after:.3f} "
          f"n_eval={len(eval_rows)} steps={summary['steps']} seconds={time.perf_counter() - started:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
