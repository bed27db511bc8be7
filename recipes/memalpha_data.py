"""The Mem-alpha task: dated chunks about the embedded world, questions answerable only from memory,
the scripted writer that teaches the cold start, the raw-chunk baselines' contexts, and the task's
word-level tokenizer that writes JSON.

A stream of dated chunks about the embedded world, then questions answerable only from memory.

Each chunk is one day's report, ``day 5 : kalo boss mira . lapu boss is now tebo . zena friend ended .
kalo visited tebo .``, with three kinds of line: a new fact (``s r o``), a change of a fact reported in
an earlier chunk (``s r is now o``: the update case; ``s r ended``: the delete case) and an event
(``s visited o``: it happened on that day). The questions at the end ask for a fact's LATEST value
(``kalo boss ?`` -> ``puni``; ``none`` after ``ended``) and for when an event happened
(``when kalo visited tebo ?`` -> ``day 5``). At least one question is about a changed fact whenever
one changed, and one about an event.

The scripted writer (the SFT cold start's teacher) runs its own calls against a ``StructuredMemory``
so it can name ids: per chunk, an insert ``semantic "s r o"`` per new fact, ``memory_update``
of the old entry per change, ``memory_delete`` per ended fact, an insert ``episodic "on day D s v o"``
per event and a core rewrite ``latest report day D`` (a real, if short, summary). Its flaw (decided per
INSTANCE: per-call noise is averaged away by imitation): on a ``flaw_p`` share of
instances it never revises, i.e. writes no update or delete, so the stale value stays and the
change questions fail; RL has that headroom.

The weak writer (``weak_writer_calls``, ``--writer weak``) teaches the tool calls and all three memory types but
not what to keep, after the untrained writer's failures the Mem-alpha paper shows (core left empty, a subset of the
facts, one generic entry). Per chunk, each draw independent, ``WeakRates``:

* ``keep_p`` 0.25: each report is stored exactly as the scripted writer stores it (insert, update, delete, dated
  insert), else left out. A quarter, not a half: an SFT model imitates the share at each call, so greedy decoding
  (the evaluation's) is expected to stop where storing the next report is less likely than stopping and keep
  little, while sampling at T 0.7 keeps a varying subset, so rollouts of one instance differ in r1 by what they
  kept (the signal the 4-part reward needs); ``memalpha_eval``'s ``entries_kept`` measures what the SFT writer
  keeps. A change whose fact was left out is stored as a new fact; an end, as nothing.
* ``generic_p`` 0.5 / ``merge_p`` 0.2: a chunk with a report left out gets, FIRST, one generic semantic entry
  naming its subjects and none of their values (``report on kalo lapu``: the paper's one generic entry; valid
  for r4, empty for r1), or one merged entry copying the left-out reports with their date (``day 5 : kalo boss
  mira . ...``: a semantic entry r4 judges invalid, and large for r3), else nothing. First, and the likelier of
  the two, so it is the greedy writer's first call: storing a fact then has to beat it.
* ``core_p`` 0.1: the core is rewritten (``latest report day D``), else left as it was: empty in 0.9^4 = 66% of
  4-chunk instances, and a writer that imitates it never writes core greedily, while the call is taught.
The weak writer never makes a failing call (a duplicate generic entry is not written), so its SFT writer's calls
are valid and its memory misses most facts. ``flawed`` is the scripted writer's and is ignored here.
``memory_answer`` is the answerer's teacher: it reads the answer off what the answerer is shown (the
first entry ``s r X`` in its view, ``none`` when there is none; ``day D`` from the first matching
event, ``unknown`` when there is none), so a frozen answerer trained on it measures the memory,
not its own knowledge.

The baselines (``long_context_chunks``, ``rag_chunks``, ``chunks_messages``, taught by ``chunks_answer``)
see the same streams as the writer: the newest raw chunks that fit a token budget, or the BM25+ top-2
chunks for the question. They live here, with the task, because both the SFT rows
(``recipes.memalpha.raw_rows``) and the evaluation (``recipes.memalpha_eval``) use them.

``build_memalpha_tokenizer``: every word of the task is ONE token wherever it stands, and JSON round-trips.

Why: with the byte-level BPE (``build_bpe_tokenizer``) a name reads `` pigo`` in the chunk but ``p`` ``igo``
after the ``"`` that opens a JSON string (Qwen2's pre-tokeniser puts the space on the word, the quote
on its own), so "copy the fact into the insert" was a learnt token-to-token MAPPING, and a 3-layer
model did not learn it in 660 SFT steps (results/MEMALPHA.md). Here copying is a pointer step, as in
MemPO's word-level world: ``pigo mother bufa`` is the same three tokens in the chunk and in the call.

How: a ``WordLevel`` model behind two ``Split`` pre-tokenisers (regexes; the leftmost alternative wins):
1. a space between a word character and a known word of 2+ characters is dropped (the decoder puts it
   back), so the words of a fact are adjacent tokens as in the chunk: a space token between them made
   every copy step a two-back match, and the copy plateau lasted ~900 steps (measured);
2. the rest is cut into the JSON glue of a tool call as whole tokens (``<tool_call>{"name": "``,
   ``", "arguments": {"``, ``": "``, ``", "``, ``"}}</tool_call>``), every word of the task (names,
   relations, verbs, tool and argument names, prompt words, numbers 0-99) between word boundaries, and
   any other single character (a space that is kept, a newline, one character of a random memory id).
The decoder marks every token of 2+ word characters, joins all tokens (``Fuse``) and turns a mark after
a word character into a space: ``decode(encode(text)) == text`` for any printable-ASCII text (a word
token is preceded by a word character only where step 1 dropped a space). A character outside the
vocabulary is ``<|endoftext|>`` (unk). Specials and chat template are ChatML's, as the BPE tokenizer's.
Meant for the embedded world: text of unknown words is spelt one character a token.
"""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field

