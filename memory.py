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
  ``<mem>``, so the model sees ``<mem><mem> ...``. Here ``llm_gen.text`` is the round
  exactly as the model wrote it (forced prefix included) and goes back unchanged.
* ``keep_rounds`` generalises the fixed "2nd tool result" cut (1 = the original).
* ``short_text`` of a webpage is its first ``webpage_chars`` characters (100 in the original), configurable; search
  results keep their full text, as in the original.

``mem_traj`` for the memory reward = the initial prompt (system + question + generation prompt)
followed by the round's tokens cut right after ``</mem>``.

Rounds count from 0 everywhere in this code: round 0 is the first, which has no history and needs no ``<mem>``;
the paper's "every round t >= 2" is every round t >= 1 here.
"""
from __future__ import annotations

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
