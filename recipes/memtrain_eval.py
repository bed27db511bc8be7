"""MemTrain's evaluation: reconstruction and IMR accuracy of the memory agent (greedy).

    python -m recipes.memtrain_eval --checkpoint runs/memtrain [--corpus wiki.jsonl]

Greedy memory-agent rollouts on held-out masked-reconstruction tasks: reconstruction accuracy = the
fraction whose final <answer> is the masked entity (normalised EM); IMR accuracy = one IMR query per
trajectory (step k, chunk l < k, [TARGET]; drawn with a seeded rng), answered greedily from memory o_k.
Held-out world tasks come from the split's world seeds (disjoint from the random seeds of training
worlds except by a one-in-10^9 chance, as for the QA splits); a real corpus uses the text heuristic.
An SFT checkpoint of the world gets ``[MASK]`` / ``[TARGET]`` added first (``add_words``). One JSON line last.
"""
from __future__ import annotations

import json
import os
import random

import data
from eval import load
from flags import Accepts, FlagParser
from models import pick_device
from recipes.memtrain import MemAgentConfig, imr_rollout, memory_rollout, reconstruction_reward
from recipes.memtrain_tasks import (MEMTRAIN_WORDS, add_words, imr_task, masked_reconstruction_tasks,
                                    world_memtrain_tasks)

SPLIT_SEEDS = data.SPLIT_SEEDS


def memtrain_heldout(n: int, split: str = "test", seed: int = 0, max_chunks: int = 4,
                     corpus: list[dict] | None = None) -> tuple[list, frozenset | None]:
    """``n`` held-out masked-reconstruction tasks (a split world, or ``corpus``) and the entity names to use."""
    if corpus is not None:
        return masked_reconstruction_tasks(corpus, n, SPLIT_SEEDS[split] + seed, max_chunks), None
    return (world_memtrain_tasks(SPLIT_SEEDS[split] + 500 + seed, n, seed=SPLIT_SEEDS[split] + seed,
                                      max_chunks=max_chunks), frozenset(data.name_pool()))


def memtrain_summary(golds: list[str], answers: list[str | None], imr_targets: list[str],
                     imr_answers: list[str | None]) -> dict:
    """Reconstruction accuracy, IMR accuracy, answered rate and counts from predictions and golds."""
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0    # noqa: E731
    return {"reconstruction": mean([reconstruction_reward(a, g) for a, g in zip(answers, golds)]),
            "imr": mean([reconstruction_reward(a, g) for a, g in zip(imr_answers, imr_targets)]),
            "answered": mean([a is not None for a in answers]), "n": len(golds), "imr_n": len(imr_targets)}


def evaluate_memtrain(model, tokenizer, tasks: list, names=None, mem_tokens: int = 48, seed: int = 0,
                      batch: int = 64) -> dict:
    """Greedy reconstruction and IMR accuracy of the memory agent on ``tasks`` (``memtrain_tasks.MemTrainTask``)."""
    agent = MemAgentConfig(data.SYSTEM_PROMPT, mem_tokens=mem_tokens, temperature=0.0)
    rng = random.Random(seed)
    golds, answers, targets, imr_answers = [], [], [], []
    for i in range(0, len(tasks), batch):
        trajs = memory_rollout(model, tokenizer, tasks[i:i + batch], 1, agent)
        golds += [x.gold for x in trajs]
        answers += [x.answer for x in trajs]
        items = []
        for x in trajs:
            q = imr_task(x.chunks, len(x.memories), rng, names)
            if q is not None:
                items.append((q.problem, x.memories[q.k], q.chunk))
                targets.append(q.target)
        imr_answers += imr_rollout(model, tokenizer, items, agent)
    return memtrain_summary(golds, answers, targets, imr_answers)


def main(argv=None) -> None:
    p = FlagParser(description="Evaluate a MemTrain memory agent: reconstruction and IMR accuracy.")
    p.add_argument("--checkpoint", required=True, help="run folder or checkpoint folder (e.g. runs/memtrain)")
    p.add_argument("--tasks", type=Accepts(int, min=1), default=64, help="held-out tasks per set")
    p.add_argument("--split", default="test", type=Accepts(str, choices=tuple(SPLIT_SEEDS)),
                   help="held-out world seeds")
    p.add_argument("--seed", type=Accepts(int, unbounded=True), default=0, help="which held-out tasks")
    p.add_argument("--corpus", default="", help="also evaluate on masked-entity tasks of this {id, contents} JSONL")
    p.add_argument("--mem-tokens", type=Accepts(int, min=1), default=48, help="memory budget in tokens")
    p.add_argument("--max-chunks", type=Accepts(int, min=1), default=4, help="chunks per held-out task")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = p.parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        p.error(f"checkpoint folder {args.checkpoint} does not exist")
    model, tokenizer, _ = load(args.checkpoint, pick_device(args.device))
    add_words(tokenizer, model, MEMTRAIN_WORDS)      # an SFT checkpoint has no [MASK] yet
    sets = {"world": memtrain_heldout(args.tasks, args.split, args.seed, args.max_chunks)}
    if args.corpus:
        sets["corpus"] = memtrain_heldout(args.tasks, args.split, args.seed, args.max_chunks,
                                          data.load_corpus(args.corpus))
    res = {k: evaluate_memtrain(model, tokenizer, t, names, args.mem_tokens, args.seed)
           for k, (t, names) in sets.items()}
    print(json.dumps({"checkpoint": args.checkpoint, "split": args.split, "memtrain": res}))


if __name__ == "__main__":
    data.exit_on_bad_input(main)         # a missing or broken input: one line, exit status 2