from rank_bm25 import BM25Plus
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from data import (CHATML_SPECIALS, CHATML_TEMPLATE, N_ENTITIES, RELATIONS, UNKNOWN, DataError, World, make_world,
                  name_pool, read_jsonl)
from recipes.memalpha_memory import (ANSWER_SYSTEM, MEMORY_TYPES, TOOL_ARGS, TRUNCATED, WRITER_SYSTEM,
                                     StructuredMemory, ToolCall, execute_tool_calls, tool_call_text)
from search import bm25_tokens

EVENT_VERBS = ["met", "visited", "called", "helped"]
NONE_ANSWER = "none"


@dataclass
class Chunk:
    """One dated report: its text and, for the embedded world, the reports it is made of."""
    text: str
    day: int | None = None
    reports: list[tuple] = field(default_factory=list)   # ("fact"|"change"|"end"|"event", s, r_or_verb, o)


@dataclass
class MemInstance:
    """A Mem-alpha instance: chunks in order, then ``(question, aliases)`` pairs."""
    chunks: list[Chunk]
    questions: list[tuple[str, list[str]]]
    flawed: bool = False        # the scripted writer's flaw for this instance (embedded world only)


def make_memalpha_instance(world: World, rng: random.Random, n_chunks: int = 4, facts_per_chunk: int = 2,
                           events_per_chunk: int = 1, change_p: float = 0.6, end_p: float = 0.3,
                           n_questions: int = 4, flaw_p: float = 0.0,
                           first_day: tuple[int, int] | list[tuple[int, int]] = (1, 3)) -> MemInstance:
    """A stream of ``n_chunks`` dated chunks over ``world`` and ``n_questions`` questions about its end state.
    Each chunk reports ``facts_per_chunk`` facts no earlier chunk reported: more than the world holds is an error.
    The first chunk's day is drawn from ``first_day`` (inclusive; from a list of ranges, from one picked uniformly),
    each later one 1-3 days after the last."""
    if n_chunks * facts_per_chunk > len(world.facts):
        raise ValueError(f"{n_chunks} chunks x {facts_per_chunk} new facts each need {n_chunks * facts_per_chunk} "
                         f"facts, the world holds {len(world.facts)}: at most {len(world.facts) // facts_per_chunk} "
                         f"chunks at {facts_per_chunk} facts each")
    keys = rng.sample(sorted(world.facts), n_chunks * facts_per_chunk)
    value: dict[tuple[str, str], str] = {}
    changed: list[tuple[str, str]] = []
    events: list[tuple[str, str, str, int]] = []
    ranges = first_day if isinstance(first_day, list) else [first_day]
    lo, hi = ranges[0] if len(ranges) == 1 else rng.choice(ranges)
    chunks, day = [], rng.randint(lo, hi)
    for c in range(n_chunks):
        reports = []
        for s, r in keys[c * facts_per_chunk:(c + 1) * facts_per_chunk]:
            value[(s, r)] = world.facts[(s, r)]
            reports.append(("fact", s, r, value[(s, r)]))
        old = [k for k in value if value[k] != NONE_ANSWER and k not in changed and
               not any(x[1:3] == k for x in reports)]
        if c > 0 and old and rng.random() < change_p:
            s, r = rng.choice(old)
            if rng.random() < end_p:
                value[(s, r)] = NONE_ANSWER
                reports.append(("end", s, r, ""))
            else:
                value[(s, r)] = rng.choice([e for e in world.entities if e not in (s, value[(s, r)])])
                reports.append(("change", s, r, value[(s, r)]))
            changed.append((s, r))
        for _ in range(events_per_chunk):
            s, o = rng.sample(world.entities, 2)
            v = rng.choice(EVENT_VERBS)
            if not any(e[:3] == (s, v, o) for e in events):
                events.append((s, v, o, day))
                reports.append(("event", s, v, o))
        chunks.append(Chunk(f"day {day} : " + " ".join(report_text(x) for x in reports), day, reports))
        day += rng.randint(1, 3)
    qs: list[tuple[str, list[str]]] = []
    if changed:
        s, r = rng.choice(changed)
        qs.append((f"{s} {r} ?", [value[(s, r)]]))
    if events:
        s, v, o, d = rng.choice(events)
        qs.append((f"when {s} {v} {o} ?", [f"day {d}"]))
    pool = [k for k in value if f"{k[0]} {k[1]} ?" not in {q for q, _ in qs}]
    for s, r in rng.sample(pool, min(len(pool), max(0, n_questions - len(qs)))):
        qs.append((f"{s} {r} ?", [value[(s, r)]]))
    return MemInstance(chunks, qs[:n_questions], rng.random() < flaw_p)


