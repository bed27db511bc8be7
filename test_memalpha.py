"""Mem-alpha (ALGORITHM.md section 2): structured memory, tool-call parser, rewards, task, loop, training."""
import copy
import json
import random
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import data
from checkpoint import save_checkpoint
from grpo import collate
from recipes import memalpha, memalpha_data, memalpha_eval
from recipes.memalpha import (WriterConfig, content_valid, memalpha_reward, memalpha_rollout, r1_accuracy,
                              r2_call_success, r3_compression, r4_validity)
from recipes.memalpha_memory import (TOOL_ARGS, TRUNCATED, StructuredMemory, ToolCall, answerer_messages,
                                     execute_tool_calls, parse_tool_calls, tool_call_text, writer_messages)
from reward import em_score
from rollout import encode_chat
from sft import sft_loss



# --------------------------------------------------------------------------- structured memory

def test_insert_update_delete_and_failures():
    m = StructuredMemory(seed=1)
    ok, msg = m.insert("semantic", "kalo boss mira")
    assert ok and msg.startswith("inserted semantic ")
    sid = msg.split()[-1]
    assert len(sid) == 4 and m.stores["semantic"] == {sid: "kalo boss mira"}
    assert m.insert("semantic", "kalo boss mira") == (False, "error: duplicate: semantic memory already holds this text")
    assert m.insert("semantic", "  kalo boss mira ")[0] is False       # stripped before the duplicate check
    assert m.insert("episodic", "kalo boss mira")[0] is True             # duplicates are per store
    for bad in [("core", "x"), ("semantic_memory", "x"), (None, "x"), ("semantic", ""), ("semantic", "   "),
                ("semantic", None), ("semantic", 3), (["semantic"], "x")]:
        ok, msg = m.insert(*bad)
        assert not ok and msg.startswith("error:"), bad
    assert m.update("semantic", "kalo boss puni", sid) == (True, f"updated semantic {sid}")
    assert m.stores["semantic"][sid] == "kalo boss puni"
    assert m.update("semantic", "kalo boss tebo", "zzzz")[0] is False   # unknown id
    assert m.update("semantic", "kalo boss tebo")[0] is False           # no id
    assert m.update("semantic", "", sid)[0] is False
    assert m.update("core", "a summary", sid)[0] is False                # core takes no id
    assert m.update("core", "a summary") == (True, "updated core") and m.core == "a summary"
    assert m.update("core", "  ")[0] is False and m.core == "a summary"
    assert m.delete("semantic", "zzzz") == (False, "error: unknown semantic id 'zzzz'")   # not a silent success
    assert m.delete("core", None)[0] is False
    assert m.delete("episodic", sid)[0] is False                         # id of another store
    assert m.delete("semantic", sid) == (True, f"deleted semantic {sid}")
    assert m.stores["semantic"] == {}
    assert m.delete("semantic", sid)[0] is False                         # twice


def test_update_to_another_entrys_text_is_a_duplicate():
    m = StructuredMemory()
    a = m.insert("semantic", "a b")[1].split()[-1]
    b = m.insert("semantic", "c d")[1].split()[-1]
    assert m.update("semantic", "a b", b)[0] is False
    assert m.update("semantic", "a b", a)[0] is True                    # rewriting itself is fine


def test_ids_deterministic_and_unique():
    def ids(seed):
        m = StructuredMemory(seed=seed)
        return [m.insert("semantic" if i % 2 else "episodic", f"fact {i}")[1].split()[-1] for i in range(200)]
    assert ids(3) == ids(3)
    assert ids(3) != ids(4)
    assert len(set(ids(3))) == 200


def test_core_truncated_with_marker_by_token_count():
    m = StructuredMemory(core_limit=6)
    ok, msg = m.update("core", "one two three four five six seven eight")
    assert ok and "truncated" in msg
    assert m.core == f"one two three four five {TRUNCATED}"
    assert m.update("core", "one two three four five six")[1] == "updated core"   # exactly at the cap
    # a character-level "tokenizer": the cap is in ITS tokens
    m = StructuredMemory(core_limit=20, count_tokens=len)
    m.update("core", "abcdef ghijkl mnopqr stuvwx")
    assert m.core == f"abcdef {TRUNCATED}" and len(m.core) <= 20


