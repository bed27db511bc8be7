"""The MemPO agent loop: G rollouts per question, multi-turn, over the engine (engine.py) and search.py's tools.

Per round, for every live trajectory,

    messages = memory.prepare_prompt(records)      # snail: question + last round; full: everything
    context  = chat_template(messages) + forced "<mem>" prefix (every round after the first, option)
    output   = engine.generate(context)            # stops at </search>, </access>, </answer>, EOS
    tool     = BM25 search (top-k docs) | access (one whole document) | answer -> done

and records what the memory reward and the update need (``Round``): the exact context ids the model saw
(``round_context``), the forced prefix, the sampled ids, and, computed once, the ``<mem>...</mem>`` span and the
sampled span in the positions of ``context + prefix + output`` (``Round.mem_span``, ``Round.policy_span``). In
``full`` mode a round's context is the trajectory so far, so the same positions place the round in the
trajectory's one growing row. Rounds count from 0: round 0 is the first, with no forced prefix.

Choices: a round that ends in no action tag (EOS, max tokens) ends its trajectory, which the format check then
scores 0; a round's text ends at its first closing action tag (``cut_at_stop``) while its ids stay exactly as
sampled; the next prompt is the chat template of the records' text, every message as written (models.py's
``encode_chat``);
tool output is a whole chunk of the next prompt, never fed token by token. The system prompt is
``PROTOCOL_PROMPT`` for a model from elsewhere, a checkpoint's own for ours (``checkpoint_prompt``).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch

from engine import PrefixCache, generate, stop_strings
from memory import Record, mem_token_end, prepare_prompt, tool_record
from models import encode_chat
from search import Retriever

PROTOCOL_PROMPT = """You are a research agent that answers questions by searching a document collection. \
You work in rounds. Each round you write, in this order and nothing else:
1. <mem> ... </mem>: your memory. Write everything worth keeping so far: what each question asks, \
what you have found (names, dates, numbers, document ids) and what is still missing. Rewrite it in full \
every round: after this round you will no longer see older rounds or older search results, only your \
newest memory, so anything you leave out is gone.
2. <think> ... </think>: brief reasoning about what to do next.
3. Exactly one action, then stop writing:
   <search> query </search> searches the collection; the top results come back inside <information> ... </information>.
   <access> document id </access> returns the beginning of one document inside <information> ... </information>.
   <answer> a1 ; a2 ; ... </answer> ends the task: one short answer per question, in the order the \
questions were asked, separated by " ; ", with no explanation.
Never write <information> yourself. Answer as soon as your memory holds every answer."""
ACTION_RE = re.compile(r"<(search|access|answer)>(.*?)</\1>\s*$", re.S)
STOP_STRINGS = ("</search>", "</access>", "</answer>")


def checkpoint_prompt(path: str) -> str:
    """The system prompt a checkpoint was trained with (``system_prompt.txt``, written by train.py), else
    ``PROTOCOL_PROMPT`` (a model from elsewhere learns the protocol from the prompt)."""
    f = os.path.join(path, "system_prompt.txt")
    if os.path.exists(f):
        with open(f, encoding="utf-8") as fh:
            return fh.read()
    return PROTOCOL_PROMPT


# --------------------------------------------------------------------------- the agent loop

@dataclass
class Round:
    """One LLM generation: what it saw (``context_ids`` = round_context), the forced prefix, what it sampled."""
    context_ids: list[int]
    prefix_ids: list[int]
    output_ids: list[int]
    text: str                 # the round as written: prefix + decoded output
    mem_end: int              # leading tokens of prefix_ids + output_ids up to </mem>; 0 = no span
    action: str | None        # "search" | "access" | "answer" | None (malformed)

    @property
    def round_ids(self) -> list[int]:
        return self.prefix_ids + self.output_ids

    @property
    def mem_span(self) -> tuple[int, int]:
        """[start, end) of the round's ``<mem>...</mem>`` (forced prefix included) in ``context_ids + round_ids``;
        empty when it has none. A full-context round's context is the trajectory so far, so these are also its
        positions in the trajectory's growing row."""
        start = len(self.context_ids)
        return start, start + self.mem_end

    @property
    def policy_span(self) -> tuple[int, int]:
        """[start, end) of the tokens the policy sampled (loss mask 1), in the same positions as ``mem_span``."""
        start = len(self.context_ids) + len(self.prefix_ids)
        return start, start + len(self.output_ids)

    @property
    def n_tokens(self) -> int:
        return len(self.context_ids) + len(self.prefix_ids) + len(self.output_ids)


@dataclass
class Trajectory:
    """One rollout of one question."""
    question: str
    golds: list[list[str]]
    group_id: int
    prompt_ids: list[int]                 # system + question + generation prompt (for mem_traj)
    records: list[Record]
    rounds: list[Round] = field(default_factory=list)
    answer: str | None = None             # body of <answer>, None if it never answered
    done: bool = False


@dataclass
class AgentConfig:
    system_prompt: str
    context: str = "snail"       # "snail" | "full"
    keep_rounds: int = 1
    max_turns: int = 16          # train.py's rollout defaults; eval.greedy_agent: 64 turns, 128 tokens, greedy
    max_new_tokens: int = 96
    temperature: float = 0.7
    top_p: float = 1.0
    mem_prefix: bool = True      # force "<mem>" at the start of every round after the first
    webpage_chars: int = 100
    prefix_cache: bool = True    # prefill system + question once per question (PrefixCache); False: every round in full
    generation_batch: int = 0    # rows generated at once, each round in chunks of at most this many; 0: one batch


