"""Tasks, corpora, tokenizer, tiny model and expert trajectories: everything the agent is trained on.

Two sources of data:

* **The embedded default** (no model hub, no GPU): a seeded synthetic world of entities and
  relations, one short document per fact, a BM25 index over the documents as the search tool,
  multi-hop questions and MEM1-style *multi-objective* questions (K sub-questions, answers joined
  by `` ; ``), a word-level tokenizer built from the world's vocabulary, and a tiny randomly
  initialised ``LlamaForCausalLM``. ALGORITHM.md section 4.
* **Real data**: a QA file (JSONL or parquet, fields ``question`` and ``golden_answers`` as in
  Search-R1 / MEM1) and a corpus (JSONL with ``id`` and ``contents``, as wiki-18). A missing file or
  a malformed line is a ``DataError`` that names the file and the line.

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
MemTrain's proxy tasks (section ``# --- MemTrain: proxy tasks``, ALGORITHM.md section 3): masked-entity
reconstruction over any ``{id, contents}`` corpus or an embedded world (which gets one paraphrase document
per fact, so a masked fact is always stated by another passage), an entity heuristic for real text, the
IMR builder, and ``add_words`` to give an SFT checkpoint ``[MASK]`` / ``[TARGET]``; the section's comment
lists its choices.

Its flaw (``forget_p``): on that fraction of episodes a finished entry is dropped as soon as a
newer objective finishes, so only the newest answer survives and it answers ``unknown`` for the
others. The flaw is decided per
episode, not per round, so that imitation does not average it away (ALGORITHM.md 4.1: random
per-fact drops at p = 0.3 left a strong SFT policy).

Mem-alpha (section at the end): dated chunks of new facts, changed / ended facts and events, then
questions on the latest value of a fact and on when an event happened; a scripted tool-call writer
whose flaw (per instance) is never revising a fact; ``load_memalpha`` for real chunked JSONL; the task's
word-level tokenizer that writes JSON (``build_memalpha_tokenizer``, its own section).
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field

import torch

RELATIONS = ["friend", "boss", "mother", "rival", "mentor", "neighbor"]
TAGS = ["<mem>", "</mem>", "<think>", "</think>", "<search>", "</search>", "<access>", "</access>",
        "<answer>", "</answer>", "<information>", "</information>"]
CHAT = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SYSTEM_PROMPT = "answer all . keep findings in mem"
UNKNOWN = "unknown"
PROBE = "probe"         # the think word of the memory reward's probes; the policy never writes it (issue 13)
SLOT = "_"              # an entity not found yet, in the question and in <mem>
N_NAMES = 48            # the shared pool of entity names
N_ENTITIES = 24         # entities in one world
MAX_DOC_IDS = N_ENTITIES * len(RELATIONS)


class DataError(ValueError):
    """A dataset or corpus file is missing or malformed; the message names the file and line."""


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


def context_answers(task: Task, episode: list[tuple[str, tuple[str, str] | None]], t: int,
                    context: str = "snail") -> str:
    """What round t's CONTEXT tells about each objective's answer, as the expert would answer (``unknown`` else).

    The answer of the memory probe's full-context rows (issue 13). ``snail``: round t sees the previous
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
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AddedToken, PreTrainedTokenizerFast
    words = words or world_vocab()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                 eos_token="<|end|>")
    # added tokens split "<mem>kalo" into "<mem>" "kalo" even without a space
    hf.add_tokens([AddedToken(t, normalized=False) for t in TAGS + CHAT])
    hf.chat_template = CHAT_TEMPLATE
    return hf


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
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
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
    from transformers import Qwen2Config, Qwen2ForCausalLM
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
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
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

def _read_jsonl(path: str) -> list[tuple[int, dict]]:
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