def test_retrieve_bm25_and_each_store():
    m = StructuredMemory()
    m.insert("semantic", "kalo boss mira")
    m.insert("semantic", "lapu friend tebo")
    m.insert("semantic", "puni rival zena")
    m.insert("episodic", "on day 2 lapu met kalo")
    m.insert("episodic", "on day 5 zena moved away")
    top = m.retrieve("who is the rival of puni", 1)
    assert [x[2] for x in top] == ["puni rival zena"]
    # both hold "zena" once: the shorter entry ranks first (BM25 length normalisation)
    assert [x[2] for x in m.retrieve("zena", 2)] == ["puni rival zena", "on day 5 zena moved away"]
    each = m.retrieve_each("lapu", 1)
    assert [t for _, t in each["semantic"]] == ["lapu friend tebo"]
    assert [t for _, t in each["episodic"]] == ["on day 2 lapu met kalo"]
    assert len(m.retrieve("anything", 10)) == 5                         # k larger than memory: all of it
    assert StructuredMemory().retrieve("x", 3) == []


def test_render_shows_relevant_old_entries_so_every_entry_is_reachable():
    m = StructuredMemory(n_recent=2, n_relevant=1)
    ids = [m.insert("semantic", f"person{i} boss person{i + 1}")[1].split()[-1] for i in range(10)]
    view = m.render("day 9 : person0 boss is now person7")
    assert f"[{ids[0]}] person0 boss person1" in view                  # the oldest, brought in by the chunk
    assert f"[{ids[9]}]" in view and f"[{ids[8]}]" in view             # the newest two
    assert f"[{ids[4]}]" not in view
    assert "(7 more not shown)" in view
    assert view.splitlines()[0] == "core: (empty)"
    assert m.n_tokens() == 30


def test_render_with_no_query_shows_newest_only():
    m = StructuredMemory(n_recent=1)
    m.insert("episodic", "on day 1 a")
    m.insert("episodic", "on day 2 b")
    assert m.render() == "core: (empty)\nsemantic:\nepisodic: (1 more not shown)\n" + \
        f"[{list(m.stores['episodic'])[1]}] on day 2 b"


# --------------------------------------------------------------------------- tool calls


INSERT = tool_call_text("new_memory_insert", {"memory_type": "semantic", "content": "kalo boss mira"})


def test_parse_good_calls_in_order_with_text_around():
    text = ("I will save it. " + INSERT + "\n" +
            tool_call_text("memory_update", {"memory_type": "core", "new_content": "summary"}) +
            ' <tool_call> {"name": "memory_delete", "arguments": {"memory_type": "episodic", "memory_id": "ab12"}} </tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.error) for c in calls] == [("new_memory_insert", None), ("memory_update", None),
                                                  ("memory_delete", None)]
    assert calls[2].arguments == {"memory_type": "episodic", "memory_id": "ab12"}
    assert parse_tool_calls("no calls here") == []


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "new_memory_insert", "arguments": {"memory_type": "semantic"}}</tool_call>', "missing: content"),
    ('<tool_call>{"name": "memory_insert", "arguments": {}}</tool_call>', "unknown tool 'memory_insert'"),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "unknown tool '3'"),
    ('<tool_call>{"arguments": {}}</tool_call>', "unknown tool 'None'"),
    ('<tool_call>{"name": "memory_delete", "arguments": "ab12"}</tool_call>', "'arguments' must be a JSON object"),
    ('<tool_call>{"name": "memory_delete", "arguments": {"memory_type": "semantic", "memory_id": 12}}</tool_call>',
     "not a string: memory_id"),
    ('<tool_call>{"name": "memory_delete", "arguments": {"memory_type": "semantic", "memory_id": "a", "x": "1"}}'
     '</tool_call>', "unexpected: x"),
    ('<tool_call>{"name": "memory_delete", "arguments": {</tool_call>', "not valid JSON"),
    ("<tool_call></tool_call>", "not valid JSON"),
    ('<tool_call>["new_memory_insert"]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "new_memory_insert"', "never closed"),
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "not valid JSON"),
    ('<tool_call>{"name": "new_memory_insert", "arguments": {"memory_type": "semantic", "content": NaN}}</tool_call>',
     "not a string: content"),
])
def test_parse_failures_are_calls_with_errors(text, error):
    calls = parse_tool_calls(text)
    assert len(calls) == 1 and calls[0].error is not None and error in calls[0].error, calls


def test_parse_closing_tag_inside_a_string_ends_the_block():
    # the tag wins over JSON quoting (as Qwen's own parser does): this call is malformed, the next one is fine
    text = '<tool_call>{"name": "x</tool_call>"}</tool_call>' + INSERT
    calls = parse_tool_calls(text)
    assert [c.error is None for c in calls] == [False, True]


