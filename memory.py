"""What the agent sees and keeps: records, snail-shell truncation, ``<mem>`` spans, ``mem_traj``.

MemPO's agent writes ``<mem> ... </mem>`` at the start of every round: a full rewrite of what is
worth keeping, not an append. With *snail-shell* truncation (the original's
``AgentMemory.prepare_prompt``) the model sees only

    system + original question + the newest round's output + that round's tool result (short_text)

so everything older must survive inside ``<mem>``. Scanning records from newest to oldest and
counting tool results, the cut is at the 2nd tool result from the end (``keep_rounds=1``); the
original question is never dropped. ``keep_rounds=None`` is the *full* context (every record, tool
results in full), which the original uses for training rollouts.

Deviations from the original code, each on purpose:

* The original re-adds an old round as ``"<mem>" + r.text`` although ``r.text`` already starts with
  ``<mem>``, so the model sees ``<mem><mem> ...`` (seed section 5.3). Here ``llm_gen.text`` is the round
  exactly as the model wrote it (forced prefix included) and goes back unchanged.
* ``keep_rounds`` generalises the fixed "2nd tool result" cut (1 = the original).
* ``short_text`` of a webpage is its first ``webpage_chars`` characters (100 in the original; seed
  section 5.6), configurable; search results keep their full text, as in the original.

``mem_traj`` for the memory reward = the initial prompt (system + question + generation prompt)
followed by the round's tokens cut right after ``</mem>``.

Mem-alpha (section at the end, ``StructuredMemory``): core / semantic / episodic stores edited by
tool calls; every failure is an ``(False, "error: ...")`` answer, deleting an unknown id included;
the prompt shows entries relevant to the chunk (BM25+) besides the newest, so every entry stays
reachable by id (the original shows only the 5 newest); see that section's notes.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

RECORD_TYPES = ("prompt", "llm_gen", "search_results", "webpage")
TOOL_TYPES = ("search_results", "webpage")
MEM_RE = re.compile(r"^\s*<mem>(.*?)</mem>", re.S)


@dataclass
class Record:
    """One entry of the agent's history. ``short_text`` is what snail-shell context shows of a tool result."""
    type: str
    text: str
    short_text: str | None = None

    def __post_init__(self):
        if self.type not in RECORD_TYPES:
            raise ValueError(f"unknown record type {self.type!r}")
        if self.short_text is None:
            self.short_text = self.text


def tool_record(kind: str, text: str, webpage_chars: int = 100) -> Record:
    """A tool result record: search results keep their full text, a webpage only its first characters."""
    short = text[:webpage_chars] if kind == "webpage" else text
    return Record(kind, text, short)


def prepare_prompt(records: list[Record], system_prompt: str, keep_rounds: int | None = 1) -> list[dict]:
    """Chat messages the model sees next: system + question, then the records after the cut point."""
    if not records or records[0].type != "prompt":
        raise ValueError("records must start with the 'prompt' record (the original question)")
    messages = [{"role": "system", "content": system_prompt},
                {"role": "user", "content": records[0].text}]
    start = 1
    if keep_rounds is not None:
        seen = 0
        for i in range(len(records) - 1, 0, -1):      # newest to oldest, never past the question
            if records[i].type in TOOL_TYPES:
                seen += 1
                if seen == keep_rounds + 1:            # the cut: drop this tool result and all before
                    start = i + 1
                    break
    full = keep_rounds is None
    for r in records[start:]:
        if r.type == "llm_gen":
            messages.append({"role": "assistant", "content": r.text})
        elif r.type in TOOL_TYPES:
            messages.append({"role": "user", "content": r.text if full else r.short_text})
        else:
            raise ValueError(f"a {r.type!r} record can only be first")
    return messages


def extract_mem(text: str) -> str | None:
    """The body of the round's leading ``<mem>...</mem>``, stripped; None when the round has none."""
    m = MEM_RE.match(text)
    return m.group(1).strip() if m else None


def mem_token_end(tokenizer, ids: list[int]) -> int:
    """Number of leading tokens of ``ids`` up to and including ``</mem>``; 0 when there is no leading span.

    Works for any tokenizer: binary search for the shortest prefix whose decoded text closes the span.
    """
    if extract_mem(tokenizer.decode(ids)) is None:
        return 0
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if extract_mem(tokenizer.decode(ids[:mid])) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def mem_traj(prompt_ids: list[int], round_ids: list[int], mem_end: int) -> list[int]:
    """The memory-only context: initial prompt + the round's tokens cut right after ``</mem>``."""
    return list(prompt_ids) + list(round_ids[:mem_end])


