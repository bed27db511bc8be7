"""Diagnostics (diagnostics.py), on expert trajectories replayed through the real tool: retention and
faithfulness, the probes by found / kept / dropped, P by round, the stop value, first errors, decisions; and
the command line's three modes on a trained checkpoint."""
import json

import pytest
import torch
from transformers import StaticCache

import data
from conftest import ExpertTape
from diagnostics import first_update, mem_grounded, memory_diagnostics
from eval import summarize
from memory import Record, tool_record
from rollout import AgentConfig, Round, Trajectory, parse_action
from search import SearchTool


def replay(task, tool, gid, forget=False):
    """An expert episode as a Trajectory, tool results from the real BM25 tool."""
    traj = Trajectory(task.question, task.golds, gid, [1, 2], [Record("prompt", task.question)])
    for text, query in data.expert_episode(task, forget):
        kind, body = parse_action(text)
        traj.rounds.append(Round([1, 2, 3], [], [4] * 5, text, 0, kind))
        traj.records.append(Record("llm_gen", text))
        if query is not None:
            traj.records.append(tool_record("search_results", tool.search(" ".join(query))))
        else:
            traj.answer = body
    return traj


def test_perfect_expert_retains_everything_and_is_faithful():
    world, tasks = data.make_tasks(31, 12, [3, 5], (1, 3))
    tool = SearchTool(world.docs)
    trajs = [replay(t, tool, i) for i, t in enumerate(tasks)]
    d = memory_diagnostics(trajs, tasks)
    assert d["retention"] == 1.0 and d["faithfulness"] == 1.0
    s = summarize(trajs)
    assert s["f1"] == 1.0 and s["em"] == 1.0 and s["valid"] == 1.0 and s["n"] == 12


def test_forgetting_expert_loses_old_entities_not_new_ones():
    world, tasks = data.make_tasks(32, 12, [4], (1, 2))
    tool = SearchTool(world.docs)
    trajs = [replay(t, tool, i, forget=True) for i, t in enumerate(tasks)]
    d = memory_diagnostics(trajs, tasks)
    assert d["retention_by_ago"]["1-1"] == 1.0          # what the last tool result showed is kept
    assert d["retention"] < 0.8
    assert d["faithfulness"] == 1.0                     # forgetting is not inventing
    s = summarize(trajs)
    assert abs(s["score"] - 0.25) < 1e-9 and s["em"] == 0.0   # only the last of 4 objectives answered


def test_retention_3plus_pools_only_the_entities_found_three_or_more_rounds_ago():
    """The forgetting expert drops a finished entry once a newer objective finishes, so what it lost was found long
    ago: retention at 3+ rounds ago is below the whole retention, which the recent, kept entities lift; the perfect
    expert keeps everything at every distance."""
    from eval import memory_retention
    world, tasks = data.make_tasks(32, 12, [4], (1, 2))
    tool = SearchTool(world.docs)
    forgets = memory_retention([replay(t, tool, i, forget=True) for i, t in enumerate(tasks)], tasks)
    assert forgets["retention_by_ago"]["1-1"] == 1.0 and forgets["retention_3plus"] < forgets["retention"] < 1.0
    keeps = memory_retention([replay(t, tool, i) for i, t in enumerate(tasks)], tasks)
    assert keeps["retention_3plus"] == keeps["retention"] == 1.0