def _mutate(rng: random.Random, s: str) -> str:
    pieces = ['{', '}', '"', ':', ',', '[', ']', '<tool_call>', '</tool_call>', 'null', '1e999', '\\', '\\u00',
              '"name"', '"arguments"', '"memory_type"', "\x00", "é", " "]
    s = list(s)
    for _ in range(rng.randint(1, 6)):
        op, i = rng.random(), rng.randrange(len(s) + 1)
        if op < 0.35 and s:
            del s[min(i, len(s) - 1)]
        elif op < 0.7:
            s.insert(i, rng.choice(pieces))
        elif s:
            s[min(i, len(s) - 1)] = chr(rng.randrange(32, 0x2FF))
    return "".join(s)


def _random_call(rng: random.Random) -> str:
    if rng.random() < 0.5:                                       # a well-formed call
        name = rng.choice(list(TOOL_ARGS))
        return tool_call_text(name, {a: rng.choice(["semantic", "episodic", "core", "kalo boss mira"])
                                     for a in TOOL_ARGS[name][0]})
    name = rng.choice(list(TOOL_ARGS) + ["memory_insert", "search"])
    args = {a: rng.choice(["semantic", "episodic", "core", "kalo boss mira", "", 5, None, [1], {"a": 1}])
            for a in rng.sample(["memory_type", "content", "new_content", "memory_id", "extra"], rng.randint(0, 4))}
    return tool_call_text(name, args)


def test_fuzzed_outputs_never_raise_and_every_block_is_one_call():
    rng = random.Random(0)
    mem = StructuredMemory(seed=0)
    n_ok = n_bad = 0
    for _ in range(400):
        text = " ".join(_random_call(rng) for _ in range(rng.randint(0, 3)))
        if rng.random() < 0.7:
            text = _mutate(rng, text or INSERT)
        calls = parse_tool_calls(text)
        # naive count: closed blocks scanning left to right, plus one for a dangling opener
        n, pos = 0, 0
        while (s := text.find("<tool_call>", pos)) >= 0:
            e = text.find("</tool_call>", s)
            n += 1
            if e < 0:
                break
            pos = e + len("</tool_call>")
        assert len(calls) == n, text
        for c in calls:
            assert isinstance(c, ToolCall)
            if c.error is None:
                required, optional = TOOL_ARGS[c.name]
                assert set(required) <= set(c.arguments) <= set(required + optional)
                n_ok += 1
            else:
                assert c.error.startswith("error:")
                n_bad += 1
        results = execute_tool_calls(mem, calls)                 # executing them never raises either
        assert len(results) == len(calls)
        assert all(ok is False for (ok, _), c in zip(results, calls) if c.error)
    assert n_ok > 20 and n_bad > 200                             # the fuzz reaches both outcomes


def test_execute_in_order_against_memory():
    mem = StructuredMemory(seed=0)
    calls = parse_tool_calls(INSERT + INSERT + tool_call_text("memory_update", {"memory_type": "core",
                                                                                 "new_content": "day 1"}))
    res = execute_tool_calls(mem, calls)
    assert [ok for ok, _ in res] == [True, False, True]
    assert "duplicate" in res[1][1] and mem.core == "day 1"
    sid = res[0][1].split()[-1]
    res = execute_tool_calls(mem, parse_tool_calls(
        tool_call_text("memory_update", {"memory_type": "semantic", "new_content": "kalo boss puni", "memory_id": sid}) +
        tool_call_text("memory_delete", {"memory_type": "semantic", "memory_id": sid}) +
        tool_call_text("memory_delete", {"memory_type": "semantic", "memory_id": sid})))
    assert [ok for ok, _ in res] == [True, True, False] and mem.stores["semantic"] == {}


# --------------------------------------------------------------------------- rewards




def test_r2_r3_hand_computed():
    assert r2_call_success([]) == 0.0
    assert r2_call_success([(True, ""), (False, "e"), (True, ""), (True, "")]) == 0.75
    assert r3_compression(30, 120) == 0.75
    assert r3_compression(150, 100) == pytest.approx(-0.5)        # a memory larger than its input
    assert r3_compression(5, 0) == 0.0


