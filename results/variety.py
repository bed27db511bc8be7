"""Does a start leave the memory advantage something to teach? What `<mem>` keeps across a question's sampled
rollouts, and whether the memory reward ranks a round that keeps above one that drops.

For a checkpoint (an SFT start, or a model an RL run kept every 20 steps), the questions of the RL steps
``--steps`` of seed ``--seed`` (the run's own data order, ``train.rl_tasks``), ``--group`` rollouts each at
``--temperature`` in ``--context``, sampled as the RL step samples them (``train.sample_rollouts``: from the SFT
start, steps 0-3 here are RL steps 0-3's own rollouts). Then:

* **what `<mem>` keeps**: a round *drops* when its `<mem>` misses an entity an earlier search found and the answer
  still needs, *keeps* when it holds all of them (``eval.retention_events``); a rollout drops when any of its
  rounds does. A question **varies** when one of its rollouts keeps and another drops: the only case where the
  memory advantage, which ranks a question's rounds against each other, has a better `<mem>` to rank up
  (``varies_rounds``: the question's pool holds a keeping and a dropping round, of one rollout or two).
  ``3+``: the same for entities found 3 or more rounds earlier, the ones only `<mem>` still holds in the snail
  shell. Retention by rounds-ago pools every round (``eval.memory_retention``).
* **what the memory reward says of it**: each round's P_mem, P_full and reward (``reward.memory_rewards``, as the
  RL step computes it) and A_M (``grpo.memory_advantage``, the paper's pool over the question's rounds); within
  each question whose pool holds both, the mean over its keeping rounds minus the mean over its dropping rounds
  (``keep_minus_drop_*``, averaged over those questions), and the spread (std) of P_mem over its rounds.
* **what the outcome says of it**: within each question that varies, the mean outcome score
  (``reward.outcome_reward``, what GRPO's A_T ranks) of its keeping rollouts minus its dropping ones
  (``keep_minus_drop_outcome``). Near 0, the outcome is blind to what `<mem>` drops and only A_M can teach keeping;
  well above 0, GRPO teaches it too.
* **where the outcome is silent**: the share of questions whose rollouts all score the same (``silent``: GRPO's A_T
  is 0 on every token of them) and all 0 (``silent_zero``), the mean outcome score, the share of scored rounds
  whose memory reward is not 0 (``mem_nonzero``: a probe past the log 0.5 cut), and among the silent questions
  the share whose memory rewards still differ (``silent_mem_ranks``: the memory advantage is the only teacher
  there) and A_M's keep - drop within them (``keep_minus_drop_adv_silent``). ``--rl-objectives K`` asks the
  step's questions at that K (the RL run's flag, ``train.rl_tasks``).
* **whether `<mem>` causes it** (``--restore N``): that gap is a correlation, and a rollout that drops may be worse
  in other ways. Two interventions, each played N times from the same point twice, as written and with each missing
  entity put back (the objective's entry filled through the hop the search found), in the full context:
  ``restore``: every rollout that answered while its `<mem>` missed a needed entity answers again, that entity put
  back in every `<mem>` that missed it, the answer round's included (does the answer read `<mem>`?);
  ``play_on``: every rollout that dropped one plays on from its first dropping round, that round's `<mem>` put
  back (what the drop costs the outcome by every path: the answer, and the searches after it).
  ``*_effect``: the mean outcome score restored minus as written, per question, averaged over questions (95%
  interval over questions). Near ``keep_minus_drop_outcome``: the outcome pays for what `<mem>` keeps, and GRPO
  teaches keeping; near 0: the outcome is blind to `<mem>`, and the gap comes from what co-varies with dropping.

    python results/variety.py --checkpoint R/sft_s0/sft --seed 0 --steps 0 1 2 3     # the precondition at step 0
    python results/variety.py --checkpoint R/mempo_s0/step_0020 --seed 0 --steps 10000 10001 10002 10003   # a curve
    python results/variety.py --checkpoint R/sft_s0/sft --seed 0 --temperature 1.0 --restore 4   # the intervention
    python results/variety.py --checkpoint R/sft_s0/sft --seed 0 --steps 0 1 2 --context snail --rl-objectives 7

Prints a table and one JSON line (``variety {...}``) that ``--json FILE`` also writes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import checkpoint  # noqa: E402
import data  # noqa: E402
import eval as evaluation  # noqa: E402
import train  # noqa: E402
from engine import generate, stop_strings  # noqa: E402
from grpo import memory_advantage  # noqa: E402
from memory import MEM_RE, Record, prepare_prompt, tool_record  # noqa: E402
from models import encode_chat, pick_device  # noqa: E402
from reward import memory_rewards, outcome_reward  # noqa: E402
from rollout import STOP_STRINGS, cut_at_stop, parse_action  # noqa: E402


def round_flags(traj, task, min_ago: int = 1) -> dict[int, int]:
    """Round t -> 1 if its `<mem>` holds every needed entity found ``min_ago`` or more rounds earlier, 0 if it
    misses one; rounds with no such entity are left out."""
    flags: dict[int, int] = {}
    for t, _, held, ago, _ in evaluation.retention_events(traj, task):
        if ago >= min_ago:
            flags[t] = min(flags.get(t, 1), held)
    return flags


def keep_minus_drop(values: dict, flags: dict) -> float | None:
    """Mean of ``values`` over the keeping rounds minus over the dropping ones; None without both."""
    keep = [values[r] for r, f in flags.items() if f == 1 and r in values]
    drop = [values[r] for r, f in flags.items() if f == 0 and r in values]
    return statistics.fmean(keep) - statistics.fmean(drop) if keep and drop else None


def variety(trajs: list, tasks: list, mem: dict, scores: list[float]) -> dict:
    """The figures above for one batch of rollouts (``trajs`` with ``group_id`` into ``tasks``), its memory
    rewards ``mem`` (``reward.memory_rewards``) and each rollout's outcome score ``scores``."""
    scored = mem["scored"]
    question = torch.tensor([trajs[i].group_id for i, _ in scored])
    adv = memory_advantage(torch.tensor(mem["reward"], dtype=torch.float64), question).tolist()
    by_round = {key: {"p_mem": pm, "reward": r, "adv": a}
                for key, pm, r, a in zip(scored, mem["p_mem"], mem["reward"], adv)}
    out: dict = {"questions": len(tasks), "rollouts": len(trajs)}
    for name, min_ago in (("", 1), ("_3plus", 3)):
        measured, varies, pooled, gaps, spread = 0, 0, 0, {"p_mem": [], "reward": [], "adv": []}, []
        outcome_gaps = []
        for q in range(len(tasks)):
            rollouts = [i for i, tr in enumerate(trajs) if tr.group_id == q]
            flags = {(i, t): f for i in rollouts for t, f in round_flags(trajs[i], tasks[q], min_ago).items()}
            per_rollout = {i: min(f for (j, _), f in flags.items() if j == i) for i in {j for j, _ in flags}}
            if not per_rollout:
                continue
            measured += 1
            if 0 in per_rollout.values() and 1 in per_rollout.values():
                varies += 1
                outcome_gaps.append(keep_minus_drop({i: scores[i] for i in per_rollout}, per_rollout))
            if 0 in flags.values() and 1 in flags.values():         # the pool holds a keeping and a dropping round
                pooled += 1
                for key in gaps:
                    gap = keep_minus_drop({r: v[key] for r, v in by_round.items()}, flags)
                    if gap is not None:
                        gaps[key].append(gap)
                p = [v["p_mem"] for (i, _), v in by_round.items() if trajs[i].group_id == q]
                spread.append(statistics.pstdev(p) if len(p) > 1 else 0.0)
        out[f"measured{name}"] = measured
        out[f"varies{name}"] = varies / measured if measured else float("nan")
        out[f"varies_rounds{name}"] = pooled / measured if measured else float("nan")
        for key, xs in gaps.items():
            out[f"keep_minus_drop_{key}{name}"] = statistics.fmean(xs) if xs else float("nan")
        out[f"p_mem_std{name}"] = statistics.fmean(spread) if spread else float("nan")
        out[f"keep_minus_drop_outcome{name}"] = statistics.fmean(outcome_gaps) if outcome_gaps else float("nan")
    rounds = [f for tr in trajs for f in round_flags(tr, tasks[tr.group_id]).values()]
    out["drop_rounds"] = rounds.count(0) / len(rounds) if rounds else float("nan")
    early = [e for e in map(data.early_answer, trajs) if e is not None]
    out["early"] = statistics.fmean(early) if early else float("nan")
    out["p_mem"] = statistics.fmean(mem["p_mem"]) if scored else float("nan")
    out["p_full"] = statistics.fmean(mem["p_full"]) if scored else float("nan")
    ret = evaluation.memory_retention(trajs, tasks)
    out["retention_3plus"] = ret["retention_3plus"]
    out["retention_by_ago"] = ret["retention_by_ago"]
    return out