# --- Mem-alpha: structured memory (ALGORITHM.md section 2)
"""Mem-alpha's memory: a core paragraph, a semantic store of facts and an episodic store of dated events.

* ``core``: one paragraph, changed only by ``update("core", text)`` (a full rewrite), capped at
  ``core_limit`` tokens; longer text is cut to fit and ends with the visible marker ``TRUNCATED``.
  Tokens are counted by ``count_tokens`` (any ``str -> int``; e.g. ``lambda s: len(tok.encode(s))``);
  the default counts whitespace-separated words.
* ``semantic`` / ``episodic``: ``{id: text}`` in insertion order. Ids are 4 lowercase letters / digits
  drawn from a ``random.Random(seed)``, unique across both stores, so one seed gives the same ids.
* Every operation returns ``(ok, message)`` and never raises. Failures: an unknown store, an id that
  is not in the store (deleting one fails too, unlike the original, which reported success), an
  exact duplicate (insert, or an update that would copy another entry), empty or non-string
  content, an id given for core, core deleted or inserted into.
* ``retrieve(query, k)``: ``rank-bm25`` over semantic + episodic together; ``retrieve_each`` takes
  top-k of each store (r1's answerer context). The variant is BM25+ (``BM25Plus``), not Okapi:
  Okapi's idf log((N - n + .5) / (n + .5)) is <= 0 for a word in half the entries, so on a store
  of one or two entries every score is 0 and the ranking is arbitrary; BM25+'s idf
  log((N + 1) / n) stays positive. Ties go to the newer entry.
* ``render(query)``: the prompt view, core in full and per store the union of the ``n_relevant``
  entries most relevant to ``query`` (the incoming chunk) by BM25 and the ``n_recent`` newest, with
  their ids, in insertion order, plus how many are hidden. Choice: the original shows only the 5
  newest ids, so an older entry can never be updated or deleted; here a chunk that mentions an old
  fact brings that fact's entry (and its id) into view, and every entry is reachable by its id.
"""
import random as _random

MEMORY_TYPES = ("core", "semantic", "episodic")
LIST_TYPES = ("semantic", "episodic")
TRUNCATED = "TRUNCATED"
ID_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"


def word_count(text: str) -> int:
    return len(text.split())