def test_r4_rules():
    assert content_valid("core", "the world has 24 people and their bosses")
    for bad in ["", "none", "N/A", "(empty)", "Summary.", "two words"]:
        assert not content_valid("core", bad), bad
    assert content_valid("semantic", "kalo boss mira")
    assert not content_valid("semantic", "on day 3 kalo met mira")      # an event, not a fact
    assert not content_valid("semantic", "kalo")
    assert content_valid("episodic", "on day 3 kalo met mira")
    assert content_valid("episodic", "2024-05-01 kalo moved to tebo")
    assert not content_valid("episodic", "kalo met mira")                # no time
    calls = parse_tool_calls(
        tool_call_text("new_memory_insert", {"memory_type": "semantic", "content": "kalo boss mira"}) +          # valid
        tool_call_text("new_memory_insert", {"memory_type": "episodic", "content": "kalo met mira"}) +           # no time
        tool_call_text("memory_update", {"memory_type": "core", "new_content": "none"}) +                     # placeholder
        tool_call_text("memory_update", {"memory_type": "episodic", "new_content": "on day 2 a met b",
                                         "memory_id": "nope"}) +                                                # valid text
        tool_call_text("memory_delete", {"memory_type": "semantic", "memory_id": "ab"}) +                      # not judged
        "<tool_call>{bad json</tool_call>")                                                                     # not judged
    assert r4_validity(calls) == 0.5
    assert r4_validity(calls[4:]) == 0.0


def test_memalpha_reward_weights():
    assert memalpha_reward(0.5, 1.0, 0.8, 0.5) == pytest.approx(0.5 + 1.0 + 0.04 + 0.05)
    assert memalpha_reward(1.0, 0.0, 0.2, 1.0, beta=0.0, gamma=0.0) == 1.0
    t = memalpha_reward(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.5]), 0.5, torch.tensor([1.0, 0.0]))
    assert torch.allclose(t, torch.tensor([1.125, 1.525]))


def test_r1_batched_equals_naive_per_question():
    tok = data.build_bpe_tokenizer(vocab_size=300)
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval()
    mems = [StructuredMemory(seed=0), StructuredMemory(seed=1)]
    mems[0].insert("semantic", "kalo boss mira")
    mems[1].update("core", "a core about lapu")
    qs = [["kalo boss ?", "lapu friend ?"], ["zena mother ?"]]
    naive = []
    for m, q in [(mems[0], qs[0][0]), (mems[0], qs[0][1]), (mems[1], qs[1][0])]:
        ids = torch.tensor([encode_chat(tok, answerer_messages(m, q, 3))])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        naive.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    # gold = the naive prediction for question 1 of memory 0 and memory 1's question, never for question 2
    golds = [[(qs[0][0], [naive[0]]), (qs[0][1], ["zzz qqq"])], [(qs[1][0], [naive[2]])]]
    assert r1_accuracy(model, tok, mems, golds, k=3, max_new_tokens=6) == [0.5, 1.0]
    assert em_score(naive[1], ["zzz qqq"]) == 0.0


# --------------------------------------------------------------------------- the memorisation task




def test_instances_deterministic_dated_and_with_change_questions():
    a = memalpha_data.make_memalpha_instances(3, 20, seed=1)
    b = memalpha_data.make_memalpha_instances(3, 20, seed=1)
    assert [c.text for i in a for c in i.chunks] == [c.text for i in b for c in i.chunks]
    assert [i.questions for i in a] == [i.questions for i in b]
    for inst in a:
        days = [c.day for c in inst.chunks]
        assert days == sorted(days) and len(set(days)) == len(days)
        assert all(c.text.startswith(f"day {c.day} : ") for c in inst.chunks)
        changed = [(r[1], r[2]) for c in inst.chunks for r in c.reports if r[0] in ("change", "end")]
        if changed:
            q, gold = inst.questions[0]
            assert tuple(q.split()[:2]) in changed
            last = [r for c in inst.chunks for r in c.reports if r[1:3] == tuple(q.split()[:2])][-1]
            assert gold == [last[3] if last[0] == "change" else "none"]     # the LATEST value
        assert any(q.startswith("when ") for q, _ in inst.questions)


