"""Mem-alpha's memory: a core paragraph, a semantic store of facts and an episodic store of dated events,
edited by tool calls in Qwen2.5's ``<tool_call>{"name", "arguments"}</tool_call>`` convention.

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
  log((N + 1) / n) stays positive. Ties go to the newer entry. Words are ``search.bm25_tokens``.
* ``render(query)``: the prompt view, core in full and per store the union of the ``n_relevant``
  entries most relevant to ``query`` (the incoming chunk) by BM25 and the ``n_recent`` newest, with
  their ids, in insertion order, plus how many are hidden. Choice: the original shows only the 5
  newest ids, so an older entry can never be updated or deleted; here a chunk that mentions an old
  fact brings that fact's entry (and its id) into view, and every entry is reachable by its id.
* Tool calls: ``parse_tool_calls`` never raises: malformed JSON, an unknown tool, missing / extra /
  non-string arguments and an unclosed block are calls with an ``error``, executed as failures (they
  count in r2's denominator). A ``</tool_call>`` inside a JSON string still closes the block (as in
  Qwen's own parser).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from rank_bm25 import BM25Plus

from search import bm25_tokens

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
        self.rng = random.Random(seed)
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
        toks = bm25_tokens(query)
        if not items:
            return []
        if not toks:
            return list(range(len(items) - 1, -1, -1))
        scores = BM25Plus([bm25_tokens(t) or ["_"] for _, _, t in items]).get_scores(toks)
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


# --------------------------------------------------------------------------- tool calls

@dataclass
class ToolCall:
    """One ``<tool_call>`` block: its tool and arguments, or why it cannot run (``error`` set)."""
    name: str | None
    arguments: dict
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` in ``text``, in order; never raises.

    A block whose body is not a JSON object with a string ``name`` of a known tool and an object
    ``arguments`` holding exactly that tool's string arguments is returned with ``error`` set (a
    failed call). An opened block that is never closed is one failed call; text outside blocks is ignored.
    """
    calls, pos = [], 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            return calls
        end = text.find(TOOL_CALL_CLOSE, start)
        if end < 0:
            calls.append(ToolCall(None, {}, "error: <tool_call> is never closed"))
            return calls
        calls.append(_tool_call(text[start + len(TOOL_CALL_OPEN):end], TOOL_ARGS))
        pos = end + len(TOOL_CALL_CLOSE)


def _tool_call(body: str, tool_args: dict) -> ToolCall:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:                  # RecursionError: "[[[[..." nested too deep
        return ToolCall(None, {}, f"error: not valid JSON ({type(e).__name__})")
    if not isinstance(obj, dict):
        return ToolCall(None, {}, "error: a tool call must be a JSON object")
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or name not in tool_args:
        return ToolCall(None, {}, f"error: unknown tool {str(name)[:40]!r} (one of {', '.join(tool_args)})")
    if not isinstance(args, dict):
        return ToolCall(name, {}, "error: 'arguments' must be a JSON object")
    required, optional = tool_args[name]
    missing = [a for a in required if a not in args]
    extra = [a for a in args if a not in required + optional]
    wrong = [a for a in args
             if a not in extra and not (isinstance(args[a], str) or (a == "memory_id" and args[a] is None))]
    if missing or extra or wrong:
        why = "; ".join(f"{k}: {', '.join(map(str, v))[:80]}" for k, v in
                        (("missing", missing), ("unexpected", extra), ("not a string", wrong)) if v)
        return ToolCall(name, args, f"error: bad arguments for {name} ({why})")
    return ToolCall(name, args)


def execute_tool_calls(memory, calls: list[ToolCall]) -> list[tuple[bool, str]]:
    """Run ``calls`` in order against a ``StructuredMemory`` -> ``(ok, message)`` per call."""
    out = []
    for c in calls:
        if c.error:
            out.append((False, c.error))
        elif c.name == "new_memory_insert":
            out.append(memory.insert(c.arguments["memory_type"], c.arguments["content"]))
        elif c.name == "memory_update":
            out.append(memory.update(c.arguments["memory_type"], c.arguments["new_content"],
                                     c.arguments.get("memory_id")))
        else:
            out.append(memory.delete(c.arguments["memory_type"], c.arguments["memory_id"]))
    return out
