"""The engine against model.generate, stop handling, sampling, the tools, and the agent loop."""
import random

import pytest
import torch

import data
from reward import outcome_reward
from rollout import AgentConfig, SearchTool, generate, left_pad, parse_action, rollout, sample_next, stop_strings


@pytest.fixture(scope="module")
def tiny():
    tok = data.build_tokenizer()
    return tok, data.build_tiny_model(tok, seed=1).eval()


def random_prompts(tok, n=12, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, len(tok)) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def test_greedy_equals_model_generate_token_for_token(tiny):
    tok, model = tiny
    prompts = random_prompts(tok)
    ours = generate(model, prompts, 24, pad_id=tok.pad_token_id, temperature=0.0)
    ids, attn = left_pad(prompts, tok.pad_token_id, model.device)
    ref = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=24, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=None)[:, ids.shape[1]:].tolist()
    assert ours == ref


def test_stop_sequence_ends_row_and_others_are_unchanged(tiny):
    tok, model = tiny
    prompts = random_prompts(tok, n=6, seed=1)
    free = generate(model, prompts, 16, pad_id=tok.pad_token_id, temperature=0.0)
    stop = free[0][4]
    first = free[0].index(stop)
    out = generate(model, prompts, 16, pad_id=tok.pad_token_id, temperature=0.0, stop_seqs=[[stop]])
    assert out[0] == free[0][: first + 1]              # the stop token is kept, nothing after it
    for a, b in zip(out, free):                        # rows leaving the batch do not disturb the rest
        cut = b.index(stop) + 1 if stop in b else len(b)
        assert a == b[:cut]
    # a two-token stop sequence only fires on the full sequence
    two = [free[1][5], free[1][6]]
    out2 = generate(model, prompts[1:2], 16, pad_id=tok.pad_token_id, temperature=0.0, stop_seqs=[two])
    i = next(j for j in range(1, len(free[1])) if free[1][j - 1:j + 1] == two)
    assert out2[0] == free[1][: i + 1]


def test_eos_ends_row(tiny):
    tok, model = tiny
    prompts = random_prompts(tok, n=4, seed=2)
    free = generate(model, prompts, 12, pad_id=tok.pad_token_id, temperature=0.0)
    eos = free[2][3]
    out = generate(model, prompts, 12, pad_id=tok.pad_token_id, eos_id=eos, temperature=0.0)
    assert out[2][-1] == eos and len(out[2]) == free[2].index(eos) + 1


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(tiny):
    tok, model = tiny
    prompts = random_prompts(tok, n=5, seed=3)
    a = generate(model, prompts, 10, pad_id=0, generator=torch.Generator().manual_seed(7))
    b = generate(model, prompts, 10, pad_id=0, generator=torch.Generator().manual_seed(7))
    c = generate(model, prompts, 10, pad_id=0, generator=torch.Generator().manual_seed(8))
    assert a == b and a != c
    greedy = generate(model, prompts, 10, pad_id=0, temperature=0.0)
    assert generate(model, prompts, 10, pad_id=0, top_p=1e-6, generator=torch.Generator().manual_seed(1)) == greedy
    logits = torch.tensor([[0.0, 10.0, 0.0]])
    assert sample_next(logits, 0.0, 1.0, None).item() == 1


def test_search_tool_finds_the_fact_and_access_returns_the_page():
    w = data.make_world(4)
    tool = SearchTool(w.docs, top_k=3)
    for (s, r), o in list(w.facts.items())[:50]:
        res = tool.search(f"{s} {r}")
        assert res.startswith("<information>") and res.endswith("</information>")
        assert f"{s} {r} {o}" in res and res.count("|") == 2
    d = w.docs[7]
    assert tool.access(d["id"]) == f"<information> {d['id']} {d['contents']} </information>"
    assert "not found" in tool.access("nope")


def test_parse_action():
    assert parse_action("<mem> a </mem> <think> x </think> <search> q r </search>") == ("search", "q r")
    assert parse_action("<think> x </think> <answer> a ; b </answer>") == ("answer", "a ; b")
    assert parse_action("<think> x </think> <access> d3 </access>") == ("access", "d3")
    assert parse_action("<search> q") == (None, "")
    assert parse_action("garbage") == (None, "")


def test_stop_candidates_of_world_tokenizer_are_the_tokens_holding_a_closing_bracket():
    tok = data.build_tokenizer()
    cands = {tok.convert_ids_to_tokens(i) for i in stop_strings(tok).candidates}
    assert {"</search>", "</access>", "</answer>"} <= cands
    assert all(">" in c for c in cands) and "kalo" not in cands and "friend" not in cands


def test_untrained_model_output_never_crashes_and_scores_zero(tiny):
    tok, model = tiny
    w, tasks = data.make_tasks(11, 3, [2])
    cfg = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=4, max_new_tokens=40)
    trajs = rollout(model, tok, tasks, 4, SearchTool(w.docs), cfg, torch.Generator().manual_seed(0))
    assert len(trajs) == 12 and [t.group_id for t in trajs] == [0] * 4 + [1] * 4 + [2] * 4
    for t in trajs:
        assert t.done and len(t.rounds) >= 1
        o = outcome_reward(t)
        assert o["score"] == 0.0 and not o["valid"]
        r = t.rounds[0]
        assert r.context_ids == t.prompt_ids and r.prefix_ids == []   # round 1: no forced prefix
