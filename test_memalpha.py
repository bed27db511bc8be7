"""Mem-alpha (recipes/memalpha.py): the 4-part reward, the chunked loop, the GRPO step,
evaluation and baselines, SFT rows, kill and resume. Its memory and task: test_memalpha_memory.py,
test_memalpha_data.py."""
import copy
import dataclasses
import json
import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

import data
from checkpoint import save_checkpoint
from grpo import collate
from recipes import memalpha, memalpha_data, memalpha_eval
from recipes.memalpha import (WriterConfig, content_valid, memalpha_reward, memalpha_rollout, r1_accuracy,
                              r2_call_success, r3_compression, r4_validity)
from recipes.memalpha_memory import (StructuredMemory, answerer_messages, execute_tool_calls, parse_tool_calls,
                                     tool_call_text, writer_messages)
from reward import em_score
from rollout import encode_chat
from sft import sft_loss




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
        tool_call_text("new_memory_insert", {"memory_type": "semantic", "content": "kalo boss mira"}) +  # valid
        tool_call_text("new_memory_insert", {"memory_type": "episodic", "content": "kalo met mira"}) +   # no time
        tool_call_text("memory_update", {"memory_type": "core", "new_content": "none"}) +                # placeholder
        tool_call_text("memory_update", {"memory_type": "episodic", "new_content": "on day 2 a met b",
                                         "memory_id": "nope"}) +                                         # valid text
        tool_call_text("memory_delete", {"memory_type": "semantic", "memory_id": "ab"}) +                # not judged
        "<tool_call>{bad json</tool_call>")                                                              # not judged
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


def test_per_chunk_r1_scores_each_chunk_on_the_answers_it_reported_last(monkeypatch):
    """A reader that answers exactly from the memory it is shown (the answerer SFT's teacher) grades two scripted
    writers: the never-revising one loses exactly the chunks whose change or end it skipped."""
    reader = lambda model, tok, message_lists, *a: [
        memalpha_data.memory_answer(m[1]["content"], m[1]["content"].rsplit("question: ", 1)[1]) for m in message_lists]
    monkeypatch.setattr(memalpha, "answer_contexts", reader)
    inst = memalpha_data.MemInstance([
        memalpha_data.Chunk("day 4 : kalo boss mira . kalo met tebo .", 4,
                            [("fact", "kalo", "boss", "mira"), ("event", "kalo", "met", "tebo")]),
        memalpha_data.Chunk("day 6 : lapu friend zena . kalo boss is now pigo .", 6,
                            [("fact", "lapu", "friend", "zena"), ("change", "kalo", "boss", "pigo")]),
        memalpha_data.Chunk("day 7 : lapu friend ended .", 7, [("end", "lapu", "friend", "")])],
        [("kalo boss ?", ["pigo"]), ("when kalo met tebo ?", ["day 4"])])
    rolls = []
    for flawed in (False, True):
        script, mem, steps = StructuredMemory(seed=0), StructuredMemory(seed=0), []
        for c in inst.chunks:
            calls = parse_tool_calls(memalpha_data.writer_calls(script, c, flawed))
            steps.append(memalpha.ChunkStep([], [], "", calls, execute_tool_calls(mem, calls)))
        rolls.append(memalpha.MemRollout(0, mem, steps))
    tok = memalpha_data.build_memalpha_tokenizer()
    rw = memalpha.memalpha_rewards(None, tok, rolls, [inst], r1_per_chunk=True)
    assert rw["r1"] == [1.0, 0.5]
    assert rw["r1_chunk"] == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    for i in range(2):
        assert rw["reward"][i] == pytest.approx([memalpha_reward(x, a, rw["r3"][i], b) for x, a, b in
                                                 zip(rw["r1_chunk"][i], rw["r2"][i], rw["r4"][i])])
    shared = memalpha.memalpha_rewards(None, tok, rolls, [inst])                   # the paper's: one r1 a rollout
    assert shared["r1_chunk"] == [[1.0] * 3, [0.5] * 3] and shared["r1"] == rw["r1"]
    assert shared["r2"] == rw["r2"] and shared["r4"] == rw["r4"]


