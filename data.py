"""Tasks, corpora, tokenizer, tiny model and expert trajectories: everything the agent is trained on.

Two sources of data:

* **The embedded default** (no model hub, no GPU): a seeded synthetic world of entities and
  relations, one short document per fact, a BM25 index over the documents as the search tool,
  multi-hop questions and MEM1-style *multi-objective* questions (K sub-questions, answers joined
  by `` ; ``), a word-level tokenizer built from the world's vocabulary, and a tiny randomly
  initialised ``LlamaForCausalLM``.
* **Real data**: a QA file (JSONL or parquet, fields ``question`` and ``golden_answers`` as in
  Search-R1 / MEM1) and a corpus (JSONL with ``id`` and ``contents``, as wiki-18). A missing file or
  a malformed line is a ``DataError`` that names the file and the line, one line on stderr from every
  script (``exit_on_bad_input``).

The world (choices of this project):

* Every relation is a random permutation of the world's entities without fixed points, so a
  document ``kalo friend mira`` has exactly one twin that mentions both ``kalo`` and ``friend``
  (``lena friend kalo``). BM25 top-3 for the query ``kalo friend`` therefore always holds the answer,
  and the model must read which entity is the subject.
* Questions are written in chain order with a slot ``_`` for every entity still to find:
  ``kalo friend _ boss _`` means "the boss of the friend of kalo". An objective of h hops takes h
  searches.
* Held-out worlds are new random graphs over the SAME pool of names: a word-level vocabulary gives
  an unseen name an untrained embedding (a feasibility run scored 0/192 on unseen names).
* The state that ``<mem>`` must carry never appears in ``<think>`` or ``<search>``: ``<think>`` is one
  word (``search`` / ``answer``) and the query names only the current entity and relation. With
  snail-shell context the answers of earlier objectives live nowhere but in ``<mem>``.

The scripted expert's ``<mem>`` holds one entry per objective, the question's path with the slots
found so far filled in: ``2 = lapu rival tebo boss _`` (``lapu rival`` returned ``tebo``; the boss of
tebo is still open); an entry with no slot left is finished and its last word is the answer.
Round 1 copies the question into ``<mem>``, and every later step is a local copy: the next query is
the pair before the first slot, and the entity that fills it follows that pair in the tool result.
Memory uses ``=`` where the question uses ``:``. Why slots: without them the question reads
``lapu rival boss`` where memory reads ``lapu rival tebo boss``, so "copy the word that followed
``rival``" had two answers and a 2-layer model copied the wrong one about half the time (measured
token by token); with slots the two sources differ only where memory holds a name and the question
a ``_``. Two earlier formats (the newest fact per objective; the current entity per objective)
needed the model to count finished objectives to find the next one in the question, and a 2-layer
model did not learn that in 1500 SFT steps.

Its flaw (``forget_p``): on that fraction of episodes a finished entry is dropped as soon as a
newer objective finishes, so only the newest answer survives and it answers ``unknown`` for the
others. The flaw is decided per episode, not per round, so that imitation does not average it away
(random per-fact drops at p = 0.3 leave a strong SFT policy).

The world knows no engine: the BM25 search tool is ``search.SearchTool``, and the expert's rows with
its real results are built in sft.py.
"""
from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (AddedToken, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2ForCausalLM, Qwen2Tokenizer)

RELATIONS = ["friend", "boss", "mother", "rival", "mentor", "neighbor"]
TAGS = ["<mem>", "</mem>", "<think>", "</think>", "<search>", "</search>", "<access>", "</access>",
        "<answer>", "</answer>", "<information>", "</information>"]
CHAT = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SYSTEM_PROMPT = "answer all . keep findings in mem"
UNKNOWN = "unknown"
PROBE = "probe"         # the think word of the memory reward's probes; the policy never writes it
SLOT = "_"              # an entity not found yet, in the question and in <mem>
N_NAMES = 48            # the shared pool of entity names
N_ENTITIES = 24         # entities in one world
MAX_DOC_IDS = N_ENTITIES * len(RELATIONS)


class DataError(ValueError):
    """A dataset or corpus file is missing or malformed; the message names the file and line."""


