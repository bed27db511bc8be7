"""Figures 5-7 and 9 of ``bench.py``, what one RL step costs beyond generation: the step split into its phases
(rollout / reward / update seconds and peak memory), the padding the update forward carries, and the step time of
``torchrun`` at several process counts. A file of its own because it times the training step and ``train.py``
runs, where ``bench.py``'s figures 1-4 time the rollout engine and the reward pass against a reference.

5. **a training step**: ``train.rl_step`` with the default config, seconds by phase, peak RSS (peak CUDA memory
   on a GPU); where every update is skipped (a random model ties every score), one ``train.update`` on random
   +-1 advantages is timed instead.
6. **padding waste** (``padding_waste``): unsorted micro-batches vs ``grpo.micro_batches``, and at a quarter of
   the token budget.
7. **processes** (``step_sec_by_procs``): seconds per RL step of ``torchrun --nproc_per_node N train.py``.
9. **against the machine's floor** (``sft_peak_share``, ``update_peak_share``, ``reward_peak_share``): the fp32
   matmul rate of this device and thread count (a 1024^3 matmul, FLOP/s), measured in the same run; default SFT
   steps of each stage (copy rows, then expert + probe + mixes: ``sft.cold_start_rows``) timed through
   ``sft.run_sft``: real and padded tokens a step, padding share, real tokens/s, and 6 N padded tokens / s as a
   share of that rate (N: the model's parameters; attention's own products left out), with the default's
   SFT seconds that implies (``--sft-copy-steps`` x copy + the rest x expert); and figure 5's step held against the
   same floor: the update at 6 N x its padded tokens, the memory reward's pass at 2 N x the tokens it scores.
   The rollout's floor is ``model.generate`` (figure 2).
"""
from __future__ import annotations

import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

import torch

