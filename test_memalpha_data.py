"""Mem-alpha's task (recipes/memalpha_data.py): the instances, the scripted writer, the answerer's memory
reading, the file loader and the word-level tokenizer."""
import json
import random
import re

import pytest
from transformers import AutoTokenizer

import data
from recipes import memalpha, memalpha_data
from recipes.memalpha_memory import (StructuredMemory, answerer_messages, execute_tool_calls, parse_tool_calls,
                                     tool_call_text)
from rollout import encode_chat




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


def test_chunk_counts_per_instance_and_no_more_chunks_than_the_world_has_facts():
    a = memalpha_data.make_memalpha_instances(3, 3, seed=1, n_chunks=[2, 6, 4])
    assert [len(i.chunks) for i in a] == [2, 6, 4]
    text = lambda insts: [c.text for i in insts for c in i.chunks]
    assert text(memalpha_data.make_memalpha_instances(3, 3, seed=1, n_chunks=[4] * 3)) == \
        text(memalpha_data.make_memalpha_instances(3, 3, seed=1, n_chunks=4))          # one count, as before
    most = memalpha_data.max_chunks(2)
    assert most == data.N_ENTITIES * len(data.RELATIONS) // 2 == 72
    full = memalpha_data.make_memalpha_instances(3, 1, n_chunks=most)[0]            # every fact of the world, once
    facts = [r[1:3] for c in full.chunks for r in c.reports if r[0] == "fact"]
    assert len(facts) == len(set(facts)) == 144
    with pytest.raises(ValueError, match="73 chunks x 2 new facts each need 146 facts, the world holds 144"):
        memalpha_data.make_memalpha_instances(3, 1, n_chunks=most + 1)
    with pytest.raises(ValueError, match="2 chunk counts for 3 instances"):
        memalpha_data.make_memalpha_instances(3, 3, n_chunks=[4, 4])


def test_hand_made_chunk_and_writer_calls():
    chunk = memalpha_data.Chunk("day 4 : kalo boss mira .", 4,
                                [("fact", "kalo", "boss", "mira"), ("event", "kalo", "met", "tebo")])
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


class Draws:
    """A ``random.Random`` stand-in that returns the given numbers in order, and must be used up."""
    def __init__(self, *xs: float):
        self.xs = list(xs)

    def random(self) -> float:
        return self.xs.pop(0)


def test_weak_writer_hand_made_chunks():
    mem = StructuredMemory(seed=0)
    c1 = memalpha_data.Chunk("", 4, [("fact", "kalo", "boss", "mira"), ("fact", "lapu", "friend", "zena"),
                                     ("event", "kalo", "met", "tebo")])
    draws = Draws(0.1, 0.9, 0.9, 0.3, 0.05)       # keep the first report only; generic (< 0.5); core (< 0.1)
    out = memalpha_data.weak_writer_calls(mem, c1, draws)
    assert [(c.name, c.arguments) for c in parse_tool_calls(out)] == [
        ("new_memory_insert", {"memory_type": "semantic", "content": "report on lapu kalo"}),       # first
        ("new_memory_insert", {"memory_type": "semantic", "content": "kalo boss mira"}),
        ("memory_update", {"memory_type": "core", "new_content": "latest report day 4"})]
    assert draws.xs == [] and mem.core == "latest report day 4"
    boss = next(i for i, t in mem.entries("semantic") if t == "kalo boss mira")
    c2 = memalpha_data.Chunk("", 6, [("change", "kalo", "boss", "pigo"), ("end", "lapu", "friend", ""),
                                     ("fact", "zena", "rival", "fira")])
    out = memalpha_data.weak_writer_calls(mem, c2, Draws(0.2, 0.2, 0.9, 0.6, 0.5))   # merged (0.5 <= 0.6 < 0.7)
    assert [(c.name, c.arguments) for c in parse_tool_calls(out)] == [
        ("new_memory_insert", {"memory_type": "semantic", "content": "day 6 : zena rival fira ."}),
        ("memory_update", {"memory_type": "semantic", "new_content": "kalo boss pigo", "memory_id": boss})]
    # (the end it kept had no entry to delete: lapu friend was left out on day 4)
    c3 = memalpha_data.Chunk("", 7, [("change", "zena", "rival", "kalo"), ("fact", "lapu", "mother", "bufa"),
                                     ("event", "kalo", "helped", "nove")])
    out = memalpha_data.weak_writer_calls(mem, c3, Draws(0.1, 0.9, 0.9, 0.0, 0.99))
    assert [(c.name, c.arguments) for c in parse_tool_calls(out)] == [     # "report on lapu kalo" is held already
        ("new_memory_insert", {"memory_type": "semantic", "content": "zena rival kalo"})]   # its fact was left out
    assert sorted(mem.stores["semantic"].values()) == ["day 6 : zena rival fira .", "kalo boss pigo",
                                                       "report on lapu kalo", "zena rival kalo"]
    assert mem.stores["episodic"] == {} and mem.core == "latest report day 4"
    nothing = StructuredMemory(seed=0)             # every rate 0: no call, and still two draws a chunk past the reports
    rates = memalpha_data.WeakRates(0, 0, 0, 0)
    assert memalpha_data.weak_writer_calls(nothing, c1, Draws(0, 0, 0, 0, 0), rates) == ""
    with pytest.raises(ValueError, match="generic_p \\+ merge_p <= 1"):
        memalpha_data.WeakRates(generic_p=0.9, merge_p=0.2)