def exit_on_bad_input(main: Callable[[], object]) -> None:
    """Run a script's ``main`` as its ``__main__``: a missing or broken input (a ``DataError``, which names the file
    and line; an ``OSError``: a path that is not there, a folder that holds no model) ends it with one line on
    stderr and exit status 2, not a traceback."""
    try:
        main()
    except (DataError, OSError) as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        sys.exit(2)


# --------------------------------------------------------------------------- the world

def name_pool(n: int = N_NAMES) -> list[str]:
    """The fixed pool of pronounceable one-token entity names shared by every world."""
    onsets, vowels = "bdfgklmnprstvz", "aeiou"
    syllables = [c + v for c in onsets for v in vowels]
    rng = random.Random(1234)
    names: list[str] = []
    seen = set()
    while len(names) < n:
        w = "".join(rng.choice(syllables) for _ in range(2))
        if w not in seen:
            seen.add(w)
            names.append(w)
    return names


@dataclass
class World:
    """Entities, facts ``(subject, relation) -> object`` and one document per fact."""
    entities: list[str]
    facts: dict[tuple[str, str], str]
    docs: list[dict]     # {"id": "d17", "contents": "kalo friend mira"}


def make_world(seed: int, n_entities: int = N_ENTITIES, relations: list[str] = RELATIONS) -> World:
    """A random world: each relation is a fixed-point-free permutation of ``n_entities`` names."""
    rng = random.Random(seed)
    entities = rng.sample(name_pool(), n_entities)
    facts: dict[tuple[str, str], str] = {}
    for rel in relations:
        perm = entities[:]
        while any(a == b for a, b in zip(entities, perm)):
            rng.shuffle(perm)
        for a, b in zip(entities, perm):
            facts[(a, rel)] = b
    items = list(facts.items())
    rng.shuffle(items)
    docs = [{"id": f"d{i}", "contents": f"{s} {r} {o}"} for i, ((s, r), o) in enumerate(items)]
    return World(entities, facts, docs)


@dataclass
class Objective:
    start: str
    relations: list[str]
    chain: list[tuple[str, str, str]]    # the facts (s, r, o) the expert finds, in order

    @property
    def answer(self) -> str:
        return self.chain[-1][2]


@dataclass
class Task:
    """One question: K objectives, golds[k] = accepted answers of objective k."""
    question: str
    golds: list[list[str]]
    objectives: list[Objective] = field(default_factory=list)


def make_task(world: World, rng: random.Random, n_objectives: int, hops: tuple[int, int] = (1, 3)) -> Task:
    """A K-objective question; each objective a chain of ``hops[0]..hops[1]`` relations."""
    objectives = []
    for _ in range(n_objectives):
        h = rng.randint(*hops)
        ent = rng.choice(world.entities)
        rels = [rng.choice(RELATIONS) for _ in range(h)]
        chain, cur = [], ent
        for r in rels:
            nxt = world.facts[(cur, r)]
            chain.append((cur, r, nxt))
            cur = nxt
        objectives.append(Objective(ent, rels, chain))
    return Task(format_question([[o.start] + o.relations for o in objectives]), [[o.answer] for o in objectives],
                objectives)


def open_path(chain: list[str]) -> list[str]:
    """``["kalo", "friend", "boss"]`` -> ``["kalo", "friend", "_", "boss", "_"]``: a slot after every relation."""
    return [chain[0]] + [w for r in chain[1:] for w in (r, SLOT)]


def format_question(chains: list[list[str]]) -> str:
    """``[["kalo", "friend", "boss"], ...]`` -> ``1 : kalo friend _ boss _ ? 2 : ...`` (chain order, slots open)."""
    return " ".join(f"{k + 1} : {' '.join(open_path(chain))} ?" for k, chain in enumerate(chains))


SPLIT_SEEDS = {"valid": 10_000, "test": 20_000}


def held_out_tasks(k: int, n: int, seed: int = 0, split: str = "test",
                   hops: tuple[int, int] = (1, 3)) -> tuple[World, list[Task]]:
    """``n`` K-objective tasks on a held-out world (``valid`` and ``test`` are disjoint world seeds)."""
    world = make_world(SPLIT_SEEDS[split] + 100 * seed + k)
    rng = random.Random(SPLIT_SEEDS[split] * 7 + 100 * seed + k)
    return world, [make_task(world, rng, k, hops) for _ in range(n)]