def load_qa(path: str) -> list[Task]:
    """QA file -> tasks. ``golden_answers``: a list of aliases (one objective) or a list of lists (K objectives)."""
    if path.endswith(".parquet"):
        if not os.path.exists(path):
            raise DataError(f"{path}: file not found")
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        rows = list(enumerate(pq.read_table(path).to_pylist(), 1))
    else:
        rows = _read_jsonl(path)
    tasks = []
    for n, row in rows:
        q, golds = row.get("question"), row.get("golden_answers")
        if not isinstance(q, str) or not q.strip():
            raise DataError(f"{path}:{n}: missing or empty field 'question'")
        if isinstance(golds, str):
            golds = [golds]
        if not isinstance(golds, list) or not golds:
            raise DataError(f"{path}:{n}: field 'golden_answers' must be a non-empty list")
        if all(isinstance(g, str) for g in golds):
            golds = [golds]
        elif not all(isinstance(g, list) and g and all(isinstance(a, str) for a in g) for g in golds):
            raise DataError(f"{path}:{n}: 'golden_answers' must be strings or lists of strings")
        tasks.append(Task(q.strip(), [list(g) for g in golds]))
    if not tasks:
        raise DataError(f"{path}: no questions")
    return tasks


def load_corpus(path: str) -> list[dict]:
    """Corpus JSONL -> ``[{"id", "contents"}]``."""
    docs, line_of = [], {}
    for n, row in _read_jsonl(path):
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
    run's own system prompt, so SFT and RL see the same one.
    """
    out = []
    for n, row in _read_jsonl(path):
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
        out.append({"question": msgs[0]["content"], "rounds": rounds})
    if not out:
        raise DataError(f"{path}: no trajectories")
    return out


def export(folder: str, ks: tuple[int, ...] = (1, 2, 4, 6), n: int = 64, episodes: int = 256, seed: int = 0) -> list[str]:
    """Write the embedded world as real-format files, so the file path can be run on it.

    ``test_k{K}.jsonl`` (Search-R1 QA: ``question``, ``golden_answers`` as K alias lists) and
    ``corpus_k{K}.jsonl`` (wiki-18: ``id``, ``contents``) hold exactly the held-out test set of ``eval.py``
    (same worlds, same questions); ``sft_trajectories.jsonl`` holds ``episodes`` expert episodes (one in
    four with the forgetting flaw, as train.py's ``--forget-p 0.25``; K 1-4, 1-3 hops, training worlds) as
    chat-format ``messages``.
    """
    from rollout import SearchTool      # the tool's output is part of a trajectory (CLI only)
    os.makedirs(folder, exist_ok=True)
    paths = []
    for k in ks:
        world, tasks = held_out_tasks(k, n)
        paths += [os.path.join(folder, f"test_k{k}.jsonl"), os.path.join(folder, f"corpus_k{k}.jsonl")]
        with open(paths[-2], "w", encoding="utf-8") as f:
            for t in tasks:
                f.write(json.dumps({"question": t.question, "golden_answers": t.golds}) + "\n")
        save_corpus(world.docs, paths[-1])
    rng = random.Random(seed)
    paths.append(os.path.join(folder, "sft_trajectories.jsonl"))
    with open(paths[-1], "w", encoding="utf-8") as f:
        for e in range(episodes):
            world = make_world(rng.randrange(10**9))
            tool, task = SearchTool(world.docs), make_task(world, rng, rng.randint(1, 4))
            msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.question}]
            for text, query in expert_episode(task, forget=e % 4 == 3):
                msgs.append({"role": "assistant", "content": text})
                if query is not None:
                    msgs.append({"role": "tool", "content": tool.search(" ".join(query))})
            f.write(json.dumps({"messages": msgs, "golden_answers": task.golds}) + "\n")
    return paths


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description="Write the embedded world as real-format files.")
    p.add_argument("--export", required=True, metavar="DIR", help="folder for test_k*.jsonl, corpus_k*.jsonl, "
                   "sft_trajectories.jsonl")
    p.add_argument("--objectives", type=int, nargs="+", default=[1, 2, 4, 6], help="objective counts K")
    p.add_argument("--tasks", type=int, default=64, help="test questions per K")
    p.add_argument("--episodes", type=int, default=256, help="expert trajectories")
    a = p.parse_args()
    print("\n".join(export(a.export, tuple(a.objectives), a.tasks, a.episodes)))


# --- MemTrain: proxy tasks (ALGORITHM.md section 3)
#
# Masked reconstruction (the end-to-end task), built from ANY corpus of {id, contents}:
#
#     pivot passage  +  its BM25 neighbours (rank-bm25, query = the pivot's text)  +  random passages
#     -> shuffled -> concatenated -> split into at most ``max_chunks`` chunks
#     one entity of the pivot -> "[MASK]" at EVERY occurrence in the pivot; problem "which entity is [MASK] ?"
#
# Choices of this project (the paper does not fix them):
# * Chunks are groups of WHOLE passages (joined by `` | ``, as the search tool joins documents), as even
#   in size as possible: an entity is never cut in two, and a chunk arrives like one tool result.
# * Recoverability is enforced, not hoped for: the masked entity is drawn only among the pivot's entities
#   that occur (as a whole word) in another passage of the same task; a pivot with none is skipped.
#   ``evidence`` lists those passages. On the embedded world a bare fact document (``kalo friend mira``)
#   has no other document stating it, so ``world_memtrain_docs`` adds one paraphrase per fact
#   (``mira is friend of kalo``); BM25 ranks it first among the pivot's neighbours, and every generated
#   world task holds a passage stating the masked fact (``test_memtrain.py`` checks every one).
# * Entities: on the world, the pool's names (``names=``); on real text, ``entity_spans`` (dates, then
#   capitalised spans minus sentence-initial function words, then numbers; a span inside an earlier one
#   is not counted twice).
# * IMR (``imr_task``): step k and an earlier chunk l < k drawn uniformly; EVERY occurrence of the entity
#   in chunk l becomes ``[TARGET]`` (one left unmasked would give the answer away); ``[MASK]`` is never a
#   target.

import re as _re

MASK, TARGET = "[MASK]", "[TARGET]"
MEMTRAIN_WORDS = [MASK, TARGET, "which", "entity", "is", "of"]   # words the world's vocabulary lacks
MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|December")
DATE_RE = _re.compile(rf"\b(?:(?:{MONTHS}) \d{{1,2}}(?:, \d{{4}})?|\d{{1,2}} (?:{MONTHS})(?: \d{{4}})?|(?:{MONTHS}) \d{{4}})\b")
CAPS_RE = _re.compile(r"\b[A-Z][\w'\-]*(?:\s+(?:of|de|von|van|the)?\s*[A-Z][\w'\-]*)*")
NUMBER_RE = _re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?![\w])")
FUNCTION_WORDS = {"The", "A", "An", "In", "On", "At", "It", "He", "She", "They", "We", "I", "This", "That",
                  "These", "Those", "His", "Her", "Its", "Their", "But", "And", "Or", "As", "After", "Before",
                  "When", "While", "There", "However", "Also", "For", "From", "By", "With", "Of", "To", "If",
                  "During", "Since", "Although", "Some", "Many", "Most", "One", "Which", "Who", "What"}


def problem_text(placeholder: str = MASK) -> str:
    """The MemTrain question: ``which entity is [MASK] ?``."""
    return f"which entity is {placeholder} ?"


def entity_spans(text: str, names: set[str] | frozenset[str] | None = None) -> list[str]:
    """Distinct entities of ``text`` in order of first appearance.

    With ``names`` (the embedded world): the words of ``text`` that are names. Otherwise a heuristic
    for real text: dates (``May 4, 1970``, ``4 May 1970``), capitalised spans (``Sam Houston``, ``Bank of
    England``; a lone sentence-initial function word such as ``The`` is dropped, ``The`` leading a longer
    span is cut off), then numbers (``1970``, ``3.5``); a span overlapping an earlier one is skipped.
    """
    if names is not None:
        return list(dict.fromkeys(w for w in text.split() if w in names))
    taken: list[tuple[int, int]] = []
    found: list[tuple[int, str]] = []
    for rx in (DATE_RE, CAPS_RE, NUMBER_RE):
        for m in rx.finditer(text):
            start, span = m.start(), m.group(0).strip()
            first, _, rest = span.partition(" ")
            if first in FUNCTION_WORDS:
                if not rest:
                    continue
                start, span = start + len(first) + 1, rest.strip()
            end = start + len(span)
            if MASK.strip("[]") in span or TARGET.strip("[]") in span:
                continue
            if any(start < b and a < end for a, b in taken):
                continue
            taken.append((start, end))
            found.append((start, span))
    return list(dict.fromkeys(s for _, s in sorted(found)))


def _occurs(entity: str, text: str) -> bool:
    return _re.search(rf"(?<!\w){_re.escape(entity)}(?!\w)", text) is not None


def replace_entity(text: str, entity: str, placeholder: str) -> str:
    """Every whole-word occurrence of ``entity`` in ``text`` -> ``placeholder``."""
    return _re.sub(rf"(?<!\w){_re.escape(entity)}(?!\w)", placeholder, text)


def world_memtrain_docs(world: World) -> list[dict]:
    """The world's fact documents plus one paraphrase per fact (``mira is friend of kalo``): a masked fact
    stays recoverable from another passage."""
    para = [{"id": f"p{i}", "contents": f"{o} is {r} of {s}"} for i, ((s, r), o) in enumerate(sorted(world.facts.items()))]
    return list(world.docs) + para


@dataclass
class MemTrainTask:
    """One masked-reconstruction task: read ``chunks`` in order, then answer ``problem`` (gold ``answer``)."""
    problem: str
    answer: str
    chunks: list[str]
    pivot_id: str
    passage_ids: list[str]          # in reading order
    evidence_ids: list[str]         # passages other than the pivot that contain the answer


def split_chunks(passages: list[str], max_chunks: int) -> list[str]:
    """Whole passages grouped into ``min(max_chunks, len)`` contiguous chunks, sizes differing by at most 1."""
    n = min(max_chunks, len(passages))
    size, extra = divmod(len(passages), n)
    out, i = [], 0
    for c in range(n):
        j = i + size + (c < extra)
        out.append(" | ".join(passages[i:j]))
        i = j
    return out


def masked_reconstruction_tasks(docs: list[dict], n: int, seed: int, max_chunks: int = 8, n_neighbours: int = 3,
                                n_random: int = 4, names: set[str] | frozenset[str] | None = None,
                                bm25=None) -> list[MemTrainTask]:
    """``n`` masked-entity reconstruction tasks over a corpus of ``{"id", "contents"}``; deterministic in ``seed``.

    ``names``: the entity vocabulary (the embedded world); None uses ``entity_spans``' heuristic for real text.
    ``bm25``: a prebuilt ``BM25Okapi`` over ``docs`` (built here when None).
    """
    from rank_bm25 import BM25Okapi
    from rollout import bm25_tokens
    if len(docs) < 2:
        raise DataError("masked reconstruction needs at least two passages")
    bm25 = bm25 or BM25Okapi([bm25_tokens(d["contents"]) for d in docs])
    rng = random.Random(seed)
    tasks: list[MemTrainTask] = []
    for _ in range(50 * n):
        if len(tasks) == n:
            break
        p = rng.randrange(len(docs))
        scores = bm25.get_scores(bm25_tokens(docs[p]["contents"]))
        ranked = sorted((i for i in range(len(docs)) if i != p), key=lambda i: (-scores[i], i))
        chosen = [p] + ranked[:n_neighbours]
        rest = [i for i in range(len(docs)) if i not in set(chosen)]
        chosen += rng.sample(rest, min(n_random, len(rest)))
        others = [i for i in chosen if i != p]
        cands = [e for e in entity_spans(docs[p]["contents"], names)
                 if any(_occurs(e, docs[i]["contents"]) for i in others)]
        if not cands:
            continue
        entity = rng.choice(cands)
        rng.shuffle(chosen)
        texts = [replace_entity(docs[i]["contents"], entity, MASK) if i == p else docs[i]["contents"] for i in chosen]
        tasks.append(MemTrainTask(problem_text(MASK), entity, split_chunks(texts, max_chunks), docs[p]["id"],
                                  [docs[i]["id"] for i in chosen],
                                  [docs[i]["id"] for i in chosen if i != p and _occurs(entity, docs[i]["contents"])]))
    if len(tasks) < n:
        raise DataError(f"only {len(tasks)} of {n} masked-reconstruction tasks: too few pivots with a shared entity")
    return tasks


def world_memtrain_tasks(world_seed: int, n: int, seed: int = 0, max_chunks: int = 8, **kw) -> list[MemTrainTask]:
    """Masked-reconstruction tasks over one embedded world (facts + paraphrases, names as entities)."""
    return masked_reconstruction_tasks(world_memtrain_docs(make_world(world_seed)), n, seed, max_chunks,
                                       names=frozenset(name_pool()), **kw)


@dataclass
class IMRTask:
    """Intermediate memory recall: memory written at step ``k`` + chunk ``l < k`` with ``[TARGET]`` -> ``target``."""
    k: int
    l: int
    chunk: str
    target: str
    problem: str = problem_text(TARGET)


def imr_task(chunks: list[str], n_steps: int, rng: random.Random,
             names: set[str] | frozenset[str] | None = None) -> IMRTask | None:
    """Pick step k in [1, n_steps) and chunk l < k holding an entity; mask that entity in chunk l.

    ``n_steps`` = memories written by the rollout (step t reads ``chunks[t]``). None when no earlier chunk
    holds an entity (or the rollout wrote fewer than two memories).
    """
    pairs = [(k, l) for k in range(1, min(n_steps, len(chunks))) for l in range(k) if entity_spans(chunks[l], names)]
    if not pairs:
        return None
    k, l = rng.choice(pairs)
    target = rng.choice(entity_spans(chunks[l], names))
    return IMRTask(k, l, replace_entity(chunks[l], target, TARGET), target)


def memtrain_expert_rounds(task: MemTrainTask, mem_words: int = 40) -> list[str]:
    """Scripted memory-agent steps for a format warm start: memory = every passage read so far, the oldest
    passages holding neither ``[MASK]`` nor the answer dropped first when over ``mem_words`` words (the
    expert is an oracle: it keeps the evidence); the last step answers the masked entity."""
    kept: list[str] = []
    out = []
    spare = lambda p: MASK not in p and not _occurs(task.answer, p)      # noqa: E731
    for t, chunk in enumerate(task.chunks):
        kept += chunk.split(" | ")
        while sum(len(p.split()) for p in kept) > mem_words and any(spare(p) for p in kept):
            kept.remove(next(p for p in kept if spare(p)))
        text = f"<mem> {' | '.join(kept)} </mem>"
        if t == len(task.chunks) - 1:
            text += f" <think> answer </think> <answer> {task.answer} </answer>"
        out.append(text)
    return out


def add_words(tokenizer, model, words: list[str]) -> list[str]:
    """Add the ``words`` a tokenizer maps to ``<unk>`` as whole-word tokens and grow the model's embeddings.

    An SFT checkpoint of the world knows no ``[MASK]``; a byte-level BPE tokenizer has no ``<unk>`` and is
    left unchanged. Returns the words added.
    """
    from transformers import AddedToken
    unk = tokenizer.unk_token_id
    if unk is None:
        return []
    missing = [w for w in words if unk in tokenizer.encode(w, add_special_tokens=False)]
    if missing:
        tokenizer.add_tokens([AddedToken(w, single_word=True, normalized=False) for w in missing])
        model.resize_token_embeddings(len(tokenizer))
    return missing


# --- Mem-alpha: the memorisation task (ALGORITHM.md section 2)
"""A stream of dated chunks about the embedded world, then questions answerable only from memory.

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
INSTANCE, ALGORITHM.md 4.1: per-call noise is averaged away by imitation): on a ``flaw_p`` share of
instances it never revises, i.e. writes no update or delete, so the stale value stays and the
change questions fail; RL has that headroom.
``memory_answer`` is the answerer's teacher: it reads the answer off what the answerer is shown (the
first entry ``s r X`` in its view, ``none`` when there is none; ``day D`` from the first matching
event, ``unknown`` when there is none), so a frozen answerer trained on it measures the memory,
not its own knowledge.
"""
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
                           n_questions: int = 4, flaw_p: float = 0.0) -> MemInstance:
    """A stream of ``n_chunks`` dated chunks over ``world`` and ``n_questions`` questions about its end state."""
    keys = rng.sample(sorted(world.facts), n_chunks * facts_per_chunk)
    value: dict[tuple[str, str], str] = {}
    changed: list[tuple[str, str]] = []
    events: list[tuple[str, str, str, int]] = []
    chunks, day = [], rng.randint(1, 3)
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


def report_text(report: tuple) -> str:
    kind, s, r, o = report
    return {"fact": f"{s} {r} {o} .", "change": f"{s} {r} is now {o} .", "end": f"{s} {r} ended .",
            "event": f"{s} {r} {o} ."}[kind]


def make_memalpha_instances(world_seed: int, n: int, seed: int = 0, **kw) -> list[MemInstance]:
    """``n`` instances over the world of ``world_seed``; ``kw`` goes to ``make_memalpha_instance``."""
    world = make_world(world_seed)
    rng = random.Random(seed * 100_003 + world_seed)
    return [make_memalpha_instance(world, rng, **kw) for _ in range(n)]


def writer_calls(memory, chunk: Chunk, flawed: bool = False) -> str:
    """The scripted writer's output for ``chunk`` (tool-call text), executing each call on ``memory`` as it goes."""
    from memory import tool_call_text
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
    from memory import StructuredMemory
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
    for n, row in _read_jsonl(path):
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