def test_first_update_counts_round_two_entries_and_checks_them():
    """The expert's round 2 writes all K entries right; merging two entries into one, copying the memory
    without the fact round 1 found, or ending in round 1, shows as what it is."""
    world, tasks = data.make_tasks(34, 6, [3], (1, 2))
    tool = SearchTool(world.docs)
    trajs = [replay(t, tool, i) for i, t in enumerate(tasks)]
    assert first_update(trajs, tasks) == {"entries": {"3": 1.0}, "all_right": 1.0}
    r = trajs[0].rounds[1]                                      # round 2 merges objectives 2 and 3
    merged = r.text.split(" ; 3 =")[0] + " </mem>" + r.text.split("</mem>", 1)[1]
    trajs[0].rounds[1] = Round(r.context_ids, r.prefix_ids, r.output_ids, merged, 0, r.action)
    trajs[1].rounds = trajs[1].rounds[:1]                       # ended in round 1
    r0, r1 = trajs[2].rounds[0], trajs[2].rounds[1]             # round 2 copies round 1's memory: the fact lost
    copied = r0.text.split("</mem>")[0] + "</mem>" + r1.text.split("</mem>", 1)[1]
    trajs[2].rounds[1] = Round(r1.context_ids, r1.prefix_ids, r1.output_ids, copied, 0, r1.action)
    d = memory_diagnostics(trajs, tasks)["first_update"]
    assert d == {"entries": {"2": 1 / 6, "3": 4 / 6, "none": 1 / 6}, "all_right": 3 / 6}


def test_invented_memory_is_unfaithful():
    world, tasks = data.make_tasks(33, 1, [2], (1, 1))
    traj = replay(tasks[0], SearchTool(world.docs), 0)
    r = traj.rounds[1]
    traj.rounds[1] = Round(r.context_ids, r.prefix_ids, r.output_ids,
                           r.text.replace("<mem> 1 =", "<mem> 1 = zzzz ; 1 ="), 0, r.action)
    d = memory_diagnostics([traj], tasks)
    assert 0 < d["faithfulness"] < 1.0
    json.dumps(d)


def test_mem_grounded_counts_only_words_a_source_holds():
    sources = ["1 : bobi friend ?", "<information> d1 bobi friend tugu | d2 gonu friend bobi </information>"]
    assert mem_grounded("1 = bobi friend tugu", sources)
    assert not mem_grounded("1 = bobi friend tugu ; 2 = zzzz", sources)     # an invented word
    assert mem_grounded("", sources)


def real_replay(tok, task, tool, gid):
    """An expert episode as rollout records it: real context ids, forced prefix from round 2, <mem> span."""
    from memory import mem_token_end, prepare_prompt
    from rollout import encode_chat
    records = [Record("prompt", task.question)]
    traj = Trajectory(task.question, task.golds, gid, encode_chat(tok, prepare_prompt(records, data.SYSTEM_PROMPT)),
                      records)
    for t, (text, query) in enumerate(data.expert_episode(task)):
        ids = tok.encode(text, add_special_tokens=False)
        pre = ids[:1] if t > 0 else []
        ctx = encode_chat(tok, prepare_prompt(traj.records, data.SYSTEM_PROMPT))
        traj.rounds.append(Round(ctx, pre, ids[len(pre):], text, mem_token_end(tok, ids), parse_action(text)[0]))
        traj.records.append(Record("llm_gen", text))
        if query is not None:
            traj.records.append(tool_record("search_results", tool.search(" ".join(query))))
    return traj


def test_p_by_round_uses_the_training_mask_mode_by_default(sft_run):
    import train
    from diagnostics import p_by_round
    from eval import load
    from reward import memory_rewards
    import torch
    model, tok, _ = load(str(sft_run), torch.device("cpu"))
    world, tasks = data.make_tasks(34, 6, [2], (1, 2))
    tool = SearchTool(world.docs)
    trajs = [real_replay(tok, t, tool, i) for i, t in enumerate(tasks)]
    # a threshold at which the two mask modes disagree on these contexts (so the default is visible)
    thr = next(t for t in (0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005)
               if memory_rewards(model, tok, trajs, t, "full")["p_mem"]
               != memory_rewards(model, tok, trajs, t, "separate")["p_mem"])

    def by_round(mode):
        m = memory_rewards(model, tok, trajs, thr, mode)
        rounds = [t for _, t in m["scored"]]
        return {str(r): sum(p for p, t in zip(m["p_mem"], rounds) if t == r) / rounds.count(r) for r in set(rounds)}
    got = {k: v["p_mem"] for k, v in p_by_round(model, tok, trajs, threshold=thr).items()}
    assert train.Config().mem_mask == "separate"
    assert got == pytest.approx(by_round("separate"), abs=1e-9) and got != pytest.approx(by_round("full"), abs=1e-9)
    full = {k: v["p_mem"] for k, v in p_by_round(model, tok, trajs, thr, mask_mode="full").items()}
    assert full == pytest.approx(by_round("full"), abs=1e-9)