def make_tasks(world_seed: int, n: int, objectives: list[int], hops: tuple[int, int] = (1, 3),
               seed: int = 0) -> tuple[World, list[Task]]:
    """A world and ``n`` tasks whose objective counts cycle through ``objectives``."""
    world = make_world(world_seed)
    rng = random.Random(seed * 100_003 + world_seed)
    return world, [make_task(world, rng, objectives[i % len(objectives)], hops) for i in range(n)]


def int_range(s: str) -> list[int]:
    """'1-3' -> [1, 2, 3]; '2,4' -> [2, 4] (the ``--sft-objectives`` / ``--hops`` form)."""
    if "-" in s:
        a, b = s.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in s.split(",")]


# --------------------------------------------------------------------------- the scripted expert

def format_mem(entries: dict[int, list[str]]) -> str:
    """``<mem>`` body: one ``k = path`` entry per objective, in objective order (paths as ``open_path`` writes them)."""
    return " ; ".join(f"{k + 1} = {' '.join(path)}" for k, path in sorted(entries.items()))


def expert_episode(task: Task, forget: bool = False) -> list[tuple[str, tuple[str, str] | None]]:
    """The expert's rounds: ``(round_text, (entity, relation) searched or None when answering)``.

    ``<mem>`` holds one entry per objective, the question's path with its slots filled so far:
    ``lapu rival _ boss _`` (nothing found yet) becomes ``lapu rival tebo boss _`` once ``lapu rival``
    returned ``tebo``, and ``lapu rival tebo boss puni`` is finished (no slot left; its last word is
    the answer). Round 1 copies the question into ``<mem>``; the next query is always the pair before
    the first slot. When ``forget`` is set, a finished entry is dropped once a newer objective
    finishes (the flaw).
    """
    entries = {k: open_path([o.start] + o.relations) for k, o in enumerate(task.objectives)}
    rounds: list[tuple[str, tuple[str, str] | None]] = []
    newest_done = None
    for k, obj in enumerate(task.objectives):
        for hop, (s, r, o) in enumerate(obj.chain):
            rounds.append((f"<mem> {format_mem(entries)} </mem> <think> search </think> <search> {s} {r} </search>",
                           (s, r)))
            entries[k][2 * hop + 2] = o                        # the slot, filled from this round's tool result
        if forget and newest_done is not None:
            entries.pop(newest_done, None)
        newest_done = k
    mem = format_mem(entries)
    rounds.append((f"<mem> {mem} </mem> <think> answer </think> <answer> {answers_from_mem(task, mem)} </answer>",
                   None))
    return rounds


def first_open_slot(entries: dict[int, list[str]]) -> tuple[int, int] | None:
    """``(k, j)``: entry ``k``'s word ``j`` is the first open slot, in objective order (None when every entry is
    finished)."""
    for k in sorted(entries):
        if SLOT in entries[k]:
            return k, entries[k].index(SLOT)
    return None


def first_open_pair(entries: dict[int, list[str]]) -> tuple[str, str] | None:
    """The expert's next search from its ``<mem>`` entries: the pair before the first open slot, in objective
    order (None when every entry is finished). It reads the same for any number of entries."""
    slot = first_open_slot(entries)
    if slot is None:
        return None
    k, j = slot
    return entries[k][j - 2], entries[k][j - 1]


def parse_mem(mem: str) -> dict[int, list[str]]:
    """``1 = a r b ; 2 = c r`` -> ``{0: ["a", "r", "b"], 1: ["c", "r"]}`` (objective index -> path)."""
    entries = {}
    for e in mem.split(";"):
        k, _, path = e.partition("=")
        if k.strip().isdigit() and path.split():
            entries[int(k) - 1] = path.split()
    return entries


def answers_from_mem(task: Task, mem: str) -> str:
    """What the expert answers from ``<mem>`` alone: a finished entry's last entity, else ``unknown``."""
    entries = parse_mem(mem)
    done = lambda p: len(p) >= 3 and p[-1] not in RELATIONS and p[-1] != SLOT
    return " ; ".join(entries[k][-1] if done(entries.get(k, [])) else UNKNOWN for k in range(len(task.objectives)))


