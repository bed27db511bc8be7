"""The RL step's wiring: ``train.rl_step`` hands each flag and each intermediate to the function that uses it (the
rollouts, A_T, the memory rewards, A_M pooled per question, the rows, the update), checked by spying on every
call of one real step of the fixture policy against values computed by hand."""
import inspect
import json
import statistics

import pytest
import torch

import metrics
import reward
import train
from test_train import RL_ARGS, load


def call_args(fn, args, kwargs) -> dict:
    """A call's arguments by parameter name, defaults filled in, however the caller passed them."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def spy_on(monkeypatch, names: list[str]) -> dict:
    """Replace each ``train.NAME`` (the name rl_step / update look up) by a wrapper that calls it and records
    (its arguments by name, its result) in ``calls[NAME]``."""
    calls = {}
    for name in names:
        real = getattr(train, name)

        def wrapper(*a, real=real, name=name, **kw):
            out = real(*a, **kw)
            calls.setdefault(name, []).append((call_args(real, a, kw), out))
            return out
        monkeypatch.setattr(train, name, wrapper)
    return calls


WIRES = ["rollout", "grouped_advantage", "memory_rewards", "memory_advantage", "update", "collate",
         "token_advantages"]


def nested(mem: dict, values, n: int) -> list[list[float]]:
    """Per-round values in ``mem["scored"]`` order (memory_rewards' layout) as one list per trajectory."""
    out = [[] for _ in range(n)]
    for (i, _), v in zip(mem["scored"], list(values)):
        out[i].append(float(v))
    return out


def spied_rl_step(sft_run, monkeypatch, extra: list[str]) -> tuple:
    """One RL step of the fixture policy (RL_ARGS: 2 questions x 3 rollouts) with every wire spied on: (cfg, calls,
    the step's trajectories, the rows update got). The update must run (not skipped): the wiring past it is
    what is tested. The memory advantage is the one ``--mem-adv-norm`` picks: at its default the paper's pool."""
    model, tok = load(sft_run / "final")
    cfg = train.parse_args(RL_ARGS + extra)
    calls = spy_on(monkeypatch, WIRES)
    m = train.rl_step(model, None, tok, torch.optim.AdamW(model.parameters(), lr=cfg.lr), cfg, 0,
                      train.agent_config(cfg))
    assert "skipped" not in m, m
    (_, trajs), = calls["rollout"]
    (update, _), = calls["update"]
    return cfg, calls, trajs, update["samples"]


def pooled_by_hand(rewards: list[list[float]], pools: list[int]) -> list[list[float]]:
    """A_M by hand: each reward minus its pool's mean, over the pool's unbiased std + 1e-6; a pool of one gets 0.
    ``pools[i]``: trajectory i's pool."""
    members = {}
    for i, rs in enumerate(rewards):
        members.setdefault(pools[i], []).extend(rs)
    out = []
    for i, rs in enumerate(rewards):
        pool = members[pools[i]]
        if len(pool) < 2:
            out.append([0.0] * len(rs))
            continue
        mean, sd = statistics.fmean(pool), statistics.stdev(pool)
        out.append([(r - mean) / (sd + 1e-6) for r in rs])
    return out


def test_rl_step_pools_the_memory_rewards_of_each_question_not_of_each_trajectory(sft_run, monkeypatch):
    """2 questions x 3 rollouts: memory_advantage gets one group id per QUESTION, in rollout order, so A_M is each
    reward against every round of every rollout of its question (by hand), not against its own trajectory's."""
    cfg, calls, trajs, samples = spied_rl_step(sft_run, monkeypatch, [])
    assert [t.group_id for t in trajs] == [0, 0, 0, 1, 1, 1]
    (args, a_m), = calls["memory_advantage"]
    (_, mem), = calls["memory_rewards"]
    assert args["question_ids"].tolist() == [trajs[i].group_id for i, _ in mem["scored"]]
    assert args["mem_reward"].tolist() == mem["reward"]
    rewards = nested(mem, mem["reward"], len(trajs))
    by_question = [sum(1 for i in range(3 * q, 3 * q + 3) if rewards[i]) for q in (0, 1)]
    assert max(by_question) >= 2, f"no question with memory rewards in two rollouts: {rewards}"
    want = pooled_by_hand(rewards, [0, 0, 0, 1, 1, 1])
    assert want != pooled_by_hand(rewards, list(range(6)))        # the test tells the two pools apart
    assert all(a == pytest.approx(w, abs=1e-5) for a, w in zip(nested(mem, a_m, len(trajs)), want))


def test_rl_step_hands_mem_mask_and_weight_to_the_reward_and_the_token_advantages(sft_run, monkeypatch):
    """--mem-mask full (not the default), --mem-weight 0.5: memory_rewards gets the mask, A_M is the paper's pool
    by hand, and every token advantage the update sees is A_T + 0.5 * A_M on the sampled tokens (A_M on <mem>
    spans) of the very batch collate built."""
    cfg, calls, trajs, samples = spied_rl_step(sft_run, monkeypatch, ["--mem-mask", "full", "--mem-weight", "0.5"])
    assert reward.MEM_MASK != "full"
    (args, mem), = calls["memory_rewards"]
    assert (args["mask_mode"], args["threshold"], args["think"]) == ("full", 0.0, cfg.probe_think)
    (args, a_m), = calls["memory_advantage"]
    rewards = nested(mem, mem["reward"], len(trajs))
    want = pooled_by_hand(rewards, [0, 0, 0, 1, 1, 1])
    assert all(a == pytest.approx(w, abs=1e-5) for a, w in zip(nested(mem, a_m, len(trajs)), want))
    assert len(calls["collate"]) == len(calls["token_advantages"]) >= 1     # one per collated micro-batch
    on_mem = 0
    for (c, x), (t, adv) in zip(calls["collate"], calls["token_advantages"]):
        assert t["mem_weight"] == 0.5
        want_adv = (x["adv_t"][:, None] + 0.5 * x["mem_adv"]) * x["loss_mask"]
        assert torch.allclose(adv, want_adv), (adv - want_adv).abs().max()
        on_mem += int(((x["mem_adv"] != 0) & (x["loss_mask"] > 0)).sum())
    assert on_mem > 0, "no sampled token carries a memory advantage: the weight is untested"


def test_an_rl_step_in_full_context_trains_each_growing_trajectory_as_one_row(sft_run, monkeypatch):
    """--train-context full end to end: the rollouts see the whole trajectory, a trajectory whose contexts grow
    reaches update as ONE row (its last round's context + output) holding every round's policy span (the
    tokens that round sampled) and <mem> span with that round's A_M, its trajectory's A_T; token advantages in
    the update are A_T on each round's sampled tokens plus A_M on its <mem> tokens, 0 between rounds."""
    cfg, calls, trajs, samples = spied_rl_step(sft_run, monkeypatch, ["--train-context", "full"])
    (args, _), = calls["rollout"]
    assert args["cfg"].context == "full"
    (_, adv_t), = calls["grouped_advantage"]
    (_, mem), = calls["memory_rewards"]
    (_, a_m), = calls["memory_advantage"]
    a_m = nested(mem, a_m, len(trajs))
    rows = {}
    for s in samples:
        rows.setdefault(s.traj, []).append(s)
    assert sorted(rows) == [i for i, t in enumerate(trajs) if any(r.output_ids for r in t.rounds)]
    one_rows = 0
    for i, t in enumerate(trajs):
        rounds = [(k, r) for k, r in enumerate(t.rounds) if r.output_ids]
        adv_m = dict(zip([t for j, t in mem["scored"] if j == i], a_m[i]))
        if len(rounds) < 2:
            continue
        grows = all(b.context_ids[:len(a.context_ids) + len(a.round_ids)] == a.context_ids + a.round_ids
                    for a, b in zip(t.rounds, t.rounds[1:]))
        if not grows:
            assert len(rows[i]) == len(rounds)
            continue
        one_rows += 1
        assert len(rows[i]) == 1, f"trajectory {i} grows over {len(rounds)} rounds but trains as {len(rows[i])} rows"
        row = rows[i][0]
        last = t.rounds[-1]
        assert row.ids == last.context_ids + last.round_ids and row.adv_t == pytest.approx(float(adv_t[i]))
        assert row.policy == [r.policy_span for _, r in rounds]
        assert row.mem == [(*r.mem_span, adv_m[k]) for k, r in rounds if k in adv_m]
        for k, r in rounds:          # the spans hold what each round wrote, at its place in the one row
            a, b = r.policy_span
            assert row.ids[a:b] == r.output_ids
            a, b = r.mem_span
            assert row.ids[a:b] == r.round_ids[:r.mem_end]
    assert one_rows >= 1, "no multi-round trajectory grew: the one-row case is untested"
    assert any(a != 0 for s in samples if len(s.policy) > 1 for *_, a in s.mem), "no A_M inside a one-row sample"
    seen = 0
    for (_, x), (_, adv) in zip(calls["collate"], calls["token_advantages"]):
        for b in range(len(x["ids"])):
            ids = x["ids"][b, :int(x["attn"][b].sum())].tolist()
            s = next((s for s in samples if len(s.policy) > 1 and s.ids == ids), None)
            if s is None:
                continue
            a_m_at, want = torch.zeros(x["ids"].shape[1]), torch.zeros(x["ids"].shape[1])
            for a, e, v in s.mem:
                a_m_at[a:e] = v
            for a, e in s.policy:       # the sampled tokens alone: no advantage on context, tool results, prefixes
                want[a:e] = s.adv_t + a_m_at[a:e]
            assert torch.allclose(adv[b], want, atol=1e-6), (adv[b] - want).abs().max()
            seen += 1
    assert seen == one_rows


def test_mem_adv_norm_nonzero_through_main_trains_and_logs_the_nonzero_pool(sft_run, tmp_path, monkeypatch):
    """``--mem-adv-norm nonzero`` on the command line: the step's A_M comes from the nonzero pool (the paper's is
    never called) and the logged pool figures are the nonzero pool's, from the same flag: one source of truth."""
    import variants
    calls = spy_on(monkeypatch, ["memory_advantage", "nonzero_memory_advantage", "memory_rewards"])
    logged = []
    real = metrics.memory_pool_weights
    monkeypatch.setattr(metrics, "memory_pool_weights", lambda *a: logged.append(a) or real(*a))
    run = tmp_path / "run"
    train.main(["--run", str(run), "--model", str(sft_run / "final"), "--mem-adv-norm", "nonzero"]
               + RL_ARGS[:1] + ["1"] + RL_ARGS[2:])
    assert "memory_advantage" not in calls and len(calls["nonzero_memory_advantage"]) == 1
    (args, adv), = calls["nonzero_memory_advantage"]
    (_, mem), = calls["memory_rewards"]
    rewards, adv_logged, questions, norm = logged[0]
    assert norm == "nonzero" and adv_logged == adv.tolist() and rewards == mem["reward"]
    row, = [json.loads(ln) for ln in open(run / "metrics.jsonl")]
    pools = variants.memory_pool_weights(mem["reward"], adv.tolist(), questions, "nonzero")
    assert row["pool_std"] == pytest.approx(sum(s for s, _ in pools) / len(pools) if pools else 0.0)
    # rl_step called on its own (as bench_update.py and the tests call it) pools as its config says, too
    calls.clear()
    spied_rl_step(sft_run, monkeypatch, ["--mem-adv-norm", "nonzero"])
    assert "memory_advantage" not in calls and len(calls["nonzero_memory_advantage"]) == 1
