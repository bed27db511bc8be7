"""Snail-shell truncation (a 4-round worked example), the nested <mem> defect, mem spans, mem_traj."""
import pytest

import data
from memory import Record, extract_mem, mem_token_end, mem_traj, prepare_prompt, tool_record

SYS = "You are a helpful assistant."


def four_rounds(kind="search_results"):
    recs = [Record("prompt", "original question")]
    for t in range(1, 5):
        recs.append(Record("llm_gen", f"<mem> memory{t} </mem> <think> t{t} </think> <search> q{t} </search>"))
        recs.append(tool_record(kind, f"<information> result{t} " + "x" * 200 + " </information>"))
    return recs


def test_seed_example_round5_sees_only_round4():
    msgs = prepare_prompt(four_rounds(), SYS)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"] == SYS
    assert msgs[1]["content"] == "original question"
    assert msgs[2]["content"].startswith("<mem> memory4 </mem>")
    assert "result4" in msgs[3]["content"]
    joined = " ".join(m["content"] for m in msgs)
    for t in (1, 2, 3):
        assert f"memory{t}" not in joined and f"result{t}" not in joined


def test_no_nested_mem_defect_through_the_real_record_path(expert_rollout):
    """forced "<mem>" prefix + sampled output -> llm_gen record -> the next round's context: one <mem>, not two."""
    from rollout import AgentConfig
    from search import SearchTool
    world, tasks = data.make_tasks(5, 16, [2], (2, 2))         # 4 searches each, then the answer
    cfg = AgentConfig(system_prompt=SYS, max_turns=5, max_new_tokens=60, temperature=0.0)
    trajs, tok = expert_rollout(tasks, SearchTool(world.docs), cfg)
    mem_id = tok.convert_tokens_to_ids("<mem>")
    checked = 0
    for t in trajs:
        for k in range(2, len(t.rounds)):                # round k's context shows round k-1, which had the prefix
            prev = t.rounds[k - 1]
            assert prev.prefix_ids == [mem_id] and prev.output_ids[0] != mem_id
            ctx = t.rounds[k].context_ids
            assert ctx.count(mem_id) == 1                # snail: only round k-1's memory
            i = ctx.index(mem_id)
            assert ctx[i:i + len(prev.round_ids)] == prev.round_ids   # exactly what was forced + sampled, once
            assert "<mem> <mem>" not in tok.decode(ctx) and "<mem><mem>" not in tok.decode(ctx)
            checked += 1
    assert checked == 16 * 3                             # 5 rounds each: k = 2, 3, 4


def test_short_text_search_full_webpage_truncated():
    search = tool_record("search_results", "a" * 500)
    page = tool_record("webpage", "b" * 500)
    assert search.short_text == search.text
    assert page.short_text == "b" * 100
    assert tool_record("webpage", "c" * 500, webpage_chars=30).short_text == "c" * 30
    msgs = prepare_prompt(four_rounds("webpage"), SYS)
    assert len(msgs[3]["content"]) == 100          # snail shows short_text


def test_full_context_keeps_everything_in_full():
    recs = four_rounds("webpage")
    msgs = prepare_prompt(recs, SYS, keep_rounds=None)
    assert len(msgs) == 2 + 8
    assert [m["content"] for m in msgs[2:]] == [r.text for r in recs[1:]]


def test_keep_rounds_two_and_short_history():
    msgs = prepare_prompt(four_rounds(), SYS, keep_rounds=2)
    assert [m["content"].split()[1] for m in msgs[2:] if m["role"] == "assistant"] == ["memory3", "memory4"]
    # one round of history: nothing to cut, the question is never dropped
    recs = four_rounds()[:3]
    msgs = prepare_prompt(recs, SYS)
    assert len(msgs) == 4 and msgs[1]["content"] == "original question"


def test_bad_records_raise():
    with pytest.raises(ValueError):
        Record("tool", "x")
    with pytest.raises(ValueError):
        prepare_prompt([Record("llm_gen", "x")], SYS)


def test_extract_mem_and_token_span():
    assert extract_mem("<mem> a b </mem> <think> x </think>") == "a b"
    assert extract_mem("<think> x </think> <mem> a </mem>") is None
    assert extract_mem("<mem> unclosed") is None
    tok = data.build_tokenizer()
    ids = tok.encode("<mem> 1 : bobi friend </mem> <think> search </think>", add_special_tokens=False)
    end = mem_token_end(tok, ids)
    assert tok.decode(ids[:end]) == "<mem> 1 : bobi friend </mem>"
    assert mem_token_end(tok, tok.encode("<think> search </think>", add_special_tokens=False)) == 0
    assert mem_traj([7, 8], ids, end) == [7, 8] + ids[:end]
