"""Mem-alpha: learn to build a core / semantic / episodic memory with tool calls.

    SFT   rows of two kinds from instances of ``--sft-chunks`` chunks, mixed in every batch: writer
          rows (the scripted writer's tool calls for one chunk, in the fresh context the loop shows:
          ``writer_messages``) and answerer rows (core + BM25 top-k of each store of the writer's FINAL
          memory + question -> the answer that memory supports, ``memory_answer``). ``--flaw-p`` of the instances have
          the never-revising writer, so the cold-started writer has headroom on changed facts.
          ``--writer weak`` (the default): the writer rows are the weak writer's
          (``memalpha_data.weak_writer_calls``: valid calls, most facts left out, core mostly empty, ``--weak-*``
          rates) on the same instances; the answerer rows stay the scripted writer's, so the answerer reads memory
          as well as before and only the writer is weak (the paper's Table 3 holds the answerer fixed;
          ``--answerer`` fixes it across writers).
    r1's answerer = a frozen copy of the cold-started model (or ``--answerer PATH``).
    GRPO  per step: ``--instances`` fresh instances x ``--group`` rollouts (``memalpha_rollout``), each instance
          of a chunk count drawn from ``--rl-chunks`` (``rl_chunk_counts``);
          reward per chunk step r1 + r2 + beta r3 + gamma r4 (``memalpha_rewards``); ONE group =
          every chunk step of every rollout of an instance, std-normalised (``grpo.grouped_advantage``);
          every chunk step is a training row (context + output, loss on output) for the shared ``train.update``.

Choices: the tokenizer is ``build_memalpha_tokenizer`` (word-level, JSON glue as tokens: a name is the
same one token in the chunk and in the call, so copying is a pointer step); ``--tokenizer bpe`` is the
byte-level BPE of ``data.build_bpe_tokenizer`` trained on the world's and this task's text, with which
the 3-layer model did not learn to copy (results/MEMALPHA.md). The first ``--sft-copy-steps`` steps see
first-chunk writer rows only: the copy plateau (loss ~0.4-0.48) ended at step ~350 on seed 0 but at ~900-1000
on seed 1 (seeds 1 and 2 had not left it at step 500), hence 1200 of 2200 SFT steps. Every SFT
step draws a new world (the name pool is shared), so held-out worlds test generalisation to new facts;
the generation ends at EOS (``<|im_end|>``) or ``--max-new-tokens``; no KL by default (the paper uses none).

The default start is the paper's Table 3 one, a writer RL can teach what to keep: ``--writer weak`` with
``--weak-copy scripted`` (it learns to copy names from the scripted writer's first chunks, then keeps about a quarter
of the reports and leaves core empty), then 80 GRPO steps sampled at T 0.4 with beta 0. ``--writer scripted`` is the
cold start that stores every fact, from which GRPO makes the calls valid, not the memory better.

    python -m recipes.memalpha --run runs/memalpha
    python -m recipes.memalpha_eval --checkpoint runs/memalpha            # after it

Built from the shared pieces: the engine (``engine.generate``), ``grpo.py`` (advantages, rows), ``sft.run_sft``
and ``train.update``; checkpoints and ``--resume`` through checkpoint.py. The memory and its tool calls are
in ``recipes/memalpha_memory.py``, the task, the scripted writer and the tokenizer in ``recipes/memalpha_data.py``,
the evaluation against the raw-chunk baselines in ``recipes/memalpha_eval.py``.

**The reward** of chunk step t of a trajectory:  r_t = r1 + r2_t + beta * r3 + gamma * r4_t.

* r1 (per trajectory): QA accuracy of a FROZEN answerer given the FINAL memory, as
  ``answerer_messages`` shows it (core + BM25 top-k of each store, question as query);
  greedy, one batched ``generate`` for every (memory, question) pair; metric = exact match after
  SQuAD normalisation against any alias (``em_score``). With ``--r1 chunk``, chunk step t's r1 is that
  accuracy on the questions whose answer chunk t reported last (every fact's latest value and every event,
  ``chunk_probes``), and a group is chunk t of an instance's rollouts: credit for what chunk t's calls kept.
* r2_t: successful calls / calls in chunk t (malformed ones count as calls); 0 with no calls.
* r3 (per trajectory): 1 - memory tokens / chunk tokens (both counted by the same tokenizer); not
  clipped, so a memory larger than its input is negative; 0 when there are no chunk tokens.
* r4_t: valid / judged among chunk t's parsed insert and update calls, judged by RULES (no judge
  model is wired in yet): core not empty and not a placeholder (``PLACEHOLDERS``, or fewer than 3
  words); semantic = a fact (>= 3 words and no time expression); episodic = an event with a time
  (>= 3 words and a time expression, ``TIME_RE``). A call is judged on its content whether or not it
  executed (execution is r2's part); deletes and unparsable calls are not judged; 0 with nothing to judge.
"""
from __future__ import annotations