def snail_replay(tok, task, tool, gid, forget):
    """An expert episode as the snail agent records it: context = prompt + previous round + its result."""
    from memory import mem_token_end, prepare_prompt
    from rollout import encode_chat
    records = [Record("prompt", task.question)]
    traj = Trajectory(task.question, task.golds, gid, encode_chat(tok, prepare_prompt(records, data.SYSTEM_PROMPT)),
                      records)
    for t, (text, query) in enumerate(data.expert_episode(task, forget)):
        ids = tok.encode(text, add_special_tokens=False)
        pre = ids[:1] if t > 0 else []
        ctx = encode_chat(tok, prepare_prompt(traj.records, data.SYSTEM_PROMPT, 1))
        traj.rounds.append(Round(ctx, pre, ids[len(pre):], text, mem_token_end(tok, ids), parse_action(text)[0]))
        traj.records.append(Record("llm_gen", text))
        if query is not None:
            traj.records.append(tool_record("search_results", tool.search(" ".join(query))))
    return traj


def test_probe_by_found_labels_match_the_expert_and_probabilities_match_a_direct_call():
    import math
    import torch
    from diagnostics import probe_by_found
    from memory import extract_mem
    from reward import answer_logprobs, answer_template
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval()
    world, tasks = data.make_tasks(35, 8, [3], (1, 2))
    tool = SearchTool(world.docs)
    trajs = [snail_replay(tok, t, tool, i, forget=i % 2 == 0) for i, t in enumerate(tasks)]
    got = probe_by_found(model, tok, trajs, tasks)
    # the labels from the expert's own bookkeeping (data.context_answers / answers_from_mem)
    want = {"not found": 0, "kept": 0, "dropped": 0}
    rounds = {"none found": 0, "kept": 0, "dropped": 0}
    for i, task in enumerate(tasks):
        ep = data.expert_episode(task, forget=i % 2 == 0)
        for t in range(1, len(ep)):
            ctx = data.context_answers(task, ep, t).split(" ; ")
            mem = data.answers_from_mem(task, extract_mem(ep[t][0])).split(" ; ")
            labels = ["not found" if c == data.UNKNOWN else "kept" if m != data.UNKNOWN else "dropped"
                      for c, m in zip(ctx, mem)]
            for lab in labels:
                want[lab] += 1
            rounds["dropped" if "dropped" in labels else "kept" if "kept" in labels else "none found"] += 1
    assert {k: got[k]["n"] for k in want} == want and want["dropped"] > 0 and want["kept"] > 0
    assert {k: v["n"] for k, v in got["reward_by_round"].items()} == rounds
    # objective 2's answer under the full probe at round 3 of trajectory 1, recomputed directly
    ids, words = answer_template(tok, tasks[1].golds)
    lp = answer_logprobs(model, [trajs[1].rounds[2].context_ids], [ids], tok.pad_token_id)[0]
    direct = math.exp(sum(lp[j] for j, w in enumerate(words) if w == 2))
    from reward import memory_rewards
    m = memory_rewards(model, tok, [trajs[1]], mask_mode="full")
    r = m["scored"].index((0, 2))
    assert math.exp(m["word_logp_full"][r, 1].item()) == pytest.approx(direct, rel=1e-5)
    assert torch.isfinite(m["word_logp_mem"]).all()


