"""Mem-alpha's evaluation: the writer (RUN/final) builds a memory per held-out
instance greedily; the frozen answerer (RUN/sft, the cold-started copy, or ``--answerer``) answers
from core + BM25 top-k of each store. Reported: accuracy (exact match), memory tokens, tool-call
success (successful / all calls), the reward's parts r1..r4 unweighted, each as training computes it (r1
and r3 per instance, r2 and r4 per chunk step), the input's chunk tokens, and the memory against the
long-context window's budget: ``over_budget`` = the share of memories with more tokens than
``--context-tokens`` (a writer past it keeps more than that baseline may read); on the embedded world also
``scripted``: the same answerer reading the scripted (never flawed) writer's memory, the ceiling of what a
writer can give it, with its reward parts as the writer's; and for the writer, what the weak writer's
failures are made of (``--writer weak``): ``entries_kept``, the share of the scripted memory's entries its
final memory holds word for word, and ``core_empty``, the share of its final memories with an empty core.
Baselines on the same streams with the same answerer: ``long_context`` (the newest raw chunks that fit
``--context-tokens``) and ``rag_top2`` (BM25 top-2 raw chunks for the question). Memory tokens of a
baseline = what it keeps: the chunks in its window, or every chunk for RAG. The embedded answerer learnt raw-chunk
contexts in SFT too (``recipes.memalpha.memalpha_raw_rows``), so the three conditions share one answerer.

    python -m recipes.memalpha_eval --checkpoint runs/memalpha [--data chunks.jsonl]
    python -m recipes.memalpha_eval --checkpoint runs/memalpha --chunks 4 8 16     # past the training horizon

``--chunks`` takes several counts: each is its own set of held-out instances over the same test world (the
paper trains on inputs up to 30k tokens and evaluates up to 474k; here the writer can be measured past the
chunk count its SFT and GRPO saw). Per count one line per method, then one JSON line last, by count.
"""
from __future__ import annotations

import json
import os
import time

from transformers import AutoTokenizer

from data import SPLIT_SEEDS, exit_on_bad_input
from flags import Accepts, FlagParser
from models import load_model, pick_device
from recipes.memalpha import (WriterConfig, answer_contexts, memalpha_rollout, r2_call_success, r3_compression,
                              r4_validity)
from recipes.memalpha_data import (chunks_messages, load_memalpha, long_context_chunks, make_memalpha_instances,
                                   max_chunks, rag_chunks, writer_calls)
from recipes.memalpha_memory import (LIST_TYPES, StructuredMemory, answerer_messages, execute_tool_calls,
                                     parse_tool_calls)
from reward import em_score


def evaluate_memalpha(writer, answerer, tokenizer, instances: list, k: int = 3, context_tokens: int = 64,
                      max_new_tokens: int = 192, scripted: bool = False) -> dict:
    """Mem-alpha writer vs long-context and RAG-top-2 on the same instances -> {method: metrics};
    ``scripted`` adds the scripted writer's memory (embedded instances only: it reads ``Chunk.reports``)."""
    count = lambda s: len(tokenizer.encode(s, add_special_tokens=False))
    rolls = memalpha_rollout(writer, tokenizer, instances, 1, WriterConfig(max_new_tokens=max_new_tokens,
                                                                          temperature=0.0))
    views = {"memalpha": [], "long_context": [], "rag_top2": []} | ({"scripted": []} if scripted else {})
    kept = {m: [] for m in views}
    golds, owner = [], []                                                # owner: the instance of each question
    ideals, script_steps = [], []          # the scripted writer's final memory and (calls, results) per instance
    for i, (r, inst) in enumerate(zip(rolls, instances)):
        texts = [c.text for c in inst.chunks]
        window = long_context_chunks(texts, count, context_tokens)
        if scripted:                   # the ceiling: the SFT teacher's memory (never flawed) read by the same answerer
            ideal = StructuredMemory(r.memory.core_limit, count, seed=0)
            replay = StructuredMemory(r.memory.core_limit, count, seed=0)      # the same calls again, for their results
            script_steps.append([])
            for chunk in inst.chunks:
                calls = parse_tool_calls(writer_calls(ideal, chunk))
                script_steps[-1].append((calls, execute_tool_calls(replay, calls)))
            ideals.append(ideal)
            kept["scripted"].append(ideal.n_tokens())
            views["scripted"] += [answerer_messages(ideal, q, k) for q, _ in inst.questions]
        kept["memalpha"].append(r.memory.n_tokens())
        kept["long_context"].append(sum(count(c) for c in window))
        kept["rag_top2"].append(sum(count(c) for c in texts))
        for q, g in inst.questions:
            views["memalpha"].append(answerer_messages(r.memory, q, k))
            views["long_context"].append(chunks_messages(window, q))
            views["rag_top2"].append(chunks_messages(rag_chunks(texts, q, 2), q))
            golds.append(g)
            owner.append(i)
    calls = [res for r in rolls for s in r.steps for res in s.results]
    # inserts whose every word comes from the chunk or is "on" / "day" / its number: copied, not invented
    inserts = [(c.arguments["content"], inst.chunks[j].text) for r, inst in zip(rolls, instances)
               for j, s in enumerate(r.steps) for c in s.calls if c.error is None and c.name == "new_memory_insert"]
    copied = [set(x.split()) <= set(t.split()) | {"on", "day"} for x, t in inserts]
    out, right = {}, {}
    for method, msgs in views.items():
        preds = answer_contexts(answerer, tokenizer, msgs)
        right[method] = [em_score(p, g) for p, g in zip(preds, golds)]
        out[method] = {"accuracy": sum(right[method]) / len(golds),
                       "memory_tokens": sum(kept[method]) / len(kept[method]), "questions": len(golds)}
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
    steps = [s for r in rolls for s in r.steps]
    input_tokens = [sum(count(c.text) for c in inst.chunks) for inst in instances]

    def parts(method: str, chunk_steps: list[tuple[list, list]]) -> dict:
        """r1..r4 of a writer as training computes them: r1 and r3 per instance, r2 and r4 per chunk step."""
        return dict(r1=mean([mean([h for h, o in zip(right[method], owner) if o == i]) for i in range(len(rolls))]),
                    r2=mean([r2_call_success(res) for _, res in chunk_steps]),
                    r3=mean([r3_compression(m, n) for m, n in zip(kept[method], input_tokens)]),
                    r4=mean([r4_validity(c) for c, _ in chunk_steps]))

    out["memalpha"].update(tool_success=mean([ok for ok, _ in calls]), calls_per_chunk=len(calls) / len(steps),
                           inserts_copied=mean(copied), **parts("memalpha", [(s.calls, s.results) for s in steps]),
                           input_tokens=mean(input_tokens),
                           over_budget=mean([m > context_tokens for m in kept["memalpha"]]),
                           core_empty=mean([r.memory.core == "" for r in rolls]))
    if scripted:
        out["memalpha"]["entries_kept"] = mean([kept_share(r.memory, ideal) for r, ideal in zip(rolls, ideals)])
        out["scripted"].update(parts("scripted", [s for ss in script_steps for s in ss]))
    return out


