"""MemTrain's proxy tasks: masked-entity reconstruction over any corpus, IMR, and
the words an SFT checkpoint of the world lacks.

Masked reconstruction (the end-to-end task), built from ANY corpus of {id, contents}:

    pivot passage  +  its BM25 neighbours (rank-bm25, query = the pivot's text)  +  random passages
    -> shuffled -> concatenated -> split into at most ``max_chunks`` chunks
    one entity of the pivot -> "[MASK]" at EVERY occurrence in the pivot; problem "which entity is [MASK] ?"

Choices of this project (the paper does not fix them):
* Chunks are groups of WHOLE passages (joined by `` | ``, as the search tool joins documents), as even
  in size as possible: an entity is never cut in two, and a chunk arrives like one tool result.
* Recoverability is enforced, not hoped for: the masked entity is drawn only among the pivot's entities
  that occur (as a whole word) in another passage of the same task; a pivot with none is skipped.
  ``evidence`` lists those passages. On the embedded world a bare fact document (``kalo friend mira``)
  has no other document stating it, so ``world_memtrain_docs`` adds one paraphrase per fact
  (``mira is friend of kalo``); BM25 ranks it first among the pivot's neighbours, and every generated
  world task holds a passage stating the masked fact (``test_memtrain.py`` checks every one).
* Entities: on the world, the pool's names (``names=``); on real text, ``entity_spans`` (dates, then
  capitalised spans minus sentence-initial function words, then numbers; a span inside an earlier one
  is not counted twice).
* IMR (``imr_task``): step k and an earlier chunk l < k drawn uniformly; EVERY occurrence of the entity
  in chunk l becomes ``[TARGET]`` (one left unmasked would give the answer away); ``[MASK]`` is never a
  target.

An embedded world gets one paraphrase document per fact (``world_memtrain_docs``), so a masked fact is
always stated by another passage; ``memtrain_expert_rounds`` scripts the memory agent's steps for the
optional format warm start (``--memtrain-warmup``).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from rank_bm25 import BM25Okapi
from transformers import AddedToken

from data import DataError, World, make_world, name_pool
from search import bm25_tokens

MASK, TARGET = "[MASK]", "[TARGET]"
MEMTRAIN_WORDS = [MASK, TARGET, "which", "entity", "is", "of"]   # words the world's vocabulary lacks
MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|December")
DATE_RE = re.compile(rf"\b(?:(?:{MONTHS}) \d{{1,2}}(?:, \d{{4}})?|\d{{1,2}} (?:{MONTHS})(?: \d{{4}})?"
                     rf"|(?:{MONTHS}) \d{{4}})\b")
CAPS_RE = re.compile(r"\b[A-Z][\w'\-]*(?:\s+(?:of|de|von|van|the)?\s*[A-Z][\w'\-]*)*")
NUMBER_RE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?![\w])")
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
    return re.search(rf"(?<!\w){re.escape(entity)}(?!\w)", text) is not None


def replace_entity(text: str, entity: str, placeholder: str) -> str:
    """Every whole-word occurrence of ``entity`` in ``text`` -> ``placeholder``."""
    return re.sub(rf"(?<!\w){re.escape(entity)}(?!\w)", placeholder, text)


def world_memtrain_docs(world: World) -> list[dict]:
    """The world's fact documents plus one paraphrase per fact (``mira is friend of kalo``): a masked fact
    stays recoverable from another passage."""
    para = [{"id": f"p{i}", "contents": f"{o} is {r} of {s}"}
            for i, ((s, r), o) in enumerate(sorted(world.facts.items()))]
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
    """Intermediate memory recall: memory written at step ``k`` + chunk l < k (``chunk_step``) with ``[TARGET]`` ->
    ``target``."""
    k: int
    chunk_step: int
    chunk: str
    target: str
    problem: str = problem_text(TARGET)


def imr_task(chunks: list[str], n_steps: int, rng: random.Random,
             names: set[str] | frozenset[str] | None = None) -> IMRTask | None:
    """Pick step k in [1, n_steps) and chunk l < k holding an entity; mask that entity in chunk l.

    ``n_steps`` = memories written by the rollout (step t reads ``chunks[t]``). None when no earlier chunk
    holds an entity (or the rollout wrote fewer than two memories).
    """
    pairs = [(k, j) for k in range(1, min(n_steps, len(chunks))) for j in range(k) if entity_spans(chunks[j], names)]
    if not pairs:
        return None
    k, chunk_step = rng.choice(pairs)
    target = rng.choice(entity_spans(chunks[chunk_step], names))
    return IMRTask(k, chunk_step, replace_entity(chunks[chunk_step], target, TARGET), target)


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
    unk = tokenizer.unk_token_id
    if unk is None:
        return []
    missing = [w for w in words if unk in tokenizer.encode(w, add_special_tokens=False)]
    if missing:
        tokenizer.add_tokens([AddedToken(w, single_word=True, normalized=False) for w in missing])
        model.resize_token_embeddings(len(tokenizer))
    return missing