def chunk_probes(inst: MemInstance) -> list[list[tuple[str, list[str]]]]:
    """Per chunk, the questions whose answer that chunk reported LAST, in the instance questions' form: every
    fact's latest value (``none`` after ``ended``) belongs to the chunk that last reported the fact, every event
    to the chunk that reported it. A chunk without reports (an instance read from a file) has none."""
    last: dict[tuple[str, str], tuple[int, str]] = {}
    probes: list[list[tuple[str, list[str]]]] = [[] for _ in inst.chunks]
    for c, chunk in enumerate(inst.chunks):
        for kind, s, r, o in chunk.reports:
            if kind == "event":
                probes[c].append((f"when {s} {r} {o} ?", [f"day {chunk.day}"]))
            else:
                last[(s, r)] = (c, NONE_ANSWER if kind == "end" else o)
    for (s, r), (c, value) in last.items():
        probes[c].append((f"{s} {r} ?", [value]))
    return probes


def report_text(report: tuple) -> str:
    kind, s, r, o = report
    return {"fact": f"{s} {r} {o} .", "change": f"{s} {r} is now {o} .", "end": f"{s} {r} ended .",
            "event": f"{s} {r} {o} ."}[kind]


def make_memalpha_instances(world_seed: int, n: int, seed: int = 0, n_chunks: int | list[int] = 4,
                            **kw) -> list[MemInstance]:
    """``n`` instances over the world of ``world_seed``, with ``n_chunks`` chunks each (or ``n_chunks[i]`` for
    instance i); ``kw`` goes to ``make_memalpha_instance``."""
    counts = [n_chunks] * n if isinstance(n_chunks, int) else n_chunks
    if len(counts) != n:
        raise ValueError(f"{len(counts)} chunk counts for {n} instances")
    world = make_world(world_seed)
    rng = random.Random(seed * 100_003 + world_seed)
    return [make_memalpha_instance(world, rng, c, **kw) for c in counts]


