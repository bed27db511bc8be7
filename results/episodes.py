"""What the `<mem>` of shown episodes does, read from ``eval.py --show`` output (the regime study in STUDIES.md).

Four counts per file, for episodes of the multi-objective questions (``--objectives 2``, or any K):

* **short first memory**: episodes whose first `<mem>` writes an objective's template with fewer tokens than the
  question's objective (a hop missing, e.g. ``2 = ramu neighbor _ mother _`` for ``ramu neighbor _ mother _
  friend _``), and how many of those end wrong (EM 0). Such a memory answers a hop early in the snail shell.
* **copy fidelity**: the episodes in which some `<mem>` rewrites a slot the one before it had filled (and how many
  of them end wrong); and, over consecutive rounds, of the entity slots the earlier `<mem>` has filled, the share
  the next `<mem>` keeps, rewrites with another entity, or drops (blank or missing). In the snail shell the last
  `<mem>` is the only copy of what was found, so a rewrite loses it.
* **slot reads**: of the entity slots a `<mem>` fills that the one before it left blank, the share that is the object
  of the result line the previous round's query asked for (``d7 fovi rival kede`` for ``<search> fovi rival``:
  right), another name of that result (misread), a name not in it (invented), or written after a result without
  that line (not retrieved: the query named a wrong entity, or the line was not in the top results). It says
  whether the agent can read its search results at all, apart from what its memory keeps.
* **no answer**: episodes that end without an answer, in practice ones that loop on a search up to the round limit.
  Retention by rounds-ago (``eval.memory_retention``) pools rounds, so one 64-round loop weighs as much as ten
  whole K = 2 episodes there; this count says when a retention figure is one such episode.

    python eval.py --checkpoint C --objectives 2 --tasks 64 --show 64 > show.txt
    python results/episodes.py show.txt [more.txt ...]
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from data import SLOT, parse_mem  # noqa: E402  (the memory's entries as the evaluator reads them)


def episodes(text: str) -> list[dict]:
    """Each shown episode: its question's objectives, its EM, and the memory of each round (objective index ->
    tokens, ``data.parse_mem``)."""
    out = []
    for block in text.split("== trajectory ")[1:]:
        question = re.search(r"question: (.*)", block).group(1)
        objectives = {int(m.group(1)) - 1: m.group(2).split() for m in re.finditer(r"(\d+) : ([^?]*)\?", question)}
        memories, queries, results = [], [], []
        for part in re.split(r"-- round \d+", block)[1:]:
            found = re.search(r"memory : (.*?)\n  think", part, re.S)
            memories.append(parse_mem(" ".join(found.group(1).split()) if found else ""))
            query = re.search(r"<search>(.*?)</search>", part)
            queries.append(query.group(1).split() if query else None)
            result = re.search(r"<information>(.*?)</information>", part, re.S)
            results.append([line.split()[1:] for line in re.findall(r"d\d+ \S+ \S+ \S+",
                                                                     " ".join(result.group(1).split()))]
                           if result else [])
        out.append({"objectives": objectives, "em": int(re.search(r"em (\d)", block).group(1)),
                    "answered": "answer: None" not in block, "memories": memories, "queries": queries,
                    "results": results})
    return out


def short_first_memory(eps: list[dict]) -> tuple[int, int]:
    """(episodes whose first memory drops a hop of some objective, those of them that end wrong)."""
    short = [e for e in eps if e["memories"] and any(len(e["memories"][0].get(k, [])) < len(v)
                                                     for k, v in e["objectives"].items())]
    return len(short), sum(e["em"] == 0 for e in short)


def slot_changes(episode: dict) -> tuple[int, int, int]:
    """(kept, rewritten, dropped): what each next `<mem>` does with the entity slots (every second token after the
    first entity) the one before it had filled."""
    kept = rewritten = dropped = 0
    for before, after in zip(episode["memories"], episode["memories"][1:]):
        for k, toks in before.items():
            nxt = after.get(k, [])
            for i in range(2, len(toks), 2):
                if toks[i] == SLOT:
                    continue
                if i < len(nxt) and nxt[i] == toks[i]:
                    kept += 1
                elif i < len(nxt) and nxt[i] != SLOT:
                    rewritten += 1
                else:
                    dropped += 1
    return kept, rewritten, dropped


def slot_reads(episode: dict) -> tuple[int, int, int, int]:
    """(right, misread, invented, not retrieved): each slot a `<mem>` fills that the one before it left blank,
    against the result of the round before it (the module's docstring)."""
    right = misread = invented = not_retrieved = 0
    rounds = zip(episode["memories"], episode["queries"], episode["results"], episode["memories"][1:])
    for before, query, result, after in rounds:
        if not query or len(query) != 2:
            continue
        asked = [obj for subj, rel, obj in result if (subj, rel) == (query[0], query[1])]
        names = {name for subj, _, obj in result for name in (subj, obj)}
        for k, toks in after.items():
            old = before.get(k, [])
            for i in range(2, len(toks), 2):
                if toks[i] == SLOT or (i < len(old) and old[i] != SLOT):
                    continue
                if not asked:
                    not_retrieved += 1
                elif toks[i] == asked[0]:
                    right += 1
                elif toks[i] in names:
                    misread += 1
                else:
                    invented += 1
    return right, misread, invented, not_retrieved


def main(paths: list[str]) -> None:
    print("| file | episodes | wrong | no answer | short first memory (wrong) | rewrite a filled slot (wrong) | "
          "slots kept / rewritten / dropped | slots filled: right / misread / invented / not retrieved |")
    print("|---|---|---|---|---|---|---|---|")
    for path in paths:
        eps = episodes(open(path).read())
        short, short_wrong = short_first_memory(eps)
        changes = [slot_changes(e) for e in eps]
        rewrites = [e for e, (_, rewritten, _) in zip(eps, changes) if rewritten]
        kept, rewritten, dropped = (sum(c[i] for c in changes) for i in range(3))
        n = max(kept + rewritten + dropped, 1)
        each = [slot_reads(e) for e in eps]
        reads = [sum(r[i] for r in each) for i in range(4)]
        filled = max(sum(reads), 1)
        print(f"| {path} | {len(eps)} | {sum(e['em'] == 0 for e in eps)} | {sum(not e['answered'] for e in eps)} | "
              f"{short} ({short_wrong}) | {len(rewrites)} ({sum(e['em'] == 0 for e in rewrites)}) | "
              f"{kept / n:.3f} / {rewritten / n:.3f} / {dropped / n:.3f} of {kept + rewritten + dropped} | "
              + " / ".join(f"{r / filled:.3f}" for r in reads) + f" of {sum(reads)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