def test_stop_value_branches_every_search_round_with_the_answer_action(expert_rollout):
    """Q_go = the trajectory's own score (the expert's: 1); Q_stop = a branch at the same state forced to answer,
    scored as training scores it: here the branch model writes the full gold (1) or only objective 1 (0.5)."""
    import conftest
    from diagnostics import STOP_TEXT, held_answers, stop_value
    w, tasks = data.make_tasks(5, 3, [2], (1, 3))
    cfg = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=12, max_new_tokens=60, temperature=0.0)
    trajs, tok = expert_rollout(tasks, SearchTool(w.docs), cfg)
    searches = [sum(r.action == "search" for r in t.rounds) for t in trajs]
    inner = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval()
    for golds, want in ((lambda t: " ; ".join(g[0] for g in t.golds), 1.0), (lambda t: t.golds[0][0], 0.5)):
        tape = [i for t, n in zip(trajs, searches) for _ in range(n)
                for i in tok.encode(f" {golds(t)} </answer>", add_special_tokens=False)]
        res = stop_value(conftest.ExpertTape(inner, tape), tok, trajs, temperature=0.0, batch=1)
        assert res["n"] == sum(searches) and res["q_go"] == 1.0
        assert res["q_stop"] == want and res["stop_better"] == 0.0
        assert sum(r["n"] for r in res["by_missing"].values()) == res["n"]
        assert [int(k) for k in res["by_round"]] == list(range(1, max(searches) + 1))
    # the answers a round's <mem> holds: none before the first search result, all of them in the answer round
    assert held_answers("", tasks[0].golds) == 0
    last = trajs[0].rounds[-1].text
    assert held_answers(last.split("</mem>")[0].replace("<mem>", ""), tasks[0].golds) == 2
    assert STOP_TEXT in last


def _replace_token(traj, i, pos, word, tok):
    """``traj`` with round i's token at ``pos`` (an index into the round's ids, past the forced prefix) = ``word``."""
    r = traj.rounds[i]
    out = list(r.output_ids)
    out[pos - len(r.prefix_ids)] = tok.convert_tokens_to_ids(word)
    rounds = list(traj.rounds)
    rounds[i] = Round(r.context_ids, r.prefix_ids, out, tok.decode(r.prefix_ids + out), r.mem_end, r.action)
    return Trajectory(traj.question, traj.golds, traj.group_id, traj.prompt_ids, traj.records, rounds, traj.answer,
                      True)


def test_first_error_names_the_first_wrong_word_of_each_kind():
    """Hand-made cases on an expert episode (2 objectives x 2 hops): the expert's own episode has no error; one
    word changed is found at its round and token with the world's word: a wrong <mem> name, an emptied slot the
    previous <mem> held, a wrong search relation, a wrong answer; of two changes the earlier one counts."""
    from diagnostics import first_error
    tok = data.build_tokenizer()
    w, tasks = data.make_tasks(7, 1, [2], (2, 2))
    task, tool = tasks[0], SearchTool(w.docs)
    traj = real_replay(tok, task, tool, 0)
    assert first_error(traj, task, tok) is None
    (s0, r1, o1), (_, r2, o2) = task.objectives[0].chain
    toks = lambda i: tok.convert_ids_to_tokens(traj.rounds[i].round_ids)
    other = next(n for n in data.name_pool() if n not in (o1, o2, s0))
    # round 2 (index 1) writes o1 into entry 1: a wrong name there
    p = toks(1).index(o1)
    assert first_error(_replace_token(traj, 1, p, other, tok), task, tok) == (1, p, "memory", o1)
    # round 3 (index 2) empties the slot round 2 filled: forgotten
    p = toks(2).index(o1)
    assert first_error(_replace_token(traj, 2, p, data.SLOT, tok), task, tok) == (2, p, "memory", o1)
    # round 1 searches "s0 r1": a wrong relation
    p = toks(0).index("<search>") + 2
    wrong_rel = next(r for r in data.RELATIONS if r != r1)
    assert first_error(_replace_token(traj, 0, p, wrong_rel, tok), task, tok) == (0, p, "query", r1)
    # the answer round's first answer word
    last = len(traj.rounds) - 1
    p = toks(last).index("<answer>") + 1
    bad = _replace_token(traj, last, p, other, tok)
    assert first_error(bad, task, tok) == (last, p, "answer", task.golds[0][0])
    # two changes: the earlier round's counts
    both = _replace_token(_replace_token(traj, 1, toks(1).index(o1), other, tok), last, p, other, tok)
    assert first_error(both, task, tok)[:3] == (1, toks(1).index(o1), "memory")