def max_chunks(facts_per_chunk: int = 2) -> int:
    """The most chunks an instance of the embedded world can have: every world holds one fact per entity and
    relation (N_ENTITIES x RELATIONS = 144), and each chunk reports ``facts_per_chunk`` new ones. (Past 33
    chunks a day number can pass 99, the last number the word-level tokenizer has as one token: it is then
    spelt digit by digit.)"""
    return N_ENTITIES * len(RELATIONS) // facts_per_chunk


def writer_calls(memory, chunk: Chunk, flawed: bool = False) -> str:
    """The scripted writer's output for ``chunk`` (tool-call text), executing each call on ``memory`` as it goes."""
    out = []

    def call(name: str, args: dict) -> str:
        out.append(tool_call_text(name, args))
        if name == "new_memory_insert":
            return memory.insert(args["memory_type"], args["content"])[1]
        if name == "memory_update":
            return memory.update(args["memory_type"], args["new_content"], args.get("memory_id"))[1]
        return memory.delete(args["memory_type"], args["memory_id"])[1]

    def fact_id(s: str, r: str) -> str | None:
        return next((i for i, t in memory.entries("semantic") if t.split()[:2] == [s, r]), None)

    for kind, s, r, o in chunk.reports:
        if kind == "fact":
            call("new_memory_insert", {"memory_type": "semantic", "content": f"{s} {r} {o}"})
        elif kind == "event":
            call("new_memory_insert", {"memory_type": "episodic", "content": f"on day {chunk.day} {s} {r} {o}"})
        elif not flawed and (i := fact_id(s, r)) is not None:
            if kind == "change":
                call("memory_update", {"memory_type": "semantic", "new_content": f"{s} {r} {o}", "memory_id": i})
            else:
                call("memory_delete", {"memory_type": "semantic", "memory_id": i})
    call("memory_update", {"memory_type": "core", "new_content": f"latest report day {chunk.day}"})
    return "".join(out)


@dataclass(frozen=True)
class WeakRates:
    """The weak writer's rates (the module's notes give each one's reason)."""
    keep_p: float = 0.25         # a report stored exactly
    generic_p: float = 0.5       # a chunk with a report left out: one generic entry ...
    merge_p: float = 0.2         # ... or one merged entry (generic_p + merge_p <= 1)
    core_p: float = 0.1          # the core rewritten

    def __post_init__(self):
        if not all(0 <= p <= 1 for p in (self.keep_p, self.generic_p, self.merge_p, self.core_p)) or \
                self.generic_p + self.merge_p > 1:
            raise ValueError(f"rates must lie in [0, 1] with generic_p + merge_p <= 1: {self}")


def weak_writer_calls(memory, chunk: Chunk, rng: random.Random, rates: WeakRates = WeakRates()) -> str:
    """The weak writer's output for ``chunk`` (tool-call text), executing each call on ``memory`` as it goes: a
    generic or merged entry for the reports it leaves out, the reports it keeps, the core now and then. Draws
    ``len(chunk.reports) + 2`` numbers from ``rng`` whatever the rates, so one rate leaves the others' draws alone."""
    kept = [rng.random() < rates.keep_p for _ in chunk.reports]
    summary, core = rng.random(), rng.random() < rates.core_p
    out = []

    def call(name: str, args: dict) -> None:
        out.append(tool_call_text(name, args))
        execute_tool_calls(memory, [ToolCall(name, args)])

    left = [x for x, k in zip(chunk.reports, kept) if not k]
    if left and summary < rates.generic_p + rates.merge_p:
        text = f"report on {' '.join(dict.fromkeys(x[1] for x in left))}" if summary < rates.generic_p else \
            f"day {chunk.day} : " + " ".join(report_text(x) for x in left)
        if text not in memory.stores["semantic"].values():
            call("new_memory_insert", {"memory_type": "semantic", "content": text})
    for kind, s, r, o in (x for x, k in zip(chunk.reports, kept) if k):
        i = next((i for i, t in memory.entries("semantic") if t.split()[:2] == [s, r]), None)
        if kind == "event":
            call("new_memory_insert", {"memory_type": "episodic", "content": f"on day {chunk.day} {s} {r} {o}"})
        elif kind in ("fact", "change") and i is None:
            call("new_memory_insert", {"memory_type": "semantic", "content": f"{s} {r} {o}"})
        elif kind == "change":
            call("memory_update", {"memory_type": "semantic", "new_content": f"{s} {r} {o}", "memory_id": i})
        elif kind == "end" and i is not None:
            call("memory_delete", {"memory_type": "semantic", "memory_id": i})
    if core:
        call("memory_update", {"memory_type": "core", "new_content": f"latest report day {chunk.day}"})
    return "".join(out)