import os
import random
import re
import time
from dataclasses import asdict, dataclass, field, fields

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

import checkpoint
import data
import dist
import train
from engine import generate
from flags import flag
from grpo import Sample, grouped_advantage, target_row
from models import load_model, pick_device
from recipes.memalpha_data import (MemInstance, WeakRates, build_memalpha_tokenizer, chunk_probes, chunks_answer,
                                   chunks_messages, long_context_chunks, make_memalpha_instances, max_chunks,
                                   memalpha_texts, memory_answer, rag_chunks, weak_writer_calls, writer_calls)
from recipes.memalpha_memory import (WRITER_SYSTEM, StructuredMemory, ToolCall, answerer_messages,
                                     execute_tool_calls, parse_tool_calls, writer_messages)
from reward import em_score
from rollout import encode_chat
from sft import cosine_lr, run_sft


@dataclass
class MemAlphaConfig(train.Config):
    """Mem-alpha: SFT cold start + GRPO over chunk steps."""
    run: str = flag("runs/memalpha", "output folder")
    algo: str = flag("memalpha", "memalpha (this recipe)", choices=("memalpha",))
    tokenizer: str = flag("word", "word (one token per word of the task, JSON glue as tokens) | digits (the same, "
                                  "numbers spelt digit by digit) | bpe (byte-level BPE, --vocab)",
                          choices=("word", "digits", "bpe"))
    sft_steps: int = flag(2200, "SFT cold-start steps (0 skips)", min=0)
    sft_copy_steps: int = flag(1200, "first SFT steps on first-chunk writer rows only (learn to copy names into JSON)",
                               min=0)
    sft_batch: int = flag(32, "rows per SFT step", min=1)
    sft_rows: str = flag("all", "all | answerer: only the answerer's rows, an SFT of r1's judge alone (for "
                                "--answerer; with --sft-copy-steps 0)", choices=("all", "answerer"))
    rl_steps: int = flag(80, "GRPO steps (0 skips)", min=0)     # a writer that keeps a quarter has more to learn
    max_new_tokens: int = flag(192, "max tokens the writer generates per chunk", min=1)
    micro_tokens: int = flag(4096, "token budget of one update micro-batch", min=1)
    mem_weight: float = flag(0.0, "unused: no <mem> spans in Mem-alpha (train.update reads it)", min=0)
    vocab: int = flag(800, "BPE vocabulary size (--tokenizer bpe)", min=1)
    answerer: str = flag("", "HF path of r1's frozen answerer (default: a frozen copy after SFT)")
    # the chunk horizon: SFT teaches at --sft-chunks, GRPO may reach past it, memalpha_eval --chunks measures
    # beyond both (the paper trains on inputs up to 30k tokens and evaluates up to 474k)
    sft_chunks: str = flag("4", "chunks per SFT cold-start instance: A-B or A,B,... (each instance draws its count)",
                           int_range=True)
    rl_chunks: str = flag("4", "chunks per GRPO instance: A-B or A,B,... (each instance draws its count, uniformly)",
                          int_range=True)
    # Where an instance's days start: a 4-chunk stream reaches day ~12 and a 16-chunk one day ~41, and an answerer
    # whose SFT read only early days misreads memories with later ones (results/MEMALPHA.md section 11).
    first_day: str = flag("1-3", "day of an instance's first chunk in SFT and GRPO, drawn from A-B, or from one of "
                                 "A-B,C-D,... picked uniformly (later chunks follow 1-3 days apart)", ranges=True)
    facts_per_chunk: int = flag(2, "new facts per chunk", min=1)
    questions_per_instance: int = flag(4, "questions per instance", min=1)
    flaw_p: float = flag(0.5, "share of SFT instances whose writer never revises", min=0, max=1)
    # the weak writer: the Mem-alpha paper's untrained writer, for RL to teach what to keep (memalpha_data's notes)
    # weak by default: the paper's Table 3 start, where its RL has something to teach; over 12 seeds RL from it
    # gains at 4 chunks with an interval above 0, from the scripted start nothing (results/MEMALPHA.md 9, 13e)
    writer: str = flag("weak", "scripted (stores every fact; --flaw-p) | weak (valid calls, most facts left "
                                   "out, core mostly empty: --weak-*): the writer SFT imitates; the answerer rows "
                                   "are the scripted writer's either way", choices=("scripted", "weak"))
    weak_keep_p: float = flag(WeakRates.keep_p, "weak writer: share of reports stored exactly", min=0, max=1)
    weak_generic_p: float = flag(WeakRates.generic_p, "weak writer: share of chunks with a report left out that get "
                                                      "one generic entry (their subjects, no values)", min=0, max=1)
    weak_merge_p: float = flag(WeakRates.merge_p, "weak writer: share of those chunks that get one merged entry (the "
                                                  "left-out reports with their date) instead", min=0, max=1)
    weak_core_p: float = flag(WeakRates.core_p, "weak writer: share of chunks whose core it rewrites", min=0, max=1)
    # a tiny model learns to copy names from the copy warm-up's rows, which the weak writer mostly leaves empty
    weak_copy: str = flag("scripted", "weak writer: whose rows the copy warm-up imitates: weak (its own) | scripted "
                                  "(learn to copy first, then the weak rows teach what not to keep)",
                          choices=("weak", "scripted"))
    # lr 1e-5, the step Mem-alpha was measured at (T 0.7, then 0.4); 8 instances, not 4, for the same reason train.py's
    # questions went 8 -> 16: half the gradient's sampling noise (3 seeds: no RL effect at either step,
    # results/MEMALPHA.md section 9)
    lr: float = flag(1e-5, "GRPO learning rate", above=0)
    # T 0.4, not train.py's 0.7: at 0.7 the tiny weak writer's samples stop copying (sampled r1 0.055 against greedy
    # 0.227), so a group's rollouts hardly differ in content and RL emptied the memory (results/MEMALPHA.md 13b-c)
    temperature: float = flag(0.4, "sampling temperature of training rollouts (also divides logits in the loss)",
                              above=0)
    instances: int = flag(8, "instances per GRPO step", min=1)
    top_k_memory: int = flag(3, "BM25 top-k of each store for r1", min=1)
    context_tokens: int = flag(64, "long-context baseline's chunk-token window (its SFT answerer rows use it)", min=1)
    # rollout: r1 is one number per rollout, so a group cannot tell a chunk copied right from one garbled
    # (results/MEMALPHA.md section 12 measures the other)
    r1: str = flag("rollout", "rollout: every chunk step's r1 is the rollout's accuracy on the instance's questions, "
                              "advantages grouped per instance (the paper's) | chunk: chunk t's r1 is the accuracy "
                              "on the questions whose answer chunk t reported last, advantages grouped per "
                              "(instance, chunk)", choices=("rollout", "chunk"))
    # 0, not the paper's 0.05: where a group's r1 hardly varies, beta r3 pulls it toward an empty memory (at T 0.4
    # 1 run of 12 collapsed with it, none of 12 without; the gains over 12 seeds do not separate: MEMALPHA.md 13e)
    beta: float = flag(0.0, "weight of r3 (compression; the paper's 0.05)", min=0)
    gamma: float = flag(0.1, "weight of r4 (content validity)", min=0)
    ckpt_every: int = flag(100, "steps (SFT or GRPO) between checkpoints in RUN/ckpt (0: only when SFT ends)", min=0)

    def conflicts(self) -> tuple[list[str], list[str]]:
        """train.Config's, and a chunk count whose new facts the embedded world does not hold."""
        errors, warnings = super().conflicts()
        most = max_chunks(self.facts_per_chunk)
        for name, value in (("sft-chunks", self.sft_chunks), ("rl-chunks", self.rl_chunks)):
            if max(data.int_range(str(value))) > most:
                errors.append(f"--{name} {value}: a world holds {most} chunks of --facts-per-chunk "
                              f"{self.facts_per_chunk} new facts (must be <= {most})")
        if self.sft_rows == "answerer" and self.sft_copy_steps > 0 and self.sft_steps > 0:
            errors.append(f"--sft-rows answerer trains no writer, so its copy steps have no rows: "
                          f"--sft-copy-steps {self.sft_copy_steps} must be 0")
        if self.weak_generic_p + self.weak_merge_p > 1:
            errors.append(f"--weak-merge-p {self.weak_merge_p}: a chunk gets a generic or a merged entry, so "
                          f"--weak-generic-p + --weak-merge-p must be <= 1 (--weak-generic-p {self.weak_generic_p})")
        weak = [f.name for f in fields(self) if f.name.startswith("weak_") and getattr(self, f.name) != f.default]
        if weak and (self.writer != "weak" or self.sft_rows == "answerer"):
            why = "the scripted writer's rows" if self.writer != "weak" else "--sft-rows answerer: no writer rows"
            warnings += [f"--{n.replace('_', '-')} {getattr(self, n)}: unused ({why})" for n in weak]
        return errors, warnings