class StructuredMemory:
    """Core paragraph + semantic and episodic ``{id: text}`` stores, edited by tool calls."""

    def __init__(self, core_limit: int = 512, count_tokens=word_count, seed: int = 0,
                 n_recent: int = 3, n_relevant: int = 6):
        self.core_limit, self.count_tokens = core_limit, count_tokens
        self.n_recent, self.n_relevant = n_recent, n_relevant
        self.rng = _random.Random(seed)
        self.core = ""
        self.stores: dict[str, dict[str, str]] = {t: {} for t in LIST_TYPES}

    # ------------------------------------------------------------------ operations
    def _new_id(self) -> str:
        while True:
            i = "".join(self.rng.choice(ID_CHARS) for _ in range(4))
            if all(i not in s for s in self.stores.values()):
                return i

    def _check(self, memory_type, content, allowed, needs_content: bool = True) -> str | None:
        if not isinstance(memory_type, str) or memory_type not in MEMORY_TYPES:
            return f"error: unknown memory_type {memory_type!r} (one of {', '.join(MEMORY_TYPES)})"
        if memory_type not in allowed:
            return f"error: this operation does not apply to {memory_type} memory"
        if needs_content and (not isinstance(content, str) or not content.strip()):
            return "error: content must be a non-empty string"
        return None

    def _fit_core(self, text: str) -> str:
        """``text`` when it fits ``core_limit`` tokens, else its longest word prefix + `` TRUNCATED`` that fits."""
        if self.count_tokens(text) <= self.core_limit:
            return text
        words = text.split()
        lo, hi = 0, len(words)                      # longest prefix whose marked text fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count_tokens(" ".join(words[:mid] + [TRUNCATED])) <= self.core_limit:
                lo = mid
            else:
                hi = mid - 1
        return " ".join(words[:lo] + [TRUNCATED])

    def insert(self, memory_type, content) -> tuple[bool, str]:
        """Add an entry to semantic or episodic memory; an exact duplicate is refused."""
        err = self._check(memory_type, content, LIST_TYPES)
        if err:
            return False, err
        content = content.strip()
        store = self.stores[memory_type]
        if content in store.values():
            return False, f"error: duplicate: {memory_type} memory already holds this text"
        i = self._new_id()
        store[i] = content
        return True, f"inserted {memory_type} {i}"

    def update(self, memory_type, new_content, memory_id=None) -> tuple[bool, str]:
        """Rewrite core (no id), or replace the text of entry ``memory_id`` of semantic / episodic."""
        err = self._check(memory_type, new_content, MEMORY_TYPES)
        if err:
            return False, err
        new_content = new_content.strip()
        if memory_type == "core":
            if memory_id not in (None, ""):
                return False, "error: core memory has no ids; call memory_update without memory_id"
            self.core = self._fit_core(new_content)
            cut = " (truncated to the core limit)" if self.core.endswith(TRUNCATED) else ""
            return True, "updated core" + cut
        store = self.stores[memory_type]
        if not isinstance(memory_id, str) or memory_id not in store:
            return False, f"error: unknown {memory_type} id {memory_id!r}"
        if any(t == new_content and k != memory_id for k, t in store.items()):
            return False, f"error: duplicate: another {memory_type} entry holds this text"
        store[memory_id] = new_content
        return True, f"updated {memory_type} {memory_id}"

    def delete(self, memory_type, memory_id) -> tuple[bool, str]:
        """Remove entry ``memory_id`` of semantic / episodic; an unknown id is a failure."""
        err = self._check(memory_type, None, LIST_TYPES, needs_content=False)
        if err:
            return False, err
        store = self.stores[memory_type]
        if not isinstance(memory_id, str) or memory_id not in store:
            return False, f"error: unknown {memory_type} id {memory_id!r}"
        del store[memory_id]
        return True, f"deleted {memory_type} {memory_id}"

    # ------------------------------------------------------------------ reading
    def entries(self, memory_type: str) -> list[tuple[str, str]]:
        return list(self.stores[memory_type].items())

    def _rank(self, items: list[tuple[str, str, str]], query: str) -> list[int]:
        """Indices of ``items`` (type, id, text) by BM25 score of ``query``, newer first among ties."""
        from rank_bm25 import BM25Plus
        toks = _bm25_tokens(query)
        if not items:
            return []
        if not toks:
            return list(range(len(items) - 1, -1, -1))
        scores = BM25Plus([_bm25_tokens(t) or ["_"] for _, _, t in items]).get_scores(toks)
        return sorted(range(len(items)), key=lambda j: (-scores[j], -j))

    def retrieve(self, query: str, k: int) -> list[tuple[str, str, str]]:
        """Top-``k`` entries of semantic + episodic for ``query`` -> ``[(memory_type, id, text)]``."""
        items = [(t, i, x) for t in LIST_TYPES for i, x in self.stores[t].items()]
        return [items[j] for j in self._rank(items, query)[:k]]

    def retrieve_each(self, query: str, k: int) -> dict[str, list[tuple[str, str]]]:
        """Top-``k`` of each store for ``query`` -> ``{memory_type: [(id, text)]}`` (the answerer's view)."""
        out = {}
        for t in LIST_TYPES:
            items = [(t, i, x) for i, x in self.stores[t].items()]
            out[t] = [items[j][1:] for j in self._rank(items, query)[:k]]
        return out

    def render(self, query: str = "") -> str:
        """The memory as the writer's prompt shows it: core, then relevant + newest entries with ids."""
        lines = [f"core: {self.core or '(empty)'}"]
        for t in LIST_TYPES:
            items = [(t, i, x) for i, x in self.stores[t].items()]
            shown = set(range(max(0, len(items) - self.n_recent), len(items)))
            shown |= set(self._rank(items, query)[:self.n_relevant]) if query.strip() else set()
            hidden = len(items) - len(shown)
            lines.append(f"{t}:" + (f" ({hidden} more not shown)" if hidden else ""))
            lines += [f"[{items[j][1]}] {items[j][2]}" for j in sorted(shown)]
        return "\n".join(lines)

    def n_tokens(self) -> int:
        """Memory size: tokens of core plus every entry's text."""
        texts = [self.core] + [x for t in LIST_TYPES for x in self.stores[t].values()]
        return sum(self.count_tokens(x) for x in texts if x)


def _bm25_tokens(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


# Qwen2.5's function-calling convention: each call is one JSON object between these tags.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_ARGS = {   # tool -> (required arguments, optional arguments); every argument is a string
    "new_memory_insert": (("memory_type", "content"), ()),
    "memory_update": (("memory_type", "new_content"), ("memory_id",)),
    "memory_delete": (("memory_type", "memory_id"), ()),
}


def tool_call_text(name: str, arguments: dict) -> str:
    """One call as the model writes it: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    return TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": arguments}) + TOOL_CALL_CLOSE


ANSWER_SYSTEM = "answer the question from memory . reply with the answer only"


def answerer_messages(memory: StructuredMemory, question: str, k: int) -> list[dict]:
    """What r1's frozen answerer sees: core in full + BM25 top-``k`` of each store for ``question``."""
    hits = memory.retrieve_each(question, k)
    lines = [f"core: {memory.core or '(empty)'}"]
    for t in LIST_TYPES:
        lines += [f"{t}: {text}" for _, text in hits[t]]
    return [{"role": "system", "content": ANSWER_SYSTEM},
            {"role": "user", "content": "\n".join(lines) + f"\nquestion: {question}"}]


WRITER_SYSTEM = "read the chunk . keep what later questions need with tool calls . memory now :"


def writer_messages(memory: StructuredMemory, chunk: str) -> list[dict]:
    """What the writer sees for one chunk (a fresh context): its instructions + rendered memory, then the chunk."""
    return [{"role": "system", "content": WRITER_SYSTEM + "\n" + memory.render(chunk)},
            {"role": "user", "content": chunk}]
