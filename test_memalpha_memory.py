"""Mem-alpha's memory (recipes/memalpha_memory.py): the three stores, BM25 retrieval, the tool-call parser
and the tool calls' execution."""
import random

import pytest

from recipes.memalpha_memory import (TOOL_ARGS, TRUNCATED, StructuredMemory, ToolCall, execute_tool_calls,
                                     parse_tool_calls, tool_call_text)




# --------------------------------------------------------------------------- structured memory

def test_insert_update_delete_and_failures():
    m = StructuredMemory(seed=1)
    ok, msg = m.insert("semantic", "kalo boss mira")
    assert ok and msg.startswith("inserted semantic ")
    sid = msg.split()[-1]
    assert len(sid) == 4 and m.stores["semantic"] == {sid: "kalo boss mira"}
    assert m.insert("semantic", "kalo boss mira") == (False,
                                                      "error: duplicate: semantic memory already holds this text")
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
            ' <tool_call> {"name": "memory_delete", "arguments": {"memory_type": "episodic", "memory_id": "ab12"}}'
            ' </tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.error) for c in calls] == [("new_memory_insert", None), ("memory_update", None),
                                                  ("memory_delete", None)]
    assert calls[2].arguments == {"memory_type": "episodic", "memory_id": "ab12"}
    assert parse_tool_calls("no calls here") == []


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "new_memory_insert", "arguments": {"memory_type": "semantic"}}</tool_call>',
     "missing: content"),
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
        tool_call_text("memory_update",
                       {"memory_type": "semantic", "new_content": "kalo boss puni", "memory_id": sid}) +
        tool_call_text("memory_delete", {"memory_type": "semantic", "memory_id": sid}) +
        tool_call_text("memory_delete", {"memory_type": "semantic", "memory_id": sid})))
    assert [ok for ok, _ in res] == [True, True, False] and mem.stores["semantic"] == {}
