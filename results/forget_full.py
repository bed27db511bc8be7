"""Tables of the memory-reward study where A_M is the only teacher and the start varies (results/STUDIES.md): a
forgetful cold start (``--forget-p 0.5 --sft-full-share 0.5``), full-context RL, snail evaluation.

Reads, under ``--runs R`` (the layout the study's commands write):

* ``R/eval/{arm}_s{S}_{context}.txt``: ``eval.py``'s output (its JSON line last), arm sft | grpo | mempo, context
  snail | full | snailT1 (the snail evaluation at ``--temperature 1.0 --objectives 2 3 4``);
* ``R/var/{arm}_s{S}_{NNNN}.json`` and ``R/var/sft_s{S}_curve.json``: ``results/variety.py`` on the kept models of
  steps 20-120 and on the start (step 0), all on the questions of steps 10000-10003;
* ``R/{arm}_s{S}/metrics.jsonl``: the RL runs' own rows (``kl`` with ``--log-kl``).

Prints markdown: each arm's F1 / EM / early / retention 3+ per K (mean +- 95% t half-width over the seeds present),
then the stated comparison, MemPO - GRPO paired by SFT seed, on (a) snail retention 3+ over K = 2-4 (the mean of the
three K's, each pooled over its rounds by eval.py) and (b) snail F1 over K = 2-4, with EM and early beside and the
same in the full context, each seed's value in brackets; then the training curves of both arms (retention 3+ and
`varies` of the sampled full-context rollouts, P_mem - P_full, A_M keep - drop, the outcome's keep - drop, the early
share, KL to the start).

    python results/forget_full.py --runs R --seeds 0 1 2 3 4
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "results"))
from regime import fmt, over, read  # noqa: E402  (the regime study's reader and interval format)

ARMS = ("sft", "grpo", "mempo")
KS = (1, 2, 3, 4, 6, 8)
SPAN = (2, 3, 4)
STEPS = (0, 20, 40, 60, 80, 100, 120)


def evaluation(runs: str, arm: str, seed: int, context: str) -> dict | None:
    return read(os.path.join(runs, "eval", f"{arm}_s{seed}_{context}.txt"))


def curve_point(runs: str, arm: str, seed: int, step: int) -> dict | None:
    """``variety.py``'s figures of ``arm`` at ``step`` (step 0: the SFT start, shared by both arms)."""
    name = f"sft_s{seed}_curve.json" if step == 0 else f"{arm}_s{seed}_{step:04d}.json"
    path = os.path.join(runs, "var", name)
    return json.load(open(path)) if os.path.exists(path) else None


def kl_at(runs: str, arm: str, seed: int, step: int) -> float:
    """The mean ``kl`` of the RL rows of the 20 steps before ``step`` (NaN without them)."""
    path = os.path.join(runs, f"{arm}_s{seed}", "metrics.jsonl")
    if not os.path.exists(path):
        return float("nan")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    kls = [r["kl"] for r in rows if r.get("stage") == "rl" and "kl" in r and step - 20 <= r["step"] < step]
    return sum(kls) / len(kls) if kls else float("nan")


def paired(runs: str, seeds: list[int], context: str, metric: str) -> str:
    """MemPO - GRPO over K = 2-4 of ``metric``, paired by seed: the interval and each seed's value."""
    diffs = []
    for s in seeds:
        a, b = evaluation(runs, "mempo", s, context), evaluation(runs, "grpo", s, context)
        diffs.append(over(a, SPAN, metric) - over(b, SPAN, metric) if a and b else float("nan"))
    each = " / ".join("-" if d != d else f"{d:+.3f}" for d in diffs)
    return f"{fmt(diffs)} ({each})"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    a = p.parse_args(argv)
    for context in ("snail", "full"):
        print(f"\n### {context}: mean +- 95% t half-width over the seeds present\n")
        head = " | ".join(f"F1 K={k}" for k in KS)
        print(f"| arm | seeds | {head} | EM K=2 | early K=3-4 | retention 3+ K=2-4 |")
        print("|---" * (len(KS) + 5) + "|")
        for arm in ARMS:
            res = [r for r in (evaluation(a.runs, arm, s, context) for s in a.seeds) if r]
            if not res:
                continue
            cells = [fmt([r[str(k)]["f1"] for r in res if str(k) in r]) for k in KS]
            cells += [fmt([r["2"]["em"] for r in res if "2" in r]), fmt([over(r, (3, 4), "early") for r in res]),
                      fmt([over(r, SPAN, "retention_3plus") for r in res])]
            print(f"| {arm} | {len(res)} | " + " | ".join(cells) + " |")
    print("\n### MemPO - GRPO, paired by SFT seed, over K = 2-4 (seeds " + " / ".join(map(str, a.seeds)) + ")\n")
    print("| context | (a) retention 3+ | (b) F1 | EM | early |")
    print("|---|---|---|---|---|")
    for context in ("snail", "snailT1", "full"):     # snailT1: the snail evaluation sampled at T 1.0 (K = 2-4)
        print(f"| {context} | " + " | ".join(paired(a.runs, a.seeds, context, m)
                                            for m in ("retention_3plus", "f1", "em", "early")) + " |")
    print("\n### Training curves: sampled full-context rollouts on fixed questions (mean over the seeds present)\n")
    keys = ("retention_3plus", "varies", "p_mem", "p_full", "keep_minus_drop_adv", "keep_minus_drop_outcome", "early")
    print("| arm | step | seeds | " + " | ".join(keys) + " | kl |")
    print("|---" * (len(keys) + 4) + "|")
    for arm in ("grpo", "mempo"):
        for step in STEPS:
            points = [q for q in (curve_point(a.runs, arm, s, step) for s in a.seeds) if q]
            if not points:
                continue
            cells = [fmt([q.get(k, float("nan")) for q in points]) for k in keys]
            kl = fmt([kl_at(a.runs, arm, s, step) for s in a.seeds]) if step else "-"
            print(f"| {arm} | {step} | {len(points)} | " + " | ".join(cells) + f" | {kl} |")


if __name__ == "__main__":
    main()