def question_prefix(tokenizer, system_prompt: str, question: str) -> list[int]:
    """Ids every round's context of ``question`` starts with (system prompt + question as the chat template
    renders them): the common start of the first round's prompt and a later round's, less its last token."""
    first = encode_chat(tokenizer, prepare_prompt([Record("prompt", question)], system_prompt))
    later = encode_chat(tokenizer, prepare_prompt([Record("prompt", question), Record("llm_gen", "<mem>"),
                                                   tool_record("search_results", "<information>")], system_prompt))
    n = next((i for i, (a, b) in enumerate(zip(first, later)) if a != b), min(len(first), len(later)))
    return first[:min(n, len(first) - 1)]


def cut_at_stop(text: str, strings=STOP_STRINGS) -> str:
    """The text up to the end of its first stop string; unchanged when it holds none.

    The engine stops at the token that completes a closing tag, and a BPE token may carry characters
    past it (``>.``, ``>\n``): those belong to no tag and are dropped from the round's text.
    """
    ends = [text.find(s) + len(s) for s in strings if s in text]
    return text[:min(ends)] if ends else text


def parse_action(text: str) -> tuple[str | None, str]:
    """The action that ends a round's text -> ``(kind, body)``; ``(None, "")`` when it ends in none.

    Whatever follows the first closing action tag (the rest of the token that completed it) is ignored.
    """
    m = ACTION_RE.search(cut_at_stop(text))
    return (m.group(1), m.group(2).strip()) if m else (None, "")


def rollout(model, tokenizer, tasks: list, group_size: int, tool: Retriever, cfg: AgentConfig,
            generator: torch.Generator | None = None) -> list[Trajectory]:
    """Run ``group_size`` trajectories per task through the multi-turn loop; returns them in task order.

    Each round generates its live rows in chunks of at most ``cfg.generation_batch`` (0: all in one batch), which
    bounds generation's KV cache and logits by the chunk. Greedy rollouts are the same at any chunk size (up to
    float summation order, as with the prefix cache). Sampled ones are not: ``engine.generate`` draws one uniform per
    row in the batch at each step from ``generator``, and which row gets which draw depends on every row of the batch
    (when finished rows leave it), so no sequence of chunks can reproduce one batch's draws; the same generator,
    seeded as before, gives another sample of the same policy, the same again at the same chunk size."""
    keep_rounds = None if cfg.context == "full" else cfg.keep_rounds
    forced_mem = tokenizer.encode("<mem>", add_special_tokens=False) if cfg.mem_prefix else []
    stops = stop_strings(tokenizer, STOP_STRINGS)
    trajs = []
    for gid, task in enumerate(tasks):
        records = [Record("prompt", task.question)]
        prompt_ids = encode_chat(tokenizer, prepare_prompt(records, cfg.system_prompt, keep_rounds))
        for _ in range(group_size):
            trajs.append(Trajectory(task.question, task.golds, gid, prompt_ids, list(records)))
    question_cache = None
    if cfg.prefix_cache:         # lives for this call only: the weights change after it
        question_cache = PrefixCache()
        question_cache.add(model, [question_prefix(tokenizer, cfg.system_prompt, t.question) for t in tasks],
                  tokenizer.pad_token_id)
    for turn in range(cfg.max_turns):
        live = [t for t in trajs if not t.done]
        if not live:
            break
        contexts, forced = [], []
        for t in live:
            ctx = encode_chat(tokenizer, prepare_prompt(t.records, cfg.system_prompt, keep_rounds))
            contexts.append(ctx)
            forced.append(forced_mem if turn > 0 else [])
        prompts, n = [c + p for c, p in zip(contexts, forced)], cfg.generation_batch or len(contexts)
        outs = [out for i in range(0, len(prompts), n)              # chunks of at most n rows, in order
                for out in generate(model, prompts[i:i + n], cfg.max_new_tokens, pad_id=tokenizer.pad_token_id,
                                    eos_id=tokenizer.eos_token_id, stops=stops, temperature=cfg.temperature,
                                    top_p=cfg.top_p, generator=generator, prefix_cache=question_cache)]
        searching, queries = [], []
        for t, ctx, pre, out in zip(live, contexts, forced, outs):
            text = cut_at_stop(tokenizer.decode(pre + out))     # ids stay exactly as sampled
            kind, body = parse_action(text)
            t.rounds.append(Round(ctx, pre, out, text, mem_token_end(tokenizer, pre + out), kind))
            t.records.append(Record("llm_gen", text))
            if kind == "search":
                searching.append(t)
                queries.append(body)
            elif kind == "access":
                t.records.append(tool_record("webpage", tool.access(body), cfg.webpage_chars))
            else:
                t.answer = body if kind == "answer" else None
                t.done = True
        for t, obs in zip(searching, tool.search_batch(queries)):     # the round's searches: one batch
            t.records.append(tool_record("search_results", obs, cfg.webpage_chars))
    return trajs


def run_episodes(model, tokenizer, tasks: list, tool: Retriever, agent: AgentConfig, batch: int = 64,
                 bar=None) -> list[Trajectory]:
    """One rollout per task (greedy when ``agent.temperature == 0``), ``batch`` tasks a call, in task order."""
    trajs = []
    for i in range(0, len(tasks), batch):
        part = rollout(model, tokenizer, tasks[i:i + batch], 1, tool, agent)
        if bar is not None:
            bar.update(len(part))
        for t in part:
            t.group_id += i                      # index into ``tasks``
        trajs += part
    return trajs
