"""Evaluation: run the agent greedily on held-out questions and report F1, EM, tokens and turns.

    python eval.py --checkpoint runs/default/final --objectives 1 2 4 6 8 10 --context snail
    python eval.py --checkpoint PATH --data qa.jsonl --corpus wiki.jsonl --context snail

Per objective count K (MEM1's multi-objective protocol): F1, EM, the fraction of objectives
matched (score), the format-valid rate, TT (total tokens: every prompt + generated token the
model processed, summed over the episode's rounds), PT (peak tokens: the longest single-round
context + output), and mean turns. TT and PT are means over episodes. A table on stdout, then
one JSON line last.

Held-out sets of the embedded world are new worlds (new fact graphs and questions) over the same
pool of entity names as training; ``--split valid`` and ``--split test`` are disjoint world seeds:
pick settings on ``valid``, report on ``test``.

``--diagnostics`` reads the memory reward's settings from the run's ``config.json`` (``run_reward_config``).
``--stop-value`` and ``--decisions RUN`` are RL's diagnostics (issue 24): does the objective pay for answering
early, and does an RL checkpoint fix its SFT start's greedy errors or change its right choices.
Other recipes have their own evaluations: ``python -m recipes.memalpha_eval``, ``python -m recipes.memtrain_eval``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
from tqdm import tqdm

import data
from memory import extract_mem
from reward import (MEM_MASK, PROBE_THINK, THRESHOLD, early_answer, mem_grounded, memory_rewards, outcome_reward,
                    template_objectives)
from rollout import (AgentConfig, Round, SearchTool, Trajectory, checkpoint_prompt, cut_at_stop, generate,
                     gguf_file, load_pretrained, parse_action, pick_device, run_episodes, stop_strings)
import viz

SPLIT_SEEDS = data.SPLIT_SEEDS
AGO_BUCKETS = [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 64)]


# --------------------------------------------------------------------------- memory diagnostics

def memory_diagnostics(trajs: list, tasks: list) -> dict:
    """Retention, faithfulness and turn drift of ``<mem>``, measurable because the world's facts are known.

    Objective k's *needed* entity after some rounds is the newest object of its gold chain that an
    earlier search retrieved (its answer once the chain is complete). Retention at round t >= 2 =
    fraction of needed entities that ``<mem>`` holds in objective k's entry (``k = path``), by
    how many rounds ago the entity was retrieved, and for rounds 2-8 vs 9-64 (turn drift).
    Faithfulness = fraction of ``<mem>`` entries whose words all occur in the question or an earlier
    tool result (an invented entry is reward hacking).
    """
    kept = {b: [0, 0] for b in AGO_BUCKETS}
    drift = {"rounds 2-8": [0, 0], "rounds 9-64": [0, 0]}
    faithful = [0, 0]
    for traj in trajs:
        task = tasks[traj.group_id]
        tools = [r.text for r in traj.records if r.type in ("search_results", "webpage")]
        found: dict[tuple[int, int], int] = {}           # (objective, hop) -> round that retrieved it
        for t, rnd in enumerate(traj.rounds):
            if t >= 1:
                mem = extract_mem(rnd.text)
                entries = data.parse_mem(mem or "")
                for e in (mem or "").split(";"):
                    if e.strip():
                        faithful[0] += mem_grounded(e, [task.question] + tools[:t])
                        faithful[1] += 1
                for k, obj in enumerate(task.objectives):
                    hops = [h for h in range(len(obj.chain)) if (k, h) in found]
                    if not hops:
                        continue
                    h = max(hops)
                    hit = int(obj.chain[h][2] in entries.get(k, []))
                    ago = t - found[(k, h)]
                    for b in AGO_BUCKETS:
                        if b[0] <= ago <= b[1]:
                            kept[b][0] += hit
                            kept[b][1] += 1
                    d = drift["rounds 2-8" if t < 8 else "rounds 9-64"]
                    d[0] += hit
                    d[1] += 1
            if t < len(tools) and rnd.action == "search":
                query = parse_action(rnd.text)[1].split()
                for k, obj in enumerate(task.objectives):
                    for h, f in enumerate(obj.chain):      # retrieved: searched for and shown
                        if query == list(f[:2]) and " ".join(f) in tools[t] and (k, h) not in found:
                            found[(k, h)] = t
    ratio = lambda a: a[0] / a[1] if a[1] else float("nan")
    return {"retention": ratio([sum(v[0] for v in kept.values()), sum(v[1] for v in kept.values())]),
            "retention_by_ago": {f"{a}-{b}": ratio(v) for (a, b), v in kept.items()},
            "retention_drift": {k: ratio(v) for k, v in drift.items()},
            "faithfulness": ratio(faithful), "mem_entries": faithful[1]}


def run_reward_config(checkpoint: str) -> tuple[str, float, str]:
    """The memory reward's ``(mem_mask, threshold, probe_think)`` of the run that wrote ``checkpoint``.

    Read from its RUN/config.json; ``checkpoint`` is a run folder or a folder inside one (``final``,
    ``ckpt``, ``sft``). A run from before the probe marker (no ``probe_think`` in its config) scored
    ``<think> answer``; a checkpoint without a run config (e.g. a hub model) gets the reward's defaults.
    """
    for folder in (checkpoint, os.path.dirname(os.path.normpath(checkpoint))):
        path = os.path.join(folder, "config.json")
        if os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
            if "mem_mask" in cfg:                     # RUN/config.json, not a model's config.json
                return cfg["mem_mask"], float(cfg.get("threshold", THRESHOLD)), cfg.get("probe_think", "answer")
    return MEM_MASK, THRESHOLD, PROBE_THINK


def _has_fact(text: str, fact: tuple[str, str, str]) -> bool:
    return f" {' '.join(fact)} " in f" {text} "


def probe_by_found(model, tokenizer, trajs: list, tasks: list, threshold: float = THRESHOLD,
                   mask_mode: str = MEM_MASK, think: str = PROBE_THINK, context: str = "snail") -> dict:
    """The memory reward's two probes where the answer is known (issue 13), on embedded-world trajectories.

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
    rewards = [x for rs in m["rewards"] for x in rs]        # in m["scored"] order (trajectory, then round)
    for r, (i, t) in enumerate(m.get("scored", [])):
        tr = trajs[i]
        tools = [rec.text for rec in tr.records if rec.type in ("search_results", "webpage")]
        lo = 0 if context == "full" else t - 1
        entry = lambda text, k: " ".join(data.parse_mem(extract_mem(text) or "").get(k, []))   # objective k's path

        def found(k: int, fact: tuple[str, str, str]) -> bool:   # an earlier <mem> entry k holds it, or its search showed it
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
            label = "not found" if not found(k, fact) else "kept" if _has_fact(entry(tr.rounds[t].text, k), fact) else "dropped"
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
    k = 0
    for rounds in m["rounds"]:
        for t in rounds:
            key = str(t + 1) if t < 8 else "9+"
            rows.setdefault(key, []).append((m["p_full"][k], m["p_mem"][k]))
            k += 1
    return {key: {"p_full": sum(a for a, _ in v) / len(v), "p_mem": sum(b for _, b in v) / len(v), "n": len(v)}
            for key, v in sorted(rows.items(), key=lambda kv: (len(kv[0]), kv[0]))}