# --------------------------------------------------------------------------- the chunked loop


_TOK = {}


def bpe():
    if "tok" not in _TOK:
        _TOK["tok"] = data.build_bpe_tokenizer(data.world_texts(n_worlds=1) + memalpha_data.memalpha_texts(n=20), 500)
    return _TOK["tok"]


def test_loop_batched_equals_each_instance_alone_and_contexts_are_fresh():
    tok = bpe()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval()
    insts = (memalpha_data.make_memalpha_instances(3, 2, n_chunks=3)
             + memalpha_data.make_memalpha_instances(4, 1, n_chunks=2))
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
    # the paper's reward (beta 0.05), sampled at T 0.7 so the overfit writer's 4 rollouts differ
    cfg = memalpha.MemAlphaConfig(questions_per_instance=2, instances=1, group=4, max_new_tokens=192, beta=0.05,
                                  temperature=0.7)
    inst = memalpha.memalpha_instances(cfg, 11, 1, 0, 2)
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


def test_step_groups_per_instance_or_per_instance_and_chunk():
    rolls = [memalpha.MemRollout(g, StructuredMemory(), [None] * n) for g, n in [(0, 2), (0, 2), (1, 3), (1, 3)]]
    assert memalpha.step_groups(rolls) == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert memalpha.step_groups(rolls, per_chunk=True) == [0, 1, 0, 1, 3, 4, 5, 3, 4, 5]


@pytest.mark.parametrize("r1", ["rollout", "chunk"])
def test_equal_rewards_give_no_update(r1):
    tok = bpe()
    cfg = memalpha.MemAlphaConfig(questions_per_instance=2, instances=1, group=2, max_new_tokens=8, r1=r1, beta=0.05)
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0)   # never writes a call
    # every rollout leaves memory empty: r1 = r2 = r4 = 0 and r3 = 1, so each reward is beta
    before = copy.deepcopy(model.state_dict())
    m = memalpha.memalpha_step(model, model, tok, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg, 0,
                            instances=memalpha.memalpha_instances(cfg, 11, 1, 0, 2))
    assert m["skipped"] == "all advantages are zero" and m["reward"] == pytest.approx(0.05)
    assert m["r1_chunk"] == m["r1"] == 0.0
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)


def _spy(monkeypatch, name: str) -> list:
    """(arguments, result) of every call of ``memalpha.<name>``, in order; the function still runs."""
    seen, real = [], getattr(memalpha, name)

    def spy(*args, **kw):
        seen.append((args, real(*args, **kw)))
        return seen[-1][1]
    monkeypatch.setattr(memalpha, name, spy)
    return seen


def test_sft_instances_have_sft_chunks(monkeypatch):
    tok = memalpha_data.build_memalpha_tokenizer()
    seen = _spy(monkeypatch, "memalpha_instances")
    cfg = memalpha.MemAlphaConfig(sft_batch=6, sft_copy_steps=1, sft_chunks="7", rl_chunks="2-3")
    for step in (0, 1):                                 # a copy step, then a step of every row kind
        assert len(memalpha.memalpha_sft_batch(tok, cfg, step)) == 6
    assert [len(i.chunks) for _, insts in seen for i in insts] == [7] * 12
    assert (memalpha.MemAlphaConfig().sft_chunks, memalpha.MemAlphaConfig().rl_chunks) == ("4", "4")   # today's
    seen.clear()
    mixed = memalpha.MemAlphaConfig(sft_batch=40, sft_copy_steps=0, sft_chunks="2-5")
    memalpha.memalpha_sft_batch(tok, mixed, 3)
    assert {len(i.chunks) for _, insts in seen for i in insts} == {2, 3, 4, 5}