def memory_answer(view: str, question: str) -> str:
    """The answerer's teacher: the answer that ``view`` (the answerer's memory text) supports."""
    words = question.replace("?", " ").split()
    lines = [ln.split(":", 1)[1].split() for ln in view.splitlines()
             if ":" in ln and not ln.startswith("question:")]
    if words and words[0] == "when":
        for ln in lines:
            if ln[:2] == ["on", "day"] and ln[3:] == words[1:]:
                return f"day {ln[2]}"
        return UNKNOWN
    for ln in lines:
        if len(ln) == 3 and ln[:2] == words[:2]:
            return ln[2]
    return NONE_ANSWER


def memalpha_texts(n: int = 40, seed: int = 0) -> list[str]:
    """Text of the Mem-alpha task (chunks, writer calls, questions): BPE training data so JSON gets merges."""
    texts = []
    for inst in make_memalpha_instances(seed + 7, n, seed=seed, flaw_p=0.5):
        mem = StructuredMemory(seed=seed)
        for c in inst.chunks:
            texts += [c.text, mem.render(c.text), writer_calls(mem, c, inst.flawed)]
        texts += [f"{q} {a[0]}" for q, a in inst.questions]
    return texts


def load_memalpha(path: str) -> list[MemInstance]:
    """Chunked instances from JSONL: ``chunks`` (list of strings) and ``questions_and_answers``
    (list of ``{"question": str, "answer": str | [str, ...]}``). Errors name the file and line."""
    out = []
    for n, row in read_jsonl(path):
        chunks, qas = row.get("chunks"), row.get("questions_and_answers")
        if not isinstance(chunks, list) or not chunks or not all(isinstance(c, str) and c.strip() for c in chunks):
            raise DataError(f"{path}:{n}: 'chunks' must be a non-empty list of non-empty strings")
        if not isinstance(qas, list) or not qas:
            raise DataError(f"{path}:{n}: 'questions_and_answers' must be a non-empty list")
        questions = []
        for j, qa in enumerate(qas):
            q = qa.get("question") if isinstance(qa, dict) else None
            a = qa.get("answer") if isinstance(qa, dict) else None
            a = [a] if isinstance(a, str) else a
            if not isinstance(q, str) or not q.strip() or not isinstance(a, list) or not a or \
                    not all(isinstance(x, str) for x in a):
                raise DataError(f"{path}:{n}: questions_and_answers[{j}] needs a string 'question' and an "
                                f"'answer' string or list of strings")
            questions.append((q.strip(), a))
        out.append(MemInstance([Chunk(c.strip()) for c in chunks], questions))
    if not out:
        raise DataError(f"{path}: no instances")
    return out


def chunks_answer(chunks: list[str], question: str) -> str:
    """The answer the raw ``chunks`` support (the baselines' teacher): the newest report of the fact
    (``none`` after ``ended`` or when unreported), or the day of the chunk that reports the event."""
    words = question.replace("?", " ").split()
    answer = UNKNOWN if words and words[0] == "when" else NONE_ANSWER
    for chunk in chunks:
        head, _, body = chunk.partition(":")
        for line in body.split("."):
            w = line.split()
            if words and words[0] == "when":
                if w == words[1:]:
                    answer = head.strip()
            elif w[:2] == words[:2] and len(w) >= 3:
                answer = NONE_ANSWER if w[2] == "ended" else w[-1]
    return answer