def parse_args(argv=None) -> MemAlphaConfig:
    return train.parse_args(argv, MemAlphaConfig)


# --------------------------------------------------------------------------- the memorisation loop

@dataclass
class ChunkStep:
    """One chunk of one rollout: the context the writer saw, what it sampled, its calls and their results."""
    context_ids: list[int]
    output_ids: list[int]
    text: str
    calls: list[ToolCall]
    results: list[tuple[bool, str]]


@dataclass
class MemRollout:
    """One rollout of one Mem-alpha instance: its memory after the last chunk and every chunk step."""
    group_id: int                      # the instance's index: all G rollouts of it form one group
    memory: StructuredMemory
    steps: list[ChunkStep] = field(default_factory=list)


@dataclass
class WriterConfig:
    core_limit: int = 512
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    id_seed: int = 0                   # every memory draws ids from this seed (the SFT writer's too)


def memalpha_rollout(model, tokenizer, instances: list, group_size: int, cfg: WriterConfig,
                     generator: torch.Generator | None = None) -> list[MemRollout]:
    """Feed every instance's chunks, in order, to ``group_size`` rollouts each; chunk c of every live
    rollout of every instance is ONE batched ``generate`` call. Returns rollouts in instance order."""
    count = lambda s: len(tokenizer.encode(s, add_special_tokens=False))
    outs = [MemRollout(i, StructuredMemory(cfg.core_limit, count, seed=cfg.id_seed))
            for i in range(len(instances)) for _ in range(group_size)]
    for c in range(max(len(inst.chunks) for inst in instances)):
        live = [r for r in outs if c < len(instances[r.group_id].chunks)]
        contexts = [encode_chat(tokenizer, writer_messages(r.memory, instances[r.group_id].chunks[c].text))
                    for r in live]                                        # fresh context per chunk
        gens = generate(model, contexts, cfg.max_new_tokens, pad_id=tokenizer.pad_token_id,
                        eos_id=tokenizer.eos_token_id, temperature=cfg.temperature, top_p=cfg.top_p,
                        generator=generator)
        for r, ctx, out in zip(live, contexts, gens):
            text = tokenizer.decode(out, skip_special_tokens=True)
            calls = parse_tool_calls(text)
            r.steps.append(ChunkStep(ctx, out, text, calls, execute_tool_calls(r.memory, calls)))
    return outs