def test_hand_made_chunk_and_writer_calls():
    chunk = memalpha_data.Chunk("day 4 : kalo boss mira .", 4, [("fact", "kalo", "boss", "mira"), ("event", "kalo", "met", "tebo")])
    mem = StructuredMemory(seed=0)
    text = memalpha_data.writer_calls(mem, chunk)
    calls = parse_tool_calls(text)
    assert [(c.name, c.error) for c in calls] == [("new_memory_insert", None)] * 2 + [("memory_update", None)]
    assert list(mem.stores["semantic"].values()) == ["kalo boss mira"]
    assert list(mem.stores["episodic"].values()) == ["on day 4 kalo met tebo"]
    assert mem.core == "latest report day 4"
    sid = list(mem.stores["semantic"])[0]
    change = memalpha_data.Chunk("day 6 : kalo boss is now puni . lapu boss ended .", 6,
                        [("change", "kalo", "boss", "puni"), ("end", "lapu", "boss", "")])
    replay = StructuredMemory(seed=0)
    assert [ok for ok, _ in execute_tool_calls(replay, parse_tool_calls(text))] == [True, True, True]
    text2 = memalpha_data.writer_calls(mem, change)
    assert f'"memory_id": "{sid}"' in text2 and mem.stores["semantic"] == {sid: "kalo boss puni"}
    assert memalpha_data.writer_calls(StructuredMemory(), change, flawed=True).count("<tool_call>") == 1   # core only
    # replaying the writer's text through the parser reproduces its memory exactly
    execute_tool_calls(replay, parse_tool_calls(text2))
    assert replay.stores == mem.stores and replay.core == "latest report day 6"


def _final_memory(inst, flawed):
    mem = StructuredMemory(seed=0)
    for c in inst.chunks:
        view = mem.render(c.text)
        out = memalpha_data.writer_calls(mem, c, flawed)
        for i in re.findall(r'"memory_id": "(\w+)"', out):
            assert f"[{i}]" in view                           # every id the writer uses is in its prompt
    return mem


def test_perfect_writer_answers_everything_and_the_flaw_fails_changes():
    insts = memalpha_data.make_memalpha_instances(5, 60, seed=0)
    right = {False: 0, True: 0}
    n_change = 0
    for inst in insts:
        for flawed in (False, True):
            mem = _final_memory(inst, flawed)
            for q, gold in inst.questions:
                view = answerer_messages(mem, q, 3)[1]["content"]
                right[flawed] += memalpha_data.memory_answer(view, q) == gold[0]
        n_change += any(r[0] in ("change", "end") for c in inst.chunks for r in c.reports)
    n_q = sum(len(i.questions) for i in insts)
    assert right[False] == n_q
    assert n_q - right[True] >= n_change > 10        # the flawed writer misses at least each change question


def test_memory_answer_reads_only_the_memory():
    view = "core: x y z\nsemantic: kalo boss mira\nepisodic: on day 3 kalo met tebo\nquestion: lapu boss ?"
    assert memalpha_data.memory_answer(view, "kalo boss ?") == "mira"
    assert memalpha_data.memory_answer(view, "lapu boss ?") == "none"            # not the question line's "?"
    assert memalpha_data.memory_answer(view, "when kalo met tebo ?") == "day 3"
    assert memalpha_data.memory_answer(view, "when kalo met lapu ?") == "unknown"


def test_load_memalpha_and_errors(tmp_path):
    good = tmp_path / "m.jsonl"
    good.write_text(json.dumps({"chunks": ["a b", "c d"], "questions_and_answers": [
        {"question": "q1", "answer": "x"}, {"question": "q2", "answer": ["y", "z"]}]}) + "\n\n")
    inst = memalpha_data.load_memalpha(str(good))
    assert [c.text for c in inst[0].chunks] == ["a b", "c d"]
    assert inst[0].questions == [("q1", ["x"]), ("q2", ["y", "z"])]
    bad = tmp_path / "bad.jsonl"
    cases = [("{not json", "bad.jsonl:2: not valid JSON"),
             (json.dumps({"chunks": [], "questions_and_answers": [{"question": "q", "answer": "a"}]}), ":2: 'chunks'"),
             (json.dumps({"chunks": ["a"], "questions_and_answers": [{"question": "q"}]}), ":2: questions_and_answers[0]"),
             (json.dumps({"chunks": ["a"]}), ":2: 'questions_and_answers'")]
    for line, msg in cases:
        bad.write_text(good.read_text().splitlines()[0] + "\n" + line + "\n")
        with pytest.raises(data.DataError, match=re.escape(msg)):
            memalpha_data.load_memalpha(str(bad))
    with pytest.raises(data.DataError, match="file not found"):
        memalpha_data.load_memalpha(str(tmp_path / "missing.jsonl"))


# --------------------------------------------------------------------------- the chunked loop


_TOK = {}


def bpe():
    if "tok" not in _TOK:
        _TOK["tok"] = data.build_bpe_tokenizer(data.world_texts(n_worlds=1) + memalpha_data.memalpha_texts(n=20), 500)
    return _TOK["tok"]