def summarize(trajs: list) -> dict:
    """Mean F1, EM, score, format-valid rate, TT, PT and turns over trajectories, and the early-answer share
    (``reward.early_answer``: answered after fewer searches than the question's hops; embedded world only)."""
    rows = []
    for t in trajs:
        o = outcome_reward(t)
        rows.append({"f1": o["f1"], "em": o["em"], "score": o["score"], "valid": float(o["valid"]),
                     "tt": sum(r.n_tokens for r in t.rounds),
                     "pt": max((r.n_tokens for r in t.rounds), default=0), "turns": len(t.rounds)})
    early = [e for e in map(early_answer, trajs) if e is not None]
    return ({k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} | {"n": len(rows)}
            | ({"early": sum(early) / len(early)} if early else {}))


def evaluate(model, tokenizer, tasks: list, tool: SearchTool, agent: AgentConfig, batch: int = 64,
             bar=None) -> dict:
    """Rollouts of ``tasks`` -> mean metrics."""
    return summarize(run_episodes(model, tokenizer, tasks, tool, agent, batch, bar))


def embedded_tasks(k: int, n: int, seed: int = 0, split: str = "test", hops: tuple[int, int] = (1, 3)):
    """``n`` held-out K-objective tasks of the embedded world and their search tool."""
    world, tasks = data.held_out_tasks(k, n, seed, split, hops)
    return tasks, SearchTool(world.docs)


