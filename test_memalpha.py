"""Mem-alpha (ALGORITHM.md section 2): structured memory, tool-call parser, rewards, task, loop, training."""
import json
import random

import pytest

from memory import TRUNCATED, StructuredMemory


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