# --------------------------------------------------------------------------- the reward

PLACEHOLDERS = {"", "none", "empty", "(empty)", "n/a", "na", "todo", "tbd", "placeholder", "nothing",
                "no information", "no info", "unknown", "...", "core", "summary", "core memory"}
TIME_RE = re.compile(r"\b(day \d+|\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}|(jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)"
                     r"[a-z]*\.? \d{1,2}|\d{1,2} (jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*|"
                     r"(1[89]|20)\d\d|yesterday|today|tonight|this (morning|evening|week)|last (week|month|year))\b",
                     re.I)


def r2_call_success(results: list[tuple[bool, str]]) -> float:
    """Fraction of a chunk's tool calls that executed; 0 when it made none."""
    return sum(ok for ok, _ in results) / len(results) if results else 0.0


def r3_compression(memory_tokens: int, chunk_tokens: int) -> float:
    """1 - memory tokens / chunk tokens (unclipped); 0 when there are no chunk tokens."""
    return 1.0 - memory_tokens / chunk_tokens if chunk_tokens > 0 else 0.0


def content_valid(memory_type: str, content: str) -> bool:
    """The rule judge: core is a real summary, semantic a timeless fact, episodic a dated event."""
    text = " ".join(str(content).split())
    words = len(text.split())
    if memory_type == "core":
        return text.lower().strip(" .") not in PLACEHOLDERS and words >= 3
    if memory_type == "semantic":
        return words >= 3 and not TIME_RE.search(text)
    if memory_type == "episodic":
        return words >= 3 and bool(TIME_RE.search(text))
    return False


def r4_validity(calls: list) -> float:
    """Fraction of a chunk's parsed insert / update calls whose content passes ``content_valid``; 0 with none."""
    judged = [content_valid(c.arguments["memory_type"], c.arguments.get("content", c.arguments.get("new_content")))
              for c in calls if c.error is None and c.name in ("new_memory_insert", "memory_update")]
    return sum(judged) / len(judged) if judged else 0.0


def memalpha_reward(r1, r2, r3, r4, beta: float = 0.05, gamma: float = 0.1):
    """r1 + r2 + beta * r3 + gamma * r4 (floats or tensors, elementwise)."""
    return r1 + r2 + beta * r3 + gamma * r4