def test_decisions_pairs_the_two_models_on_the_same_ids():
    """``decisions(model, other)``: on a fully right episode, the tokens where other's argmax differs from the
    episode's equal a naive per-prefix count; at a failed episode's first error, other = model gains 0 and
    'fixes' it exactly when the model already prefers the right word; another model's gain is its own log-odds
    minus the model's."""
    from diagnostics import decisions
    tok = data.build_tokenizer()
    w, tasks = data.make_tasks(8, 2, [2], (1, 2))
    tool = SearchTool(w.docs)
    right = real_replay(tok, tasks[0], tool, 0)
    right.answer = parse_action(right.rounds[-1].text)[1]
    wrong = real_replay(tok, tasks[1], tool, 1)
    last = len(wrong.rounds) - 1
    p = tok.convert_ids_to_tokens(wrong.rounds[last].round_ids).index("<answer>") + 1
    name = next(n for n in data.name_pool() if n != tasks[1].golds[0][0])
    wrong = _replace_token(wrong, last, p, name, tok)
    wrong.answer = parse_action(wrong.rounds[last].text)[1]
    m1 = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval()
    m2 = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=1).eval()
    res = decisions(m1, m2, tok, [right, wrong], tasks)
    naive = 0
    with torch.no_grad():
        for r in right.rounds:
            for j, t in enumerate(r.output_ids):
                ids = r.context_ids + r.prefix_ids + r.output_ids[:j]
                naive += int(m2(torch.tensor([ids])).logits[0, -1].argmax().item() != t)
    assert res["right_episodes"] == 1 and res["failed"] == 1 and res["kinds"] == {"answer": 1}
    assert res["right_tokens"] == sum(len(r.output_ids) for r in right.rounds) and res["right_changed"] == naive
    assert res["right_episodes_changed"] == int(naive > 0)
    r = wrong.rounds[last]
    ids = r.context_ids + r.round_ids[:p]
    gold, chosen = tok.convert_tokens_to_ids(tasks[1].golds[0][0]), tok.convert_tokens_to_ids(name)
    with torch.no_grad():
        a, b = (torch.log_softmax(m(torch.tensor([ids])).logits[0, -1], -1) for m in (m1, m2))
    same = decisions(m1, m1, tok, [right, wrong], tasks)
    assert abs(same["margin_gain"]) < 1e-6 and same["fixed"] == int(a[gold] > a[chosen])
    assert abs(res["margin_gain"] - (b[gold] - b[chosen] - a[gold] + a[chosen]).item()) < 1e-5
    assert res["gains"] == [res["margin_gain"]]               # one scored error: its gain is the mean
    assert res["fixed"] == int(b[gold] > b[chosen])
    assert abs(res["p_right_median"] - a[gold].exp().item()) < 1e-6