# --- Mem-alpha: a word-level tokenizer that writes JSON (ALGORITHM.md section 2)
"""``build_memalpha_tokenizer``: every word of the task is ONE token wherever it stands, and JSON round-trips.

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
TOOL_JSON_GLUE = ['<tool_call>{"name": "', '", "arguments": {"', '"}}</tool_call>', '": "', '", "']


def memalpha_words() -> list[str]:
    """Every word the Mem-alpha task writes (world names, relations, verbs, tools, prompts), deduplicated."""
    from memory import ANSWER_SYSTEM, MEMORY_TYPES, TOOL_ARGS, TRUNCATED, WRITER_SYSTEM
    words = name_pool() + RELATIONS + EVENT_VERBS + list(MEMORY_TYPES) + list(TOOL_ARGS)
    words += [a for req, opt in TOOL_ARGS.values() for a in req + opt]
    words += (WRITER_SYSTEM + " " + ANSWER_SYSTEM).split() + [TRUNCATED, NONE_ANSWER, UNKNOWN]
    words += "day is now ended on when latest report question chunk more not shown empty system user assistant".split()
    words += [str(k) for k in range(100)]
    return list(dict.fromkeys(w for w in words if _re.fullmatch(r"\w+", w)))


def build_memalpha_tokenizer():
    """The word-level ChatML tokenizer of the Mem-alpha task (see this section's notes). Deterministic."""
    import string
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = memalpha_words()
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = list(dict.fromkeys(CHATML_SPECIALS + TOOL_JSON_GLUE + words + chars))
    alt = lambda ws: "|".join(sorted(ws, key=len, reverse=True))      # longest first: memory_type before memory
    glue = "|".join(_re.escape(g) for g in TOOL_JSON_GLUE)
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