def answer_contexts(model, tokenizer, message_lists: list[list[dict]], max_new_tokens: int = 16,
                    batch: int = 256) -> list[str]:
    """Greedy answers of ``model`` to each message list, ``batch`` prompts a ``generate`` call."""
    prompts = [encode_chat(tokenizer, m) for m in message_lists]
    out = []
    for s in range(0, len(prompts), batch):
        gens = generate(model, prompts[s:s + batch], max_new_tokens, pad_id=tokenizer.pad_token_id,
                        eos_id=tokenizer.eos_token_id, temperature=0.0)
        out += [tokenizer.decode(g, skip_special_tokens=True) for g in gens]
    return out


def qa_hits(model, tokenizer, memories: list, questions: list[list[tuple[str, list[str]]]], k: int = 3,
            max_new_tokens: int = 16, batch: int = 256) -> list[list[float]]:
    """Per memory, per ``(question, aliases)``: 1.0 when the frozen answerer's greedy answer is an exact match."""
    pairs = [(i, q, golds) for i, qs in enumerate(questions) for q, golds in qs]
    preds = answer_contexts(model, tokenizer, [answerer_messages(memories[i], q, k) for i, q, _ in pairs],
                            max_new_tokens, batch)
    hits = [[] for _ in memories]
    for (i, _, golds), p in zip(pairs, preds):
        hits[i].append(em_score(p, golds))
    return hits


def r1_accuracy(model, tokenizer, memories: list, questions: list[list[tuple[str, list[str]]]], k: int = 3,
                max_new_tokens: int = 16, batch: int = 256) -> list[float]:
    """Per memory: share of its ``(question, aliases)`` the frozen answerer gets exactly right (greedy)."""
    return [sum(h) / len(h) if h else 0.0
            for h in qa_hits(model, tokenizer, memories, questions, k, max_new_tokens, batch)]


def memalpha_rewards(answerer, tokenizer, rollouts: list, instances: list, k: int = 3, beta: float = 0.05,
                     gamma: float = 0.1, max_new_tokens: int = 16, r1_per_chunk: bool = False) -> dict:
    """Every component for ``MemRollout`` s: r1 / r3 per rollout, r2 / r4 / reward per chunk step.

    ``r1_per_chunk``: chunk step t's reward uses r1_t, the answerer's accuracy from the FINAL memory on the
    questions whose answer chunk t reported last (``chunk_probes``), instead of the rollout's r1; a chunk with
    no such questions keeps the rollout's r1. ``r1`` stays the rollout's accuracy on the instance's questions."""
    asked = [instances[r.group_id].questions for r in rollouts]
    probes = [chunk_probes(inst) if r1_per_chunk else [] for inst in instances]       # once per instance
    hits = qa_hits(answerer, tokenizer, [r.memory for r in rollouts],
                   [q + [p for ps in probes[r.group_id] for p in ps] for q, r in zip(asked, rollouts)], k,
                   max_new_tokens)
    mean = lambda xs, empty: sum(xs) / len(xs) if xs else empty
    r1 = [mean(h[:len(q)], 0.0) for h, q in zip(hits, asked)]
    r1_chunk = [[x] * len(r.steps) for x, r in zip(r1, rollouts)]                     # the paper's: one a rollout
    for i, r in enumerate(rollouts):
        at = len(asked[i])
        for t, ps in enumerate(probes[r.group_id]):
            r1_chunk[i][t] = mean(hits[i][at:at + len(ps)], r1[i])
            at += len(ps)
    count = lambda s: len(tokenizer.encode(s, add_special_tokens=False))
    chunk_tokens = [sum(count(c.text) for c in inst.chunks) for inst in instances]
    mem_tokens = [r.memory.n_tokens() for r in rollouts]
    r3 = [r3_compression(m, chunk_tokens[r.group_id]) for m, r in zip(mem_tokens, rollouts)]
    r2 = [[r2_call_success(s.results) for s in r.steps] for r in rollouts]
    r4 = [[r4_validity(s.calls) for s in r.steps] for r in rollouts]
    reward = [[memalpha_reward(c, a, r3[i], b, beta, gamma) for c, a, b in zip(r1_chunk[i], r2[i], r4[i])]
              for i in range(len(rollouts))]
    return {"r1": r1, "r1_chunk": r1_chunk, "r2": r2, "r3": r3, "r4": r4, "reward": reward,
            "mem_tokens": mem_tokens}


# --------------------------------------------------------------------------- SFT rows, the GRPO step, the run