def test_rl_instances_draw_their_chunk_counts_from_rl_chunks(monkeypatch):
    cfg = memalpha.MemAlphaConfig(rl_chunks="2-4", sft_chunks="9", instances=6)
    draws = [memalpha.rl_chunk_counts(cfg, step) for step in range(12)]
    assert all(len(d) == 6 and set(d) <= {2, 3, 4} for d in draws) and set(sum(draws, [])) == {2, 3, 4}
    assert draws[3] == memalpha.rl_chunk_counts(cfg, 3)                         # fixed by seed and step
    assert set(memalpha.rl_chunk_counts(dataclasses.replace(cfg, rl_chunks="3,5"), 0)) <= {3, 5}
    one = memalpha.MemAlphaConfig()                 # the default: every instance has 4, the stream of before
    assert memalpha.rl_chunk_counts(one, 0) == [4] * one.instances
    assert [c.text for i in memalpha.memalpha_instances(one, 5, 8, 1, memalpha.rl_chunk_counts(one, 0))
            for c in i.chunks] == [c.text for i in memalpha.memalpha_instances(one, 5, 8, 1, 4) for c in i.chunks]
    # a real GRPO step builds its instances with the step's counts, and each rollout runs every chunk
    tok = bpe()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0)
    small = dataclasses.replace(cfg, instances=3, group=2, max_new_tokens=6, questions_per_instance=2)
    counts = memalpha.rl_chunk_counts(small, 1)
    assert len(set(counts)) > 1                                                 # the step mixes counts
    seen = _spy(monkeypatch, "memalpha_rollout")
    m = memalpha.memalpha_step(model, model, tok, torch.optim.AdamW(model.parameters(), lr=1e-3), small, 1)
    ((_, _, insts, *_), rolls), = seen
    assert [len(i.chunks) for i in insts] == counts
    assert [len(r.steps) for r in rolls] == [n for n in counts for _ in range(2)]
    assert m["chunks"] == pytest.approx(sum(counts) / 3)


def test_first_day_sets_where_sft_and_grpo_instances_start(monkeypatch):
    tok = memalpha_data.build_memalpha_tokenizer()
    seen = _spy(monkeypatch, "memalpha_instances")
    cfg = memalpha.MemAlphaConfig(sft_batch=6, sft_copy_steps=0, sft_chunks="4", first_day="40-45")
    memalpha.memalpha_sft_batch(tok, cfg, 0)
    firsts = [i.chunks[0].day for _, insts in seen for i in insts]
    assert all(40 <= d <= 45 for d in firsts) and len(set(firsts)) > 1
    rl = memalpha.memalpha_instances(cfg, 5, 8, 1, 6)
    assert all(40 <= i.chunks[0].day <= 45 and i.chunks[-1].day <= 45 + 5 * 3 for i in rl)
    # every day a chunk shows is one token of the word-level tokenizer, the first chunk's too
    assert all(len(tok.encode(f"day {c.day}", add_special_tokens=False)) == 2 for i in rl for c in i.chunks)
    mix = memalpha.MemAlphaConfig(first_day="1-3,40-45")     # each instance picks a range, then its day
    firsts = [i.chunks[0].day for i in memalpha.memalpha_instances(mix, 5, 40, 1, 4)]
    assert set(firsts) <= {1, 2, 3, 40, 41, 42, 43, 44, 45} and min(firsts) <= 3 and max(firsts) >= 40
    assert memalpha.day_ranges("1-3,40-45") == [(1, 3), (40, 45)] and memalpha.day_ranges("7") == [(7, 7)]
    one = memalpha.MemAlphaConfig()                 # the default 1-3: the instances of before, draw for draw
    assert one.first_day == "1-3"
    assert [c.text for i in memalpha.memalpha_instances(one, 5, 8, 1, 4) for c in i.chunks] == \
        [c.text for i in memalpha_data.make_memalpha_instances(5, 8, seed=1, n_chunks=4) for c in i.chunks]