def test_loop_batched_equals_each_instance_alone_and_contexts_are_fresh():
    tok = bpe()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval()
    insts = memalpha_data.make_memalpha_instances(3, 2, n_chunks=3) + memalpha_data.make_memalpha_instances(4, 1, n_chunks=2)
    cfg = WriterConfig(max_new_tokens=12, temperature=0.0)
    both = memalpha_rollout(model, tok, insts, 2, cfg)
    assert [r.group_id for r in both] == [0, 0, 1, 1, 2, 2]
    assert [len(r.steps) for r in both] == [3, 3, 3, 3, 2, 2]
    for i, inst in enumerate(insts):
        alone = memalpha_rollout(model, tok, [inst], 1, cfg)[0]
        assert [s.output_ids for s in alone.steps] == [s.output_ids for s in both[2 * i].steps]
    for r in both:
        for c, s in enumerate(r.steps):
            ctx = tok.decode(s.context_ids)
            assert insts[r.group_id].chunks[c].text in ctx                           # this chunk
            assert all(ch.text not in ctx for j, ch in enumerate(insts[r.group_id].chunks) if j != c)   # no other
        assert r.steps[0].context_ids == encode_chat(tok, writer_messages(StructuredMemory(),
                                                                           insts[r.group_id].chunks[0].text))


# --------------------------------------------------------------------------- training




def test_one_memalpha_step_changes_weights():
    tok = bpe()
    cfg = memalpha.MemAlphaConfig(chunks=2, questions_per_instance=2, instances=1, group=4, max_new_tokens=192)
    inst = memalpha.memalpha_instances(cfg, 11, 1, 0)
    rows = memalpha.memalpha_expert_samples(tok, inst[0])[:2]          # the writer's two chunk rows
    assert tok.decode(rows[0].ids[rows[0].n_prompt:], skip_special_tokens=True).startswith("<tool_call>{")
    torch.manual_seed(0)
    model = data.build_tiny_model(tok, hidden=64, layers=2, heads=4, ffn=128, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    n = float(sum(len(r.ids) - r.n_prompt for r in rows))
    for _ in range(150):                                             # overfit the writer so it makes calls
        opt.zero_grad()
        sft_loss(model, collate(rows, tok.pad_token_id, "cpu"), n).backward()
        opt.step()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = memalpha.memalpha_step(model, copy.deepcopy(model).eval(), tok, opt, cfg, 0, instances=inst)
    assert "skipped" not in m and m["calls"] > 0 and 0 < m["r2"] < 1
    assert m["reward"] == pytest.approx(m["r1"] + m["r2"] + 0.05 * m["r3"] + 0.1 * m["r4"])
    assert max((model.state_dict()[k] - before[k]).abs().max().item() for k in before) > 0


def test_equal_rewards_give_no_update():
    tok = bpe()
    cfg = memalpha.MemAlphaConfig(chunks=2, questions_per_instance=2, instances=1, group=2, max_new_tokens=8)
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0)   # never writes a call
    before = copy.deepcopy(model.state_dict())
    m = memalpha.memalpha_step(model, model, tok, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg, 0,
                            instances=memalpha.memalpha_instances(cfg, 11, 1, 0))
    assert m["skipped"] == "all advantages are zero" and m["reward"] == pytest.approx(0.05)
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)


# --------------------------------------------------------------------------- evaluation and baselines



def test_baseline_windows_and_raw_chunk_teacher():
    chunks = ["day 1 : kalo boss mira . lapu met tebo .", "day 3 : zena friend puni .",
              "day 4 : kalo boss is now tebo .", "day 6 : zena friend ended ."]
    words = lambda s: len(s.split())
    assert memalpha_data.long_context_chunks(chunks, words, 16) == chunks[2:]      # 7 + 9 words fit
    assert memalpha_data.long_context_chunks(chunks, words, 15) == chunks[3:]      # the 9-word chunk does not
    assert memalpha_data.long_context_chunks(chunks, words, 6) == []
    assert memalpha_data.rag_chunks(chunks, "kalo boss ?", 2) == [chunks[0], chunks[2]]
    assert memalpha_data.chunks_answer(chunks, "kalo boss ?") == "tebo"
    assert memalpha_data.chunks_answer(chunks[:2], "kalo boss ?") == "mira"
    assert memalpha_data.chunks_answer(chunks, "zena friend ?") == "none"
    assert memalpha_data.chunks_answer(chunks[2:], "lapu met tebo ?") == "none"
    assert memalpha_data.chunks_answer(chunks, "when lapu met tebo ?") == "day 1"
    assert memalpha_data.chunks_answer(chunks[1:], "when lapu met tebo ?") == "unknown"
    # the teacher agrees with the gold on the whole stream
    for inst in memalpha_data.make_memalpha_instances(6, 40):
        for q, g in inst.questions:
            assert memalpha_data.chunks_answer([c.text for c in inst.chunks], q) == g[0]


