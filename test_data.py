"""The embedded world, the expert, the tokenizer and model round trip, and the real-data loaders."""
import json
import random

import pytest

import data
from memory import extract_mem
from rollout import AgentConfig
from search import SearchTool


def test_world_relations_are_permutations_and_docs_match_facts():
    w = data.make_world(3)
    for rel in data.RELATIONS:
        objs = [w.facts[(e, rel)] for e in w.entities]
        assert sorted(objs) == sorted(w.entities)              # a permutation
        assert all(w.facts[(e, rel)] != e for e in w.entities)  # no fixed points
    assert len(w.docs) == len(w.facts)
    assert {d["contents"] for d in w.docs} == {f"{s} {r} {o}" for (s, r), o in w.facts.items()}


def test_same_seed_same_world_new_seed_same_names():
    assert data.make_world(5).docs == data.make_world(5).docs
    pool = set(data.name_pool())
    assert set(data.make_world(6).entities) <= pool and set(data.make_world(7).entities) <= pool


def test_task_golds_follow_the_chain():
    w = data.make_world(1)
    task = data.make_task(w, random.Random(0), 3, (2, 2))
    assert len(task.golds) == 3 and task.question.count("?") == 3
    for obj, gold in zip(task.objectives, task.golds):
        cur = obj.start
        for r in obj.relations:
            cur = w.facts[(cur, r)]
        assert gold == [cur]


def test_expert_memory_and_forgetting():
    w = data.make_world(2)
    task = data.make_task(w, random.Random(1), 3, (1, 1))
    rounds = data.expert_episode(task)
    assert len(rounds) == 4
    assert extract_mem(rounds[0][0]) == " ; ".join(f"{k + 1} = {o.start} {o.relations[0]} _"
                                                   for k, o in enumerate(task.objectives))  # the question, copied
    assert task.question.replace(" :", " =").replace(" ?", " ;").rstrip(" ;") == extract_mem(rounds[0][0])
    final_mem = extract_mem(rounds[-1][0])
    assert final_mem == " ; ".join(f"{k + 1} = {' '.join(o.chain[0])}" for k, o in enumerate(task.objectives))
    assert rounds[-1][0].endswith(f"<answer> {' ; '.join(g[0] for g in task.golds)} </answer>")
    forgot = data.expert_episode(task, forget=True)
    assert extract_mem(forgot[-1][0]).count(";") == 0
    assert f"<answer> {data.UNKNOWN} ; {data.UNKNOWN} ; {task.golds[2][0]} </answer>" in forgot[-1][0]


def test_tokenizer_covers_world_and_round_trips(tmp_path):
    tok = data.build_tokenizer()
    w, tasks = data.make_tasks(9, 5, [4])
    for task in tasks:
        for text, _ in data.expert_episode(task):
            ids = tok.encode(text, add_special_tokens=False)
            assert tok.unk_token_id not in ids
            assert tok.decode(ids) == text
    assert tok.encode("<mem>kalo", add_special_tokens=False)[0] == tok.convert_tokens_to_ids("<mem>")
    model = data.build_tiny_model(tok)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok2 = AutoTokenizer.from_pretrained(tmp_path)          # the folder holds config.json too
    assert (tok2.encode(tasks[0].question, add_special_tokens=False)
            == tok.encode(tasks[0].question, add_special_tokens=False))
    msgs = [{"role": "user", "content": "q"}]
    assert tok2.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(m2).__name__ == "LlamaForCausalLM"


def test_load_qa_and_corpus(tmp_path):
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "who?", "golden_answers": ["Ann", "Anne"]}) + "\n\n"
                  + json.dumps({"question": "two?", "golden_answers": [["a"], ["b", "bb"]]}) + "\n")
    tasks = data.load_qa(str(qa))
    assert tasks[0].golds == [["Ann", "Anne"]] and tasks[1].golds == [["a"], ["b", "bb"]]
    corpus = tmp_path / "c.jsonl"
    data.save_corpus([{"id": "1", "contents": "x y"}, {"id": "2", "contents": "z"}], str(corpus))
    assert [d["id"] for d in data.load_corpus(str(corpus))] == ["1", "2"]


