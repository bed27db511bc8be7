"""A QA file from real text: cloze questions on the Wikipedia lead paragraphs of ``python search.py wiki-corpus``.

    python search.py wiki-corpus wiki.jsonl
    python examples/wiki_qa.py --corpus wiki.jsonl --train train.jsonl --test test.jsonl

The rule (one question a paragraph at most, written in Search-R1's fields ``question`` / ``golden_answers``):

* **The span.** In the paragraph's sentences, in order, an `` in `` followed by either a year (a 4-digit
  number 1000-2029 standing alone: ``in 1964``) or a name (1-3 capitalised words after an optional ``the``:
  ``in Paris``, ``in the United States``). A name is kept only where its extent is plain: not a month or weekday,
  not followed by a fourth capitalised word, ``of``, ``de``, ``and`` or ``'s`` (``in the Republic of Ireland``
  would cut ``Republic``) or a comma and a capitalised word (``in Paris, France``, ``in European, Asian``: a list
  or a longer name), nor by a lower-case word that does not start a phrase (``in European history``: an
  adjective), at least 3 characters.
* **The question.** The article title, then the sentence's words before the span (the last 14, from its last
  ``;`` on: ``;`` separates the objectives of a composed question), then ``___`` and what is asked:
  ``Action figure: "The term was coined by Hasbro in ___" - which year?``. A span whose words occur in the title
  or in those words is dropped: the question would hold its answer.
* **Readable.** The answer's words occur as whole words of the sentence under EM's normalisation
  (``trajectories.find_alias``, the gold teacher's own match: ``in 1610–1611`` is one word, no year).
* **Findable.** BM25 (``search.SearchTool``, the retriever ``--corpus`` gives the run) with the question as the
  query must return the paragraph in its top 3, the first search of ``trajectories.py --teacher gold``; a
  paragraph's first two candidates are put to it, the first found is its question.
* **Held out by paragraph.** A paragraph is on the test side when the SHA-256 of its title falls in the first
  ``--test-share`` of the hash range, so train and test questions come from disjoint paragraphs (and a paragraph
  keeps its side in any corpus version that keeps its title).
* **Deterministic.** The paragraphs are visited in a ``--seed``-shuffled order of their ids until ``--n-train``
  and ``--n-test`` questions are kept; the same corpus and flags write the same files.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))    # the repository's modules

import data  # noqa: E402
from reward import TAG_RE, normalize_answer  # noqa: E402
from search import SearchTool  # noqa: E402
from trajectories import find_alias  # noqa: E402

LEFT_WORDS = 14
MONTHS = {"January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"}
SENTENCE_RE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
YEAR_RE = re.compile(r"\bin ((?:1\d|20)\d\d)(?![\w\-–—])")
WORD_RE = re.compile(r"[^\W\d_](?:[\w'’.\-]*[^\W\d_])?")     # letters of any script, inner ' . -
UNCLEAR_AFTER = {"of", "de", "and"}
# a lower-case word after a name ends its extent only where it starts a new phrase; any other (``in European
# history``, ``in the Western world``) makes the capitalised words an adjective, not the answer
PHRASE_STARTS = {"in", "on", "at", "from", "to", "until", "by", "with", "as", "for", "during", "where", "which",
                 "who", "that", "after", "before", "since", "between", "while", "when", "near", "under", "into",
                 "is", "was", "are", "were", "but", "or"}


def is_test(title: str, test_share: float) -> bool:
    """The paragraph's side: the SHA-256 of its title in the first ``test_share`` of the hash range."""
    return int(hashlib.sha256(title.encode("utf-8")).hexdigest()[:8], 16) < test_share * 16 ** 8