def test_each_mode_prints_its_report_then_one_json_line(sft_run, capsys):
    import diagnostics
    quick = ["--checkpoint", str(sft_run), "--objectives", "2", "--tasks", "2", "--max-turns", "6", "--device", "cpu"]
    last = lambda: json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    diagnostics.main(quick + ["--memory"])
    out = last()
    assert out["mem_mask"] == "separate" and out["checkpoint"] == str(sft_run)
    assert {"retention", "faithfulness", "first_update", "p_by_round", "probe"} <= set(out["diagnostics"]["2"])
    diagnostics.main(quick + ["--stop-value", "--temperature", "1", "--tasks", "8"])   # 2 may hold no <mem> search
    assert {"n", "q_stop", "q_go", "by_round"} <= set(last()["stop_value"]["2"])
    diagnostics.main(quick + ["--decisions", str(sft_run)])
    res = last()["decisions"]["2"]
    assert res["failed"] + res["right_episodes"] == 2 and abs(res.get("margin_gain", 0.0)) < 1e-6    # itself: no gain
    with pytest.raises(SystemExit) as stop:             # one mode is required
        diagnostics.main(quick)
    assert stop.value.code == 2 and "--memory" in capsys.readouterr().err


def test_variety_counts_questions_whose_rollouts_keep_and_drop_and_ranks_their_rounds_by_hand():
    """results/variety.py on expert replays: question 0's four rollouts are two keeping and two forgetting
    experts (it varies), question 1's four all keep (it does not). With a memory reward of +1 on each keeping
    round and -1 on each dropping one, keep - drop is 2 in reward and 2 / std in A_M (the pool's unbiased std).
    Outcome scores 1, 0.5 for question 0's keeping rollouts and 0, 0.5 for its dropping ones: keep - drop 0.5."""
    import statistics
    import sys
    sys.path.insert(0, "results")
    from variety import round_flags, variety
    world, tasks = data.make_tasks(32, 2, [4], (1, 2))
    tool = SearchTool(world.docs)
    trajs = [replay(tasks[q], tool, q, forget=q == 0 and g >= 2) for q in range(2) for g in range(4)]
    flags = {(i, t): f for i, tr in enumerate(trajs) for t, f in round_flags(tr, tasks[tr.group_id]).items()}
    assert 0 in {f for (i, _), f in flags.items() if i >= 2 and i < 4} and all(f for (i, _), f in flags.items()
                                                                             if i < 2 or i >= 4)
    scored = [(i, t) for i, tr in enumerate(trajs) for t in range(1, len(tr.rounds))]
    reward = [(2.0 * flags[key] - 1.0) if key in flags else 0.0 for key in scored]
    mem = {"scored": scored, "reward": reward, "p_mem": [(r + 1) / 2 for r in reward], "p_full": [0.5] * len(reward)}
    out = variety(trajs, tasks, mem, [1.0, 0.5, 0.0, 0.5, 1.0, 1.0, 0.0, 0.0])
    assert out["keep_minus_drop_outcome"] == 0.5        # question 1 does not vary: its scores do not count
    assert out["measured"] == 2 and out["varies"] == 0.5 and out["varies_rounds"] == 0.5
    assert out["keep_minus_drop_reward"] == 2.0 and out["keep_minus_drop_p_mem"] == 1.0
    pool = [r for (i, _), r in zip(scored, reward) if i < 4]
    assert abs(out["keep_minus_drop_adv"] - 2.0 / (statistics.stdev(pool) + 1e-6)) < 1e-9
    assert out["retention_by_ago"]["1-1"] == 1.0 and out["drop_rounds"] > 0