def early_answer(traj) -> float | None:
    """1.0 if ``traj`` (``.question``, ``.rounds[t].action``) answered after fewer searches than its question has
    hops, else 0.0; None when the question's hops are unknown (a real QA file). A question of this world has one
    ``_`` slot per hop, and its expert searches exactly once per hop."""
    hops = traj.question.count(" _")
    if not hops:
        return None
    answered = bool(traj.rounds) and traj.rounds[-1].action == "answer"
    return float(answered and sum(r.action == "search" for r in traj.rounds) < hops)


def context_answers(task: Task, episode: list[tuple[str, tuple[str, str] | None]], t: int,
                    context: str = "snail") -> str:
    """What round t's CONTEXT tells about each objective's answer, as the expert would answer (``unknown`` else).

    The answer of the memory probe's full-context rows. ``snail``: round t sees the previous
    round (its ``<mem>``) and that round's tool result, so an answer is known when the previous ``<mem>``
    holds it finished or when the previous round's search was the objective's last hop (the tool result
    shows it). ``full``: every earlier round and result is in the context, so an answer is known once its
    last hop was searched. A flawed expert's dropped answer is known to the context that still shows it
    and ``unknown`` to the next ``<mem>``: the "found and dropped" case the reward must see.
    """
    if t == 0:
        return " ; ".join(UNKNOWN for _ in task.objectives)
    searched = [q for _, q in episode[:t]] if context == "full" else [episode[t - 1][1]]
    prev = answers_from_mem(task, episode[t - 1][0].split("</mem>")[0].replace("<mem>", "")).split(" ; ")
    known = [a if a != UNKNOWN and context == "snail" else UNKNOWN for a in prev]
    for k, obj in enumerate(task.objectives):
        s, r, o = obj.chain[-1]
        if (s, r) in searched:
            known[k] = o
    return " ; ".join(known)


# --------------------------------------------------------------------------- tokenizer and model

def world_vocab() -> list[str]:
    """Every word the embedded world can produce, specials first."""
    words = ["<pad>", "<unk>"] + CHAT + TAGS + [UNKNOWN, ";", ":", "=", "?", "|", ",", SLOT] + RELATIONS
    words += [str(k) for k in range(1, 65)] + [f"d{i}" for i in range(MAX_DOC_IDS)]
    words += SYSTEM_PROMPT.split() + ["search", "answer", "not", "found"]
    words += name_pool() + [PROBE]
    seen, out = set(), []
    for w in words:
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer(words: list[str] | None = None):
    """A word-level ``PreTrainedTokenizerFast`` over ``words`` with tags as added tokens and a chat template."""
    words = words or world_vocab()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                 eos_token="<|end|>")
    # added tokens split "<mem>kalo" into "<mem>" "kalo" even without a space
    hf.add_tokens([AddedToken(t, normalized=False) for t in TAGS + CHAT])
    hf.chat_template = CHAT_TEMPLATE
    return hf