def silence(trajs: list, tasks: list, mem: dict, scores: list[float]) -> dict:
    """Where GRPO has nothing: the questions whose rollouts' ``scores`` tie, and what the memory reward ``mem``
    (``reward.memory_rewards``) still says there (module docstring)."""
    adv = memory_advantage(torch.tensor(mem["reward"], dtype=torch.float64),
                           torch.tensor([trajs[i].group_id for i, _ in mem["scored"]])).tolist()
    rewards: dict[int, list] = {}
    for (i, t), r, a in zip(mem["scored"], mem["reward"], adv):
        rewards.setdefault(trajs[i].group_id, []).append(((i, t), r, a))
    silent, zero, ranks, gaps = 0, 0, 0, []
    for q in range(len(tasks)):
        mine = {scores[i] for i, tr in enumerate(trajs) if tr.group_id == q}
        if len(mine) != 1:
            continue
        silent += 1
        zero += mine == {0.0}
        pool = rewards.get(q, [])
        if len({r for _, r, _ in pool}) > 1:
            ranks += 1
            flags = {(i, t): f for i, tr in enumerate(trajs) if tr.group_id == q
                     for t, f in round_flags(tr, tasks[q]).items()}
            gap = keep_minus_drop({key: a for key, _, a in pool}, flags)
            if gap is not None:
                gaps.append(gap)
    n = len(tasks)
    return {"silent": silent / n, "silent_zero": zero / n, "score": statistics.fmean(scores),
            "mem_nonzero": sum(r != 0 for r in mem["reward"]) / len(mem["reward"]) if mem["reward"] else float("nan"),
            "silent_mem_ranks": ranks / silent if silent else float("nan"),
            "keep_minus_drop_adv_silent": statistics.fmean(gaps) if gaps else float("nan")}