def progress_bar(total: int):
    """ONE bar for a whole evaluation, counting episodes (a log file gets a few lines, not one bar per K)."""
    return tqdm(total=total, desc="eval", unit="episode", mininterval=10)


def greedy_agent(context: str = "snail", max_turns: int = 64, max_new_tokens: int = 128,
                 system_prompt: str = data.SYSTEM_PROMPT, temperature: float = 0.0) -> AgentConfig:
    """The agent every evaluation runs: greedy, the checkpoint's system prompt (default: the embedded world's).
    ``temperature`` > 0 samples instead (``--temperature 1 --max-turns 16``: the policy RL trains, scored as
    training scores it)."""
    return AgentConfig(system_prompt=system_prompt, context=context, max_turns=max_turns,
                       max_new_tokens=max_new_tokens, temperature=temperature)


def evaluate_embedded(model, tokenizer, ks: list[int], n: int, seed: int = 0, split: str = "valid",
                      context: str = "snail", max_turns: int = 64, hops: tuple[int, int] = (1, 3),
                      max_new_tokens: int = 128, progress: bool = False,
                      system_prompt: str = data.SYSTEM_PROMPT, temperature: float = 0.0) -> dict[int, dict]:
    """Metrics per objective count K on held-out embedded worlds."""
    agent = greedy_agent(context, max_turns, max_new_tokens, system_prompt, temperature)
    bar = progress_bar(len(ks) * n) if progress else None
    out = {}
    for k in ks:
        tasks, tool = embedded_tasks(k, n, seed, split, hops)
        out[k] = evaluate(model, tokenizer, tasks, tool, agent, bar=bar)
    if bar is not None:
        bar.close()
    return out


def print_table(results: dict, title: str = "") -> None:
    cols = ["f1", "em", "score", "valid", "tt", "pt", "turns", "n"]
    cols += ["early"] if all("early" in r for r in results.values()) else []
    if title:
        print(title)
    print("K    " + " ".join(f"{c:>8}" for c in cols))
    for k, r in results.items():
        print(f"{k:<4} " + " ".join(f"{r[c]:8.3f}" if isinstance(r[c], float) else f"{r[c]:8d}" for c in cols))