def unknown_words(tokenizer, text: str) -> list[str]:
    """The words of ``text`` (whitespace-split, first occurrence order) that ``tokenizer`` maps to its unknown
    token: the word-level tokenizer knows only the world's vocabulary (``world_vocab``); a BPE knows every word."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return []
    return [w for w in dict.fromkeys(text.split()) if unk in tokenizer.encode(w, add_special_tokens=False)]


CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def world_texts(n_worlds: int = 4, seed: int = 0) -> list[str]:
    """Text the embedded world produces (documents, questions, expert rounds, tool results): BPE training data."""
    rng = random.Random(seed)
    texts = [SYSTEM_PROMPT, " ".join(world_vocab()[len(CHAT) + len(TAGS) + 2:])]
    for w in range(n_worlds):
        world = make_world(seed * 1000 + w)
        texts += [f"{d['id']} {d['contents']}" for d in world.docs]
        for _ in range(50):
            task = make_task(world, rng, rng.randint(1, 4))
            texts.append(task.question)
            # a round as a chat turn ends in a newline (ChatML), sometimes in a stray character: a real BPE
            # vocabulary has tokens such as ">\n" and ">." that run past a closing tag
            texts += [text + rng.choice(["\n", "\n", "."]) for text, _ in expert_episode(task, rng.random() < 0.5)]
    return texts


def build_bpe_tokenizer(texts: list[str] | None = None, vocab_size: int = 400):
    """A byte-level BPE tokenizer shaped like Qwen2.5's, trained on ``texts`` (default: the world's text).

    Same normaliser, pre-tokeniser regex and byte-level decoder as ``transformers``' ``Qwen2Tokenizer``,
    ``<|endoftext|>`` (pad / unk) and ``<|im_start|>`` / ``<|im_end|>`` (eos) as the only special tokens and a
    ChatML chat template. Tags are NOT special: ``</search>`` is at least three tokens (``</`` ``search``
    ``>``), and with the small default vocabulary most names are two or three. Deterministic.
    """
    proto = Qwen2Tokenizer()                               # borrow Qwen2's exact pre-tokeniser and decoder
    tok = Tokenizer(models.BPE())
    tok.normalizer = proto.backend_tokenizer.normalizer
    tok.pre_tokenizer = proto.backend_tokenizer.pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHATML_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts or world_texts(), trainer)
    state = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    hf = Qwen2Tokenizer(vocab=state["vocab"], merges=merges, eos_token="<|im_end|>",
                        additional_special_tokens=CHATML_SPECIALS[1:])
    hf.chat_template = CHATML_TEMPLATE
    return hf


def save_random_checkpoint(path: str, tokenizer=None, seed: int = 0, **shape) -> str:
    """A folder shaped like a real Qwen2.5 download, built offline: a randomly initialised ``Qwen2ForCausalLM``
    (GQA) and a byte-level BPE tokenizer with a ChatML template, both ``save_pretrained``; load it back with
    ``AutoModelForCausalLM`` / ``AutoTokenizer`` as any checkpoint. ``shape``: ``Qwen2Config`` fields."""
    tokenizer = tokenizer or build_bpe_tokenizer()
    torch.manual_seed(seed)
    cfg = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
               tie_word_embeddings=True) | shape
    model = Qwen2ForCausalLM(Qwen2Config(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                         bos_token_id=None, **cfg))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_model(tokenizer, hidden: int = 128, layers: int = 3, heads: int = 8, ffn: int = 256, seed: int = 0,
                     kv_heads: int | None = None):
    """A randomly initialised ``LlamaForCausalLM`` over ``tokenizer`` (0.5M parameters at the defaults).

    Llama, not Qwen2: transformers 5 lists ``qwen2`` among the model types whose saved tokenizer class
    it overrides, so ``AutoTokenizer`` on a Qwen2 checkpoint would load a byte-level BPE tokenizer
    instead of this word-level one. Qwen2 is Llama plus a qkv bias; the engine does not care.
    """
    torch.manual_seed(seed)
    qwen = isinstance(tokenizer, Qwen2Tokenizer)          # a BPE tokenizer gets the architecture it belongs to
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if qwen else (LlamaConfig, LlamaForCausalLM)
    cfg = config_cls(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=ffn,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                     max_position_embeddings=8192, tie_word_embeddings=True,
                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                     bos_token_id=None)
    cfg._attn_implementation = "sdpa"
    return model_cls(cfg)


# --------------------------------------------------------------------------- real data

def read_jsonl(path: str) -> list[tuple[int, dict]]:
    if not os.path.exists(path):
        raise DataError(f"{path}: file not found")
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{n}: not UTF-8 text (byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            rows.append((n, row))
    return rows


def alias_lists(golds) -> list[list[str]] | None:
    """``golden_answers`` -> one alias list per objective: a string or a list of strings is one objective, a list
    of lists K; None when it is neither."""
    golds = [golds] if isinstance(golds, str) else golds
    if not isinstance(golds, list) or not golds:
        return None
    if all(isinstance(g, str) for g in golds):
        return [list(golds)]
    if all(isinstance(g, list) and g and all(isinstance(a, str) for a in g) for g in golds):
        return [list(g) for g in golds]
    return None


def load_qa(path: str) -> list[Task]:
    """QA file -> tasks. ``golden_answers``: a list of aliases (one objective) or a list of lists (K objectives)."""
    if path.endswith(".parquet"):
        if not os.path.exists(path):
            raise DataError(f"{path}: file not found")
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading parquet needs pyarrow: pip install pyarrow") from None
        rows = list(enumerate(pq.read_table(path).to_pylist(), 1))
    else:
        rows = read_jsonl(path)
    tasks = []
    for n, row in rows:
        q, golds = row.get("question"), row.get("golden_answers")
        if not isinstance(q, str) or not q.strip():
            raise DataError(f"{path}:{n}: missing or empty field 'question'")
        if isinstance(golds, str):
            golds = [golds]
        if not isinstance(golds, list) or not golds:
            raise DataError(f"{path}:{n}: field 'golden_answers' must be a non-empty list")
        if alias_lists(golds) is None:
            raise DataError(f"{path}:{n}: 'golden_answers' must be strings or lists of strings")
        tasks.append(Task(q.strip(), alias_lists(golds)))
    if not tasks:
        raise DataError(f"{path}: no questions")
    return tasks


def load_corpus(path: str) -> list[dict]:
    """Corpus JSONL -> ``[{"id", "contents"}]``."""
    docs, line_of = [], {}
    for n, row in read_jsonl(path):
        if "id" not in row or not isinstance(row.get("contents"), str):
            raise DataError(f"{path}:{n}: each line needs 'id' and a string 'contents'")
        doc_id = str(row["id"])
        if doc_id in line_of:     # <access> must name one document
            raise DataError(f"{path}:{n}: duplicate id {doc_id!r} (first on line {line_of[doc_id]})")
        line_of[doc_id] = n
        docs.append({"id": doc_id, "contents": row["contents"]})
    if not docs:
        raise DataError(f"{path}: empty corpus")
    return docs


def save_corpus(docs: list[dict], path: str) -> None:
    """Write a corpus as JSONL (the embedded world is searched through the same file format)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")


