"""Where the memory advantage's magnitude goes, from RL runs' metrics.jsonl (train.py logs it every MemPO step).

    python results/pool_noise.py runs/mempo_std_s0 runs/mempo_floor_s0 [--first 20]

Per run: the mean over its steps (or its first N) of the pool std's median, the share of sum |A_M| from pools
whose reward std is below 0.01 / 0.05, the share and mean of A_M on no-signal rounds (neither probe confident),
|A_M| per scored round, the KL to the start (with --log-kl), and the periodic greedy validation F1 at K=4.
"""
from __future__ import annotations

import argparse
import json
import os

KEYS = ("pool_std_p50", "mem_adv_share_std01", "mem_adv_share_std05", "mem_adv_no_signal_share",
        "mem_adv_no_signal", "mem_adv_abs", "no_signal_frac", "kl", "score")


def summary(run: str, first: int = 0) -> dict:
    """Mean of each of KEYS over the run's RL steps (its first ``first`` when > 0), and its val_f1_k4 curve."""
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    rows = [r for r in rows if r.get("stage") == "rl"]
    rows = rows[:first] if first else rows
    out = {"run": run, "steps": len(rows)}
    for k in KEYS:
        xs = [r[k] for r in rows if k in r]
        out[k] = sum(xs) / len(xs) if xs else float("nan")
    out["val_f1_k4"] = [(r["step"] + 1, r["val_f1_k4"]) for r in rows if "val_f1_k4" in r]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--first", type=int, default=0, help="only the first N RL steps (0 = all)")
    a = p.parse_args()
    print("| run | steps | " + " | ".join(KEYS) + " | val F1 K=4 (step) |")
    print("|---" * (len(KEYS) + 3) + "|")
    for run in a.runs:
        s = summary(run, a.first)
        curve = ", ".join(f"{f:.3f} ({st})" for st, f in s["val_f1_k4"])
        print(f"| {os.path.basename(run.rstrip('/'))} | {s['steps']} | " +
              " | ".join(f"{s[k]:.3f}" for k in KEYS) + f" | {curve} |")


if __name__ == "__main__":
    main()