T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (0 for one value)."""
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
    return m, T95.get(len(xs) - 1, 1.96) * sd / len(xs) ** 0.5


def checkpoint_dir(path: str) -> str:
    """A run folder (with ``final/``), a checkpoint folder, a ``.gguf`` file or ``smollm2`` (as it is)."""
    return os.path.join(path, "final") if os.path.isdir(os.path.join(path, "final")) else path


def load(path: str, device):
    """(model, tokenizer, system prompt) of a checkpoint (or a model from elsewhere: ``rollout.load_pretrained``);
    bf16 weights on CUDA (no optimizer to feed)."""
    path = checkpoint_dir(path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tokenizer = load_pretrained(path, device, dtype)
    return model.eval(), tokenizer, checkpoint_prompt(path)


def compare(variants: dict[str, list[str]], ks: list[int], n: int, split: str, context: str,
            max_turns: int, hops: tuple[int, int], device) -> dict:
    """Per variant (a list of runs, one per seed) and K: mean and 95% interval of each metric.

    Besides the outcome metrics it keeps each run's memory retention by rounds-ago (pooled over K),
    so a variant that forgets shows it here and in the plot of ``plot_compare``.
    """
    metrics = ("f1", "em", "valid", "tt", "pt", "turns", "retention")
    out: dict = {}
    for name, runs in variants.items():
        per_run = []
        for run in runs:
            model, tok, prompt = load(run, device)
            agent = greedy_agent(context, max_turns, system_prompt=prompt)
            res, trajs_all, tasks_all = {}, [], []
            for k in ks:
                tasks, tool = embedded_tasks(k, n, 0, split, hops)
                trajs = run_episodes(model, tok, tasks, tool, agent)
                res[k] = summarize(trajs) | {"retention": memory_diagnostics(trajs, tasks)["retention"]}
                for t in trajs:                                  # pool K: index into tasks_all
                    t.group_id += len(tasks_all)
                trajs_all += trajs
                tasks_all += tasks
            res["by_ago"] = memory_diagnostics(trajs_all, tasks_all)["retention_by_ago"]
            per_run.append(res)
        nan_free = lambda xs: [x for x in xs if x == x] or [float("nan")]
        out[name] = {k: {m: mean_ci(nan_free([r[k][m] for r in per_run])) for m in metrics} for k in ks}
        out[name]["by_ago"] = {a: mean_ci(nan_free([r["by_ago"][a] for r in per_run])) for a in per_run[0]["by_ago"]}
    for k in ks:
        print(f"\nK = {k}  ({split} worlds, {n} questions, context={context}, mean +- 95% CI over seeds)")
        print(f"{'variant':<24}" + "".join(f"{m:>16}" for m in metrics))
        for name in variants:
            print(f"{name:<24}" + "".join(f"{out[name][k][m][0]:9.3f} +-{out[name][k][m][1]:5.3f}" for m in metrics))
    print("\nmemory retention by rounds since the fact was found (all K pooled)")
    ago = list(out[next(iter(variants))]["by_ago"])
    print(f"{'variant':<24}" + "".join(f"{a:>16}" for a in ago))
    for name in variants:
        print(f"{name:<24}" + "".join(f"{out[name]['by_ago'][a][0]:9.3f} +-{out[name]['by_ago'][a][1]:5.3f}"
                                      for a in ago))
    return out


def plot_compare(res: dict, folder: str) -> list[str]:
    """PNG plots of a ``compare`` result: F1 vs K and retention vs rounds-ago (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    os.makedirs(folder, exist_ok=True)
    paths = []
    for fname, key, xlabel, ylabel in (("f1_vs_k.png", "f1", "objectives K", "F1 (held-out, greedy)"),
                                       ("retention_vs_ago.png", "by_ago", "rounds since the fact was found",
                                        "fraction of needed facts still in <mem>")):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for name, r in res.items():
            if key == "f1":
                xs = [k for k in r if k != "by_ago"]
                ys, es = zip(*(r[k]["f1"] for k in xs))
            else:
                xs = list(r["by_ago"])
                ys, es = zip(*(r["by_ago"][a] for a in xs))
            ax.errorbar([str(x) for x in xs], ys, yerr=es, marker="o", capsize=3, label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(folder, fname))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def diagnose(model, tokenizer, ks: list[int], n: int, split: str, max_turns: int, hops: tuple[int, int],
             system_prompt: str = data.SYSTEM_PROMPT, mask_mode: str = MEM_MASK,
             threshold: float = THRESHOLD, think: str = PROBE_THINK, probe_temperature: float = 1.0,
             probe_turns: int = 16) -> dict:
    """Memory diagnostics (retention by rounds-ago, faithfulness, drift), P_full / P_mem by round, and the
    probes split by found / kept / dropped (``probe_by_found``).

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
        d = out[k]
        print(f"K={k}: retention {d['retention']:.3f}  faithfulness {d['faithfulness']:.3f}  "
              f"by rounds-ago {json.dumps({a: round(v, 3) for a, v in d['retention_by_ago'].items()})}  "
              f"drift {json.dumps({a: round(v, 3) for a, v in d['retention_drift'].items()})}")
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
    return out


# --------------------------------------------------------------------------- stop value (issue 24)

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
    stop_ids, stops = tokenizer.encode(STOP_TEXT, add_special_tokens=False), stop_strings(tokenizer)
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
    prefers the right word there; ``margin_gain``: the mean rise of log p(right) - log p(chosen), by kind); on the
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
                "fixed": sum(p["fixed"] for p in scored), "margin_gain": mean_ci([p["gain"] for p in scored]),
                "by_kind": {k: {"n": len(ps), "fixed": sum(p["fixed"] for p in ps),
                                "margin_gain": sum(p["gain"] for p in ps) / len(ps)}
                            for k in kinds if (ps := [p for p in scored if p["kind"] == k])}}
    return res


def print_decisions(res: dict, title: str = "") -> None:
    """``decisions``' lines: the first errors, what other does at them, and its changes on the right episodes."""
    if title:
        print(title)
    print(f"failed episodes {res['failed']} (first error: {res['kinds']}); right episodes {res['right_episodes']}")
    if res.get("scored"):
        m, h = res["margin_gain"]
        print(f"at the first errors: p(chosen) median {res['p_chosen_median']:.3f}, p(right) median "
              f"{res['p_right_median']:.3f}; other fixes {res['fixed']} of {res['scored']}, log-odds toward the "
              f"right word {m:+.3f} +- {h:.3f}")
        for k, v in res["by_kind"].items():
            print(f"  {k:<7} n {v['n']:3d}  fixed {v['fixed']:3d}  margin gain {v['margin_gain']:+.3f}")
    print(f"on the right episodes: other changes {res['right_changed']} of {res['right_tokens']} greedy tokens, in "
          f"{res['right_episodes_changed']} of {res['right_episodes']} episodes")


def show_episodes(model, tokenizer, prompt: str, args, hops: tuple[int, int]) -> None:
    """``--show`` / ``--viz`` / ``--question``: greedy episodes printed round by round (viz.format_episode) and
    / or written as one page (viz.write_page), with each round's P_full / P_mem as the run's reward saw them."""
    agent = greedy_agent(args.context, args.max_turns, args.max_new_tokens, prompt)
    k = args.objectives[0]
    if args.data or args.corpus:
        if not args.corpus:
            raise SystemExit("--data needs --corpus")
        tool = SearchTool(data.load_corpus(args.corpus))
        tasks = data.load_qa(args.data) if args.data else []
    else:
        tasks, tool = embedded_tasks(k, args.show or args.tasks, args.seed, args.split, hops)
    if args.question:
        tasks = [data.Task(args.question, [])]
    if not tasks:
        raise SystemExit("--show / --viz with --corpus need --data (or --question)")
    tasks = tasks[:args.show or args.tasks]                # a --data file: its first N
    trajs = run_episodes(model, tokenizer, tasks, tool, agent)
    mem = None
    if not args.question:                          # no gold, nothing to probe
        mask_mode, threshold, think = run_reward_config(args.checkpoint)
        mem = memory_rewards(model, tokenizer, trajs, threshold, mask_mode, think)
    record = viz.step_record(trajs, tokenizer, mem=mem, metrics=summarize(trajs),
                             title=f"{args.checkpoint}: greedy episodes, K={k if not args.data else 'file'}")
    if args.viz:
        print("wrote", viz.write_page(args.viz, record))
    for q in record["questions"][:args.show or (1 if args.question else 0)]:
        print(viz.format_episode(q, q["rollouts"][0]), end="\n\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Evaluate MemPO checkpoints.")
    p.add_argument("--checkpoint", "--model", dest="checkpoint",
                   help="run folder or checkpoint folder saved by train.py (e.g. runs/default), or a model from "
                        "elsewhere: a model folder, a .gguf file, smollm2 (it gets rollout.PROTOCOL_PROMPT)")
    p.add_argument("--compare", nargs="+", metavar="NAME=RUN[,RUN...]",
                   help="side-by-side variants, each a comma-separated list of runs (one per seed)")
    p.add_argument("--objectives", type=int, nargs="+", default=[1, 2, 4, 6, 8, 10], help="objective counts K")
    p.add_argument("--context", default="snail", choices=["snail", "full"], help="context mode")
    p.add_argument("--max-turns", type=int, default=64, help="max rounds per episode")
    p.add_argument("--max-new-tokens", type=int, default=128, help="max tokens per round")
    p.add_argument("--tasks", type=int, default=64, help="questions per K (embedded world)")
    p.add_argument("--split", default="test", choices=list(SPLIT_SEEDS), help="held-out world seeds")
    p.add_argument("--seed", type=int, default=0, help="which held-out worlds")
    p.add_argument("--hops", default="1-3", help="hops per objective, e.g. 1-3")
    p.add_argument("--diagnostics", action="store_true", help="also print memory retention / faithfulness / P by round")
    p.add_argument("--probe-think", default="", help="with --diagnostics: the probes' think word (default: the run's)")
    p.add_argument("--plot", default="", metavar="FOLDER", help="with --compare: write F1-vs-K and retention PNGs here")
    p.add_argument("--data", default="", help="QA file (JSONL/parquet) instead of the embedded world")
    p.add_argument("--corpus", default="", help="corpus JSONL for --data")
    p.add_argument("--compose", type=int, nargs="+", default=[], metavar="K",
                   help="with --data: MEM1-style K-objective questions joined from the file's, one table row per K")
    p.add_argument("--system-prompt", default="", help="text file with the system prompt (default: the checkpoint's)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (the reported eval); e.g. 1 with --max-turns 16: RL's own objective, sampled")
    p.add_argument("--stop-value", action="store_true",
                   help="at every round that searched: Q_stop (force the answer now) vs Q_go (search on), per K")
    p.add_argument("--decisions", default="", metavar="RUN",
                   help="RUN (e.g. the RL run of this SFT checkpoint) on this checkpoint's greedy episodes: does it "
                        "fix their first errors, does it change their right choices (embedded world, word tokenizer)")
    p.add_argument("--show", type=int, default=0, metavar="N",
                   help="print N held-out episodes (the first --objectives K) round by round instead of the table")
    p.add_argument("--viz", default="", metavar="FILE",
                   help="write the episodes (--show N, else --tasks) as one HTML page (viz.py) instead of the table")
    p.add_argument("--question", default="",
                   help="run the agent on this question against the corpus (--corpus, else the K-th test world)")
    args = p.parse_args(argv)
    if args.show < 0:
        p.error("--show N: N must be at least 0")
    if min(args.objectives) < 1:
        p.error(f"--objectives {' '.join(map(str, args.objectives))}: each objective count K must be at least 1")
    if not args.compare and not args.checkpoint:
        p.error("give --checkpoint or --compare")
    runs = [r for v in args.compare or [] for r in v.split("=", 1)[-1].split(",")] or [args.checkpoint]
    for run in runs:                 # a missing folder would reach the model hub as a model name
        if not os.path.isdir(run) and gguf_file(run) is None:
            p.error(f"checkpoint folder {run} does not exist")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = pick_device(args.device)
    a, b = (int(x) for x in args.hops.split("-"))
    if args.compare:
        variants = dict(v.split("=", 1) for v in args.compare)
        res = compare({k: v.split(",") for k, v in variants.items()}, args.objectives, args.tasks, args.split,
                      args.context, args.max_turns, (a, b), device)
        if args.plot:
            print("plots:", " ".join(plot_compare(res, args.plot)))
        print(json.dumps({"compare": {n: {str(k): v for k, v in r.items()} for n, r in res.items()},
                          "split": args.split, "context": args.context}))
        return
    model, tokenizer, prompt = load(args.checkpoint, device)
    torch.manual_seed(args.seed)                    # --temperature > 0: the same sampled episodes on a rerun
    if args.system_prompt:
        with open(args.system_prompt, encoding="utf-8") as f:
            prompt = f.read().strip()
    if args.show or args.viz or args.question:
        return show_episodes(model, tokenizer, prompt, args, (a, b))
    if args.stop_value:
        agent = greedy_agent(args.context, args.max_turns, args.max_new_tokens, prompt, args.temperature)
        out = {}
        for k in args.objectives:
            tasks, tool = embedded_tasks(k, args.tasks, args.seed, args.split, (a, b))
            trajs = run_episodes(model, tokenizer, tasks, tool, agent)
            out[str(k)] = stop_value(model, tokenizer, trajs, args.temperature, args.max_new_tokens, seed=args.seed)
            print_stop_value(out[str(k)], f"K={k}  T={args.temperature}  max_turns={args.max_turns}")
        print(json.dumps({"checkpoint": args.checkpoint, "temperature": args.temperature, "stop_value": out}))
        return
    if args.decisions:
        other, out = load(args.decisions, device)[0], {}
        agent = greedy_agent(args.context, args.max_turns, args.max_new_tokens, prompt)
        for k in args.objectives:
            tasks, tool = embedded_tasks(k, args.tasks, args.seed, args.split, (a, b))
            trajs = run_episodes(model, tokenizer, tasks, tool, agent)
            out[str(k)] = decisions(model, other, tokenizer, trajs, tasks)
            print_decisions(out[str(k)], f"K={k}: {args.decisions} on {args.checkpoint}'s greedy episodes")
        print(json.dumps({"checkpoint": args.checkpoint, "other": args.decisions, "decisions": out}))
        return
    if args.data:
        if not args.corpus:
            raise SystemExit("--data needs --corpus")
        tasks, tool = data.load_qa(args.data), SearchTool(data.load_corpus(args.corpus))
        sets = {k: data.compose_tasks(tasks, k, args.seed) for k in args.compose} or {"all": tasks}
        agent = greedy_agent(args.context, args.max_turns, args.max_new_tokens, prompt, args.temperature)
        bar = progress_bar(sum(len(t) for t in sets.values()))
        results = {k: evaluate(model, tokenizer, t, tool, agent, bar=bar) for k, t in sets.items()}
        bar.close()
    else:
        results = evaluate_embedded(model, tokenizer, args.objectives, args.tasks, args.seed, args.split,
                                    args.context, args.max_turns, (a, b), args.max_new_tokens, progress=True,
                                    system_prompt=prompt, temperature=args.temperature)
    print_table(results, f"{args.checkpoint}  context={args.context}  max_turns={args.max_turns}")
    out = {"checkpoint": args.checkpoint, "context": args.context, "max_turns": args.max_turns,
           "results": {str(k): v for k, v in results.items()}}
    if args.diagnostics and not args.data:
        mask_mode, threshold, think = run_reward_config(args.checkpoint)  # P_mem as the run's reward saw it
        think = args.probe_think or think
        out["diagnostics"] = {str(k): v for k, v in diagnose(model, tokenizer, args.objectives, args.tasks,
                                                             args.split, args.max_turns, (a, b), prompt,
                                                             mask_mode, threshold, think).items()}
        out["diagnostics_mem_mask"] = mask_mode
    print(json.dumps(out))


if __name__ == "__main__":
    try:
        main()
    except data.DataError as e:          # a bad data file: one line naming file and line, exit status 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