def filled_path(obj, hop: int) -> list[str]:
    """An objective's ``<mem>`` entry as the expert writes it once its chain is found through ``hop``."""
    path = data.open_path([obj.start] + obj.relations)
    for h in range(hop + 1):
        path[2 * h + 2] = obj.chain[h][2]
    return path


def restore(traj, task) -> tuple[int, tuple[list, str], tuple[list, str]] | None:
    """A rollout whose answer round's `<mem>` misses a needed entity -> that round, its context (the records
    before it) and its `<mem>` body, as written and restored; None for any other rollout.

    Every round whose `<mem>` misses one is rewritten in both: its `<mem>` parsed and written back
    (``data.format_mem``), and in the restored one each missing objective's entry filled through the needed hop
    (``filled_path``). So the two differ in the missing entities alone."""
    if len(traj.rounds) < 2 or traj.rounds[-1].action != "answer":
        return None
    missing = missing_hops(traj, task)
    last = len(traj.rounds) - 1
    if last not in missing:
        return None
    gens = [i for i, r in enumerate(traj.records) if r.type == "llm_gen"]
    arms = []
    for restored in (False, True):
        records = list(traj.records[:gens[last]])
        for t, objectives in missing.items():
            body, rest = mem_body(traj.rounds[t].text, task, objectives if restored else {})
            if t < last:
                records[gens[t]] = Record("llm_gen", f"<mem> {body} </mem>" + rest)
            else:
                last_body = body
        arms.append((records, last_body))
    return last, arms[0], arms[1]


def first_drop(traj, task) -> tuple[int, tuple[list, str], tuple[list, str]] | None:
    """A rollout whose `<mem>` misses a needed entity -> the first such round, its context (the records before it)
    and its `<mem>` body, as written and restored (``restore``); None when no round misses one."""
    missing = missing_hops(traj, task)
    if not missing:
        return None
    t = min(missing)
    records = traj.records[:[i for i, r in enumerate(traj.records) if r.type == "llm_gen"][t]]
    return t, *((records, mem_body(traj.rounds[t].text, task, objectives)[0]) for objectives in ({}, missing[t]))


