"""Diagnostics: look inside a checkpoint's embedded-world episodes, where the world's facts are known.

    python diagnostics.py --checkpoint runs/default --objectives 2 4 --split valid --memory
    python diagnostics.py --checkpoint runs/default --objectives 2 4 --temperature 1 --max-turns 16 --stop-value
    python diagnostics.py --checkpoint runs/default/sft --objectives 4 --decisions runs/default

What ``<mem>`` kept (``--memory``): ``memory_diagnostics`` (eval.py's retention by rounds-ago and turn drift,
faithfulness, round 1's update), ``probe_by_found`` (the memory reward's two probes split by found / kept /
dropped) and ``p_by_round``, with the memory reward's settings from the run's ``config.json``. What RL changed:
``stop_value`` (``--stop-value``: does the objective pay for answering early), ``first_error`` and ``decisions``
(``--decisions RUN``: does an RL checkpoint fix its SFT start's greedy errors, does it change the choices the
start got right).

Plain functions over trajectories and models: they sample only where a check branches (``stop_value``). The
episodes are eval.py's (its agent, held-out worlds and checkpoint loading); each mode prints its report, then
one JSON line.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Callable

import torch

import data
from engine import generate, stop_strings
from eval import embedded_tasks, greedy_agent, load, mean_ci, memory_retention, run_reward_config
from flags import Accepts, FlagParser
from memory import extract_mem
from models import gguf_file, pick_device
from reward import (MEM_MASK, PROBE_THINK, THRESHOLD, memory_rewards, normalize_answer, outcome_reward,
                    template_objectives)
from rollout import STOP_STRINGS, AgentConfig, Round, Trajectory, cut_at_stop, parse_action, run_episodes


# --------------------------------------------------------------------------- what <mem> kept

def mem_grounded(mem: str, sources: list[str]) -> bool:
    """True when every word of a ``<mem>`` entry occurs in the question or an earlier tool result (an invented
    fact is not). Digits and punctuation (entry numbers, separators) are free."""
    seen = set(normalize_answer(" ".join(sources)).split())
    words = [w for w in normalize_answer(mem).split() if not w.isdigit()]
    return all(w in seen for w in words)


def memory_diagnostics(trajs: list, tasks: list) -> dict:
    """``eval.memory_retention`` (retention by rounds-ago, turn drift), faithfulness, and round 1's memory update
    (``first_update``).

    Faithfulness = fraction of ``<mem>`` entries whose words all occur in the question or an earlier
    tool result (an invented entry is reward hacking).
    """
    faithful = [0, 0]
    for traj in trajs:
        sources = [tasks[traj.group_id].question] + [r.text for r in traj.records
                                                     if r.type in ("search_results", "webpage")]
        for t, rnd in enumerate(traj.rounds[1:], start=1):
            for e in (extract_mem(rnd.text) or "").split(";"):
                if e.strip():
                    faithful[0] += mem_grounded(e, sources[:t + 1])     # the question and the results before t
                    faithful[1] += 1
    return memory_retention(trajs, tasks) | {
        "faithfulness": faithful[0] / faithful[1] if faithful[1] else float("nan"), "mem_entries": faithful[1],
        "first_update": first_update(trajs, tasks)}


def first_update(trajs: list, tasks: list) -> dict:
    """The first memory update, round 1's ``<mem>`` (rounds count from 0): the share of episodes by how many entries
    it writes (``"none"``: the episode ended in round 0), and the share where it is exactly the expert's update after
    the episode's own round 0: the question's paths, with the first slot filled wherever round 0 searched an
    objective's first pair and its result showed the fact.

    Round 0 copies the question; round 1 is the first rewrite, and past the expert's largest K it is where
    an agent breaks, by writing the entry count it was taught, or by copying the memory without the fact it
    found. On sampled episodes ``all_right`` is what RL has to reinforce there: an update it never samples
    right, the outcome never pays.
    """
    counts: dict[str, int] = {}
    right = 0
    for traj in trajs:
        mem = (extract_mem(traj.rounds[1].text) or "") if len(traj.rounds) > 1 else None
        key = "none" if mem is None else str(len(data.parse_mem(mem)))
        counts[key] = counts.get(key, 0) + 1
        if mem is not None:
            task, tools = tasks[traj.group_id], [r.text for r in traj.records if r.type == "search_results"]
            kind, body = parse_action(traj.rounds[0].text)
            expected = {k: data.open_path([o.start] + o.relations) for k, o in enumerate(task.objectives)}
            for k, obj in enumerate(task.objectives):
                s, r, o = obj.chain[0]
                if kind == "search" and body.split() == [s, r] and tools and _has_fact(tools[0], obj.chain[0]):
                    expected[k][2] = o
            right += data.parse_mem(mem) == expected
    n = max(len(trajs), 1)
    return {"entries": {c: v / n for c, v in sorted(counts.items())}, "all_right": right / n}


def _has_fact(text: str, fact: tuple[str, str, str]) -> bool:
    return f" {' '.join(fact)} " in f" {text} "


def probe_by_found(model, tokenizer, trajs: list, tasks: list, threshold: float = THRESHOLD,
                   mask_mode: str = MEM_MASK, think: str = PROBE_THINK, context: str = "snail") -> dict:
    """The memory reward's two probes where the answer is known, on embedded-world trajectories.

    For every scored round (t >= 2 with a ``<mem>``) and objective k: **found** when the round's context
    holds the objective's last fact ``s r answer``: an earlier ``<mem>`` entry k holds it, or an earlier round
    searched ``s r`` and its result shows it (snail: the previous round only; full: every earlier one). A
    fact shown as a side hit of another query does not count (nothing in the context says it answers k).
    Then **kept** when the
    round's ``<mem>`` entry k still holds it, else **dropped**; else **not found**. Per label: the mean probability
    of that objective's answer (all its words) under each probe and the share above ``threshold``. A fair
    probe is unconfident on both sides when not found, confident on both when kept, and confident in
    P_full only when dropped. Rounds are labelled too (dropped if any found answer was dropped, kept if
    some were found and all kept, else none found) with the mean memory reward P_mem - P_full.
    """
    m = memory_rewards(model, tokenizer, trajs, threshold=threshold, mask_mode=mask_mode, think=think)
    acc: dict[str, list] = {"not found": [], "kept": [], "dropped": []}
    by_round: dict[str, list] = {"none found": [], "kept": [], "dropped": []}
    rewards = m["reward"]                                  # in m["scored"] order (trajectory, then round)
    for r, (i, t) in enumerate(m["scored"]):
        tr = trajs[i]
        tools = [rec.text for rec in tr.records if rec.type in ("search_results", "webpage")]
        lo = 0 if context == "full" else t - 1
        entry = lambda text, k: " ".join(data.parse_mem(extract_mem(text) or "").get(k, []))   # objective k's path

        # an earlier <mem> entry k holds it, or its search showed it
        def found(k: int, fact: tuple[str, str, str]) -> bool:
            return any(_has_fact(entry(x.text, k), fact)
                       or (x.action == "search" and parse_action(x.text)[1].split() == list(fact[:2])
                           and j < len(tools) and _has_fact(tools[j], fact))
                       for j, x in enumerate(tr.rounds[lo:t], lo))
        objs = torch.tensor(template_objectives(tr.golds))
        labels = []
        for k, obj in enumerate(tasks[tr.group_id].objectives):
            cols = (objs == k).nonzero().flatten()
            lp_full, lp_mem = m["word_logp_full"][r, cols].sum().item(), m["word_logp_mem"][r, cols].sum().item()
            fact = obj.chain[-1]
            label = ("not found" if not found(k, fact)
                     else "kept" if _has_fact(entry(tr.rounds[t].text, k), fact) else "dropped")
            acc[label].append((math.exp(lp_full), math.exp(lp_mem)))
            labels.append(label)
        rl = "dropped" if "dropped" in labels else "kept" if "kept" in labels else "none found"
        by_round[rl].append(rewards[r])
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    out = {lab: {"n": len(v), "p_full": mean([a for a, _ in v]), "p_mem": mean([b for _, b in v]),
                 "conf_full": mean([float(a > threshold) for a, _ in v]),
                 "conf_mem": mean([float(b > threshold) for _, b in v])} for lab, v in acc.items()}
    out["reward_by_round"] = {lab: {"n": len(v), "mem_reward": mean(v)} for lab, v in by_round.items()}
    out["empty_frac"], out["no_signal_frac"] = m["empty_frac"], m["no_signal_frac"]
    return out


def p_by_round(model, tokenizer, trajs: list, threshold: float = THRESHOLD,
               mask_mode: str = MEM_MASK, think: str = PROBE_THINK) -> dict:
    """Mean P_full and P_mem by round index on (eval) trajectories: where does memory carry the answer?

    ``mask_mode`` and ``threshold`` should be the run's own (``run_reward_config``), so P_mem here is
    the P_mem its training reward computed.
    """
    m = memory_rewards(model, tokenizer, trajs, threshold=threshold, mask_mode=mask_mode, think=think)
    rows: dict[str, list] = {}
    for k, (_, t) in enumerate(m["scored"]):
        rows.setdefault(str(t) if t < 8 else "8+", []).append((m["p_full"][k], m["p_mem"][k]))
    return {key: {"p_full": sum(a for a, _ in v) / len(v), "p_mem": sum(b for _, b in v) / len(v), "n": len(v)}
            for key, v in sorted(rows.items(), key=lambda kv: (len(kv[0]), kv[0]))}


# --------------------------------------------------------------------------- what RL changed

STOP_TEXT = " <think> answer </think> <answer>"     # the expert's answer action after its <mem> (data.expert_rounds)


def held_answers(mem_text: str, golds: list[list[str]]) -> int:
    """How many objectives' gold answers (first alias) a round's ``<mem>`` text already holds."""
    words = set(mem_text.split())
    return sum(bool(g) and all(w in words for w in g[0].split()) for g in golds)


def stop_value(model, tokenizer, trajs: list, temperature: float, max_new_tokens: int = 128,
               batch: int = 64, seed: int = 0) -> dict:
    """Does the objective pay for stopping early? At every round of ``trajs`` that searched, the two actions
    at the SAME state: Q_go, the score the trajectory got by searching on, and Q_stop, the score of a branch
    that keeps the round's context and ``<mem>`` span, then forces the answer action (``STOP_TEXT``) and lets
    the policy write the answer at ``temperature``; scored by ``outcome_reward`` over the rounds before it plus
    the branch round, as training scores a trajectory. Returns the means overall, by round and by the answers
    the round's ``<mem>`` already held; ``stop_better`` is the share of states where Q_stop > Q_go.

    A policy that learns to answer early is right to if Q_stop >= Q_go where it stops; if Q_stop < Q_go at
    every round with answers still missing, early answers are the optimizer's noise, not the objective's."""
    stop_ids, stops = tokenizer.encode(STOP_TEXT, add_special_tokens=False), stop_strings(tokenizer, STOP_STRINGS)
    states = []                                         # (traj, round index, its Q_go, the branch's prompt ids)
    for t in trajs:
        q_go = outcome_reward(t)["score"]
        for i, r in enumerate(t.rounds):
            if r.action == "search" and r.mem_end:
                states.append((t, i, q_go, r.context_ids + r.round_ids[:r.mem_end] + stop_ids))
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    outs = []
    for j in range(0, len(states), batch):
        outs += generate(model, [s[3] for s in states[j:j + batch]], max_new_tokens, pad_id=tokenizer.pad_token_id,
                         eos_id=tokenizer.eos_token_id, stops=stops, temperature=temperature,
                         generator=gen if temperature > 0 else None)
    rows = []
    for (t, i, q_go, _), out in zip(states, outs):
        r = t.rounds[i]
        head = r.round_ids[:r.mem_end]
        text = cut_at_stop(tokenizer.decode(head + stop_ids + out))
        kind, body = parse_action(text)
        branch_round = Round(r.context_ids, r.prefix_ids, (head + stop_ids + out)[len(r.prefix_ids):], text,
                             r.mem_end, kind)
        branch = Trajectory(t.question, t.golds, t.group_id, t.prompt_ids, [], t.rounds[:i] + [branch_round],
                            body if kind == "answer" else None, True)
        mem_text = extract_mem(tokenizer.decode(head)) or ""
        rows.append({"round": i + 1, "held": held_answers(mem_text, t.golds), "k": len(t.golds),
                     "q_stop": outcome_reward(branch)["score"], "q_go": q_go})

    def agg(rs):
        n = len(rs)
        return {"n": n, "q_stop": sum(r["q_stop"] for r in rs) / n, "q_go": sum(r["q_go"] for r in rs) / n,
                "stop_better": sum(r["q_stop"] > r["q_go"] for r in rs) / n}
    if not rows:
        return {"n": 0}
    by_round = {str(k): agg([r for r in rows if r["round"] == k]) for k in sorted({r["round"] for r in rows})}
    by_missing = {str(m): agg([r for r in rows if r["k"] - r["held"] == m])
                  for m in sorted({r["k"] - r["held"] for r in rows})}
    return {**agg(rows), "by_round": by_round, "by_missing": by_missing}


def first_error(traj: Trajectory, task: data.Task, tokenizer) -> tuple[int, int, str, str | None] | None:
    """Where an embedded-world episode first goes wrong: ``(round, index into the round's ids, kind, right word)``,
    None when no word it generated contradicts the world. Kinds: ``memory`` (a ``<mem>`` word that is not the
    world's at its path position, or a slot emptied that the previous ``<mem>`` held right; right word None when
    the entry itself is malformed), ``query`` (a search word other than the pair before the first slot of the
    round's own ``<mem>``), ``answer`` (an answer word not the gold). One token a word: the word tokenizer."""
    truth = [[o.start] + [w for (_, r, x) in o.chain for w in (r, x)] for o in task.objectives]
    prev: dict[int, list[str]] = {}
    for ri, rd in enumerate(traj.rounds):
        toks, gen_from = tokenizer.convert_ids_to_tokens(rd.round_ids), len(rd.prefix_ids)
        mem: dict[int, list[str]] = {}
        i = 0
        while i < len(toks):
            if toks[i] == "<mem>":
                entry, i = None, i + 1
                while i < len(toks) and toks[i] != "</mem>":
                    w = toks[i]
                    if w == ";":
                        entry = None
                    elif w.isdigit() and i + 1 < len(toks) and toks[i + 1] == "=":
                        entry, i = int(w) - 1, i + 1
                    elif entry is not None:
                        pos = len(mem.setdefault(entry, []))
                        mem[entry].append(w)
                        path = truth[entry] if 0 <= entry < len(truth) else []
                        if i >= gen_from:
                            if pos >= len(path):
                                return ri, i, "memory", None
                            forgot = w == data.SLOT and prev.get(entry, [])[pos:pos + 1] == [path[pos]]
                            if w not in (data.SLOT, path[pos]) or forgot:
                                return ri, i, "memory", path[pos]
                    i += 1
            elif toks[i] == "<search>":
                want = next((p[p.index(data.SLOT) - 2:p.index(data.SLOT)] for _, p in sorted(mem.items())
                             if data.SLOT in p), [])
                for j, w in enumerate(want if len(want) == 2 else []):
                    if i + 1 + j < len(toks) and i + 1 + j >= gen_from and toks[i + 1 + j] != w:
                        return ri, i + 1 + j, "query", w
                i += 3
            elif toks[i] == "<answer>":
                a, i = 0, i + 1
                while i < len(toks) and toks[i] != "</answer>":
                    if toks[i] == ";":
                        a += 1
                    elif i >= gen_from and a < len(task.golds) and toks[i] not in task.golds[a]:
                        return ri, i, "answer", task.golds[a][0]
                    i += 1
            else:
                i += 1
        prev = mem
    return None


@torch.no_grad()
def decisions(model, other, tokenizer, trajs: list, tasks: list) -> dict:
    """Does ``other`` (an RL checkpoint) fix ``model``'s (its SFT start's) greedy errors, and does it change the
    choices ``model`` got right? On ``model``'s own greedy episodes, teacher-forced on their ids, so the two are
    paired: at each failed episode's ``first_error``, log p(chosen) and log p(right) under both (``fixed``: other
    prefers the right word there; ``gains``: the rise of log p(right) - log p(chosen) at each, ``margin_gain``
    their mean, overall and by kind); on the
    episodes ``model`` answers fully right, the generated tokens whose argmax other changes (``right_changed``:
    each one can break a right episode)."""
    def logp(m, ids):
        return torch.log_softmax(m(torch.tensor([ids], device=next(m.parameters()).device)).logits[0].float(), -1)
    points, changed, n_right, episodes_changed = [], 0, 0, 0
    for t, task in zip(trajs, tasks):
        if outcome_reward(t)["f1"] >= 1.0:
            before = changed
            for rd in t.rounds:
                ids, start = rd.context_ids + rd.round_ids, len(rd.context_ids) + len(rd.prefix_ids)
                if rd.output_ids:
                    pred = logp(other, ids)[start - 1:len(ids) - 1].argmax(-1).cpu()
                    changed += (pred != torch.tensor(rd.output_ids)).sum().item()
                    n_right += len(rd.output_ids)
            episodes_changed += changed > before
            continue
        err = first_error(t, task, tokenizer)
        if err is None or err[3] is None:
            points.append({"kind": err[2] if err else "none"})
            continue
        ri, ti, kind, word = err
        rd = t.rounds[ri]
        ids, chosen = rd.context_ids + rd.round_ids[:ti], rd.round_ids[ti]
        right = tokenizer.convert_tokens_to_ids(word)
        a, b = logp(model, ids)[-1], logp(other, ids)[-1]
        points.append({"kind": kind, "p_chosen": a[chosen].exp().item(), "p_right": a[right].exp().item(),
                       "gain": (b[right] - b[chosen] - a[right] + a[chosen]).item(),
                       "fixed": bool(b[right] > b[chosen])})
    scored = [p for p in points if "gain" in p]
    kinds = sorted({p["kind"] for p in points})
    res = {"failed": len(points), "kinds": {k: sum(p["kind"] == k for p in points) for k in kinds},
           "right_episodes": len(trajs) - len(points), "right_tokens": n_right, "right_changed": changed,
           "right_episodes_changed": episodes_changed}
    if scored:
        med = lambda xs: sorted(xs)[len(xs) // 2]
        res |= {"scored": len(scored), "p_chosen_median": med([p["p_chosen"] for p in scored]),
                "p_right_median": med([p["p_right"] for p in scored]),
                "fixed": sum(p["fixed"] for p in scored), "gains": [p["gain"] for p in scored],
                "margin_gain": sum(p["gain"] for p in scored) / len(scored),
                "by_kind": {k: {"n": len(ps), "fixed": sum(p["fixed"] for p in ps),
                                "margin_gain": sum(p["gain"] for p in ps) / len(ps)}
                            for k in kinds if (ps := [p for p in scored if p["kind"] == k])}}
    return res


# --------------------------------------------------------------------------- the reports

def print_memory_diagnostics(k: int, d: dict, probe_temperature: float, think: str) -> None:
    """``--memory``'s lines for objective count ``k``: retention, P by round, the probes."""
    print(f"K={k}: retention {d['retention']:.3f}  faithfulness {d['faithfulness']:.3f}  "
          f"by rounds-ago {json.dumps({a: round(v, 3) for a, v in d['retention_by_ago'].items()})}  "
          f"drift {json.dumps({a: round(v, 3) for a, v in d['retention_drift'].items()})}")
    for name, label in (("first_update", "greedy"), ("first_update_sampled", f"T={probe_temperature}")):
        if name in d:
            fu = d[name]
            print(f"      round 1's <mem> ({label}): all entries right {fu['all_right']:.3f}, share by entry count "
                  + json.dumps({c: round(v, 3) for c, v in fu["entries"].items()}))
    print("      P_full / P_mem by round: " + "  ".join(
        f"{r}: {v['p_full']:.2f}/{v['p_mem']:.2f}" for r, v in d["p_by_round"].items()))
    pr = d["probe"]
    if pr:
        print(f"      probes (T={probe_temperature}, think={think!r}), answer P full/mem [confident share] by "
              "objective: " + "  ".join(f"{lab}: {v['p_full']:.2f}/{v['p_mem']:.2f} [{v['conf_full']:.2f}/"
                                        f"{v['conf_mem']:.2f}] n={v['n']}" for lab, v in pr.items()
                                        if lab in ("not found", "kept", "dropped")))
        print("      memory reward by round: " + "  ".join(
            f"{lab}: {v['mem_reward']:+.3f} n={v['n']}" for lab, v in pr["reward_by_round"].items())
              + f"  a probe empty {pr['empty_frac']:.2f}, both empty (reward 0) {pr['no_signal_frac']:.2f}")


def print_stop_value(res: dict, title: str = "") -> None:
    """``stop_value``'s table: rows by the answers still missing from the round's <mem>, then by round."""
    if title:
        print(title)
    print("state          n   Q_stop     Q_go  stop>go")
    for name, part in (("missing", res.get("by_missing", {})), ("round", res.get("by_round", {}))):
        for k, r in part.items():
            print(f"{name} {k:<6} {r['n']:6d} {r['q_stop']:8.3f} {r['q_go']:8.3f} {r['stop_better']:8.3f}")
    if res.get("n"):
        print(f"all          {res['n']:6d} {res['q_stop']:8.3f} {res['q_go']:8.3f} {res['stop_better']:8.3f}")


def print_decisions(res: dict, title: str = "") -> None:
    """``decisions``' lines: the first errors, what other does at them, and its changes on the right episodes."""
    if title:
        print(title)
    print(f"failed episodes {res['failed']} (first error: {res['kinds']}); right episodes {res['right_episodes']}")
    if res.get("scored"):
        m, h = mean_ci(res["gains"])
        print(f"at the first errors: p(chosen) median {res['p_chosen_median']:.3f}, p(right) median "
              f"{res['p_right_median']:.3f}; other fixes {res['fixed']} of {res['scored']}, log-odds toward the "
              f"right word {m:+.3f} +- {h:.3f}")
        for k, v in res["by_kind"].items():
            print(f"  {k:<7} n {v['n']:3d}  fixed {v['fixed']:3d}  margin gain {v['margin_gain']:+.3f}")
    print(f"on the right episodes: other changes {res['right_changed']} of {res['right_tokens']} greedy tokens, in "
          f"{res['right_episodes_changed']} of {res['right_episodes']} episodes")


def report_stop_value(model, tokenizer, episodes: Callable[[int], tuple[list, list]], ks: list[int],
                      temperature: float, max_turns: int, max_new_tokens: int, seed: int, checkpoint: str) -> None:
    """``--stop-value``: ``stop_value`` per K on ``episodes(k)`` (-> trajectories, tasks), its
    table per K, then one JSON line."""
    out = {}
    for k in ks:
        trajs, _ = episodes(k)
        out[str(k)] = stop_value(model, tokenizer, trajs, temperature, max_new_tokens, seed=seed)
        print_stop_value(out[str(k)], f"K={k}  T={temperature}  max_turns={max_turns}")
    print(json.dumps({"checkpoint": checkpoint, "temperature": temperature, "stop_value": out}))


def report_decisions(model, other, tokenizer, episodes: Callable[[int], tuple[list, list]], ks: list[int],
                     checkpoint: str, other_name: str) -> None:
    """``--decisions RUN``: ``decisions`` of ``other`` per K on ``model``'s greedy ``episodes(k)``,
    its lines per K, then one JSON line."""
    out = {}
    for k in ks:
        trajs, tasks = episodes(k)
        out[str(k)] = decisions(model, other, tokenizer, trajs, tasks)
        print_decisions(out[str(k)], f"K={k}: {other_name} on {checkpoint}'s greedy episodes")
    print(json.dumps({"checkpoint": checkpoint, "other": other_name, "decisions": out}))


# --------------------------------------------------------------------------- the command line

def diagnose(model, tokenizer, ks: list[int], n: int, split: str, max_turns: int, hops: tuple[int, int],
             system_prompt: str = data.SYSTEM_PROMPT, mask_mode: str = MEM_MASK,
             threshold: float = THRESHOLD, think: str = PROBE_THINK, probe_temperature: float = 1.0,
             probe_turns: int = 16) -> dict:
    """``--memory``: ``memory_diagnostics``, P_full / P_mem by round and the probes split by found / kept / dropped
    (``probe_by_found``) per K, each K's lines printed.

    Retention and P by round come from greedy episodes; the probe split from episodes sampled at
    ``probe_temperature`` (seeded) with training's turn limit, the rollouts the RL reward scores.
    """
    agent = greedy_agent("snail", max_turns, system_prompt=system_prompt)
    sampled = AgentConfig(system_prompt=system_prompt, context="snail", max_turns=probe_turns,
                          max_new_tokens=agent.max_new_tokens, temperature=probe_temperature)
    out = {}
    for k in ks:
        tasks, tool = embedded_tasks(k, n, 0, split, hops)
        trajs = run_episodes(model, tokenizer, tasks, tool, agent)
        out[k] = memory_diagnostics(trajs, tasks) | {"p_by_round": p_by_round(model, tokenizer, trajs, threshold,
                                                                              mask_mode, think)}
        torch.manual_seed(k)
        strajs = run_episodes(model, tokenizer, tasks, tool, sampled)
        out[k]["probe"] = probe_by_found(model, tokenizer, strajs, tasks, threshold, mask_mode, think)
        out[k]["first_update_sampled"] = first_update(strajs, tasks)
        print_memory_diagnostics(k, out[k], probe_temperature, think)
    return out


def held_out_episodes(model, tokenizer, agent: AgentConfig, n: int, seed: int, split: str,
                      hops: tuple[int, int]):
    """``k -> (trajectories, tasks)``: ``agent``'s episodes on ``n`` held-out K-objective questions."""
    def episodes(k: int) -> tuple[list, list]:
        tasks, tool = embedded_tasks(k, n, seed, split, hops)
        return run_episodes(model, tokenizer, tasks, tool, agent), tasks
    return episodes


def parse_args(argv=None) -> argparse.Namespace:
    p = FlagParser(description="Diagnostics of a checkpoint on held-out embedded worlds.")
    p.add_argument("--checkpoint", "--model", dest="checkpoint", required=True,
                   help="run folder or checkpoint folder saved by train.py (e.g. runs/default), or a model folder")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--memory", action="store_true",
                      help="memory retention / faithfulness / P by round, the probes by found / kept / dropped")
    mode.add_argument("--stop-value", action="store_true",
                      help="at every round that searched: Q_stop (force the answer now) vs Q_go (search on), per K")
    mode.add_argument("--decisions", default="", metavar="RUN",
                      help="RUN (e.g. the RL run of this SFT checkpoint) on this checkpoint's greedy episodes: does "
                           "it fix their first errors, does it change their right choices (word tokenizer)")
    p.add_argument("--objectives", type=Accepts(int, min=1), nargs="+", default=[1, 2, 4, 6, 8, 10],
                   help="objective counts K")
    p.add_argument("--context", default="snail", type=Accepts(str, choices=("snail", "full")),
                   help="context of the episodes --stop-value and --decisions look at (--memory: snail)")
    p.add_argument("--max-turns", type=Accepts(int, min=1), default=64, help="max rounds per episode")
    p.add_argument("--max-new-tokens", type=Accepts(int, min=1), default=128,
                   help="max tokens per round (--stop-value, --decisions)")
    p.add_argument("--tasks", type=Accepts(int, min=1), default=64, help="questions per K")
    p.add_argument("--split", default="test", type=Accepts(str, choices=tuple(data.SPLIT_SEEDS)),
                   help="held-out world seeds")
    p.add_argument("--seed", type=Accepts(int, unbounded=True), default=0,
                   help="which held-out worlds (--stop-value, --decisions), and the sampling seed")
    p.add_argument("--hops", default="1-3", type=Accepts(str, int_range=True), help="hops per objective, e.g. 1-3")
    p.add_argument("--temperature", type=Accepts(float, min=0), default=0.0,
                   help="--stop-value: the episodes' and the branches' sampling temperature (0 = greedy)")
    p.add_argument("--probe-think", default="", help="--memory: the probes' think word (default: the run's)")
    p.add_argument("--system-prompt", default="", help="text file with the system prompt (default: the checkpoint's)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = p.parse_args(argv)
    for run in [args.checkpoint] + ([args.decisions] if args.decisions else []):
        if not os.path.isdir(run) and gguf_file(run) is None:      # it would reach the model hub as a model name
            p.error(f"checkpoint folder {run} does not exist")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = pick_device(args.device)
    hops = tuple(int(x) for x in args.hops.split("-"))
    model, tokenizer, prompt = load(args.checkpoint, device)
    torch.manual_seed(args.seed)                    # --temperature > 0: the same sampled episodes on a rerun
    if args.system_prompt:
        with open(args.system_prompt, encoding="utf-8") as f:
            prompt = f.read().strip()
    if args.memory:
        mask_mode, threshold, think = run_reward_config(args.checkpoint)  # P_mem as the run's reward saw it
        res = diagnose(model, tokenizer, args.objectives, args.tasks, args.split, args.max_turns, hops, prompt,
                       mask_mode, threshold, args.probe_think or think)
        print(json.dumps({"checkpoint": args.checkpoint, "mem_mask": mask_mode,
                          "diagnostics": {str(k): v for k, v in res.items()}}))
    elif args.stop_value:
        agent = greedy_agent(args.context, args.max_turns, args.max_new_tokens, prompt, args.temperature)
        episodes = held_out_episodes(model, tokenizer, agent, args.tasks, args.seed, args.split, hops)
        report_stop_value(model, tokenizer, episodes, args.objectives, args.temperature, args.max_turns,
                          args.max_new_tokens, args.seed, args.checkpoint)
    else:
        other = load(args.decisions, device)[0]
        agent = greedy_agent(args.context, args.max_turns, args.max_new_tokens, prompt)
        episodes = held_out_episodes(model, tokenizer, agent, args.tasks, args.seed, args.split, hops)
        report_decisions(model, other, tokenizer, episodes, args.objectives, args.checkpoint, args.decisions)


if __name__ == "__main__":
    data.exit_on_bad_input(main)         # a missing or broken input: one line, exit status 2