def test_silence_finds_the_questions_whose_outcome_ties_and_what_the_memory_reward_says_there_by_hand():
    """results/variety.py's ``silence`` on the same replays: question 0's four rollouts all score 0 (silent: A_T is 0
    on each) while its memory rewards are +1 on keeping rounds and -1 on dropping ones; question 1's scores differ.
    Silent 1/2, all-zero 1/2, every silent question still ranked by the memory reward, A_M's keep - drop there
    2 / std of question 0's pool; question 1's rounds, rewarded 0, do not count as nonzero."""
    import statistics
    import sys
    sys.path.insert(0, "results")
    from variety import round_flags, silence
    world, tasks = data.make_tasks(32, 2, [4], (1, 2))
    tool = SearchTool(world.docs)
    trajs = [replay(tasks[q], tool, q, forget=q == 0 and g >= 2) for q in range(2) for g in range(4)]
    flags = {(i, t): f for i, tr in enumerate(trajs) for t, f in round_flags(tr, tasks[tr.group_id]).items()}
    scored = [(i, t) for i, tr in enumerate(trajs) for t in range(1, len(tr.rounds))]
    reward = [2.0 * flags[(i, t)] - 1.0 if i < 4 else 0.0 for i, t in scored]       # question 1's probes: silent
    mem = {"scored": scored, "reward": reward}
    scores = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 1.0]
    out = silence(trajs, tasks, mem, scores)
    assert (out["silent"], out["silent_zero"], out["silent_mem_ranks"]) == (0.5, 0.5, 1.0)
    assert out["score"] == 3.5 / 8
    assert 0 < out["mem_nonzero"] == sum(i < 4 for i, _ in scored) / len(scored) < 1
    pool = [r for (i, _), r in zip(scored, reward) if i < 4]
    assert abs(out["keep_minus_drop_adv_silent"] - 2.0 / (statistics.stdev(pool) + 1e-6)) < 1e-9
    out = silence(trajs, tasks, mem, [0.0, 0.5] + scores[2:])          # question 0 no longer ties
    assert out["silent"] == 0.0 and out["silent_mem_ranks"] != out["silent_mem_ranks"]    # nan: no silent question


class AnswersFrom(ExpertTape):
    """``ExpertTape`` whose tape its prefill writes: `` <think> answer </think> <answer> {reads(prompt text)}
    </answer>``, the answer of what the prompt shows. One prompt a call (the engine drops a finished row from its
    batch, so a batch's rows could not be told apart)."""

    def __init__(self, inner, tok, reads):
        super().__init__(inner, [])
        self.tok, self.reads = tok, reads

    def forward(self, input_ids, **kw):
        if isinstance(kw.get("past_key_values"), StaticCache) and input_ids.shape[1] > 1:   # the prefill: a new prompt
            row, = input_ids.tolist()
            self.tape = self.tok.encode(f" <think> answer </think> <answer> {self.reads(self.tok.decode(row))}"
                                        " </answer>", add_special_tokens=False)
            self.n = 0
        return super().forward(input_ids, **kw)