def missing_hops(traj, task) -> dict[int, dict[int, int]]:
    """Round -> objective -> the hop of the needed entity its `<mem>` misses (``eval.retention_events``)."""
    missing: dict[int, dict[int, int]] = {}
    for t, k, held, _, hop in evaluation.retention_events(traj, task):
        if not held:
            missing.setdefault(t, {})[k] = hop
    return missing


def mem_body(text: str, task, restore_hops: dict[int, int]) -> tuple[str, str]:
    """A round's `<mem>` body written back by ``data.format_mem``, each objective of ``restore_hops`` filled
    through its hop, and the round's text after the `<mem>`."""
    m = MEM_RE.match(text)
    entries = data.parse_mem(m.group(1) if m else "")
    entries |= {k: filled_path(task.objectives[k], hop) for k, hop in restore_hops.items()}
    return data.format_mem(entries), text[m.end() if m else 0:]


def play_on(model, tokenizer, cases: list, system_prompt: str, agent, n: int, generator: torch.Generator,
            batch: int = 32) -> list[list[float]]:
    """Each case ``(records, mem body, golds, rounds left, tool)`` played on ``n`` times in the full context: its
    next round starts with the forced ``<mem> body </mem>``, every later one with ``<mem>``, as the agent loop
    (``rollout.rollout``) plays them, to an answer or the last round -> the outcome score of each (0 unanswered)."""
    forced_mem = tokenizer.encode("<mem>", add_special_tokens=False)
    stops = stop_strings(tokenizer, STOP_STRINGS)
    runs = [SimpleNamespace(records=list(records), forced=tokenizer.encode(f"<mem> {body} </mem>",
                                                                           add_special_tokens=False),
                            golds=golds, left=left, tool=tool, answer=None, done=False)
            for records, body, golds, left, tool in cases for _ in range(n)]
    while live := [r for r in runs if not r.done]:
        for i in range(0, len(live), batch):
            part = live[i:i + batch]
            contexts = [encode_chat(tokenizer, prepare_prompt(r.records, system_prompt, None)) for r in part]
            outs = generate(model, [c + r.forced for c, r in zip(contexts, part)], agent.max_new_tokens,
                            pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                            stops=stops, temperature=agent.temperature,
                            top_p=agent.top_p, generator=generator)
            for r, out in zip(part, outs):
                text = cut_at_stop(tokenizer.decode(r.forced + out))
                kind, body = parse_action(text)
                r.records.append(Record("llm_gen", text))
                r.forced, r.left = forced_mem, r.left - 1
                if kind == "search":
                    r.records.append(tool_record("search_results", r.tool.search(body), agent.webpage_chars))
                elif kind == "access":
                    r.records.append(tool_record("webpage", r.tool.access(body), agent.webpage_chars))
                else:
                    r.answer = body if kind == "answer" else None
                r.done = kind not in ("search", "access") or r.left == 0
    scores = [outcome_reward(SimpleNamespace(rounds=[x for x in r.records if x.type == "llm_gen"], answer=r.answer,
                                             golds=r.golds))["score"] for r in runs]
    return [scores[j:j + n] for j in range(0, len(scores), n)]


