"""Why does Mem-alpha's answerer fail past the chunks its SFT saw? Same memories, day numbers mapped back into range.

The scripted (never flawed) writer builds each held-out instance's memory; the frozen answerer of a run reads it
as ``memalpha_eval`` does (core + BM25 top-3 of each store). Then the same prompts again with every ``day N``
rewritten to ``day ((N - 1) % 10) + 1``, a day number a 4-chunk SFT trained on. If accuracy comes back, what
broke the answerer is the untrained day tokens, not the longer stream. Per question kind: relation questions
whose answer is an entity (the date does not matter to them), ``when`` questions (the date IS the answer, so the
rewrite makes them wrong by design) and ``none`` answers. ``--shift S`` rewrites ``day N`` to ``day N+S`` instead:
for an answerer trained on late days, does it fail on the early days every evaluation instance starts with?
``--first-day A-B`` builds the instances themselves with a first day in A-B (the evaluation's start at 1-3).
``--lines core`` (or ``episodic``) rewrites only the memory lines that start so: which lines break the answerer?
Each row ends with the commonest answers to relation questions.

    python results/memalpha_days.py --checkpoint runs/memalpha/sft --chunks 4 8 16
"""
from __future__ import annotations

import argparse
import os
from collections import Counter
import re
import sys

import torch
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import SPLIT_SEEDS, int_range  # noqa: E402
from models import load_model  # noqa: E402
from recipes.memalpha import answer_contexts  # noqa: E402
from recipes.memalpha_data import make_memalpha_instances, writer_calls  # noqa: E402
from recipes.memalpha_memory import StructuredMemory, answerer_messages  # noqa: E402
from reward import em_score  # noqa: E402


def fold_days(text: str) -> str:
    return re.sub(r"day (\d+)", lambda m: f"day {(int(m.group(1)) - 1) % 10 + 1}", text)


def shift_days(text: str, shift: int) -> str:
    return re.sub(r"day (\d+)", lambda m: f"day {int(m.group(1)) + shift}", text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="the answerer's HF folder (a Mem-alpha run's sft/)")
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--instances", type=int, default=16)
    p.add_argument("--first-day", default="1-3", help="A-B: the instances' first day (memalpha_eval's: 1-3)")
    p.add_argument("--lines", default="", help="rewrite only the memory lines that start with this (core, episodic)")
    p.add_argument("--shift", type=int, default=0, help="rewrite day N to N+SHIFT (0: fold into 1-10)")
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    model = load_model(args.checkpoint, torch.device("cpu")).eval()
    count = lambda s: len(tok.encode(s, add_special_tokens=False))
    first = int_range(args.first_day)
    for n in args.chunks:
        rows, insts = [], make_memalpha_instances(SPLIT_SEEDS["test"], args.instances, seed=0, n_chunks=n,
                                                  first_day=(first[0], first[-1]))
        for inst in insts:
            memory = StructuredMemory(512, count, seed=0)
            for chunk in inst.chunks:
                writer_calls(memory, chunk)
            for q, gold in inst.questions:
                kind = "when" if q.startswith("when ") else "none" if gold == ["none"] else "relation"
                rows.append((answerer_messages(memory, q, 3), gold, kind))
        days = max(c.day for inst in insts for c in inst.chunks)
        other = (f"days shifted by {args.shift}", lambda s: shift_days(s, args.shift)) if args.shift else \
            ("days folded into 1-10", fold_days)
        if args.lines:
            other = (f"{other[0]} in {args.lines}", lambda s, f=other[1]: "\n".join(
                f(ln) if ln.startswith(args.lines) else ln for ln in s.split("\n")))
        for name, fix in (("as written", lambda s: s), other):
            msgs = [[m[0], {"role": "user", "content": fix(m[1]["content"])}] for m, _, _ in rows]
            answers = answer_contexts(model, tok, msgs)
            right = [em_score(a, g) for a, (_, g, _) in zip(answers, rows)]
            common = Counter(a for a, (_, _, k) in zip(answers, rows) if k == "relation").most_common(3)
            by = {k: [r for r, (_, _, kk) in zip(right, rows) if kk == k] for k in ("relation", "when", "none")}
            print(f"chunks {n:2d} (days up to {days:2d}), {name:22s} " + "  ".join(
                f"{k} {sum(v) / len(v):.3f} (n {len(v)})" for k, v in by.items() if v) +
                "  relation answers: " + ", ".join(f"{a!r} x{c}" for a, c in common))


if __name__ == "__main__":
    main()
