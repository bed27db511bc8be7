"""Peak RSS of SFT and RL steps of train.py on a Qwen2.5-0.5B-shaped model, with and without the one-GPU memory
levers --gradient-checkpointing and --generation-batch (results/MEMORY.md).

    python results/gpu_memory.py --all /tmp/gm --write results/MEMORY.md      # every configuration, then the table
    python results/gpu_memory.py --build /tmp/gm                               # only: the model folder and the data
    MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 python results/gpu_memory.py --work /tmp/gm --mode sft \\
        --gradient-checkpointing                                               # one configuration: one JSON line

The model: ``data.save_random_checkpoint`` at Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, tied embeddings, vocab 151936: 494M fp32 parameters), randomly initialised, over the repository's
400-token byte-level BPE tokenizer (the vocab is padded through the config; ids past the tokenizer decode to
nothing). The data: ``sft.export`` (K = 1 test set and corpus, 64 expert trajectories).

Each configuration runs in its own process (``ru_maxrss`` is per process), one thread, with glibc's mmap threshold
pinned (``MALLOC_MMAP_THRESHOLD_=131072``) so that RSS follows the live tensors (results/LORA.md). Besides the
process's peak, the peak of each phase (loading, SFT steps, rollouts, updates, the rest) is read from ``VmHWM``,
reset between phases by writing 5 to ``/proc/self/clear_refs``; the process's peak is the largest of them.
The weights, gradient and AdamW-state bytes are counted on the tensors themselves.

RL: rollout 0 of each question is forced to the right answer (conftest's ``ExpertTape``, as results/lora_rss.py
does), so the update is not skipped; two steps, so that AdamW's state (allocated at the end of step 1) is live in
the second backward.

The rows (CONFIGS): SFT and RL steps with and without ``--gradient-checkpointing``, each also under
``--precision bf16`` (the autocast the trainer runs on CUDA, here on the CPU); and RL rollouts of 2 questions x 8
with ``--generation-batch`` 0 and 2, their updates skipped (``--rollout-only``: the rollout's peak alone).
"""
import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

QWEN05 = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=True)

# (name, mode, extra flags of this script): the table's rows, in order
CONFIGS = [
    ("SFT", "sft", []),
    ("SFT + checkpointing", "sft", ["--gradient-checkpointing"]),
    ("SFT, bf16 autocast", "sft", ["--precision", "bf16"]),
    ("SFT + checkpointing, bf16 autocast", "sft", ["--gradient-checkpointing", "--precision", "bf16"]),
    ("RL", "rl", []),
    ("RL + checkpointing", "rl", ["--gradient-checkpointing"]),
    ("RL, bf16 autocast", "rl", ["--precision", "bf16"]),
    ("RL + checkpointing, bf16 autocast", "rl", ["--gradient-checkpointing", "--precision", "bf16"]),
    ("RL rollouts only, 2 x 8 rows", "rl", ["--questions", "2", "--group", "8", "--rollout-only"]),
    ("RL rollouts only, 2 x 8 rows + --generation-batch 2", "rl",
     ["--questions", "2", "--group", "8", "--rollout-only", "--generation-batch", "2"]),
]
MB = 2 ** 20


def status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024          # kB
    raise KeyError(field)


class Phases:
    """Peak RSS (VmHWM) and seconds per phase; ``switch(name)`` closes the current phase and starts ``name``."""

    def __init__(self):
        self.peak, self.runs, self.sec = {}, {}, {}       # runs: [RSS at its start, its peak] per occurrence
        self.current, self.t0, self.rss0 = "imports", time.time(), round(status_mb("VmRSS"))

    def switch(self, name: str) -> None:
        hwm = status_mb("VmHWM")
        self.peak[self.current] = max(self.peak.get(self.current, 0.0), hwm)
        self.runs.setdefault(self.current, []).append([self.rss0, round(hwm)])
        self.sec[self.current] = self.sec.get(self.current, 0.0) + time.time() - self.t0
        with open("/proc/self/clear_refs", "w") as f:       # resets VmHWM (and ru_maxrss) to the current RSS
            f.write("5")
        self.rss0 = round(status_mb("VmRSS"))
        self.current, self.t0 = name, time.time()


