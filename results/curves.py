"""Learning curves of RL runs that kept a model at every save (``train.py --keep-checkpoints``), arm against arm.

Each kept model (``RUN/step_NNNN``) and the run's start (``--model`` in ``RUN/config.json``, step 0) is scored by
``eval.py`` (greedy, held-out test worlds, ``--tasks`` questions per K); the score is cached beside the model as
``eval_test_<tasks>.json``, so a second call only reads. Runs of two arms are paired by their position in the
lists (the same SFT start and RL seed); every figure is a mean over runs with the half-width of its 95%
t-interval, and the last arm minus the first is paired run by run. Also from each run's metrics.jsonl: the KL
to the start (``--log-kl``), the training score (a 20-step window) and the share of groups whose outcome ties.

    python results/curves.py --arm mempo=runs/all/mempo_s0,runs/all/mempo_s1 \
        --arm grpo=runs/all/grpo_s0,runs/all/grpo_s1 --out results/curves_all

writes OUT/curves.json, OUT/curves.txt (the tables) and, with matplotlib, OUT/curves.png (bands: 95% intervals;
``--also NAME=OTHER_OUT`` adds an earlier call's curves as a second row, two settings in one figure).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from eval import mean_ci  # noqa: E402  (the evaluator's 95% t-interval, so the tables match eval.py --compare)


def scored(model: str, ks: list[int], tasks: int) -> dict[int, float]:
    """F1 per K of ``model`` (eval.py's JSON line), cached in the model's folder."""
    cache = os.path.join(model, f"eval_test_{tasks}.json")
    res = json.load(open(cache)) if os.path.exists(cache) else {}
    if not all(str(k) in res for k in ks):
        out = subprocess.run([sys.executable, "eval.py", "--checkpoint", model, "--objectives", *map(str, ks),
                              "--tasks", str(tasks)], cwd=ROOT, capture_output=True, text=True, check=True)
        res.update({k: v["f1"] for k, v in json.loads(out.stdout.strip().splitlines()[-1])["results"].items()})
        json.dump(res, open(cache, "w"))
    return {k: res[str(k)] for k in ks}


def run_curve(run: str, ks: list[int], tasks: int) -> dict:
    """{"steps", "f1": {K: [..]}, "kl", "score", "zero_var"} of one run."""
    cfg = json.load(open(os.path.join(run, "config.json")))
    kept = sorted(d for d in os.listdir(run) if d.startswith("step_"))
    models = [(0, cfg["model"])] + [(int(d[5:]), os.path.join(run, d)) for d in kept]
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    f1 = {k: [] for k in ks}
    for _, model in models:
        for k, v in scored(model, ks, tasks).items():
            f1[k].append(v)
    steps = [s for s, _ in models]
    window = lambda s: [r["score"] for r in rows if s - 20 <= r["step"] < s] or [rows[0]["score"]]
    return {"steps": steps, "f1": f1,
            # skipped steps log none
            "kl": [next((r["kl"] for r in reversed(rows[:s]) if "kl" in r), 0.0) for s in steps],
            "score": [sum(window(s)) / len(window(s)) if s else rows[0]["score"] for s in steps],
            "zero_var": sum(r["zero_var_frac"] for r in rows) / len(rows),
            "zero_var_mem": sum(r["zero_var_mem_frac"] for r in rows) / len(rows)}


def series(curves: list[dict], key: str, ks: list[int] | None = None) -> list[list[float]]:
    """Per run, the curve of ``key`` (an F1 key ``f1`` averaged over ``ks``)."""
    if key == "f1":
        return [[sum(c["f1"][k][i] for k in ks) / len(ks) for i in range(len(c["steps"]))] for c in curves]
    return [c[key] for c in curves]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arm", action="append", required=True, metavar="NAME=RUN[,RUN...]")
    p.add_argument("--objectives", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--tasks", type=int, default=64)
    p.add_argument("--out", required=True)
    p.add_argument("--label", default="", help="the setting's name in the figure (default: OUT's folder name)")
    p.add_argument("--also", action="append", default=[], metavar="NAME=OUT",
                   help="another setting's OUT (its curves.json) as a second row of the figure")
    args = p.parse_args(argv)
    arms = {a.split("=", 1)[0]: a.split("=", 1)[1].split(",") for a in args.arm}
    curves = {name: [run_curve(r, args.objectives, args.tasks) for r in runs] for name, runs in arms.items()}
    n = min(len(c) for c in curves.values())
    steps = min((c[0]["steps"] for c in curves.values()), key=len)
    views = [(f"F1 K={k}", "f1", [k]) for k in args.objectives]
    views += [("F1 K=3-4", "f1", [k for k in args.objectives if k in (3, 4)])] if 3 in args.objectives else []
    views += [("KL to the start", "kl", None), ("training score (20 steps)", "score", None)]
    names = list(curves)
    table, out = [], {"arms": arms, "tasks": args.tasks, "steps": steps, "views": {}}
    for title, key, ks in views:
        per = {a: [s[:len(steps)] for s in series(curves[a][:n], key, ks)] for a in names}
        table.append(f"\n{title} (mean +- 95% half-width over {n} paired runs; last column: {names[-1]} - {names[0]})")
        table.append("step  " + "".join(f"{a:>18}" for a in names) + f"{'diff':>18}")
        view = {}
        for i, s in enumerate(steps):
            cells = {a: mean_ci([r[i] for r in per[a]]) for a in names}
            diff = mean_ci([x[i] - y[i] for x, y in zip(per[names[-1]], per[names[0]])])
            view[s] = {**{a: cells[a] for a in names}, "diff": diff}
            table.append(f"{s:<6}" + "".join(f"{m:>11.3f} +-{h:.3f}" for m, h in [*cells.values(), diff]))
        out["views"][title] = view
    for a in names:
        table.append(f"{a}: groups whose outcome ties {mean_ci([c['zero_var'] for c in curves[a][:n]])[0]:.3f}, "
                     f"of them with memory rewards that differ "
                     f"{mean_ci([c['zero_var_mem'] for c in curves[a][:n]])[0]:.3f} (share of all groups)")
    os.makedirs(args.out, exist_ok=True)
    text = "\n".join(table)
    print(text)
    open(os.path.join(args.out, "curves.txt"), "w").write(text + "\n")
    json.dump(out | {"curves": curves}, open(os.path.join(args.out, "curves.json"), "w"), indent=1)
    setting = args.label or os.path.basename(os.path.normpath(args.out))
    rows = [(setting, out)] + [(a.split("=", 1)[0], json.load(open(os.path.join(a.split("=", 1)[1], "curves.json"))))
                               for a in args.also]
    plot(rows, os.path.join(args.out, "curves.png"))


def plot(rows: list[tuple[str, dict]], path: str) -> None:
    """One row of panels per setting: F1 K=2, F1 K=3-4, KL, training score (each arm's mean and 95% band), and the
    last arm minus the first over K=3-4, paired run by run (its 95% band)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure")
        return
    titles = ["F1 K=2", "F1 K=3-4", "KL to the start", "training score (20 steps)", "F1 K=3-4"]
    fig, axes = plt.subplots(len(rows), len(titles), figsize=(3.6 * len(titles), 3.2 * len(rows)), squeeze=False)
    for row, (setting, out) in zip(axes, rows):
        steps, names = out["steps"], list(out["arms"])
        for i, (ax, title) in enumerate(zip(row, titles)):
            view = {int(s): cells for s, cells in out["views"][title].items()}     # JSON keys are strings
            paired = i == len(titles) - 1          # the last panel: the paired difference, last arm - first
            for a in ["diff"] if paired else names:
                m, h = [view[s][a][0] for s in steps], [view[s][a][1] for s in steps]
                line, = ax.plot(steps, m, marker="o", label=a, color="k" if paired else None)
                ax.fill_between(steps, [x - y for x, y in zip(m, h)], [x + y for x, y in zip(m, h)], alpha=0.2,
                                color=line.get_color())
            if paired:
                ax.axhline(0, color="grey", lw=0.8)
                title = f"{title}: {names[-1]} - {names[0]}, paired"
            ax.set_title(f"{setting}: {title}" if len(rows) > 1 else title, fontsize=9)
            ax.set_xlabel("RL step")
        row[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print("figure:", path)


if __name__ == "__main__":
    main()