def restore_effect(pairs: list[tuple[int, list[float], list[float]]], name: str = "restore") -> dict:
    """``(question, scores as written, scores restored)`` per rollout -> the figures of ``--restore``."""
    by_question: dict[int, list[float]] = {}
    for q, control, restored in pairs:
        by_question.setdefault(q, []).append(statistics.fmean(restored) - statistics.fmean(control))
    effects = [statistics.fmean(v) for v in by_question.values()]
    mean, ci = evaluation.mean_ci(effects) if effects else (float("nan"), float("nan"))
    return {f"{name}_rollouts": len(pairs), f"{name}_questions": len(effects),
            f"{name}_control": statistics.fmean(statistics.fmean(c) for _, c, _ in pairs) if pairs else float("nan"),
            f"{name}_restored": statistics.fmean(statistics.fmean(r) for _, _, r in pairs) if pairs else float("nan"),
            f"{name}_effect": mean, f"{name}_effect_ci": ci}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a model folder (RUN/sft/, RUN/step_0020, RUN/final)")
    p.add_argument("--seed", type=int, default=0, help="the RL run's seed: its data order and sampling")
    p.add_argument("--steps", type=int, nargs="+", default=[0, 1, 2, 3], help="whose RL steps' questions")
    p.add_argument("--context", default="full", choices=("snail", "full"), help="the rollouts' context")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--questions", type=int, default=16, help="questions a step")
    p.add_argument("--group", type=int, default=8, help="rollouts a question")
    p.add_argument("--rl-objectives", default="1-4", help="objective counts K of the steps' questions (train.py's)")
    p.add_argument("--threshold", type=float, default=train.Config.threshold,
                   help="the memory reward's confidence cut (train.py's --threshold; 0: no cut)")
    p.add_argument("--restore", type=int, default=0, help="answer rounds re-sampled per arm (0: no intervention)")
    p.add_argument("--json", default="", help="also write the JSON line here")
    a = p.parse_args(argv)
    device = pick_device("auto")
    model, tokenizer, prompt = evaluation.load(a.checkpoint, device)
    think = checkpoint.trained_probe_think(evaluation.checkpoint_dir(a.checkpoint))
    cfg = train.Config(seed=a.seed, train_context=a.context, temperature=a.temperature, questions=a.questions,
                       group=a.group, probe_think=think, rl_objectives=a.rl_objectives, threshold=a.threshold)
    agent = train.agent_config(cfg, prompt)
    trajs, tasks, tools, t0 = [], [], [], time.time()
    for step in a.steps:
        step_tasks, tool = train.rl_tasks(cfg, step)
        batch = train.sample_rollouts(model, tokenizer, step_tasks, 0, cfg, step, tool, agent)   # q0 as one process
        for tr in batch:
            tr.group_id += len(tasks)
        trajs += batch
        tasks += step_tasks
        tools += [tool] * len(step_tasks)
    with torch.no_grad():
        mem = memory_rewards(model, tokenizer, trajs, threshold=cfg.threshold, mask_mode=cfg.mem_mask,
                             think=cfg.probe_think)
    scores = [outcome_reward(t)["score"] for t in trajs]
    out = {"checkpoint": a.checkpoint, "seed": a.seed, "steps": a.steps, "context": a.context,
           "temperature": a.temperature, "rl_objectives": a.rl_objectives, "threshold": a.threshold} \
        | variety(trajs, tasks, mem, scores) | silence(trajs, tasks, mem, scores)
    keys: list[str] = []
    if a.restore:
        gen = torch.Generator(device=model.device).manual_seed(a.seed)
        for name, pick in (("restore", restore), ("play_on", first_drop)):
            found = [(tr.group_id, cut) for tr in trajs if (cut := pick(tr, tasks[tr.group_id])) is not None]
            played = []                                      # per arm: as written, restored
            for arm in (1, 2):
                cases = [(cut[arm][0], cut[arm][1], tasks[q].golds,
                          1 if name == "restore" else agent.max_turns - cut[0], tools[q]) for q, cut in found]
                played.append(play_on(model, tokenizer, cases, prompt, agent, a.restore, gen) if cases else [])
            out |= restore_effect([(q, c, r) for (q, _), c, r in zip(found, *played)], name)
            keys += [f"{name}_{k}" for k in ("rollouts", "questions", "control", "restored", "effect", "effect_ci")]
    out["sec"] = round(time.time() - t0, 1)
    for key in ("questions", "rollouts", "measured", "varies", "varies_3plus", "varies_rounds",
                "varies_rounds_3plus", "drop_rounds", "early", "p_mem", "p_full", "p_mem_std",
                "keep_minus_drop_p_mem", "keep_minus_drop_reward", "keep_minus_drop_adv", "keep_minus_drop_adv_3plus",
                "keep_minus_drop_outcome", "keep_minus_drop_outcome_3plus", "retention_3plus", "silent", "silent_zero",
                "score", "mem_nonzero", "silent_mem_ranks", "keep_minus_drop_adv_silent", *keys):
        v = out[key]
        print(f"{key:28s} {v:.3f}" if isinstance(v, float) else f"{key:28s} {v}")
    print("retention by rounds ago      " + "  ".join(f"{k}: {v:.3f}" for k, v in out["retention_by_ago"].items()))
    line = json.dumps(out)
    print("variety " + line)
    if a.json:
        with open(a.json, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