import data
import grpo
import reward
import sft
import rollout
import train
from rollout import AgentConfig


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock times are the work's."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_train_step(model, tok, device, steps: int) -> dict:
    """Figure 5: ``train.rl_step`` seconds by phase (on a copy of the model) and peak memory."""
    cfg = train.parse_args([])
    model = copy.deepcopy(model)            # the update changes the weights; the other figures keep theirs
    agent = AgentConfig(system_prompt=data.SYSTEM_PROMPT, context=cfg.train_context, max_turns=cfg.max_turns,
                        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rows = []
    for step in range(steps):       # the tokens each phase computes, counted where the step hands them on
        seen = {"update_tokens": 0, "reward_tokens": 0}
        build, score = train.build_samples, reward.answer_logprobs

        def counted_build(*a, **k):
            samples = build(*a, **k)
            seen["update_tokens"] += sum(len(x.ids) for x in samples)
            return samples

        def counted_score(m, contexts, answers, *a, **k):
            seen["reward_tokens"] += sum(len(c) + len(x) for c, x in zip(contexts, answers))
            return score(m, contexts, answers, *a, **k)

        with mock.patch.object(train, "build_samples", counted_build), \
                mock.patch.object(reward, "answer_logprobs", counted_score):
            row = train.rl_step(model, None, tok, opt, cfg, step, agent)
        # the update's forward runs on padded micro-batches: real / (1 - padding share) positions
        rows.append(row | seen | {"update_padded": seen["update_tokens"] / (1 - row.get("padding_waste", 0.0))})
    med = lambda k: statistics.median(r.get(k, 0.0) for r in rows)
    out = {k: med(k) for k in ("sec_rollout", "sec_reward", "sec_update", "padding_waste", "update_tokens",
                               "update_padded", "reward_tokens")}
    out["skipped_updates"] = sum("skipped" in r for r in rows)       # e.g. every score tied: nothing to learn
    if out["skipped_updates"]:     # a random model ties every score: time the update on random +-1 advantages
        tasks, tool = train.rl_tasks(cfg, 0)
        trajs = rollout.rollout(model, tok, tasks, cfg.group, tool, agent, torch.Generator(device).manual_seed(0))
        adv = torch.tensor([(-1.0) ** i for i in range(len(trajs))])
        samples = train.build_samples(trajs, adv, {})
        t0 = time.perf_counter()
        row = train.update(model, None, opt, samples, cfg, tok.pad_token_id)
        sync(device)
        out["sec_update_forced"] = time.perf_counter() - t0
        out["update_rows"] = len(samples)
        out["update_tokens"] = sum(len(s.ids) for s in samples)
        out["update_padded"] = out["update_tokens"] / (1 - row.get("padding_waste", 0.0))
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def matmul_peak(device: torch.device, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an n^3 fp32 matmul on this device and thread count (median of ``repeats``): the floor's rate."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    secs = []
    for _ in range(repeats + 1):               # the first is warm-up
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        secs.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(secs[1:])


def bench_sft(model, tok, device, steps: int, peak: float) -> dict:
    """Figure 9's SFT rows: default SFT steps (on a copy of the model) of each stage, the copy rows (steps 0 to
    ``--sft-copy-steps``, if any) and the expert rows after them, through ``sft.run_sft`` as the cold start runs
    them. Rows grow over the expert stage (its late steps carry ~15% more tokens), so the timed steps are ``steps``
    spread evenly over each stage, after one untimed warm-up step at its start."""
    cfg = train.parse_args([])
    n_params = sum(p.numel() for p in model.parameters())
    out = {"n_params": n_params, "peak_flops": peak}
    rows = lambda step: sft.cold_start_rows(tok, cfg, step, data.SYSTEM_PROMPT)
    stages = [("copy", 0, cfg.sft_copy_steps)] if cfg.sft_copy_steps else []      # --sft-copy-steps 0: none
    stages.append(("expert", cfg.sft_copy_steps, cfg.sft_steps))
    out["stages"] = [name for name, _, _ in stages]
    for stage, lo, hi in stages:
        at = [lo + (hi - lo) * i // steps for i in range(steps)]
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
        real = padded = 0
        for step in at:
            batches = sft.micro_batches(rows(step), cfg.micro_tokens)
            real += sum(len(x.ids) for b in batches for x in b)
            padded += sum(len(b) * max(len(x.ids) for x in b) for b in batches)
        secs = []
        sft.run_sft(m, opt, rows, range(lo, lo + 1), lambda s: cfg.sft_lr, cfg, tok.pad_token_id, lambda *a: None,
                    desc="bench sft (warm-up)")
        for step in at:
            sft.run_sft(m, opt, rows, range(step, step + 1), lambda s: cfg.sft_lr, cfg, tok.pad_token_id,
                        lambda s, loss, gn, sec: secs.append(sec), desc=f"bench sft ({stage})")
        sec = statistics.mean(secs)
        out[stage] = {"sec_step": sec, "real_tokens": real / steps, "padded_tokens": padded / steps,
                      "padding": 1 - real / padded, "tok_s": real / steps / sec,
                      "peak_share": 6 * n_params * padded / steps / sec / peak}
    out["sft_sec"] = sum((hi - lo) * out[stage]["sec_step"] for stage, lo, hi in stages)
    return out


def floors(st: dict, n_params: int, peak: float) -> dict:
    """Figure 5's phases against the floor: seconds at the matmul rate over seconds taken (1: at the floor)."""
    sec_update = st.get("sec_update_forced", st["sec_update"])       # every update skipped: the forced one's
    return {"update_peak_share": 6 * n_params * st["update_padded"] / peak / sec_update,
            "reward_peak_share": 2 * n_params * st["reward_tokens"] / peak / max(st["sec_reward"], 1e-9)}


def bench_padding(trajs, cfg: train.Config) -> dict:
    """Figure 6: padding fraction of the update forward, unsorted vs ``grpo.micro_batches``."""
    samples = train.build_samples(trajs, torch.zeros(len(trajs)), {})
    after = grpo.micro_batches(samples, cfg.micro_tokens)
    size = -(-len(samples) // len(after))                     # same number of micro-batches, unsorted
    before = [samples[i:i + size] for i in range(0, len(samples), size)]
    small = grpo.micro_batches(samples, cfg.micro_tokens // 4)
    return {"rows": len(samples), "micro_batches": len(after), "before": grpo.padding_waste(before),
            "after": grpo.padding_waste(after), "small_budget": grpo.padding_waste(small),
            "small_budget_batches": len(small)}


def bench_processes(model, tok, source: str, device: torch.device, procs: list[int], steps: int) -> dict:
    """Figure 7: seconds per RL step (default config) of ``torchrun --nproc_per_node N train.py``, per N.

    Each N is a fresh run of ``steps`` RL steps from the same model; the step time is the median over
    steps after the first (warm-up) of sec_rollout + sec_reward + sec_update (each the slowest rank's).
    """
    here = os.path.dirname(os.path.abspath(__file__))
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = source if os.path.isdir(source) else os.path.join(tmp, "model")
        if path != source:                      # a random model: save it so that every rank loads it
            model.save_pretrained(path)
            tok.save_pretrained(path)
        for n in procs:
            run = os.path.join(tmp, f"run{n}")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                   "train.py", "--run-dir", run, "--model", path, "--device", device.type, "--rl-steps", str(steps),
                   "--eval-every", "0", "--save-every", "1000000"]
            t0 = time.time()
            p = subprocess.run(cmd, cwd=here, capture_output=True, text=True)
            if p.returncode != 0:                 # reported in the table, the other figures still print
                res[n] = {"sec_step": float("nan"), "wall_s": time.time() - t0, "skipped": 0,
                          "error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
                print(f"figure 7, {n} processes failed:\n{p.stderr[-3000:]}")
                continue
            rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
            secs = [r["sec_rollout"] + r["sec_reward"] + r["sec_update"] for r in rows[1:] or rows]
            res[n] = {"sec_step": statistics.median(secs), "wall_s": time.time() - t0,
                      "skipped": sum("skipped" in r for r in rows)}
    return res


def step_seconds(st: dict) -> float:
    return st["sec_rollout"] + st["sec_reward"] + st["sec_update"]


def print_update(st: dict, pad: dict, pr: dict, procs: list[int], micro: int, steps: int,
                 device: torch.device) -> None:
    """Rows 5-7 of ``bench.py``'s table (``steps``: the RL steps figure 5 timed; ``micro``: the config's
    ``micro_tokens``)."""
    print(f"5 train step (default config, median of {steps}): rollout "
          f"{st['sec_rollout']:.2f} s  reward {st['sec_reward']:.2f} s  update {st['sec_update']:.2f} s  "
          f"peak RSS {st['peak_rss_mb']:.0f} MB  skipped updates {st['skipped_updates']}"
          + (f"  peak CUDA {st['peak_cuda_mb']:.0f} MB" if "peak_cuda_mb" in st else "")
          + (f"\n  every update skipped (scores tied): one update on random +-1 advantages, {st['update_rows']} rows, "
             f"{st['update_tokens']} tokens: {st['sec_update_forced']:.2f} s" if "sec_update_forced" in st else ""))
    print(f"6 padding waste, {pad['rows']} round samples of one step: unsorted in {pad['micro_batches']} "
          f"micro-batches {pad['before']:.3f} | grpo.micro_batches (sorted, budget {micro}) "
          f"{pad['after']:.3f} | same at budget {micro // 4} ({pad['small_budget_batches']} micro-batches) "
          f"{pad['small_budget']:.3f}")
    print(f"7 step time, torchrun --nproc_per_node N train.py (default config, B={train.Config.questions} questions "
          f"split over N): "
          + "  ".join(f"N={n} {x['sec_step']:.2f} s ({pr[procs[0]]['sec_step'] / x['sec_step']:.2f}x)"
                      for n, x in pr.items())
          + ("  [CPU: a smoke test, the ranks share the cores]" if device.type == "cpu" else ""))


def print_floor(sf: dict, fl: dict, st: dict, rollout_speedup: float) -> None:
    """Row 9: SFT and the RL step's phases against the fp32 matmul rate measured in the same run."""
    print(f"9 against the floor: fp32 matmul {sf['peak_flops'] / 1e9:.1f} GFLOP/s (1024^3, this thread count), "
          f"N = {sf['n_params'] / 1e6:.2f}M parameters")
    for stage in sf["stages"]:
        x = sf[stage]
        print(f"  SFT {stage:6s} step {x['sec_step']:.3f} s  {x['real_tokens']:.0f} real / {x['padded_tokens']:.0f} "
              f"padded tokens (padding {x['padding']:.3f})  {x['tok_s']:.0f} tok/s  6N x padded tok/s = "
              f"{x['peak_share']:.2f} of the matmul rate")
    print(f"  the default SFT at these step times: {sf['sft_sec'] / 60:.1f} min")
    sec_update = st.get("sec_update_forced", st["sec_update"])
    print(f"  RL step: update {sec_update:.2f} s for {st['update_padded']:.0f} padded tokens: "
          f"{fl['update_peak_share']:.2f} of the rate | memory reward {st['sec_reward']:.2f} s for "
          f"{st['reward_tokens']:.0f} scored tokens: {fl['reward_peak_share']:.2f} | rollout "
          f"{st['sec_rollout']:.2f} s: {rollout_speedup:.2f}x model.generate's loop (figure 2)")