def memalpha_tokenizer(vocab: int = 800, seed: int = 0, kind: str = "bpe"):
    """``kind`` word (digits: numbers spelt digit by digit): ``build_memalpha_tokenizer``; bpe: the byte-level BPE
    tokenizer trained on the world's text and this task's chunks and tool calls."""
    if kind in ("word", "digits"):
        return build_memalpha_tokenizer(digits=kind == "digits")
    if kind != "bpe":
        raise ValueError(f"--tokenizer must be word, digits or bpe, not {kind!r}")
    return data.build_bpe_tokenizer(data.world_texts(seed=seed) + memalpha_texts(seed=seed), vocab)


def day_ranges(text: str) -> list[tuple[int, int]]:
    """'1-3' -> [(1, 3)]; '1-3,1-60' -> [(1, 3), (1, 60)]; '5' -> [(5, 5)] (``--first-day``)."""
    return [(days[0], days[-1]) for days in map(data.int_range, text.split(","))]


def memalpha_instances(cfg: MemAlphaConfig, world_seed: int, n: int, seed: int, n_chunks: int | list[int],
                       flaw_p: float = 0.0):
    """``n`` instances of ``n_chunks`` chunks (one count, or one per instance) at the config's task sizes."""
    return make_memalpha_instances(world_seed, n, seed=seed, n_chunks=n_chunks, facts_per_chunk=cfg.facts_per_chunk,
                                   n_questions=cfg.questions_per_instance, flaw_p=flaw_p,
                                   first_day=day_ranges(cfg.first_day))


def chunk_counts(spec: str, n: int, seed: int) -> list[int]:
    """``n`` chunk counts drawn uniformly from ``spec`` ('A-B' or 'A,B,...') by a generator of their own, so that
    a single count leaves the instances' stream as it was."""
    rng = random.Random(seed)
    counts = data.int_range(spec)
    return [rng.choice(counts) for _ in range(n)]


def rl_chunk_counts(cfg: MemAlphaConfig, step: int) -> list[int]:
    """GRPO step ``step``'s chunk count per instance, from ``--rl-chunks``."""
    return chunk_counts(cfg.rl_chunks, cfg.instances, cfg.seed * 5_000_011 + step)