# --------------------------------------------------------------------------- the baselines' contexts

def chunks_messages(chunks: list[str], question: str) -> list[dict]:
    """The answerer's context for the raw-chunk baselines: the chunks, then the question."""
    return [{"role": "system", "content": ANSWER_SYSTEM},
            {"role": "user", "content": "\n".join(f"chunk: {c}" for c in chunks) + f"\nquestion: {question}"}]


def long_context_chunks(chunks: list[str], count_tokens, budget: int) -> list[str]:
    """The newest chunks whose tokens fit ``budget`` together, in stream order (at least none)."""
    kept, used = [], 0
    for c in reversed(chunks):
        n = count_tokens(c)
        if used + n > budget:
            break
        kept.insert(0, c)
        used += n
    return kept


def rag_chunks(chunks: list[str], question: str, k: int = 2) -> list[str]:
    """BM25 (``rank-bm25``, BM25+ as the structured memory) top-``k`` raw chunks for ``question``, in stream order."""
    scores = BM25Plus([bm25_tokens(c) for c in chunks]).get_scores(bm25_tokens(question))
    top = sorted(range(len(chunks)), key=lambda i: (-scores[i], -i))[:k]
    return [chunks[i] for i in sorted(top)]


# --------------------------------------------------------------------------- the word-level tokenizer

TOOL_JSON_GLUE = ['<tool_call>{"name": "', '", "arguments": {"', '"}}</tool_call>', '": "', '", "']


def memalpha_words(numbers: int = 100) -> list[str]:
    """Every word the Mem-alpha task writes (world names, relations, verbs, tools, prompts), deduplicated; the
    numbers below ``numbers`` are words (one token each), larger ones are spelt digit by digit."""
    words = name_pool() + RELATIONS + EVENT_VERBS + list(MEMORY_TYPES) + list(TOOL_ARGS)
    words += [a for req, opt in TOOL_ARGS.values() for a in req + opt]
    words += (WRITER_SYSTEM + " " + ANSWER_SYSTEM).split() + [TRUNCATED, NONE_ANSWER, UNKNOWN]
    words += "day is now ended on when latest report question chunk more not shown empty system user assistant".split()
    words += [str(k) for k in range(numbers)]
    return list(dict.fromkeys(w for w in words if re.fullmatch(r"\w+", w)))


def build_memalpha_tokenizer(digits: bool = False):
    """The word-level ChatML tokenizer of the Mem-alpha task (see this section's notes). Deterministic. With
    ``digits`` every number is spelt digit by digit, as a real model's tokenizer (Qwen's) does, so that day 37
    is made of tokens a short stream trained; without it each of 0-99 is one token of its own."""
    words = memalpha_words(10 if digits else 100)
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = list(dict.fromkeys(CHATML_SPECIALS + TOOL_JSON_GLUE + words + chars))
    alt = lambda ws: "|".join(sorted(ws, key=len, reverse=True))      # longest first: memory_type before memory
    glue = "|".join(re.escape(g) for g in TOOL_JSON_GLUE)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=CHATML_SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(rf"(?<=\w) (?=(?:{alt(w for w in words if len(w) > 1)})\b)"), behavior="removed"),
        pre_tokenizers.Split(Regex(rf"{glue}|\b(?:{alt(words)})\b|[\s\S]"), behavior="isolated")])
    mark = "\x02"                                                      # never in the text: not in the vocabulary
    tok.decoder = decoders.Sequence([decoders.Replace(Regex(r"^(?=\w{2,}$)"), mark), decoders.Fuse(),
                                     decoders.Replace(Regex(rf"(?<=\w){mark}"), " "), decoders.Replace(mark, "")])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=CHATML_SPECIALS[0], pad_token=CHATML_SPECIALS[0],
                                 eos_token="<|im_end|>", additional_special_tokens=CHATML_SPECIALS[1:],
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = CHATML_TEMPLATE
    return hf
