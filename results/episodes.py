"""What the `<mem>` of shown episodes does, read from ``eval.py --show`` output (the regime study in STUDIES.md).

Three counts per file, for episodes of the multi-objective questions (``--objectives 2``):

* **short first memory**: episodes whose first `<mem>` writes an objective's template with fewer tokens than the
  question's objective (a hop missing, e.g. ``2 = ramu neighbor _ mother _`` for ``ramu neighbor _ mother _
  friend _``), and how many of those end wrong (EM 0). Such a memory answers a hop early in the snail shell.
* **copy fidelity**: the episodes in which some `<mem>` rewrites a slot the one before it had filled (and how many
  of them end wrong); and, over consecutive rounds, of the entity slots the earlier `<mem>` has filled, the share
  the next `<mem>` keeps, rewrites with another entity, or drops (blank or missing). In the snail shell the last
  `<mem>` is the only copy of what was found, so a rewrite loses it.
* **no answer**: episodes that end without an answer, in practice ones that loop on a search up to the round limit.
  Retention by rounds-ago (``eval.memory_retention``) pools rounds, so one 64-round loop weighs as much as ten
  whole K = 2 episodes there; this count says when a retention figure is one such episode.

    python eval.py --checkpoint C --objectives 2 --tasks 64 --show 64 > show.txt
    python results/episodes.py show.txt [more.txt ...]
"""
from __future__ import annotations

import re
import sys


def episodes(text: str) -> list[dict]:
    """Each shown episode: its question's objectives, its EM, and the memory of each round (objective -> tokens)."""
    out = []
    for block in text.split("== trajectory ")[1:]:
        question = re.search(r"question: (.*)", block).group(1)
        objectives = {m.group(1): m.group(2).split() for m in re.finditer(r"(\d+) : ([^?]*)\?", question)}
        memories = []
        for part in re.split(r"-- round \d+", block)[1:]:
            found = re.search(r"memory : (.*?)\n  think", part, re.S)
            memory = " ".join(found.group(1).split()) if found else ""
            memories.append({m.group(1): m.group(2).split() for m in re.finditer(r"(\d+) = ([^;]*)", memory)})
        out.append({"objectives": objectives, "em": int(re.search(r"em (\d)", block).group(1)),
                    "answered": "answer: None" not in block, "memories": memories})
    return out


def short_first_memory(eps: list[dict]) -> tuple[int, int]:
    """(episodes whose first memory drops a hop of some objective, those of them that end wrong)."""
    short = [e for e in eps if e["memories"] and any(len(e["memories"][0].get(k, [])) < len(v)
                                                     for k, v in e["objectives"].items())]
    return len(short), sum(e["em"] == 0 for e in short)


def copy_fidelity(eps: list[dict]) -> dict[str, float]:
    """Shares of the filled entity slots (every second token after the first entity) kept, rewritten, dropped."""
    kept = rewritten = dropped = 0
    for e in eps:
        for before, after in zip(e["memories"], e["memories"][1:]):
            for k, toks in before.items():
                nxt = after.get(k, [])
                for i in range(2, len(toks), 2):
                    if toks[i] == "_":
                        continue
                    if i < len(nxt) and nxt[i] == toks[i]:
                        kept += 1
                    elif i < len(nxt) and nxt[i] != "_":
                        rewritten += 1
                    else:
                        dropped += 1
    n = max(kept + rewritten + dropped, 1)
    return {"slots": kept + rewritten + dropped, "kept": kept / n, "rewritten": rewritten / n, "dropped": dropped / n}


def main(paths: list[str]) -> None:
    print("| file | episodes | wrong | no answer | short first memory (wrong) | rewrite a filled slot (wrong) | "
          "slots kept / rewritten / dropped |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        eps = episodes(open(path).read())
        short, short_wrong = short_first_memory(eps)
        rewrites = [e for e in eps if copy_fidelity([e])["rewritten"] > 0]
        c = copy_fidelity(eps)
        print(f"| {path} | {len(eps)} | {sum(e['em'] == 0 for e in eps)} | {sum(not e['answered'] for e in eps)} | "
              f"{short} ({short_wrong}) | {len(rewrites)} ({sum(e['em'] == 0 for e in rewrites)}) | "
              f"{c['kept']:.3f} / {c['rewritten']:.3f} / {c['dropped']:.3f} of {c['slots']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