def test_chunk_flags_parse_and_a_count_the_world_cannot_fill_stops(capsys):
    cfg = memalpha.parse_args(["--sft-chunks", "4", "--rl-chunks", "4-8"])
    assert (cfg.sft_chunks, cfg.rl_chunks) == ("4", "4-8")
    assert memalpha.parse_args(["--rl-chunks", "72"]).rl_chunks == "72"       # 72 x 2 facts: the whole world
    for argv, start in ((["--sft-chunks", "73"], "--sft-chunks 73: "), (["--rl-chunks", "4-80"], "--rl-chunks 4-80: "),
                        (["--rl-chunks", "30", "--facts-per-chunk", "5"], "--rl-chunks 30: ")):
        with pytest.raises(SystemExit) as stop:
            memalpha.parse_args(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith("error: " + start) and err.count("\n") == 1, err


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
    mem = res["memalpha"]                               # so no call succeeds nor is judged, and nothing is kept
    assert (mem["r2"], mem["r3"], mem["r4"], mem["over_budget"]) == (0.0, 1.0, 0.0, 0.0)
    assert mem["r1"] == pytest.approx(sum(r1_accuracy(model, tok, [StructuredMemory() for _ in insts],
                                                      [i.questions for i in insts])) / 2)   # training's r1
    with_ceiling = memalpha_eval.evaluate_memalpha(model, model, tok, insts, max_new_tokens=8, scripted=True)
    assert {m: r["accuracy"] for m, r in with_ceiling.items() if m != "scripted"} == \
        {m: r["accuracy"] for m, r in res.items()}
    sizes = []
    for inst in insts:                                  # naive reference: the teacher's memory, token-counted
        mem = StructuredMemory(512, count, seed=0)
        for c in inst.chunks:
            memalpha_data.writer_calls(mem, c)
        sizes.append(sum(count(x) for x in [mem.core]
                         + [t for _, t in mem.entries("semantic") + mem.entries("episodic")]))
    assert with_ceiling["scripted"]["memory_tokens"] == sum(sizes) / 2 > 0
    assert with_ceiling["scripted"]["questions"] == n_q
    # the reward's parts of the scripted memory: every call executes and is valid, r3 from its size, r1 its accuracy
    script, inputs = with_ceiling["scripted"], [sum(count(c.text) for c in i.chunks) for i in insts]
    assert (script["r2"], script["r4"]) == (1.0, 1.0)
    assert script["r3"] == pytest.approx(sum(1 - m / n for m, n in zip(sizes, inputs)) / 2)
    assert script["r1"] == pytest.approx(script["accuracy"])              # every instance asks as many questions
    # what the writer kept of it: nothing (it never calls), and its core is empty
    assert (with_ceiling["memalpha"]["entries_kept"], with_ceiling["memalpha"]["core_empty"]) == (0.0, 1.0)
    assert "entries_kept" not in res["memalpha"] and res["memalpha"]["core_empty"] == 1.0


def test_kept_share_counts_the_reference_entries_held_word_for_word_in_the_same_store():
    ref, mem = StructuredMemory(), StructuredMemory()
    for t, x in (("semantic", "kalo boss mira"), ("semantic", "lapu friend zena"), ("episodic", "on day 3 a met b")):
        ref.insert(t, x)
    mem.insert("semantic", "kalo  boss mira")                      # held (spacing aside)
    mem.insert("episodic", "lapu friend zena")                     # the text, but in the other store
    mem.insert("semantic", "report on kalo lapu")                  # not in the reference
    mem.update("core", "latest report day 3")
    assert memalpha_eval.kept_share(mem, ref) == pytest.approx(1 / 3)
    assert memalpha_eval.kept_share(ref, ref) == 1.0 and memalpha_eval.kept_share(mem, StructuredMemory()) == 1.0


def test_eval_reports_every_chunk_count_it_was_asked(tmp_path, capsys):
    tok = memalpha_data.build_memalpha_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0)
    for d in ("final", "sft"):
        model.save_pretrained(tmp_path / d)
        tok.save_pretrained(tmp_path / d)
    argv = ["--checkpoint", str(tmp_path), "--instances", "2", "--max-new-tokens", "4", "--device", "cpu"]
    memalpha_eval.main(argv + ["--chunks", "2", "5"])
    out = capsys.readouterr().out.splitlines()
    res = json.loads(out[-1])["by_chunks"]
    assert list(res) == ["2", "5"] and set(json.loads(out[-1])["sec"]) == {"2", "5"}
    assert [x.split(",")[0] for x in out if x.startswith("chunks ")] == ["chunks 2: 2 instances",
                                                                         "chunks 5: 2 instances"]
    count = lambda s: len(tok.encode(s, add_special_tokens=False))
    for n, r in res.items():
        insts = memalpha_data.make_memalpha_instances(data.SPLIT_SEEDS["test"], 2, n_chunks=int(n))
        assert all(len(i.chunks) == int(n) for i in insts)
        assert set(r) == {"memalpha", "long_context", "rag_top2", "scripted"}
        assert all(v["questions"] == sum(len(i.questions) for i in insts) for v in r.values())
        assert r["memalpha"]["input_tokens"] == r["rag_top2"]["memory_tokens"] == \
            sum(count(c.text) for i in insts for c in i.chunks) / 2                # these instances, at this count
        assert {"r1", "r2", "r3", "r4", "over_budget"} <= set(r["memalpha"])
    assert res["5"]["scripted"]["memory_tokens"] > res["2"]["scripted"]["memory_tokens"]
    with pytest.raises(SystemExit):                     # more chunks than a world has facts: stops before loading
        memalpha_eval.main(argv + ["--chunks", "4", "73"])
    assert capsys.readouterr().err == "error: --chunks 73: a world holds 72 chunks of 2 new facts (must be <= 72)\n"


