"""Per question, what the greedy snail-shell episodes of ``eval.py --data --compose`` did, and where each missed
objective was lost; with two checkpoints, their paired F1 difference per K.

    python results/wiki_causes.py --checkpoint runs/sft runs/rl --data test.jsonl --corpus wiki.jsonl \\
        --compose 1 2 --max-turns 6 --max-new-tokens 256

The episodes are eval.py's own (``eval.load``, ``eval.greedy_agent``, ``rollout.run_episodes`` in batches of 64,
tasks from ``data.compose_tasks`` at seed 0), so the means printed equal eval.py's. Each objective an episode did
not answer right (EM) is put in the first of: the episode broke a format rule (``valid`` 0, scored 0); no search
result it saw held the gold answer (``retrieved``: ``sft.held_answers``, the gold's words in the text); its last
round's ``<mem>`` did not hold it (``in_mem``: the memory the answer was written from, in the snail shell); else
it answered something else though its memory held the gold (``misread``). The paired interval is the mean of the
per-question F1 differences (second checkpoint minus first) with its 95% t-interval (``eval.mean_ci``).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import data  # noqa: E402
import eval as ev  # noqa: E402
from memory import extract_mem  # noqa: E402
from reward import em_score, outcome_reward  # noqa: E402
from rollout import run_episodes  # noqa: E402
from search import open_search  # noqa: E402
from sft import held_answers  # noqa: E402


def causes(traj) -> dict:
    """One episode's F1, validity, and per objective: retrieved, held in the last ``<mem>``, answered right."""
    out = outcome_reward(traj)
    seen = " ".join(r.text for r in traj.records if r.type in ("search_results", "webpage"))
    mem = (extract_mem(traj.rounds[-1].text) or "") if traj.rounds else ""
    parts = [p.strip() for p in (traj.answer or "").split(";")] if out["valid"] else []
    parts += [""] * (len(traj.golds) - len(parts))
    objectives = []
    for k, golds in enumerate(traj.golds):
        retrieved = held_answers([golds], seen)[0] != data.UNKNOWN
        in_mem = held_answers([golds], mem)[0] != data.UNKNOWN
        right = bool(out["valid"]) and em_score(parts[k], golds) == 1.0
        lost = ("right" if right else "invalid" if not out["valid"] else "not retrieved" if not retrieved
                else "not in mem" if not in_mem else "misread")
        objectives.append({"retrieved": retrieved, "in_mem": in_mem, "right": right, "lost": lost})
    return {"f1": out["f1"], "em": out["em"], "valid": bool(out["valid"]), "turns": len(traj.rounds),
            "objectives": objectives}


def main(argv=None) -> None:
    """Play the checkpoints' episodes, print the per-K breakdown and the paired difference."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", nargs="+", required=True, help="one or two run / checkpoint folders (or smollm2)")
    p.add_argument("--data", required=True)
    p.add_argument("--corpus", default="")
    p.add_argument("--search-url", default="")
    p.add_argument("--compose", type=int, nargs="+", default=[1])
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--out", default="", help="write every episode's row here (JSONL)")
    args = p.parse_args(argv)
    tasks, tool = data.load_qa(args.data), open_search(args.corpus, args.search_url)
    rows: dict[str, dict[int, list[dict]]] = {}
    for ckpt in args.checkpoint:
        model, tok, prompt = ev.load(ckpt, torch.device("cpu"))
        agent = ev.greedy_agent("snail", args.max_turns, args.max_new_tokens, prompt)
        rows[ckpt] = {k: [causes(t) for t in run_episodes(model, tok, data.compose_tasks(tasks, k, 0), tool, agent)]
                      for k in args.compose}
        for k, rs in rows[ckpt].items():
            objs = [o for r in rs for o in r["objectives"]]
            share = lambda key: sum(o[key] for o in objs) / len(objs)
            lost = {why: sum(o["lost"] == why for o in objs) / len(objs)
                    for why in ("invalid", "not retrieved", "not in mem", "misread")}
            mean = lambda key: sum(r[key] for r in rs) / len(rs)
            print(f"{ckpt} K={k}: F1 {mean('f1'):.3f}  EM {mean('em'):.3f}"
                  f"  valid {mean('valid'):.3f}  objectives {len(objs)}: retrieved "
                  f"{share('retrieved'):.3f} in last <mem> {share('in_mem'):.3f} right {share('right'):.3f}; lost: "
                  + ", ".join(f"{why} {v:.3f}" for why, v in lost.items()), flush=True)
        del model
    if len(args.checkpoint) == 2:
        a, b = args.checkpoint
        for k in args.compose:
            diff = [y["f1"] - x["f1"] for x, y in zip(rows[a][k], rows[b][k])]
            m, h = ev.mean_ci(diff)
            print(f"K={k}: {b} - {a} F1 {m:+.3f} +- {h:.3f} (paired over {len(diff)} questions; "
                  f"{sum(d > 0 for d in diff)} up, {sum(d < 0 for d in diff)} down)")
    if args.out:
        with open(args.out, "w") as f:
            for ckpt, by_k in rows.items():
                for k, rs in by_k.items():
                    f.writelines(json.dumps({"checkpoint": ckpt, "k": k, "question": i} | r) + "\n"
                                 for i, r in enumerate(rs))


if __name__ == "__main__":
    main()