def test_evaluate_memalpha_runs_all_three_methods():
    tok = bpe()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval()
    insts = memalpha_data.make_memalpha_instances(20_000, 2, n_chunks=2)
    res = memalpha_eval.evaluate_memalpha(model, model, tok, insts, max_new_tokens=8)
    assert set(res) == {"memalpha", "long_context", "rag_top2"}
    n_q = sum(len(i.questions) for i in insts)
    assert all(r["questions"] == n_q for r in res.values())
    count = lambda s: len(tok.encode(s))
    assert res["rag_top2"]["memory_tokens"] == sum(count(c.text) for i in insts for c in i.chunks) / 2
    assert res["memalpha"]["memory_tokens"] == 0 and res["memalpha"]["tool_success"] == 0.0   # never calls
    with_ceiling = memalpha_eval.evaluate_memalpha(model, model, tok, insts, max_new_tokens=8, scripted=True)
    assert {m: r["accuracy"] for m, r in with_ceiling.items() if m != "scripted"} == \
        {m: r["accuracy"] for m, r in res.items()}
    sizes = []
    for inst in insts:                                  # naive reference: the teacher's memory, token-counted
        mem = StructuredMemory(512, count, seed=0)
        for c in inst.chunks:
            memalpha_data.writer_calls(mem, c)
        sizes.append(sum(count(x) for x in [mem.core] + [t for _, t in mem.entries("semantic") + mem.entries("episodic")]))
    assert with_ceiling["scripted"]["memory_tokens"] == sum(sizes) / 2 > 0
    assert with_ceiling["scripted"]["questions"] == n_q


def test_sft_batches_copy_phase_then_all_rows():
    tok = bpe()
    cfg = memalpha.MemAlphaConfig(sft_batch=8, sft_copy_steps=2, chunks=3)
    copy_rows = memalpha.memalpha_sft_batch(tok, cfg, 1)
    assert len(copy_rows) == 8
    for r in copy_rows:                               # first chunks only: empty memory, a writer target
        ctx = tok.decode(r.ids[:r.n_prompt])
        assert "core: (empty)\nsemantic:\nepisodic:<|im_end|>" in ctx
        assert tok.decode(r.ids[r.n_prompt:], skip_special_tokens=True).startswith("<tool_call>")
    rows = memalpha.memalpha_sft_batch(tok, cfg, 2)
    targets = [tok.decode(r.ids[r.n_prompt:], skip_special_tokens=True) for r in rows]
    assert len(rows) == 8 and any(not t.startswith("<tool_call>") for t in targets)   # answerer rows too
    assert memalpha.memalpha_sft_batch(tok, cfg, 2)[0].ids == rows[0].ids              # deterministic per step


# --------------------------------------------------------------------------- the word-level tokenizer

def test_word_tokenizer_names_are_one_token_in_the_chunk_and_in_the_json():
    tok = memalpha_data.build_memalpha_tokenizer()
    chunk = "day 3 : pigo mother bufa ."
    call = tool_call_text("new_memory_insert", {"memory_type": "semantic", "content": "pigo mother bufa"})
    pieces = lambda s: [tok.decode([i]) for i in tok.encode(s, add_special_tokens=False)]
    # a space before a known word of 2+ characters is implicit: the words of a fact are adjacent tokens
    assert pieces(chunk) == ["day", " ", "3", " ", ":", " ", "pigo", "mother", "bufa", " ", "."]
    assert pieces(call) == ['<tool_call>{"name": "', "new_memory_insert", '", "arguments": {"', "memory_type",
                            '": "', "semantic", '", "', "content", '": "', "pigo", "mother", "bufa",
                            '"}}</tool_call>']
    assert pieces("on day 12 ramu") == ["on", "day", "12", "ramu"] and pieces("3 ramu") == ["3", "ramu"]
    # a random id is spelt by characters; a word inside a longer word is not split out
    assert pieces('"memory_id": "ka0x"') == ['"', "memory_id", '": "', "k", "a", "0", "x", '"']
    assert pieces("memory_types") == list("memory_types")