def test_restore_puts_back_what_the_forgetting_expert_dropped_and_separates_a_mem_reader_from_a_context_reader():
    """results/variety.py's interventions on expert replays of 3-objective questions. The forgetting expert drops
    objective 1's entry once objective 2 finishes, and objective 2's once objective 3 does: restored, every round is
    the keeping expert's own; as written, the forgetting one's. Answered again by a model that answers from the
    `<mem>` it was just forced to write, the restored arm scores 1 and the written one 1/3 (effect 2/3); by one that
    answers from the search results in its full context, both score 1 (effect 0). Played on from the first drop
    (objective 1 lost, objective 3 not searched yet), the two readers answer at once: from `<mem>` 2/3 restored and
    1/3 as written; from the context the same in both arms, at least 2/3 (a search result may show more)."""
    import sys
    sys.path.insert(0, "results")
    from variety import first_drop, play_on, restore, restore_effect
    world, tasks = data.make_tasks(33, 4, [3], (1, 2))
    tool = SearchTool(world.docs)
    forgets = [replay(t, tool, q, forget=True) for q, t in enumerate(tasks)]
    keeps = [replay(t, tool, q) for q, t in enumerate(tasks)]
    assert all(restore(tr, t) is None and first_drop(tr, t) is None for tr, t in zip(keeps, tasks))
    answers = [restore(tr, t) for tr, t in zip(forgets, tasks)]
    firsts = [first_drop(tr, t) for tr, t in zip(forgets, tasks)]
    for (last, written, restored), (first, w0, r0), forget, keep in zip(answers, firsts, forgets, keeps):
        assert last == len(forget.rounds) - 1 and 0 < first < last
        assert [r.text for r in written[0]] == [r.text for r in forget.records[:-1]]
        assert [r.text for r in restored[0]] == [r.text for r in keep.records[:-1]]
        assert f"<mem> {written[1]} </mem>" in forget.rounds[-1].text
        assert f"<mem> {restored[1]} </mem>" in keep.rounds[-1].text and restored[1] != written[1]
        assert w0[0] == r0[0] == forget.records[:len(w0[0])] and w0[0][-1].type == "search_results"
        assert f"<mem> {w0[1]} </mem>" in forget.rounds[first].text
        assert f"<mem> {r0[1]} </mem>" in keep.rounds[first].text

    def from_mem(text):
        q = next(q for q, t in enumerate(tasks) if t.question in text)
        return data.answers_from_mem(tasks[q], text.rsplit("<mem>", 1)[1].split("</mem>")[0])

    def from_context(text):
        q = next(q for q, t in enumerate(tasks) if t.question in text)
        return " ; ".join(o.answer if " ".join(o.chain[-1]) in text.split(t.question, 1)[1] else data.UNKNOWN
                          for t in [tasks[q]] for o in t.objectives)

    tok = data.build_tokenizer()
    inner = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval()
    agent = AgentConfig(system_prompt=data.SYSTEM_PROMPT, context="full", temperature=1.0)
    effects = {}
    for name, reads in (("mem", from_mem), ("context", from_context)):
        for point, cuts, left in (("answer", answers, 1), ("first", firsts, 16)):
            model = AnswersFrom(inner, tok, reads)
            scored = [play_on(model, tok, [(cut[arm][0], cut[arm][1], t.golds, left, tool)
                                           for cut, t in zip(cuts, tasks)],
                              data.SYSTEM_PROMPT, agent, 2, torch.Generator().manual_seed(0), batch=1)
                      for arm in (1, 2)]
            effects[name, point] = restore_effect([(q, c, r) for q, (c, r) in enumerate(zip(*scored))])
    mem, context = effects["mem", "answer"], effects["context", "answer"]
    assert mem["restore_control"] == pytest.approx(1 / 3) and mem["restore_restored"] == 1.0
    assert mem["restore_effect"] == pytest.approx(2 / 3) and mem["restore_questions"] == 4
    assert context["restore_control"] == 1.0 and context["restore_effect"] == 0.0
    mem, context = effects["mem", "first"], effects["context", "first"]
    assert mem["restore_control"] == pytest.approx(1 / 3) and mem["restore_restored"] == pytest.approx(2 / 3)
    assert context["restore_control"] == context["restore_restored"] >= 2 / 3 and context["restore_effect"] == 0.0


def test_restore_effect_averages_each_question_then_the_questions():
    """Question 0: effects 1 and 0 (mean 0.5); question 1: 0. Over questions 0.25 (not 1/3 over rollouts), its
    95% interval t(1) (eval.T95, 12.71) times the std 0.354 over sqrt 2."""
    import sys
    sys.path.insert(0, "results")
    from variety import restore_effect
    out = restore_effect([(0, [0.0, 0.0], [1.0, 1.0]), (0, [0.5, 0.5], [0.5, 0.5]), (1, [0.0, 0.0], [0.0, 0.0])])
    assert out["restore_effect"] == 0.25 and out["restore_rollouts"] == 3 and out["restore_questions"] == 2
    assert out["restore_effect_ci"] == pytest.approx(12.71 * 0.5 ** 0.5 * 0.5 / 2 ** 0.5)
    assert out["restore_control"] == pytest.approx(1 / 6) and out["restore_restored"] == pytest.approx(0.5)
