"""Tables of the full-context regime study (results/STUDIES.md): SFT, MemPO and GRPO per K, in the snail shell and in
the full context, and MemPO - GRPO paired by SFT seed.

Reads the JSON line ``eval.py`` prints last, one file per (arm, seed, context):
``RUNS/eval_{arm}_s{seed}_{context}.txt`` as written by

    python eval.py --checkpoint C --objectives 1 2 3 4 5 6 8 --tasks 64 --context snail > RUNS/eval_mempo_s0_snail.txt

and prints markdown: each arm's mean +- 95% t half-width over the seeds present (F1, EM, early, retention 3+ rounds
ago, peak tokens of a round), then MemPO - GRPO (and each RL arm - SFT) paired by seed at K = 2, over K = 3-4 and over
K = 2-4 (the mean of the K's F1), with each seed's value. ``--arms`` adds MemPO variants (files named by the arm, e.g.
``eval_right_s0_snail.txt``), each paired against GRPO, MemPO and the SFT.

    python results/regime.py --runs /path/to/runs --seeds 0 1 2 3 4
    python results/regime.py --runs /path/to/runs --seeds 0 1 2 --arms sft grpo mempo right nonzero w05
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from eval import mean_ci  # noqa: E402  (the evaluator's 95% t-interval)

ARMS = ("sft", "grpo", "mempo")
SPANS = {"K=2": (2,), "K=3-4": (3, 4), "K=2-4": (2, 3, 4)}


def load(runs: str, arm: str, seed: int, context: str) -> dict | None:
    """The per-K results of ``RUNS/eval_{arm}_s{seed}_{context}.txt`` (see ``read``)."""
    return read(os.path.join(runs, f"eval_{arm}_s{seed}_{context}.txt"))


def read(path: str) -> dict | None:
    """The per-K results of one evaluation, or None when its file is missing or holds no JSON line."""
    if not os.path.exists(path):
        return None
    lines = [line for line in open(path) if line.startswith("{")]
    return json.loads(lines[-1])["results"] if lines else None


def over(res: dict, ks: tuple[int, ...], metric: str) -> float:
    """The mean of ``metric`` over the K's ``ks`` (NaN when one is missing)."""
    vals = [res[str(k)].get(metric, float("nan")) for k in ks if str(k) in res]
    return sum(vals) / len(vals) if len(vals) == len(ks) else float("nan")


def fmt(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    m, h = mean_ci(xs)
    return f"{m:.3f} +- {h:.3f}" if len(xs) > 1 else f"{m:.3f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", required=True, help="folder of the eval_*.txt files")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--arms", nargs="+", default=list(ARMS), help="sft first; grpo and mempo are the baselines")
    a = p.parse_args(argv)
    rank = lambda arm: ARMS.index(arm) if arm in ARMS else len(ARMS)      # a variant ranks above MemPO
    pairs = [(x, y) for x in a.arms for y in reversed(ARMS) if y in a.arms and rank(y) < rank(x)]
    for context in ("snail", "full"):
        res = {arm: {s: load(a.runs, arm, s, context) for s in a.seeds} for arm in a.arms}
        ks = sorted({int(k) for r in res["sft"].values() if r for k in r}, key=int)
        print(f"\n### {context} context: mean +- 95% t half-width over seeds (n = seeds present)\n")
        print("| arm | metric | " + " | ".join(f"K={k}" for k in ks) + " |")
        print("|---|---|" + "---|" * len(ks))
        for arm in a.arms:
            present = {s: r for s, r in res[arm].items() if r}
            for metric in ("f1", "em", "early", "retention_3plus", "pt"):
                cells = [fmt([r[str(k)].get(metric, float("nan")) for r in present.values() if str(k) in r])
                         for k in ks]
                print(f"| {arm} (n={len(present)}) | {metric} | " + " | ".join(cells) + " |")
        print(f"\n{context}: paired by SFT seed (seeds with both arms), mean +- 95% t half-width; each seed's value\n")
        for x, y in pairs:
            seeds = [s for s in a.seeds if res[x][s] and res[y][s]]
            if not seeds:
                continue
            for metric in ("f1", "em", "early", "retention_3plus"):
                parts = []
                for name, span in SPANS.items():
                    d = [over(res[x][s], span, metric) - over(res[y][s], span, metric) for s in seeds]
                    parts.append(f"{name} {fmt(d)} ({' / '.join(f'{v:+.3f}' for v in d)})")
                print(f"* {x} - {y}, {metric} (seeds {', '.join(map(str, seeds))}): " + "; ".join(parts))


if __name__ == "__main__":
    main()