def test_sft_batches_copy_phase_then_all_rows():
    tok = bpe()
    cfg = memalpha.MemAlphaConfig(sft_batch=8, sft_copy_steps=2, sft_chunks="3")
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


def test_answerer_only_sft_rows_are_the_answerers_rows_of_the_same_instances(capsys):
    tok = bpe()
    cfg = memalpha.MemAlphaConfig(sft_chunks="3", sft_rows="answerer", sft_copy_steps=0)
    inst = memalpha.memalpha_instances(cfg, 11, 1, 0, 3)[0]
    everything = memalpha.memalpha_expert_samples(tok, inst)
    judge = memalpha.memalpha_expert_samples(tok, inst, writer=False)
    assert [r.ids for r in judge] == [r.ids for r in everything[3:]]        # the memory the writer left, read
    targets = [tok.decode(r.ids[r.n_prompt:], skip_special_tokens=True) for r in memalpha.memalpha_sft_batch(
        tok, dataclasses.replace(cfg, sft_batch=16), 0)]
    assert len(targets) == 16 and not any(t.startswith("<tool_call>") for t in targets)
    with pytest.raises(SystemExit):                     # a copy phase of writer rows has nothing to copy
        memalpha.parse_args(["--sft-rows", "answerer"])
    assert "--sft-copy-steps 1200 must be 0" in capsys.readouterr().err