def compose_tasks(tasks: list[Task], k: int, seed: int = 0) -> list[Task]:
    """MEM1's multi-objective questions from a single-objective set: K questions joined into one prompt.

    ``"Answer the following questions: q1 ; q2 ; ..."`` with gold = the K alias lists, in order. Each
    question is used once per pass over a seeded shuffle; ``len(tasks) // k`` tasks come out.
    """
    if k < 1 or k > len(tasks):
        raise DataError(f"--compose {k}: needs 1 <= K <= the number of questions ({len(tasks)})")
    order = list(range(len(tasks)))
    random.Random(seed).shuffle(order)
    out = []
    for i in range(0, len(order) - k + 1, k):
        part = [tasks[j] for j in order[i:i + k]]
        question = "Answer the following questions: " + " ; ".join(t.question for t in part)
        out.append(Task(question, [g for t in part for g in t.golds]))
    return out


# --------------------------------------------------------------------------- chat-format trajectories (SFT files)

def load_trajectories(path: str) -> list[dict]:
    """SFT file -> ``[{"question", "rounds": [(assistant_text, tool_text or None), ...]}]``.

    One JSON object a line with ``messages``: an optional ``system`` turn, one ``user`` turn (the
    question), then ``assistant`` turns in the tag protocol, each but the last followed by one ``tool``
    (or ``user``) turn holding its result. The system turn is not used: SFT renders every round with the
    run's own system prompt, so SFT and RL see the same one. ``golds``: the line's ``golden_answers`` as
    ``load_qa`` reads them, None when it has none (the SFT's probe rows then read the trajectory's own answer).
    """
    out = []
    for n, row in read_jsonl(path):
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                 and isinstance(m.get("role"), str) for m in msgs):
            raise DataError(f"{path}:{n}: 'messages' must be a list of {{role, content}} objects")
        msgs = [m for m in msgs if m["role"] != "system"]
        if len(msgs) < 2 or msgs[0]["role"] != "user" or msgs[1]["role"] != "assistant":
            raise DataError(f"{path}:{n}: expected a user turn (the question), then an assistant turn")
        rounds, i = [], 1
        while i < len(msgs):
            if msgs[i]["role"] != "assistant":
                raise DataError(f"{path}:{n}: turn {i + 1} should be an assistant turn, got {msgs[i]['role']!r}")
            tool = msgs[i + 1]["content"] if i + 1 < len(msgs) else None
            if tool is not None and msgs[i + 1]["role"] not in ("tool", "user"):
                raise DataError(f"{path}:{n}: turn {i + 2} should be a tool result, got {msgs[i + 1]['role']!r}")
            rounds.append((msgs[i]["content"], tool))
            i += 2
        out.append({"question": msgs[0]["content"], "rounds": rounds, "golds": alias_lists(row.get("golden_answers"))})
    if not out:
        raise DataError(f"{path}: no trajectories")
    return out