def kept_share(memory: StructuredMemory, reference: StructuredMemory) -> float:
    """The share of ``reference``'s semantic and episodic entries that ``memory`` holds word for word, in the same
    store (1.0 when the reference holds none): what a writer kept of what the scripted writer keeps."""
    want = [(t, x) for t in LIST_TYPES for _, x in reference.entries(t)]
    have = {(t, " ".join(x.split())) for t in LIST_TYPES for _, x in memory.entries(t)}
    return sum((t, " ".join(x.split())) in have for t, x in want) / len(want) if want else 1.0


def main(argv=None) -> None:
    p = FlagParser(description="Evaluate a Mem-alpha run against long-context and RAG-top-2.")
    p.add_argument("--checkpoint", required=True, help="Mem-alpha run folder (writer in final/, answerer in sft/)")
    p.add_argument("--answerer", default="", help="HF path of the answerer (default: RUN/sft)")
    p.add_argument("--writer", default="", help="HF path of the writer (default: RUN/final; RUN/sft = the SFT writer)")
    p.add_argument("--data", default="", help="chunked instances JSONL (chunks, questions_and_answers)")
    p.add_argument("--instances", type=Accepts(int, min=1), default=64, help="held-out instances (embedded world)")
    p.add_argument("--split", default="test", type=Accepts(str, choices=tuple(SPLIT_SEEDS)),
                   help="held-out world seeds")
    p.add_argument("--seed", type=Accepts(int, unbounded=True), default=0, help="which held-out instances")
    p.add_argument("--chunks", type=Accepts(int, min=1), nargs="+", default=[4],
                   help="chunks per instance (embedded world); several counts evaluate each, e.g. 4 8 16")
    p.add_argument("--top-k", type=Accepts(int, min=1), default=3, help="BM25 top-k of each store for the answerer")
    p.add_argument("--context-tokens", type=Accepts(int, min=1), default=64,
                   help="long-context baseline's budget of chunk tokens")
    p.add_argument("--max-new-tokens", type=Accepts(int, min=1), default=192,
                   help="max tokens the writer generates per chunk")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = p.parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        p.error(f"checkpoint folder {args.checkpoint} does not exist")
    if args.data and args.chunks != [4]:
        p.error(f"--chunks {' '.join(map(str, args.chunks))}: not with --data (its instances have their own chunks)")
    if max(args.chunks) > max_chunks():
        p.error(f"--chunks {max(args.chunks)}: a world holds {max_chunks()} chunks of 2 new facts (must be <= "
                f"{max_chunks()})")
    device = pick_device(args.device)
    final = args.writer or os.path.join(args.checkpoint, "final")
    writer = load_model(final, device).eval()
    answerer = load_model(args.answerer or os.path.join(args.checkpoint, "sft"), device).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    by_chunks, sec = {}, {}
    for n in ["file"] if args.data else list(dict.fromkeys(args.chunks)):
        t0 = time.time()
        instances = load_memalpha(args.data) if args.data else \
            make_memalpha_instances(SPLIT_SEEDS[args.split] + args.seed, args.instances, seed=args.seed, n_chunks=n)
        res = by_chunks[str(n)] = evaluate_memalpha(writer, answerer, tokenizer, instances, args.top_k,
                                                    args.context_tokens, args.max_new_tokens, scripted=not args.data)
        sec[str(n)] = time.time() - t0
        print(f"chunks {n}: {len(instances)} instances, {sec[str(n)]:.1f} s")
        for method, r in res.items():
            print(f"  {method:13s} " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in r.items()))
    print(json.dumps({"checkpoint": args.checkpoint, "writer": final, "split": args.split, "by_chunks": by_chunks,
                      "sec": sec}))


if __name__ == "__main__":
    exit_on_bad_input(main)              # a missing or broken input: one line, exit status 2