def test_weak_writer_calls_are_valid_and_keep_a_subset_at_its_rates():
    """Over 400 four-chunk instances at the default rates: every call executes; each fact and event is stored
    with probability keep_p; a chunk that left one out opens with a generic entry at generic_p or a merged one
    at merge_p; the core is written at core_p a chunk and is empty after 4 chunks at (1 - core_p)^4."""
    rates, rng = memalpha_data.WeakRates(), random.Random(5)
    stored = core_calls = chunks = core_empty = 0
    firsts, reports, answered, questions = [], 0, 0, 0
    for inst in memalpha_data.make_memalpha_instances(5, 400, seed=3):
        mem, replay = StructuredMemory(seed=0), StructuredMemory(seed=0)
        for c in inst.chunks:
            calls = parse_tool_calls(memalpha_data.weak_writer_calls(mem, c, rng, rates))
            assert all(ok for ok, _ in execute_tool_calls(replay, calls))           # valid: every call executes
            contents = [x.arguments.get("content") for x in calls]
            wanted = [f"{s} {r} {o}" if k == "fact" else f"on day {c.day} {s} {r} {o}"
                      for k, s, r, o in c.reports if k in ("fact", "event")]
            stored += sum(w in contents for w in wanted)
            reports += len(wanted)
            core_calls += any(x.arguments["memory_type"] == "core" for x in calls)
            chunks += 1
            if any(w not in contents for w in wanted):                                # something was left out
                first = contents[0] if contents else None
                firsts.append("generic" if first and first.startswith("report on ") else
                              "merged" if first and first.startswith(f"day {c.day} : ") else "other")
        assert replay.stores == mem.stores and replay.core == mem.core
        core_empty += mem.core == ""
        for q, gold in inst.questions:
            answered += memalpha_data.memory_answer(answerer_messages(mem, q, 3)[1]["content"], q) == gold[0]
            questions += 1
    assert abs(stored / reports - rates.keep_p) < 0.03                                # a subset: a quarter
    assert abs(core_calls / chunks - rates.core_p) < 0.03
    assert abs(core_empty / 400 - (1 - rates.core_p) ** 4) < 0.08                     # 0.66: core mostly empty
    assert abs(firsts.count("generic") / len(firsts) - rates.generic_p) < 0.06        # (a duplicate is not written)
    assert abs(firsts.count("merged") / len(firsts) - rates.merge_p) < 0.04
    assert answered / questions < 0.45           # its memory answers a third (the scripted writer's: all of them)


def test_chunk_probes_belong_to_the_chunk_that_reported_the_answer_last():
    inst = memalpha_data.MemInstance([
        memalpha_data.Chunk("", 4, [("fact", "kalo", "boss", "mira"), ("event", "kalo", "met", "tebo")]),
        memalpha_data.Chunk("", 6, [("fact", "lapu", "friend", "zena"), ("change", "kalo", "boss", "pigo")]),
        memalpha_data.Chunk("", 7, [("end", "lapu", "friend", "")]),
        memalpha_data.Chunk("no reports", None, [])], [])
    assert memalpha_data.chunk_probes(inst) == [[("when kalo met tebo ?", ["day 4"])],
                                                [("kalo boss ?", ["pigo"])],
                                                [("lapu friend ?", ["none"])], []]
    for inst in memalpha_data.make_memalpha_instances(5, 30, seed=2, n_chunks=[2, 4, 8] * 10):
        probes = memalpha_data.chunk_probes(inst)
        assert len(probes) == len(inst.chunks) and all(probes)      # every chunk reports a fact or an event
        flat = [p for ps in probes for p in ps]
        assert len(flat) == len({q for q, _ in flat})               # each question in one chunk only
        assert all((q, g) in flat for q, g in inst.questions)      # the instance's questions, same gold


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
             (json.dumps({"chunks": ["a"], "questions_and_answers": [{"question": "q"}]}),
              ":2: questions_and_answers[0]"),
             (json.dumps({"chunks": ["a"]}), ":2: 'questions_and_answers'")]
    for line, msg in cases:
        bad.write_text(good.read_text().splitlines()[0] + "\n" + line + "\n")
        with pytest.raises(data.DataError, match=re.escape(msg)):
            memalpha_data.load_memalpha(str(bad))
    with pytest.raises(data.DataError, match="file not found"):
        memalpha_data.load_memalpha(str(tmp_path / "missing.jsonl"))


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


def test_digits_tokenizer_spells_every_number_by_digits_and_round_trips():
    tok = memalpha.memalpha_tokenizer(kind="digits")
    word = memalpha_data.build_memalpha_tokenizer()
    pieces = lambda t, s: [t.decode([i]) for i in t.encode(s, add_special_tokens=False)]
    # day 37 is two tokens that a stream of days 1-12 already trained, not one token of its own
    assert pieces(tok, "on day 37 ramu") == ["on", "day", " ", "3", "7", "ramu"]
    assert pieces(word, "on day 37 ramu") == ["on", "day", "37", "ramu"]
    assert pieces(tok, "day 5 : pigo") == pieces(word, "day 5 : pigo")
    assert set(tok.get_vocab()) < set(word.get_vocab()) and "37" not in tok.get_vocab()
    texts = memalpha_data.memalpha_texts(n=10) + [c.text for i in memalpha_data.make_memalpha_instances(
        3, 4, n_chunks=30, first_day=(90, 99)) for c in i.chunks]
    for t in texts:
        ids = tok.encode(t, add_special_tokens=False)
        assert tok.unk_token_id not in ids and tok.decode(ids) == t


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