def memalpha_expert_samples(tokenizer, inst: MemInstance, k: int = 3, core_limit: int = 512,
                            context_tokens: int = 64, writer: bool = True, weak: WeakRates | None = None,
                            rng: random.Random | None = None) -> list[Sample]:
    """The writer's rows (one per chunk; none when not ``writer``), then the answerer's rows: one per question from
    the scripted writer's final memory, one per question from raw chunks (``memalpha_raw_rows``). The writer is the
    scripted one, or with ``weak`` the weak writer (drawing from ``rng``) in the context of its own memory; the
    answerer's rows read the scripted writer's memory either way."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)
    mem = StructuredMemory(core_limit, lambda s: len(enc(s)), seed=0)     # ids as the loop draws them
    own = mem if weak is None else StructuredMemory(core_limit, lambda s: len(enc(s)), seed=0)
    rows = []
    for chunk in inst.chunks:
        if not writer:
            writer_calls(mem, chunk, inst.flawed)
            continue
        ctx = encode_chat(tokenizer, writer_messages(own, chunk.text))
        scripted = writer_calls(mem, chunk, inst.flawed)       # run either way: the answerer rows read its memory
        calls = scripted if weak is None else weak_writer_calls(own, chunk, rng, weak)
        rows.append(target_row(ctx, enc(calls) + [tokenizer.eos_token_id]))
    for q, _ in inst.questions:
        msgs = answerer_messages(mem, q, k)
        ctx = encode_chat(tokenizer, msgs)
        rows.append(target_row(ctx, enc(memory_answer(msgs[1]["content"], q)) + [tokenizer.eos_token_id]))
    return rows + memalpha_raw_rows(tokenizer, inst, context_tokens)


def memalpha_raw_rows(tokenizer, inst: MemInstance, context_tokens: int = 64) -> list[Sample]:
    """Answerer rows over RAW chunks (the baselines' contexts), so one answerer serves memory and baselines:
    question i sees the long-context window when i is even, the BM25 top-2 chunks when odd."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)
    texts = [c.text for c in inst.chunks]
    window = long_context_chunks(texts, lambda s: len(enc(s)), context_tokens)
    rows = []
    for i, (q, _) in enumerate(inst.questions):
        seen = window if i % 2 == 0 else rag_chunks(texts, q, 2)
        ctx = encode_chat(tokenizer, chunks_messages(seen, q))
        rows.append(target_row(ctx, enc(chunks_answer(seen, q)) + [tokenizer.eos_token_id]))
    return rows


def memalpha_sft_batch(tokenizer, cfg: MemAlphaConfig, step: int) -> list[Sample]:
    """``cfg.sft_batch`` rows from instances of a world drawn for this step only.

    During the first ``cfg.sft_copy_steps`` steps only the FIRST chunk's writer row of each instance
    (empty memory: the shortest prompt) is used: the tiny model must first learn to copy names from the
    chunk into JSON, and a measured 300-step cold start on all rows wrote one constant memory whatever
    the chunk said (results/MEMALPHA.md, section 1)."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    counts = chunk_counts(cfg.sft_chunks, cfg.sft_batch, cfg.seed * 3_000_017 + step)
    insts = memalpha_instances(cfg, rng.randrange(10**9), cfg.sft_batch, rng.randrange(10**9), counts, cfg.flaw_p)
    # the weak writer draws from a generator of its own: the instances and the rows picked are the scripted run's
    weak = weak_rates(cfg)
    wrng = random.Random(cfg.seed * 11_000_027 + step) if weak is not None else None
    if step < cfg.sft_copy_steps:
        copy = weak if cfg.weak_copy == "weak" else None
        return [memalpha_expert_samples(tokenizer, MemInstance(inst.chunks[:1], []), weak=copy, rng=wrng)[0]
                for inst in insts]
    rows = [r for inst in insts for r in memalpha_expert_samples(tokenizer, inst, cfg.top_k_memory,
                                                                 context_tokens=cfg.context_tokens,
                                                                 writer=cfg.sft_rows == "all", weak=weak, rng=wrng)]
    return rng.sample(rows, cfg.sft_batch)


def weak_rates(cfg: MemAlphaConfig) -> WeakRates | None:
    """The weak writer's rates from ``--weak-*`` with ``--writer weak``; None for the scripted writer."""
    if cfg.writer != "weak":
        return None
    return WeakRates(cfg.weak_keep_p, cfg.weak_generic_p, cfg.weak_merge_p, cfg.weak_core_p)


def step_groups(rollouts: list, per_chunk: bool = False) -> list[int]:
    """The advantage group of every chunk step, rollout by rollout: its instance, or with ``per_chunk`` its
    (instance, chunk index), so chunk t is compared only with chunk t of the same instance's other rollouts."""
    n = max(len(r.steps) for r in rollouts)
    return [r.group_id * n + t if per_chunk else r.group_id for r in rollouts for t in range(len(r.steps))]


def memalpha_step(model, answerer, tokenizer, optimizer, cfg: MemAlphaConfig, step: int, instances=None) -> dict:
    """One GRPO step: rollouts -> r1..r4 -> advantages grouped per instance over chunk steps -> train.update."""
    if instances is None:
        rng = random.Random(cfg.seed * 7_000_003 + step)
        instances = memalpha_instances(cfg, rng.randrange(10**9), cfg.instances, rng.randrange(10**9),
                                       rl_chunk_counts(cfg, step))
    gen = torch.Generator(device=model.device).manual_seed(cfg.seed * 9_000_011 + step)
    t0 = time.time()
    model.eval()
    rolls = memalpha_rollout(model, tokenizer, instances, cfg.group,
                             WriterConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature), gen)
    m: dict = {"stage": "rl", "step": step, "sec_rollout": time.time() - t0}
    t0 = time.time()
    per_chunk = cfg.r1 == "chunk"
    rw = memalpha_rewards(answerer, tokenizer, rolls, instances, cfg.top_k_memory, cfg.beta, cfg.gamma,
                          r1_per_chunk=per_chunk)
    pairs = [(s, x) for r, xs in zip(rolls, rw["reward"]) for s, x in zip(r.steps, xs)]
    steps = [(g, s, x) for g, (s, x) in zip(step_groups(rolls, per_chunk), pairs)]
    # float64: equal rewards must give exactly-zero advantages, not float32 noise / (std + eps)
    adv = grouped_advantage(torch.tensor([x for _, _, x in steps], dtype=torch.float64),
                            torch.tensor([g for g, _, _ in steps]))
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
    m.update(reward=mean([x for _, _, x in steps]), r1=mean(rw["r1"]), r3=mean(rw["r3"]),
             r1_chunk=mean([x for xs in rw["r1_chunk"] for x in xs]),
             r2=mean([x for xs in rw["r2"] for x in xs]), r4=mean([x for xs in rw["r4"] for x in xs]),
             mem_tokens=mean(rw["mem_tokens"]), calls=mean([len(s.calls) for _, s, _ in steps]),
             chunks=mean([len(inst.chunks) for inst in instances]),
             sec_reward=time.time() - t0)
    samples = [target_row(s.context_ids, s.output_ids, adv_t=float(a))
               for (_, s, _), a in zip(steps, adv) if s.output_ids]
    t0 = time.time()
    if not samples or all(abs(s.adv_t) < 1e-6 for s in samples):
        m["skipped"] = "all advantages are zero"
    else:
        m.update(train.update(model, None, optimizer, samples, cfg, tokenizer.pad_token_id))
    m["sec_update"] = time.time() - t0
    return m


