"""TEMPORARY sweep helper (deleted after the sweep)."""
import json, sys, time, os
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch
torch.set_num_threads(1)
from pipelines.arith.prepare import TASK
from pipelines.srm.task import make_pairs, write_jsonl
from streamrft.rm.config import RMTrainConfig, RMModelConfig, RMDataConfig, RMTrainSection
from streamrft.rm.train import train_srm, srm_accuracy
from streamrft.rm.data import read_preference_pairs

def main():
    mode = sys.argv[1]
    if mode == "backbone":
        out, steps = sys.argv[2], int(sys.argv[3])
        from pipelines.srm.prepare import build_backbone
        from pipelines.arith.task import greedy_accuracy, make_rows
        from streamrft.models.tiny import load_policy
        t0 = time.perf_counter(); build_backbone(out, 0, steps)
        m, tok = load_policy(out)
        acc = greedy_accuracy(m, tok, make_rows(989, 0, split="eval", **TASK))
        print(json.dumps({"backbone": out, "steps": steps, "greedy_eval_acc": acc, "s": time.perf_counter() - t0}), flush=True)
        return
    spec = json.loads(sys.argv[2])
    name = spec.pop("name"); bb = spec.pop("backbone"); ppp = spec.pop("ppp", 4); hard = spec.pop("hard", 0.0)
    n_train = spec.pop("n_train", 9011 * ppp); pooling = spec.pop("pooling", "last")
    d = Path("sweep") / name; d.mkdir(parents=True, exist_ok=True)
    train_path = write_jsonl(str(d / "train.jsonl"), make_pairs("train", n_train, 0, pairs_per_problem=ppp, hard_fraction=hard, **TASK))
    eval_path = write_jsonl(str(d / "eval.jsonl"), make_pairs("eval", 500, 1, **TASK))
    big = write_jsonl(str(d / "eval_big.jsonl"), make_pairs("eval", 4000, 7, pairs_per_problem=4, **TASK))
    hardp = write_jsonl(str(d / "eval_hard.jsonl"), make_pairs("eval", 4000, 8, pairs_per_problem=4, hard_fraction=1.0, **TASK))
    train = dict(steps=8000, batch_size=32, lr=5e-4, lr_schedule="cosine", log_every=0); train.update(spec)
    cfg = RMTrainConfig(kind="srm", seed=0, output_dir=str(d / "rm"), model=RMModelConfig(path=bb, pooling=pooling),
                        data=RMDataConfig(train_path=train_path, eval_path=eval_path), train=RMTrainSection(**train))
    s = train_srm(cfg)
    from streamrft.rm.model import ScalarRewardModel
    m = ScalarRewardModel.from_pretrained(str(d / "rm"))
    res = {"name": name, "acc500": s["eval_pairwise_accuracy"], "acc_big": srm_accuracy(m, read_preference_pairs(big)),
           "acc_hard": srm_accuracy(m, read_preference_pairs(hardp)), "train_s": s["seconds"], "n_train": s["n_train"],
           "final_loss": s["final_loss"], "bb": bb, "ppp": ppp, "hard": hard, "pooling": pooling, **train}
    print(json.dumps(res), flush=True)

main()