@pytest.mark.parametrize("text,where", [
    ('{"question": "q", "golden_answers": ["a"]}\n{"question": "q2", "golden_answers": ["a"]\n', ":2:"),
    ('{"question": "q", "golden_answers": ["a"]}\n{"golden_answers": ["a"]}\n', ":2:"),
    ('[1, 2]\n', ":1:"),
    ('{"question": "q", "golden_answers": []}\n', ":1:"),
])
def test_malformed_qa_names_file_and_line(tmp_path, text, where):
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    with pytest.raises(data.DataError) as e:
        data.load_qa(str(p))
    assert str(p) in str(e.value) and where in str(e.value)


def test_a_parquet_file_without_pyarrow_is_one_line(tmp_path, monkeypatch, capsys):
    """pyarrow is optional (requirements.txt): without it, train.py on a parquet QA file stops with one line
    saying what to install, exit status 2, before any model loads."""
    import sys
    import train
    monkeypatch.setitem(sys.modules, "pyarrow", None)                # absent, whether installed here or not
    qa = tmp_path / "qa.parquet"
    qa.write_bytes(b"PAR1")
    with pytest.raises(SystemExit) as e:
        data.exit_on_bad_input(lambda: train.main(["--run", str(tmp_path / "run"), "--data", str(qa),
                                                   "--corpus", str(tmp_path / "c.jsonl")]))
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: {qa}: reading parquet needs pyarrow: pip install pyarrow\n"


def test_missing_and_malformed_corpus(tmp_path):
    with pytest.raises(data.DataError, match="not found"):
        data.load_corpus(str(tmp_path / "nope.jsonl"))
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": 1, "contents": "a"}\n{"id": 2}\n')
    with pytest.raises(data.DataError, match=r"c\.jsonl:2:"):
        data.load_corpus(str(p))


def test_context_answers_snail_and_full_on_a_forgetting_episode():
    # 2 objectives x 2 hops: searches in rounds 1-4, objective 1's answer shown to round 3, objective 2's to
    # round 5 (the answer round), whose <mem> the flawed expert writes without objective 1
    world = data.make_world(1)
    task = next(t for t in (data.make_task(world, random.Random(s), 2, (2, 2)) for s in range(50))
                if t.golds[0][0] != t.golds[1][0])
    a1, a2 = task.golds[0][0], task.golds[1][0]
    ep = data.expert_episode(task, forget=True)
    snail = [data.context_answers(task, ep, t) for t in range(len(ep))]
    full = [data.context_answers(task, ep, t, "full") for t in range(len(ep))]
    u = data.UNKNOWN
    assert snail == full == [f"{u} ; {u}", f"{u} ; {u}", f"{a1} ; {u}", f"{a1} ; {u}", f"{a1} ; {a2}"]
    # round 5 (index 4) is "found and dropped": its context shows a1, its own <mem> no longer holds it
    assert data.answers_from_mem(task, extract_mem(ep[4][0])) == f"{u} ; {a2}"
    perfect = data.expert_episode(task)
    assert [data.context_answers(task, perfect, t) for t in range(len(perfect))] == full
    # 3 one-hop objectives: once the flawed expert dropped answer 1 (round 3), the next snail context lost it too
    task3 = data.make_task(world, random.Random(7), 3, (1, 1))
    b1, b2, b3 = (g[0] for g in task3.golds)
    ep3 = data.expert_episode(task3, forget=True)
    assert [data.context_answers(task3, ep3, t) for t in range(4)] == [
        f"{u} ; {u} ; {u}", f"{b1} ; {u} ; {u}", f"{b1} ; {b2} ; {u}", f"{u} ; {b2} ; {b3}"]
    assert data.context_answers(task3, ep3, 3, "full") == f"{b1} ; {b2} ; {b3}"


def test_early_answer_counts_searches_against_the_question_s_hops(expert_rollout):
    w, tasks = data.make_tasks(4, 4, [2], (1, 3))
    cfg = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=12, max_new_tokens=60, temperature=0.0)
    trajs, _ = expert_rollout(tasks, SearchTool(w.docs), cfg)
    assert [data.early_answer(t) for t in trajs] == [0.0] * 4          # the expert searches once per hop
    t = trajs[0]
    t.rounds = t.rounds[:1] + t.rounds[-1:]                            # one search, then the answer
    assert data.early_answer(t) == 1.0
    t.rounds = t.rounds[:1]                                            # no answer at all: not early
    assert data.early_answer(t) == 0.0
    t.question = "who founded the city?"                               # a real question: hops unknown
    assert data.early_answer(t) is None
