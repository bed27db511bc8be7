"""Peak RSS of RL steps of train.py on SmolLM2-135M, full fine-tuning vs LoRA (results/LORA.md).

    python results/lora_rss.py --save /tmp/smollm2          # once: SmolLM2 as a plain folder (the GGUF reader's
                                                            # own peak would hide the step's)
    MALLOC_MMAP_THRESHOLD_=131072 python results/lora_rss.py --model /tmp/smollm2 --run /tmp/r0 --lora-rank 0
    MALLOC_MMAP_THRESHOLD_=131072 python results/lora_rss.py --model /tmp/smollm2 --run /tmp/r16 --lora-rank 16

The pinned mmap threshold makes RSS follow the live tensors: glibc's default raises it as large buffers are
freed, and freed activations then stay resident (results/LORA.md).

Zero-shot SmolLM2 writes no valid round, so every score would be 0 and the step skipped (no gradient, no AdamW
state: nothing to measure); rollout 0 of each question is therefore forced to the right answer (conftest's
``ExpertTape``, as test_smollm2.py does), so the update runs. Two steps by default: AdamW allocates its state at
the first step's end, so only from the second step on is it live during a backward. Prints one JSON line: the
peak RSS after loading and after the steps.
"""
import argparse
import json
import os
import resource
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import models  # noqa: E402
import rollout  # noqa: E402
import sft  # noqa: E402
import train  # noqa: E402
from conftest import ExpertTape  # noqa: E402


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024     # Linux: KiB


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save", default="", help="write SmolLM2 as a plain model folder here and stop")
    p.add_argument("--model", default="")
    p.add_argument("--run", default="")
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--micro-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.save:
        model, tok = models.load_pretrained("smollm2", torch.device("cpu"))
        model.save_pretrained(args.save)
        tok.save_pretrained(args.save)
        return
    files = sft.export(args.run + "_data", ks=(1,), n=8, episodes=4)
    real_rollout, real_load = rollout.rollout, train.load_pretrained
    loaded = {}

    def load(*a, **kw):                 # the peak once the model is in memory, before any step
        out = real_load(*a, **kw)
        loaded["mb"] = peak_mb()
        return out

    def half_forced(model, tok, tasks, group, tool, agent, gen=None):
        own = real_rollout(model, tok, tasks, group - 1, tool, agent, gen)
        trajs = []
        for gid, task in enumerate(tasks):
            answer = " ; ".join(g[0] for g in task.golds)
            tape = tok.encode(f"<think> answer </think> <answer> {answer} </answer> more", add_special_tokens=False)
            forced, = real_rollout(ExpertTape(model, tape), tok, [task], 1, tool, agent)
            forced.group_id = gid
            trajs += [forced] + [t for t in own if t.group_id == gid]
        return trajs

    with mock.patch.object(train, "rollout", half_forced), mock.patch.object(train, "load_pretrained", load):
        train.main(["--run", args.run, "--model", args.model, "--data", files[0], "--corpus", files[1],
                    "--questions", "2", "--group", "4", "--max-turns", "1", "--max-new-tokens", "64",
                    "--rl-steps", str(args.steps), "--eval-every", "0", "--no-log-kl",
                    "--lora-rank", str(args.lora_rank), "--lr", "1e-4", "--micro-tokens", str(args.micro_tokens)])
    rows = [json.loads(line) for line in open(os.path.join(args.run, "metrics.jsonl"))]
    print(json.dumps({"lora_rank": args.lora_rank, "micro_tokens": args.micro_tokens, "steps": args.steps,
                      "updated": sum("skipped" not in r for r in rows), "tokens": [r["tokens"] for r in rows],
                      "peak_rss_after_load_mb": round(loaded["mb"]), "peak_rss_after_step_mb": round(peak_mb())}))


if __name__ == "__main__":
    main()
