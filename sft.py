"""The SFT cold start: the scripted expert's rows, the probe and copy rows, file rows, and ONE SFT loop.

Every recipe's supervised stage runs through ``run_sft``: per step, a batch of rows (``batch(step)``), their
policy-token count as the WHOLE batch's denominator, micro-batches sorted by length with gradient
accumulation, grad-norm clipping, one AdamW step, then the caller's ``on_step`` (logging, evaluation,
checkpoints). MemPO's cold start (``cold_start``) feeds it:

* ``copy_batch`` for the first ``--sft-copy-steps`` steps: a random question -> its objectives copied as
  ``<mem>`` entries (a tiny model learns to copy a name only after a long loss plateau, cheaper on short rows);
* then ``sft_batch``: rounds of the scripted expert (``data.expert_episode``, with the BM25 tool's real
  results) on a world drawn for the step (or, with ``--sft-episodes N``, from N episodes drawn once:
  ``fixed_episodes``), a few rounds per episode, the K curriculum (``--sft-ramp``), ``--forget-p`` of the
  episodes with the forgetting flaw; plus probe rows (``probe_samples``, ``--sft-probe``): both contexts the
  memory reward scores -> the answers that context holds, after a ``<think> probe </think> <answer>``
  marker without loss (reward.py, choice 1); with ``--sft-copy-mix``, copy rows of ``--sft-copy-objectives``
  too (the first round of questions longer than the expert's, which otherwise garbles past its largest K);
* or, with ``--sft-data``, ``file_batch``: rounds of a chat-format trajectory file, rendered with the run's
  system prompt in the context ``--sft-full-share`` draws per trajectory, and probe rows of its rounds
  (``file_probe_samples``: the answers a context or a ``<mem>`` holds are read off its text), so the memory
  reward's probes are in distribution on this path too.

Every row is rendered exactly as the agent loop renders the round (``episode_samples``: snail or full context, the
forced ``<mem>`` prefix without loss on every round after the first). The lr warms up linearly, then follows a
cosine to 0 (``cosine_lr``). ``held_out_f1`` is the periodic greedy check on held-out worlds that the SFT and RL
logs carry (``val_f1_k2`` / ``val_f1_k4``); eval.py reports the full tables.

``python sft.py --export DIR`` writes the embedded world as real-format files (test sets, corpora, and
expert trajectories for ``--sft-data``).
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

import data
import dist
from checkpoint import log_jsonl, save_checkpoint, writing
from flags import Accepts, FlagParser
from grpo import Sample, collate, micro_batches, target_row
from memory import Record, extract_mem, prepare_prompt, tool_record
from reward import answer_template, normalize_answer, outcome_reward
from models import autocast
from rollout import AgentConfig, encode_chat, parse_action, run_episodes
from search import SearchTool


# --------------------------------------------------------------------------- rows of the cold start

def episode_records(question: str, rounds: list[tuple[str, str | None]]):
    """Walk one episode: yield ``(t, text, records before round t)``, the records the agent loop would hold.

    ``rounds[t] = (assistant text, tool result or None)``. The one walk behind the policy's SFT rows and
    the probe rows; a caller encodes the records it needs (``prepare_prompt``: snail or full context).
    """
    records = [Record("prompt", question)]
    for t, (text, tool_text) in enumerate(rounds):
        yield t, text, records
        records.append(Record("llm_gen", text))
        if tool_text is not None:
            kind = "webpage" if parse_action(text)[0] == "access" else "search_results"
            records.append(tool_record(kind, tool_text))


def episode_samples(tokenizer, question: str, rounds: list[tuple[str, str | None]], system_prompt: str,
                    mem_prefix: bool = True, picked_rounds: set[int] | None = None,
                    context: str = "snail") -> list[Sample]:
    """Render one episode's rounds as training rows, exactly as the agent loop would see them.

    ``rounds[t] = (assistant text, tool result or None)``. Row t = the round's context (``context``: snail or
    full) + the forced ``<mem>`` prefix (rounds t >= 1, loss mask 0) + the rest of the round. ``picked_rounds``
    (0-based round indices) renders only those rows; None renders all.
    """
    prefix = tokenizer.encode("<mem>", add_special_tokens=False) if mem_prefix else []
    out = []
    for t, text, records in episode_records(question, rounds):
        if picked_rounds is None or t in picked_rounds:
            ctx = encode_chat(tokenizer, prepare_prompt(records, system_prompt, None if context == "full" else 1))
            pre = prefix if t > 0 and text.startswith("<mem>") else []
            body = text[len("<mem>"):] if pre else text
            out.append(target_row(ctx + pre, tokenizer.encode(body, add_special_tokens=False)))
    return out


def expert_turns(task: data.Task, tool: SearchTool,
                 forget: bool) -> list[tuple[str, tuple[str, str] | None, str | None]]:
    """The scripted expert's episode with the BM25 tool's real results: ``(round text, query, tool result)``."""
    return [(text, q, tool.search(" ".join(q)) if q is not None else None)
            for text, q in data.expert_episode(task, forget)]


def answer_from_context(task: data.Task, turns: list) -> list:
    """``turns`` with the answer round answering what the full context shows (``data.context_answers``: every
    answer whose last hop was searched) instead of what the round's ``<mem>`` holds. The same for an expert that
    keeps; a forgetting one answers the entries it dropped from the earlier rounds' results, as an agent that
    reads its whole history would."""
    episode = [(text, q) for text, q, _ in turns]
    text, q, result = turns[-1]
    answer = data.context_answers(task, episode, len(turns) - 1, "full")
    return turns[:-1] + [(text.split("<answer>")[0] + f"<answer> {answer} </answer>", q, result)]


def expert_samples(tokenizer, task: data.Task, tool: SearchTool, forget: bool, mem_prefix: bool = True,
                   system_prompt: str = data.SYSTEM_PROMPT, picked_rounds: set[int] | None = None,
                   turns: list | None = None, context: str = "snail") -> list[Sample]:
    """Rows of one scripted expert episode (``episode_samples`` with the BM25 tool's real results), in
    ``context`` (snail or full) as the agent loop would render them.

    ``turns``: the episode's ``expert_turns`` when the caller has them (sft_batch shares them with the
    probe rows); else they are made here.
    """
    turns = turns if turns is not None else expert_turns(task, tool, forget)
    return episode_samples(tokenizer, task.question, [(text, res) for text, _, res in turns], system_prompt,
                           mem_prefix, picked_rounds, context)


def probe_samples(tokenizer, task: data.Task, tool: SearchTool, forget: bool, rng: random.Random, p: float,
                  system_prompt: str = data.SYSTEM_PROMPT, picked_rounds: set[int] | None = None,
                  context: str = "snail", think: str = data.PROBE, turns: list | None = None) -> list[Sample]:
    """Probe rows: teach the policy to answer from BOTH contexts the memory reward scores.

    For each expert round t >= 1 (``picked_rounds`` of them; with probability ``p``) two rows, so neither probe is
    favoured: ``round_context`` (the round's context as the agent saw it, no forced prefix) -> the answers that
    context holds (``data.context_answers``), and ``mem_traj`` (prompt + the round's ``<mem>``) -> the
    answers that memory holds (``data.answers_from_mem``); ``unknown`` where there is none. Both end in
    the reward's own template ``<think> probe </think> <answer> a1 ; a2 </answer>``; the loss starts at the
    first answer word, so the marker (``<think> probe``) is never learnt as an output: the policy's own
    choice after ``</mem>`` (search or answer) gets no gradient from these rows and it does not learn to
    stop early (rows that train ``<think> answer`` right after a ``<mem>`` teach exactly that). ``turns``: as in
    ``expert_samples``.
    """
    turns = turns if turns is not None else expert_turns(task, tool, forget)
    episode = [(text, q) for text, q, _ in turns]
    prompt_ids = encode_chat(tokenizer, prepare_prompt([Record("prompt", task.question)], system_prompt))
    out = []
    for t, text, records in episode_records(task.question, [(text, res) for text, _, res in turns]):
        if t >= 1 and (picked_rounds is None or t in picked_rounds) and rng.random() < p:
            ctx = encode_chat(tokenizer, prepare_prompt(records, system_prompt, None if context == "full" else 1))
            mem_ctx = prompt_ids + tokenizer.encode(f"<mem> {extract_mem(text)} </mem>", add_special_tokens=False)
            for c, answer in ((ctx, data.context_answers(task, episode, t, context)),
                              (mem_ctx, data.answers_from_mem(task, extract_mem(text)))):
                out.append(probe_row(tokenizer, c, answer.split(" ; "), think))
    return out


def taught_marker(cfg) -> str:
    """The think word SFT's probe rows teach: ``--probe-think``, ``probe`` for ``auto`` (what a run with an SFT
    stage resolves it to, train.resolve_probe_think)."""
    return data.PROBE if cfg.probe_think == "auto" else cfg.probe_think


def probe_row(tokenizer, context: list[int], answers: list[str], think: str) -> Sample:
    """``context`` + the reward's template ``<think> {think} </think> <answer> a1 ; a2 </answer>``, the loss from
    the first answer word on (the marker is never learnt as an output)."""
    ids, words = answer_template(tokenizer, [[a] for a in answers], think)
    first = next(j for j, w in enumerate(words) if w)
    return target_row(context + ids[:first], ids[first:])


def held_answers(golds: list[list[str]], text: str) -> list[str]:
    """Per objective, the first alias whose words occur in ``text`` (SQuAD-normalised, whole words), else
    ``unknown``: what a context or a memory holds, read off its text when no world says so."""
    seen = f" {normalize_answer(text)} "
    return [next((a for a in aliases if normalize_answer(a) and f" {normalize_answer(a)} " in seen), data.UNKNOWN)
            for aliases in golds]


def file_probe_samples(tokenizer, trajectory: dict, rng: random.Random, p: float, system_prompt: str,
                       picked_rounds: set[int], context: str = "snail", think: str = data.PROBE) -> list[Sample]:
    """Probe rows of a trajectory file's round (``--sft-data``), as ``probe_samples`` makes of the expert's: for
    each picked round t >= 1 with a ``<mem>`` (with probability ``p``), the round's context -> the gold answers
    its earlier rounds and results hold, and prompt + ``<mem>`` -> those the memory holds (``held_answers``; the
    question itself does not count). Golds: the line's ``golden_answers``, else the trajectory's own last
    ``<answer>`` (a file of successful episodes)."""
    golds = trajectory.get("golds")
    if not golds:
        kind, body = parse_action(trajectory["rounds"][-1][0])
        golds = [[a.strip()] for a in body.split(";")] if kind == "answer" and body.strip() else None
    if not golds:
        return []
    question = trajectory["question"]
    prompt_ids = encode_chat(tokenizer, prepare_prompt([Record("prompt", question)], system_prompt))
    out = []
    for t, text, records in episode_records(question, trajectory["rounds"]):
        mem = extract_mem(text)
        if t >= 1 and t in picked_rounds and mem is not None and rng.random() < p:
            messages = prepare_prompt(records, system_prompt, None if context == "full" else 1)
            seen = " ".join(m["content"] for m in messages[2:])                   # after system + question
            mem_ctx = prompt_ids + tokenizer.encode(f"<mem> {mem} </mem>", add_special_tokens=False)
            out += [probe_row(tokenizer, encode_chat(tokenizer, messages), held_answers(golds, seen), think),
                    probe_row(tokenizer, mem_ctx, held_answers(golds, mem), think)]
    return out


def file_batch(tokenizer, cfg, step: int, trajectories: list[dict], system_prompt: str) -> list[Sample]:
    """A batch of ``cfg.sft_batch`` rounds from a chat-format trajectory file (``--sft-data``): 4 rounds an episode,
    each trajectory in the context ``episode_context`` draws for it (``--sft-full-share``, as the expert's), plus
    its probe rows in that context (``file_probe_samples``, ``--sft-probe``) on top, drawn apart so the rounds stay
    the same."""
    rng, probe_rng = random.Random(cfg.seed * 1_000_003 + step), random.Random(cfg.seed * 7_000_003 + step)
    out: list[Sample] = []
    probes: list[Sample] = []
    while len(out) < cfg.sft_batch:
        tr = rng.choice(trajectories)
        picked = set(rng.sample(range(len(tr["rounds"])), min(len(tr["rounds"]), 4)))
        context = episode_context(cfg, rng)
        out += episode_samples(tokenizer, tr["question"], tr["rounds"], system_prompt, picked_rounds=picked,
                               context=context)
        if cfg.sft_probe > 0:
            probes += file_probe_samples(tokenizer, tr, probe_rng, cfg.sft_probe, system_prompt, picked,
                                         context, taught_marker(cfg))
    return out[: cfg.sft_batch] + probes


@dataclass
class ExpertEpisode:
    """One scripted expert episode of the fixed set: its question, whether it forgets, its rounds and results."""
    task: data.Task
    forget: bool
    turns: list          # expert_turns: (round text, query, tool result)


def fixed_episodes(cfg) -> list[ExpertEpisode]:
    """``cfg.sft_episodes`` expert episodes drawn once from ``cfg.seed`` by a generator of their own, each on a
    world of its own (K from ``--sft-objectives``, hops from ``--hops``, the forgetting flaw at ``--forget-p``),
    searched once: the whole of the task's data an SFT with ``--sft-episodes N`` sees."""
    rng = random.Random(cfg.seed * 13_000_019 + 2_718_281)
    ks, hops = data.int_range(cfg.sft_objectives), data.int_range(cfg.hops)
    out = []
    for _ in range(cfg.sft_episodes):
        world = data.make_world(rng.randrange(10**9))
        task = data.make_task(world, rng, rng.choice(ks), (hops[0], hops[-1]))
        forget = rng.random() < cfg.forget_p
        out.append(ExpertEpisode(task, forget, expert_turns(task, SearchTool(world.docs), forget)))
    return out


def sft_batch(tokenizer, cfg, step: int, system_prompt: str = data.SYSTEM_PROMPT,
              episodes: list[ExpertEpisode] | None = None) -> list[Sample]:
    """A batch of ``cfg.sft_batch`` expert rounds from a world drawn for this step only, or with ``episodes``
    (``fixed_episodes``) from the episodes of that set whose K the curriculum has reached (all of them if none)."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    world = tool = None                                                  # a fixed set was searched when drawn
    if episodes is None:
        world = data.make_world(rng.randrange(10**9))
        tool = SearchTool(world.docs)
    ks, hops = data.int_range(cfg.sft_objectives), data.int_range(cfg.hops)
    if cfg.sft_ramp > 0:     # curriculum: one objective first (short contexts, where copying is learnt)
        ks = ks[: max(1, round(len(ks) * (step - cfg.sft_copy_steps) / (cfg.sft_ramp * cfg.sft_steps)))]
    pool = None if episodes is None else [e for e in episodes if len(e.task.golds) in ks] or episodes
    out: list[Sample] = []
    probes: list[Sample] = []
    while len(out) < cfg.sft_batch:
        if pool is None:
            task = data.make_task(world, rng, rng.choice(ks), (hops[0], hops[-1]))
            n_rounds = len(data.expert_episode(task))                    # the same count with or without forgetting
            picked = set(rng.sample(range(n_rounds), min(n_rounds, 4)))  # a few rounds per episode: more episodes
            forget = rng.random() < cfg.forget_p
            context = episode_context(cfg, rng)
            turns = expert_turns(task, tool, forget)                     # searched once for both kinds of row
        else:                                                            # an episode of the fixed set, searched once
            episode = rng.choice(pool)
            task, forget, turns = episode.task, episode.forget, episode.turns
            picked = set(rng.sample(range(len(turns)), min(len(turns), 4)))
            context = episode_context(cfg, rng)
        if forget and context == "full" and cfg.sft_full_answers == "context":
            turns = answer_from_context(task, turns)
        out += expert_samples(tokenizer, task, tool, forget, system_prompt=system_prompt, picked_rounds=picked,
                              turns=turns, context=context)
        if cfg.sft_probe > 0:                                            # on top of the batch: the policy's rows stay
            probes += probe_samples(tokenizer, task, tool, forget, rng, cfg.sft_probe, system_prompt,
                                    picked_rounds=picked, context=context, think=taught_marker(cfg),
                                    turns=turns)
    return out[: cfg.sft_batch] + probes


def episode_context(cfg, rng: random.Random) -> str:
    """The context one episode's rows are rendered in (the expert's, or a ``--sft-data`` trajectory's): ``full``
    for ``--train-context full``, else ``full`` with probability ``--sft-full-share`` (a cold start that plays both
    contexts), else ``snail``. No draw at a share of 0 or 1, so those batches are the ones a single context gives."""
    if cfg.train_context == "full" or cfg.sft_full_share >= 1:
        return "full"
    return "full" if cfg.sft_full_share > 0 and rng.random() < cfg.sft_full_share else "snail"


def random_chains(rng: random.Random, names: list[str], objectives: tuple[int, int]) -> list[list[str]]:
    """A question's chains for a copy or fill row: K in ``objectives``, each a random name and 1-3 relations (no
    world behind them: these rows teach copying, not facts)."""
    return [[rng.choice(names)] + [rng.choice(data.RELATIONS) for _ in range(rng.randint(1, 3))]
            for _ in range(rng.randint(*objectives))]


# K of the warm-up's questions: on 1-8 from the start the 3-layer model never leaves the copy plateau
COPY_WARMUP_OBJECTIVES = (1, 4)


def round_action(entries: dict[int, list[str]]) -> str:
    """What follows ``</mem>`` in the expert's round with these entries (``--sft-row-action``): the search of
    ``data.first_open_pair``, or with every entry finished the answer, each entry's last word."""
    pair = data.first_open_pair(entries)
    if pair is None:
        return f" <think> answer </think> <answer> {' ; '.join(entries[k][-1] for k in sorted(entries))} </answer>"
    return f" <think> search </think> <search> {pair[0]} {pair[1]} </search>"


def copy_batch(tokenizer, cfg, step: int, system_prompt: str = data.SYSTEM_PROMPT, n: int | None = None,
               objectives: tuple[int, int] = COPY_WARMUP_OBJECTIVES, action: bool = False) -> list[Sample]:
    """Warm-up rows: a random question -> its objectives copied as ``<mem>`` entries (with ``action``, then the
    round's search, ``round_action``).

    A tiny model learns to copy a name from its context only after a long loss plateau. On these
    short rows the default 3-layer model sat at loss 0.46 until step ~650 and copied exactly (loss
    0.02) by step ~900, at 0.17 s a step; on expert episodes the same plateau costs 0.3 s a step and
    its end varied from step ~850 to ~1350 between two runs. (The expert episodes still need slots
    in the question and memory to be learnt: see data.py.)
    """
    rng = random.Random(cfg.seed * 3_000_017 + step)
    names = data.name_pool()
    out = []
    for _ in range(cfg.sft_batch if n is None else n):
        chains = random_chains(rng, names, objectives)
        question = data.format_question(chains)
        ctx = encode_chat(tokenizer, prepare_prompt([Record("prompt", question)], system_prompt))
        entries = {k: data.open_path(c) for k, c in enumerate(chains)}
        text = f"<mem> {data.format_mem(entries)} </mem>" + (round_action(entries) if action else "")
        out.append(target_row(ctx, tokenizer.encode(text, add_special_tokens=False)))
    return out


def sft_loss(model, batch: dict[str, torch.Tensor], n_tokens: float) -> torch.Tensor:
    """Next-token cross entropy summed over policy tokens (loss mask 1), divided by the whole batch's count."""
    logits = model(input_ids=batch["ids"], attention_mask=batch["attn"]).logits[:, :-1].float()
    target, mask = batch["ids"][:, 1:], batch["loss_mask"][:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                            reduction="none").view_as(mask)
    return (nll * mask).sum() / n_tokens


# --------------------------------------------------------------------------- the one SFT loop

def cosine_lr(base: float, step: int, total: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine from ``base`` to 0 at step ``total``."""
    return base * (min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total)))


def run_sft(model, optimizer, batch, steps: range, lr, cfg, pad_id: int, on_step, desc: str = "sft") -> None:
    """Supervised steps ``steps``: ``batch(step)`` -> rows, ``lr(step)`` -> the step's learning rate, and
    ``on_step(step, loss, grad_norm, seconds)`` after each optimizer step. ``cfg`` gives ``micro_tokens``,
    ``grad_clip`` and ``precision``. Under torchrun each rank takes every W-th row of the (same) batch."""
    model.train()
    train_model = dist.update_module(model)
    for step in tqdm(steps, desc=desc, initial=steps.start, total=steps.stop, disable=dist.DIST.rank > 0):
        for g in optimizer.param_groups:
            g["lr"] = lr(step)
        t0 = time.time()
        samples = batch(step)
        n_tokens = float(sum(s.n_policy for s in samples))     # every rank builds the whole batch
        samples = samples[dist.DIST.rank::dist.DIST.world]                    # torchrun: this rank's rows
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        batches = dist.even_micro_batches(micro_batches(samples, cfg.micro_tokens), pad_id)
        for bi, mb in enumerate(batches):          # sorted by length: little padding
            with dist.grad_sync(model, bi == len(batches) - 1):
                with autocast(cfg.precision, model.device):
                    part = sft_loss(train_model, collate(mb, pad_id, model.device), n_tokens)
                (part * dist.DIST.world).backward()     # DDP / FSDP2 average over ranks
            loss += part.item()
        loss = dist.all_sum([loss])[0]
        gn = dist.grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)        # nor through a checkpoint's save or a validation pass
        on_step(step, loss, gn.item(), time.time() - t0)


# --------------------------------------------------------------------------- MemPO's cold start

def held_out_f1(model, tokenizer, k: int, n: int, seed: int, split: str, system_prompt: str) -> float:
    """Mean F1 of greedy episodes on ``n`` held-out K-objective questions (eval.py's agent and batches)."""
    world, tasks = data.held_out_tasks(k, n, seed, split)
    agent = AgentConfig(system_prompt=system_prompt, max_turns=64, max_new_tokens=128, temperature=0.0)
    trajs = run_episodes(model, tokenizer, tasks, SearchTool(world.docs), agent)
    return sum(outcome_reward(t)["f1"] for t in trajs) / len(trajs)


def fill_batch(tokenizer, cfg, step: int, n: int, objectives: tuple[int, int],
               system_prompt: str = data.SYSTEM_PROMPT, action: bool = False) -> list[Sample]:
    """Rows of a later round whose search found its memory's next fact: the previous round's ``<mem>`` (K entries,
    some slots filled) searched its next pair (``data.first_open_pair``), the result shows the fact, and this
    round's ``<mem>`` fills that one slot and carries the other entries whole.

    The expert's update rounds only ever rewrite a memory of its own K entries; these rows (names and results
    drawn at random, no world) show a later round updating a memory of any K in ``objectives``, in the snail
    context the loop renders (the forced ``<mem>`` prefix without loss). With ``action`` the row goes on to
    the round's search (``round_action``)."""
    rng = random.Random(cfg.seed * 5_000_011 + step + 7_919_000)
    names, prefix = data.name_pool(), tokenizer.encode("<mem>", add_special_tokens=False)
    out = []
    for _ in range(n):
        chains = random_chains(rng, names, objectives)
        entries = {}
        for k, chain in enumerate(chains):
            path = data.open_path(chain)
            for h in range(rng.randint(0, len(chain) - 1)):           # slots found so far
                path[2 * h + 2] = rng.choice(names)
            entries[k] = path
        slot = data.first_open_slot(entries)
        if slot is None:                                               # keep one slot open to fill
            slot = len(entries) - 1, len(entries[len(entries) - 1]) - 1
            entries[slot[0]][slot[1]] = data.SLOT
        k, j = slot
        s, r = entries[k][j - 2], entries[k][j - 1]
        mem = data.format_mem(entries)
        docs = [f"d{rng.randrange(data.MAX_DOC_IDS)} {rng.choice([x for x in names if x != s])} "
                f"{rng.choice(data.RELATIONS)} {rng.choice(names)}" for _ in range(3)]  # nothing on s r ...
        new = {k: list(path) for k, path in entries.items()}
        o = rng.choice(names)
        docs[rng.randrange(3)] = f"d{rng.randrange(data.MAX_DOC_IDS)} {s} {r} {o}"  # ... but one: the fact
        new[k][j] = o
        records = [Record("prompt", data.format_question(chains)),
                   Record("llm_gen", f"<mem> {mem} </mem> <think> search </think> <search> {s} {r} </search>"),
                   tool_record("search_results", f"<information> {' | '.join(docs)} </information>")]
        ctx = encode_chat(tokenizer, prepare_prompt(records, system_prompt, 1))
        text = f" {data.format_mem(new)} </mem>" + (round_action(new) if action else "")
        out.append(target_row(ctx + prefix, tokenizer.encode(text, add_special_tokens=False)))
    return out


def cold_start_rows(tokenizer, cfg, step: int, system_prompt: str, episodes: list | None = None,
                    trajectories: list[dict] | None = None) -> list[Sample]:
    """The rows of SFT step ``step``: copy rows before ``--sft-copy-steps``, then expert + probe rows with the copy
    and fill mixes (or ``--sft-data`` rows); ``episodes``: ``fixed_episodes`` where ``--sft-episodes`` is set."""
    if trajectories is not None:
        return file_batch(tokenizer, cfg, step, trajectories, system_prompt)
    if step < cfg.sft_copy_steps:
        return copy_batch(tokenizer, cfg, step, system_prompt)
    rows = sft_batch(tokenizer, cfg, step, system_prompt, episodes)
    ks = data.int_range(cfg.sft_copy_objectives)
    if cfg.sft_copy_mix > 0:         # copy rows past the expert's K keep round 0 of longer questions trained
        rows += copy_batch(tokenizer, cfg, step, system_prompt, round(cfg.sft_copy_mix * cfg.sft_batch),
                           (ks[0], ks[-1]), cfg.sft_row_action)
    if cfg.sft_fill_mix > 0:         # and fill rows a later round's update of that many entries
        rows += fill_batch(tokenizer, cfg, step, round(cfg.sft_fill_mix * cfg.sft_batch), (ks[0], ks[-1]),
                           system_prompt, cfg.sft_row_action)
    return rows


def cold_start(model, tokenizer, cfg, start: int, optimizer, metrics_path: str, ckpt: str,
               system_prompt: str = data.SYSTEM_PROMPT, trajectories: list[dict] | None = None) -> None:
    """MemPO's SFT stage from step ``start``: copy rows, then expert + probe rows (or ``--sft-data`` rows);
    a row of metrics every 50 steps (+ ``val_f1_k2`` every 500 with ``--eval-every``), a checkpoint every
    ``--sft-save-every``, and the result in ``RUN/sft``. ``cfg``: train.Config."""
    episodes = fixed_episodes(cfg) if cfg.sft_episodes > 0 and trajectories is None else None
    batch = lambda step: cold_start_rows(tokenizer, cfg, step, system_prompt, episodes, trajectories)
    lr = lambda step: cosine_lr(cfg.sft_lr, step, cfg.sft_steps, 100)
    state = lambda step: {"stage": "sft", "step": step, "precision": cfg.precision}

    def on_step(step: int, loss: float, gn: float, sec: float) -> None:
        if step % 50 == 0 or step == cfg.sft_steps - 1:
            row = {"stage": "sft", "step": step, "loss": loss, "grad_norm": gn, "lr": lr(step), "sec": sec}
            # under 1 s once good
            if cfg.eval_every and not cfg.model and (step % 500 == 0 or step == cfg.sft_steps - 1):
                model.eval()
                with dist.full_weights(model):
                    if dist.DIST.rank == 0:
                        row["val_f1_k2"] = held_out_f1(model, tokenizer, 2, cfg.eval_tasks, cfg.seed, "valid",
                                                       system_prompt)
                model.train()
            log_jsonl(metrics_path, row)
        if (step + 1) % cfg.sft_save_every == 0 and step + 1 < cfg.sft_steps:
            save_checkpoint(ckpt, model, tokenizer, optimizer, state(step + 1), system_prompt, cfg.probe_think)

    run_sft(model, optimizer, batch, range(start, cfg.sft_steps), lr, cfg, tokenizer.pad_token_id, on_step)
    save_checkpoint(os.path.join(cfg.run, "sft"), model, tokenizer, None, state(cfg.sft_steps), system_prompt,
                    cfg.probe_think)


# --------------------------------------------------------------------------- the world as files

def export(folder: str, ks: tuple[int, ...] = (1, 2, 4, 6), n: int = 64, episodes: int = 256,
           seed: int = 0) -> list[str]:
    """Write the embedded world as real-format files, so the file path can be run on it.

    ``test_k{K}.jsonl`` (Search-R1 QA: ``question``, ``golden_answers`` as K alias lists) and
    ``corpus_k{K}.jsonl`` (wiki-18: ``id``, ``contents``) hold exactly the held-out test set of ``eval.py``
    (same worlds, same questions); ``sft_trajectories.jsonl`` holds ``episodes`` expert episodes (one in
    four with the forgetting flaw, as ``--forget-p 0.25``; K 1-4, 1-3 hops, training worlds) as
    chat-format ``messages``.
    """
    os.makedirs(folder, exist_ok=True)
    paths = []
    for k in ks:
        world, tasks = data.held_out_tasks(k, n)
        paths += [os.path.join(folder, f"test_k{k}.jsonl"), os.path.join(folder, f"corpus_k{k}.jsonl")]
        with writing(paths[-2]), open(paths[-2], "w", encoding="utf-8") as f:      # a full disk: one line
            for t in tasks:
                f.write(json.dumps({"question": t.question, "golden_answers": t.golds}) + "\n")
        with writing(paths[-1]):
            data.save_corpus(world.docs, paths[-1])
    rng = random.Random(seed)
    paths.append(os.path.join(folder, "sft_trajectories.jsonl"))
    with writing(paths[-1]), open(paths[-1], "w", encoding="utf-8") as f:
        for e in range(episodes):
            world = data.make_world(rng.randrange(10**9))
            tool, task = SearchTool(world.docs), data.make_task(world, rng, rng.randint(1, 4))
            msgs = [{"role": "system", "content": data.SYSTEM_PROMPT}, {"role": "user", "content": task.question}]
            for text, query in data.expert_episode(task, forget=e % 4 == 3):
                msgs.append({"role": "assistant", "content": text})
                if query is not None:
                    msgs.append({"role": "tool", "content": tool.search(" ".join(query))})
            f.write(json.dumps({"messages": msgs, "golden_answers": task.golds}) + "\n")
    return paths


def main(argv=None) -> None:
    p = FlagParser(description="Write the embedded world as real-format files.")
    p.add_argument("--export", required=True, metavar="DIR", help="folder for test_k*.jsonl, corpus_k*.jsonl, "
                   "sft_trajectories.jsonl")
    p.add_argument("--objectives", type=Accepts(int, min=1), nargs="+", default=[1, 2, 4, 6], help="objective counts K")
    p.add_argument("--tasks", type=Accepts(int, min=1), default=64, help="test questions per K")
    p.add_argument("--episodes", type=Accepts(int, min=1), default=256, help="expert trajectories")
    a = p.parse_args(argv)
    print("\n".join(export(a.export, tuple(a.objectives), a.tasks, a.episodes)))


if __name__ == "__main__":
    data.exit_on_bad_input(main)         # a missing or broken input: one line, exit status 2