def spans(sentence: str) -> list[tuple[int, str, str]]:
    """``(start, answer, kind)`` of each candidate span after `` in `` in ``sentence``, in text order."""
    out = []
    for m in YEAR_RE.finditer(sentence):
        if int(m.group(1)) <= 2029:
            out.append((m.start(1), m.group(1), "year"))
    for m in re.finditer(r"\bin (?:the )?", sentence):
        words, end = [], m.end()
        while (w := WORD_RE.match(sentence, end)) and w.group()[0].isupper():      # the capitalised words
            words.append(w.group())
            end = w.end() + 1
            if sentence[w.end():end] != " ":
                break
        name = " ".join(words)
        after = sentence[end:].split(" ", 1)[0] if sentence[end - 1:end] == " " else ""
        bare = after.strip(",.:;()\"")
        listed = re.match(r", \S", sentence[end - 1:]) and sentence[end + 1:end + 2].isupper()   # "in X, Y": a list
        if (listed or not words or len(words) > 3 or words[0] in MONTHS or len(name) < 3 or name.endswith(("'s", "’s"))
                or bare.lower() in UNCLEAR_AFTER or (after[:1].islower() and bare not in PHRASE_STARTS)):
            continue
        out.append((m.end(), name.rstrip("."), "name"))
    return sorted(out)


def cloze(title: str, sentence: str, start: int, answer: str, kind: str) -> str | None:
    """The question of one span, or None where it would hold its answer or break the protocol."""
    left = sentence[:start].split(";")[-1].split()
    if not left:
        return None
    left = (["..."] if len(left) > LEFT_WORDS else []) + left[-LEFT_WORDS:]
    shown = f"{title} {' '.join(left)}"
    a = set(normalize_answer(answer).split())
    if not a or a & set(normalize_answer(shown).split()) or TAG_RE.search(shown) or ";" in title:
        return None
    return f'{title}: "{" ".join(left)} ___" - which {kind}?'


def questions_of(doc: dict) -> list[dict]:
    """Every candidate QA row of one paragraph, in text order (the first findable one is kept)."""
    title, _, text = doc["contents"].partition("\n")
    out = []
    for sentence in SENTENCE_RE.split(" ".join(text.split())):
        for start, answer, kind in spans(sentence):
            q = cloze(title.strip(), sentence, start, answer, kind)
            if q is not None and find_alias([answer], sentence, 0) is not None:
                out.append({"question": q, "golden_answers": [answer], "id": doc["id"]})
    return out


def make_qa(docs: list[dict], n_train: int, n_test: int, seed: int = 0, test_share: float = 0.125,
            tool: SearchTool | None = None, tries: int = 2) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows) by the module's rule; ``tries``: candidates of a paragraph put to BM25 at most."""
    tool = tool or SearchTool(docs)
    order = sorted(docs, key=lambda d: d["id"])
    random.Random(seed).shuffle(order)
    train, test = [], []
    for doc in order:
        if len(train) >= n_train and len(test) >= n_test:
            break
        side = test if is_test(doc["contents"].split("\n", 1)[0], test_share) else train
        if len(side) >= (n_test if side is test else n_train):
            continue
        for row in questions_of(doc)[:tries]:
            hits = tool.retrieve([row["question"]], 3)[0]
            if any(d["id"] == doc["id"] for d, _ in hits):
                side.append(row)
                break
    return train, test


def write(rows: list[dict], path: str) -> None:
    """A QA JSONL file: ``question``, ``golden_answers`` and the paragraph's ``id`` (provenance)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main(argv: list[str] | None = None) -> None:
    """Write the train and test QA files from the corpus."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="corpus JSONL (python search.py wiki-corpus wiki.jsonl)")
    p.add_argument("--train", required=True, help="output: training questions")
    p.add_argument("--test", required=True, help="output: held-out questions (other paragraphs)")
    p.add_argument("--n-train", type=int, default=320, help="training questions")
    p.add_argument("--n-test", type=int, default=64, help="held-out questions")
    p.add_argument("--test-share", type=float, default=0.125, help="share of paragraphs on the test side")
    p.add_argument("--seed", type=int, default=0, help="the order paragraphs are visited in")
    args = p.parse_args(argv)
    train, test = make_qa(data.load_corpus(args.corpus), args.n_train, args.n_test, args.seed, args.test_share)
    write(train, args.train)
    write(test, args.test)
    print(f"{args.train}: {len(train)} questions, {args.test}: {len(test)} questions")


if __name__ == "__main__":
    data.exit_on_bad_input(main)