def test_weak_writer_rows_teach_its_calls_in_its_own_memory_and_the_answerer_rows_stay_the_scripted(capsys):
    tok = memalpha_data.build_memalpha_tokenizer()
    count = lambda s: len(tok.encode(s, add_special_tokens=False))
    rates = memalpha_data.WeakRates()
    cfg = memalpha.MemAlphaConfig(sft_chunks="4")
    differ = 0
    for inst in memalpha.memalpha_instances(cfg, 11, 6, 0, 4, flaw_p=0.5):
        scripted = memalpha.memalpha_expert_samples(tok, inst)
        weak = memalpha.memalpha_expert_samples(tok, inst, weak=rates, rng=random.Random(2))
        n = len(inst.chunks)
        assert [r.ids for r in weak[n:]] == [r.ids for r in scripted[n:]]       # answerer + raw rows: the same
        own, script, draws = StructuredMemory(512, count, seed=0), StructuredMemory(512, count, seed=0), \
            random.Random(2)
        for row, chunk in zip(weak[:n], inst.chunks):
            assert row.ids[:row.n_prompt] == encode_chat(tok, writer_messages(own, chunk.text))   # its own memory
            target = tok.decode(row.ids[row.n_prompt:], skip_special_tokens=True)
            assert target == memalpha_data.weak_writer_calls(script, chunk, draws, rates)
            assert all(ok for ok, _ in execute_tool_calls(own, parse_tool_calls(target)))        # valid calls
            assert row.ids[-1] == tok.eos_token_id
        differ += [r.ids for r in weak[:n]] != [r.ids for r in scripted[:n]]
    assert differ == 6
    # a batch: the same instances and picks as the scripted writer's; only the writer rows differ
    base = memalpha.MemAlphaConfig(writer="scripted", sft_batch=24, sft_copy_steps=1)
    weakc = memalpha.parse_args(["--writer", "weak", "--weak-copy", "weak", "--sft-batch", "24",
                                 "--sft-copy-steps", "1"])
    for step in (0, 1):
        a, b = memalpha.memalpha_sft_batch(tok, weakc, step), memalpha.memalpha_sft_batch(tok, base, step)
        is_writer = [tok.decode(r.ids[r.n_prompt:], skip_special_tokens=True).startswith("<tool_call>") for r in b]
        assert len(a) == len(b) == 24 and all(x.ids == y.ids for x, y, w in zip(a, b, is_writer) if not w)
        assert any(x.ids != y.ids for x, y in zip(a, b))
        assert [r.ids for r in memalpha.memalpha_sft_batch(tok, weakc, step)] == [r.ids for r in a]   # seed, step
        if step == 0:                     # the copy phase: first chunks, empty memory, the weak writer's targets
            assert all(x.ids[:x.n_prompt] == y.ids[:y.n_prompt] for x, y in zip(a, b))
    # --weak-copy scripted: the copy warm-up is the scripted writer's batch, the steps after it the weak writer's
    weak_sc = memalpha.parse_args(["--writer", "weak", "--weak-copy", "scripted", "--sft-batch", "24",
                                   "--sft-copy-steps", "1"])
    assert [r.ids for r in memalpha.memalpha_sft_batch(tok, weak_sc, 0)] == \
        [r.ids for r in memalpha.memalpha_sft_batch(tok, base, 0)]
    assert [r.ids for r in memalpha.memalpha_sft_batch(tok, weak_sc, 1)] == \
        [r.ids for r in memalpha.memalpha_sft_batch(tok, weakc, 1)]
    # the rates' flags: out of range or together impossible stops in one line; set for the scripted writer, a warning
    for argv, err in ((["--weak-keep-p", "1.5"], "error: --weak-keep-p 1.5: must be >= 0 and <= 1\n"),
                      (["--writer", "weak", "--weak-generic-p", "0.9"], "error: --weak-merge-p 0.2: a chunk gets a "
                       "generic or a merged entry, so --weak-generic-p + --weak-merge-p must be <= 1 "
                       "(--weak-generic-p 0.9)\n")):
        with pytest.raises(SystemExit):
            memalpha.parse_args(argv)
        assert capsys.readouterr().err == err
    assert memalpha.parse_args(["--writer", "scripted", "--weak-core-p", "0.5"]).writer == "scripted"
    assert capsys.readouterr().err == "warning: --weak-core-p 0.5: unused (the scripted writer's rows)\n"
    assert memalpha.weak_rates(memalpha.MemAlphaConfig(writer="scripted")) is None
    assert memalpha.weak_rates(memalpha.MemAlphaConfig()) == rates              # the default writer is the weak one
    assert memalpha.weak_rates(weakc) == rates                                   # the defaults are WeakRates'


# --------------------------------------------------------------------------- checkpoint / resume

def _tiny_run(path, **kw) -> "memalpha.MemAlphaConfig":
    return memalpha.MemAlphaConfig(run=str(path), device="cpu", hidden=32, layers=1, heads=2, ffn=64, sft_chunks="2",
                                   rl_chunks="2", questions_per_instance=2, sft_steps=4, sft_copy_steps=1, sft_batch=4,
                                   rl_steps=3, instances=1, group=2, max_new_tokens=48, ckpt_every=2, **kw)


def _weights(path) -> dict:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def _overfit_start(path) -> None:
    """A run folder whose SFT has just ended (RUN/sft + RUN/ckpt at RL step 0), holding a writer overfit on
    two scripted rows so that its rollouts make calls and GRPO steps really update."""
    tok = memalpha_data.build_memalpha_tokenizer()
    cfg = _tiny_run(path)
    rows = memalpha.memalpha_expert_samples(tok, memalpha.memalpha_instances(cfg, 11, 1, 0, 2)[0])[:2]
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
    saved = torch.load(tmp_path / "cut" / "ckpt" / "trainer.pt", weights_only=True)["state"]
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