def tensor_mb(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / MB


def measure(args) -> dict:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import rollout
    import sft
    import train
    from conftest import ExpertTape

    torch.set_num_threads(1)
    ph = Phases()
    runtime_mb = status_mb("VmRSS")               # the interpreter, torch and transformers, before any model
    run = os.path.join(args.work, "runs", f"{args.mode}_q{args.questions}_g{args.group}_gb{args.generation_batch}"
                                          f"_ckpt{int(args.gradient_checkpointing)}_{args.precision}"
                                          f"{'_rollouts' if args.rollout_only else ''}")
    if os.path.exists(run):
        subprocess.run(["rm", "-rf", run], check=True)
    seen = {"model": None, "adam_mb": 0.0, "micro": [], "rows": []}
    real = {"load": train.load_pretrained, "rollout": rollout.rollout, "update": train.update,
            "run_sft": sft.run_sft, "train_mb": train.micro_batches, "sft_mb": sft.micro_batches}

    def load(*a, **kw):
        ph.switch("load")
        out = real["load"](*a, **kw)
        seen["model"] = out[0]
        ph.switch("other")
        return out

    def micro(samples, budget, which):
        out = real[which](samples, budget)
        seen["micro"].append([len(b) * max(len(s.ids) for s in b) for b in out])      # padded tokens
        seen["rows"].append(max(len(s.ids) for s in samples))
        return out

    def run_sft(*a, **kw):
        ph.switch("sft steps")
        real["run_sft"](*a, **kw)
        ph.switch("other")

    def half_forced(model, tok, tasks, group, tool, agent, gen=None):
        ph.switch("rollout")
        own = real["rollout"](model, tok, tasks, group - 1, tool, agent, gen)
        trajs = []
        for gid, task in enumerate(tasks):
            answer = " ; ".join(g[0] for g in task.golds)
            tape = tok.encode(f"<think> answer </think> <answer> {answer} </answer> more", add_special_tokens=False)
            forced, = real["rollout"](ExpertTape(model, tape), tok, [task], 1, tool, agent)
            forced.group_id = gid
            trajs += [forced] + [t for t in own if t.group_id == gid]
        ph.switch("other")
        return trajs

    def update(*a, **kw):
        if args.rollout_only:
            return {"skipped": "rollout only"}
        ph.switch("update")
        out = real["update"](*a, **kw)
        ph.switch("other")
        return out

    def adam_state(optimizer, *_):
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        seen["adam_mb"] = max(seen["adam_mb"], tensor_mb(state))

    hook = register_optimizer_step_post_hook(adam_state)
    files = os.path.join(args.work, "data")
    common = ["--run", run, "--model", os.path.join(args.work, "qwen05"), "--eval-every", "0",
              "--micro-tokens", str(args.micro_tokens), "--precision", args.precision]
    if args.gradient_checkpointing:
        common.append("--gradient-checkpointing")
    if args.mode == "sft":
        argv = common + ["--sft-data", os.path.join(files, "sft_trajectories.jsonl"), "--sft-steps", str(args.steps),
                         "--rl-steps", "0", "--sft-batch", str(args.sft_batch), "--sft-full-share",
                         str(args.sft_full_share)]
    else:
        argv = common + ["--data", os.path.join(files, "test_k1.jsonl"),
                         "--corpus", os.path.join(files, "corpus_k1.jsonl"),
                         "--rl-steps", str(args.steps), "--questions", str(args.questions), "--group", str(args.group),
                         "--max-turns", "2", "--max-new-tokens", "32", "--generation-batch", str(args.generation_batch),
                         "--no-log-kl", "--lr", "1e-4"]
    t0 = time.time()
    with mock.patch.object(train, "load_pretrained", load), mock.patch.object(train, "rollout", half_forced), \
            mock.patch.object(train, "update", update), mock.patch.object(sft, "run_sft", run_sft), \
            mock.patch.object(train, "micro_batches", lambda s, b: micro(s, b, "train_mb")), \
            mock.patch.object(sft, "micro_batches", lambda s, b: micro(s, b, "sft_mb")):
        train.main(argv)
    seconds = time.time() - t0
    ph.switch("end")
    hook.remove()
    model = seen["model"]
    params = list(model.parameters())
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    out = {"mode": args.mode, "argv": "python train.py " + " ".join(argv), "seconds": round(seconds),
           "peak_mb": round(max(ph.peak.values())),
           "phase_peak_mb": {k: round(v) for k, v in ph.peak.items()},
           "phase_runs_mb": ph.runs, "phase_sec": {k: round(v) for k, v in ph.sec.items()},
           "runtime_mb": round(runtime_mb), "params": sum(p.numel() for p in params),
           "weights_mb": round(tensor_mb(params)),
           "grads_mb": round(tensor_mb([p.grad for p in params if p.grad is not None])),
           "adam_mb": round(seen["adam_mb"]), "micro_tokens": seen["micro"], "longest_row": seen["rows"]}
    if args.mode == "rl":
        out["updated"] = sum("skipped" not in r for r in rows if "score" in r)
        out["sec_rollout"] = [round(r.get("sec_rollout", 0)) for r in rows if "score" in r]
    return out


def build(work: str) -> None:
    import data
    import sft

    if not os.path.exists(os.path.join(work, "qwen05", "model.safetensors")):
        data.save_random_checkpoint(os.path.join(work, "qwen05"), **QWEN05)
    if not os.path.exists(os.path.join(work, "data", "sft_trajectories.jsonl")):
        sft.export(os.path.join(work, "data"), ks=(1,), n=8, episodes=64)


def machine() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    return f"{name}, {os.cpu_count()} cores, {platform.system()}"


def run_all(args) -> list[dict]:
    """Every configuration of CONFIGS in a process of its own, one after the other; results kept in
    WORK/results.jsonl, so a rerun measures only the configurations it lacks."""
    build(args.work)
    path = os.path.join(args.work, "results.jsonl")
    done = {}
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            done[r["name"]] = r
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    for name, mode, extra in CONFIGS:
        if name in done:
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--work", args.work, "--mode", mode] + extra

        def limit():
            if args.limit_gb:               # an allocation past it fails in this process, not in a neighbour's
                resource.setrlimit(resource.RLIMIT_AS, (args.limit_gb * 2 ** 30,) * 2)
        print("running", name, flush=True)
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, preexec_fn=limit)
        if p.returncode != 0:
            print(p.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{name}: exit status {p.returncode}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r |= {"name": name, "flags": " ".join(extra), "date": datetime.date.today().isoformat(), "machine": machine()}
        done[name] = r
        with open(path, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)
    return [done[name] for name, *_ in CONFIGS]


BEGIN, END = "<!-- gpu_memory.py: begin -->", "<!-- gpu_memory.py: end -->"


def where(r: dict) -> str:
    """The peak of each phase (MB); a rollout's '+N': its own rise over the RSS it started from, in the last step."""
    p = r["phase_peak_mb"]
    if r["mode"] == "sft":
        return f"SFT steps {p['sft steps']}"
    start, peak = r["phase_runs_mb"]["rollout"][-1]
    out = f"rollout {p['rollout']} (+{peak - start})"
    return out + (f", update {p['update']}" if "update" in p else ", no update")


def command(r: dict) -> str:
    argv = r["argv"]
    work = os.path.dirname(argv.split("--model ")[1].split()[0])
    return argv.replace(work + "/runs/", "RUNS/").replace(work, "WORK")


def block(results: list[dict]) -> str:
    """The generated part of MEMORY.md: what was measured, the table, the commands, the parts of each peak."""
    r0 = results[0]
    lines = [BEGIN, "", f"Measured {r0['date']} on {r0['machine']} (`lscpu`'s model name), torch CPU, one thread, "
             "`MALLOC_MMAP_THRESHOLD_=131072`, each row its own process; MB = 2^20 bytes. Seconds: wall time of "
             "`train.main` on a machine shared with other jobs (they depend on the load; the RSS does not).", "",
             "| configuration | flags of gpu_memory.py | peak RSS MB | phase peaks MB | micro-batches, padded tokens "
             "(step 1; step 2) | seconds |", "|---|---|---|---|---|---|"]
    for r in results:
        micro = "; ".join(", ".join(str(t) for t in m) for m in r["micro_tokens"]) or "-"
        lines.append(f"| {r['name']} | `{r['flags'] or '(none)'}` | {r['peak_mb']} | {where(r)} | {micro} "
                     f"| {r['seconds']} |")
    lines += ["", "The `train.py` command of each row (`gpu_memory.py` runs `train.main` on it; WORK: the model "
              "folder and the data, RUNS: a scratch folder):", ""]
    lines += [f"* {r['name']}: `{command(r)}`" for r in results]
    lines += ["", "The parts of each peak that trained (MB): the runtime is the RSS after imports, before the model; "
              "weights, gradients and AdamW's state are counted on the tensors (fp32, "
              f"{r0['params']:,} parameters); activations are the rest of the peak.", "",
              "| configuration | runtime | weights | gradients | AdamW state | activations (the rest) |",
              "|---|---|---|---|---|---|"]
    for r in results:
        if r["grads_mb"]:
            act = r["peak_mb"] - r["runtime_mb"] - r["weights_mb"] - r["grads_mb"] - r["adam_mb"]
            lines.append(f"| {r['name']} | {r['runtime_mb']} | {r['weights_mb']} | {r['grads_mb']} | "
                         f"{r['adam_mb']} | {act} |")
    lines += ["", END]
    return "\n".join(lines)


def write(path: str, results: list[dict]) -> None:
    text = open(path).read() if os.path.exists(path) else f"# Memory\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN)
    with open(path, "w") as f:
        f.write(head + block(results) + rest.split(END, 1)[1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", default="/tmp/gm", help="the model folder, the data, the runs")
    p.add_argument("--build", default="", metavar="WORK", help="write the model folder and the data here and stop")
    p.add_argument("--all", default="", metavar="WORK", help="measure every configuration, each in its own process")
    p.add_argument("--write", default="", help="with --all: replace the generated part of this markdown file")
    p.add_argument("--limit-gb", type=int, default=20, help="with --all: address-space limit of each run (0: none)")
    p.add_argument("--mode", choices=("sft", "rl"), default="sft")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--generation-batch", type=int, default=0)
    p.add_argument("--questions", type=int, default=1)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--rollout-only", action="store_true", help="RL: skip every update (the rollout's peak alone)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--sft-batch", type=int, default=4)
    p.add_argument("--sft-full-share", type=float, default=1.0, help="1: rows in the full context, the longest")
    p.add_argument("--micro-tokens", type=int, default=2048)
    p.add_argument("--precision", default="auto", help="auto = fp32 on CPU")
    args = p.parse_args()
    if args.build:
        build(args.build)
    elif args.all:
        args.work = args.all
        results = run_all(args)
        if args.write:
            write(args.write, results)
    else:
        print(json.dumps(measure(args)))


if __name__ == "__main__":
    main()
