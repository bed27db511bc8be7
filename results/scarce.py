"""Tables of MemTrain where the task's data is scarce (results/MEMTRAIN.md): the agent SFT'd on N expert episodes and
then RL'd, with and without MemTrain before its SFT, paired by seed.

Reads the JSON line ``eval.py`` prints last, one file per (arm, N, seed, checkpoint):
``RUNS/eval_{plain|mt}{N}_s{seed}.txt`` for the final checkpoint and ``..._sft.txt`` for the SFT one, as written by

    python eval.py --checkpoint RUNS/plain64_s0/final --objectives 1 2 3 4 5 --tasks 64 > RUNS/eval_plain64_s0.txt

and prints markdown: each arm's F1, EM and early share per K (mean +- 95% t half-width over the seeds present), then
MemTrain - plain paired by seed at each K and over the K the plain arm reaches (its mean F1 over seeds above 0.1),
with each seed's value.

    python results/scarce.py --runs /path/to/runs --n 64 --seeds 0 1 2
"""
from __future__ import annotations

import argparse
import os

from regime import fmt, read  # the regime study's reader and its mean +- 95% t half-width

REACHED = 0.1      # a K counts as reached when the plain arm's mean F1 over seeds is above this


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", required=True, help="folder of the eval_*.txt files")
    p.add_argument("--n", type=int, default=64, help="expert episodes the SFT saw")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    a = p.parse_args(argv)
    for stage, suffix in (("after RL (final)", ""), ("the SFT checkpoint", "_sft")):
        res = {arm: {s: read(os.path.join(a.runs, f"eval_{arm}{a.n}_s{s}{suffix}.txt")) for s in a.seeds}
               for arm in ("plain", "mt")}
        seeds = [s for s in a.seeds if res["plain"][s] and res["mt"][s]]
        if not seeds:
            continue
        ks = sorted(int(k) for k in res["plain"][seeds[0]])
        print(f"\n### N = {a.n}, {stage}: mean +- 95% t half-width over seeds {', '.join(map(str, seeds))}\n")
        print("| arm | metric | " + " | ".join(f"K={k}" for k in ks) + " |")
        print("|---|---|" + "---|" * len(ks))
        for arm in ("plain", "mt"):
            for metric in ("f1", "em", "early"):
                cells = [fmt([res[arm][s][str(k)][metric] for s in seeds]) for k in ks]
                print(f"| {arm} | {metric} | " + " | ".join(cells) + " |")
        reached = [k for k in ks if sum(res["plain"][s][str(k)]["f1"] for s in seeds) / len(seeds) > REACHED]
        print(f"\nmt - plain, paired by seed (each seed's value in brackets); reached K: {reached}\n")
        for metric in ("f1", "em", "early"):
            spans = [(f"K={k}", [k]) for k in ks] + [("reached", reached)]
            parts = []
            for name, span in spans:
                if not span:
                    continue
                d = [sum(res["mt"][s][str(k)][metric] - res["plain"][s][str(k)][metric] for k in span) / len(span)
                     for s in seeds]
                parts.append(f"{name} {fmt(d)} ({' / '.join(f'{v:+.3f}' for v in d)})")
            print(f"* {metric}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