def run_memalpha(cfg: MemAlphaConfig) -> None:
    """SFT cold start on the scripted writer + answerer, then GRPO with a frozen answerer for r1.

    Checkpoints: ``RUN/ckpt`` (``checkpoint.save_checkpoint``: model, tokenizer, optimizer, stage + step, torch
    RNG; written atomically) every ``--ckpt-every`` steps of either stage and when SFT ends; ``--resume``
    continues from it with the same batches (data and sampling depend only on seed and step) and the
    answerer saved in ``RUN/sft`` when SFT ended."""
    metrics_path, ckpt = checkpoint.check_run(cfg.run, cfg.resume), os.path.join(cfg.run, "ckpt")
    checkpoint.write_config(cfg.run, asdict(cfg))
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)        # one process: Mem-alpha has no torchrun path
    state, trainer = {"stage": "sft", "step": 0}, checkpoint.resume(cfg.run) if cfg.resume else None
    if trainer is not None:
        state = trainer["state"]
        model, tokenizer = load_model(ckpt, device), AutoTokenizer.from_pretrained(ckpt)
        print(f"resuming memalpha {state['stage']} at step {state['step']} from {ckpt}")
    else:
        tokenizer = memalpha_tokenizer(cfg.vocab, cfg.seed, cfg.tokenizer)
        model = data.build_tiny_model(tokenizer, cfg.hidden, cfg.layers, cfg.heads, cfg.ffn, seed=cfg.seed).to(device)
    save = lambda opt, st: checkpoint.save_checkpoint(ckpt, model, tokenizer, opt, st, WRITER_SYSTEM)
    t_start = time.time()
    if state["stage"] == "sft":
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
        if trainer is not None:
            dist.load_optimizer(model, opt, trainer["optimizer"])
            torch.set_rng_state(trainer["torch_rng"])

        def on_step(step: int, loss: float, gn: float, sec: float) -> None:
            if step % 50 == 0 or step == cfg.sft_steps - 1:
                checkpoint.log_jsonl(metrics_path, {"stage": "sft", "step": step, "loss": loss, "grad_norm": gn,
                                                    "sec_total": time.time() - t_start})
            if cfg.ckpt_every > 0 and (step + 1) % cfg.ckpt_every == 0 and step + 1 < cfg.sft_steps:
                save(opt, {"stage": "sft", "step": step + 1})

        run_sft(model, opt, lambda step: memalpha_sft_batch(tokenizer, cfg, step), range(state["step"], cfg.sft_steps),
                lambda step: cosine_lr(cfg.sft_lr, step, cfg.sft_steps, 50), cfg, tokenizer.pad_token_id, on_step,
                desc="memalpha sft")
        checkpoint.save_folder(os.path.join(cfg.run, "sft"), model, tokenizer)
        state, trainer = {"stage": "rl", "step": 0}, None
        save(None, state)                   # SFT done: a kill from here on resumes at RL step 0
    answerer = load_model(cfg.answerer or os.path.join(cfg.run, "sft"), device).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    if trainer is not None:
        if trainer["optimizer"] is not None:           # None: the checkpoint written when SFT ended
            dist.load_optimizer(model, opt, trainer["optimizer"])
        torch.set_rng_state(trainer["torch_rng"])
    bar = tqdm(range(state["step"], cfg.rl_steps), desc="memalpha grpo")
    for step in bar:
        m = memalpha_step(model, answerer, tokenizer, opt, cfg, step)
        m["sec_total"] = time.time() - t_start
        checkpoint.log_jsonl(metrics_path, m)
        bar.set_postfix(reward=f"{m['reward']:.3f}", r1=f"{m['r1']:.3f}")
        if cfg.ckpt_every > 0 and (step + 1) % cfg.ckpt_every == 0 and step + 1 < cfg.rl_steps:
            save(opt, {"stage": "rl", "step": step + 1})
    checkpoint.save_folder(os.path.join(cfg.run, "final"), model, tokenizer)
    print(f"saved {cfg.run}/final")


def main(argv=None) -> None:
    run_memalpha(parse_args(argv))


if __name__ == "__main__":
    data.exit_on_bad_input(main)         # a missing or broken input: one line, exit status 2