def test_word_tokenizer_round_trips_every_text_of_the_task_and_saves(tmp_path):
    tok = memalpha_data.build_memalpha_tokenizer()
    texts = memalpha_data.memalpha_texts(n=10) + ['{"name": "memory_delete"} ~!@#$%^&*()\n\t[x] <tool_call>{"name": "']
    rng = random.Random(0)                   # fuzz: words, glue and characters with and without spaces
    pool = memalpha_data.memalpha_words() + memalpha_data.TOOL_JSON_GLUE + list(' .:[]"{}\nab0_')
    texts += ["".join(rng.choice(pool) + rng.choice(["", " ", "  "]) for _ in range(rng.randint(1, 12)))
              for _ in range(500)]
    for t in texts:
        ids = tok.encode(t, add_special_tokens=False)
        assert tok.unk_token_id not in ids and tok.decode(ids) == t
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "user", "content": texts[0]}]
    assert encode_chat(again, msgs) == encode_chat(tok, msgs)
    assert again.eos_token == "<|im_end|>" and tok.encode("é", add_special_tokens=False) == [tok.unk_token_id]
    assert memalpha.memalpha_tokenizer(kind="word").get_vocab() == tok.get_vocab()
    with pytest.raises(ValueError):
        memalpha.memalpha_tokenizer(kind="chars")


# --------------------------------------------------------------------------- checkpoint / resume

def _tiny_run(path, **kw) -> "memalpha.MemAlphaConfig":
    return memalpha.MemAlphaConfig(run=str(path), device="cpu", hidden=32, layers=1, heads=2, ffn=64, chunks=2,
                                questions_per_instance=2, sft_steps=4, sft_copy_steps=1, sft_batch=4, rl_steps=3,
                                instances=1, group=2, max_new_tokens=48, ckpt_every=2, **kw)


def _weights(path) -> dict:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def _overfit_start(path) -> None:
    """A run folder whose SFT has just ended (RUN/sft + RUN/ckpt at RL step 0), holding a writer overfit on
    two scripted rows so that its rollouts make calls and GRPO steps really update."""
    tok = memalpha_data.build_memalpha_tokenizer()
    cfg = _tiny_run(path)
    rows = memalpha.memalpha_expert_samples(tok, memalpha.memalpha_instances(cfg, 11, 1, 0)[0])[:2]
    torch.manual_seed(0)
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n = float(sum(len(r.ids) - r.n_prompt for r in rows))
    for _ in range(60):
        opt.zero_grad()
        sft_loss(model, collate(rows, tok.pad_token_id, "cpu"), n).backward()
        opt.step()
    model.save_pretrained(path / "sft")
    tok.save_pretrained(path / "sft")
    save_checkpoint(str(path / "ckpt"), model, tok, None, {"stage": "rl", "step": 0}, "")


@pytest.mark.parametrize("kill_stage, kill_step", [("sft", 3), ("rl", 2)])
def test_killed_memalpha_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, kill_stage, kill_step):
    rl = kill_stage == "rl"
    if rl:                                              # both runs start where SFT ended, from one writer
        _overfit_start(tmp_path / "whole")
        shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    memalpha.run_memalpha(_tiny_run(tmp_path / "whole", resume=rl))
    whole = _weights(tmp_path / "whole" / "final")
    full = [json.loads(x) for x in open(tmp_path / "whole" / "metrics.jsonl")]
    if rl:
        assert sum("skipped" not in r for r in full) >= 2      # GRPO steps that changed the weights
    real = {"sft": memalpha.memalpha_sft_batch, "rl": memalpha.memalpha_step}[kill_stage]

    def killed(*args):
        if args[-1] == kill_step:                       # the step argument: the process dies here
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(memalpha, real.__name__, killed)
    with pytest.raises(KeyboardInterrupt):
        memalpha.run_memalpha(_tiny_run(tmp_path / "cut", resume=rl))
    saved = torch.load(tmp_path / "cut" / "ckpt" / "trainer.pt", weights_only=False)["state"]
    assert saved == {"stage": kill_stage, "step": 2}     # ckpt_every 2: the last checkpoint before the kill
    with pytest.raises(SystemExit):                     # a run folder is never reused without --resume
        memalpha.run_memalpha(_tiny_run(tmp_path / "cut"))
    monkeypatch.setattr(memalpha, real.__name__, real)
    memalpha.run_memalpha(_tiny_run(tmp_path / "cut", resume=True))
    cut = _weights(tmp_path / "cut" / "final")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    rows = [json.loads(x) for x in open(tmp_path / "cut" / "metrics.jsonl")]
    assert [(r["stage"], r["step"]) for r in rows] == [(r["stage"], r["step"]) for r in full]   # no row twice
    assert memalpha.parse_args(["--resume"]).resume and not memalpha.parse_args([]).resume
