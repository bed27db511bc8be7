"""What each RL step logs beside the loss (train.py's ``rl_step`` writes it to ``metrics.jsonl``).

Outcome, format and length; the groups whose outcome ties (GRPO learns nothing from them) and, among them, those
the memory reward still ranks (``zero_var_frac``, ``zero_var_mem_frac``, per objective count K); the memory
reward's parts (``p_mem``, ``p_full``, the masks, the rounds with no signal); and where the memory advantage's
magnitude goes: the share of sum |A_M| from pools whose rewards differ by less than 0.01 / 0.05 (each pool is
divided by its std, so a pool of near-equal rewards still gets unit-variance advantages), what the rounds
with nothing to keep receive, and the mean A_M on rounds that search, answer, or answer early (before the last
hop). A file of its own so the RL step reads without it.

``rl_metrics`` is what the step calls: ``metric_values`` collects one rank's values, ``dist.gather_metrics`` joins the
ranks', ``step_metrics`` reduces.
"""
from __future__ import annotations

import torch

import data
import dist
from variants import memory_pool_weights


def rl_metrics(trajs, outs: list[dict], mem: dict | None, adv_m: dict, search_failures: int,
               mem_adv_norm: str = "std") -> dict:
    """One RL step's metrics over every rank's trajectories: this rank's ``metric_values``, gathered (dist.py),
    then ``step_metrics``."""
    v = metric_values(trajs, outs, mem, [t.group_id for t in trajs], adv_m, mem_adv_norm)
    v["search_failures"] = [search_failures]
    return step_metrics(dist.gather_metrics(v))


def metric_values(trajs, outs: list[dict], mem: dict | None, group_ids: list[int], adv_m: dict | None,
                  mem_adv_norm: str = "std") -> dict[str, list]:
    """This rank's per-trajectory (and per-round) values behind the step's metrics (``step_metrics``); ``adv_m``:
    A_M by (trajectory, round); ``mem_adv_norm``: how the memory advantage pooled its rewards (variants.py)."""
    ks = [len(t.golds) for t in trajs]
    v = {"outs": outs, "turns": [len(t.rounds) for t in trajs],
         "tokens": [sum(r.n_tokens for t in trajs for r in t.rounds)],
         "early": [e for e in (data.early_answer(t) for t in trajs) if e is not None],
         "k": ks, "groups": group_stats(outs, mem, group_ids, ks)}
    if mem is not None:
        # a group never spans ranks, so each rank's memory pools are whole: its per-pool stds are final
        v |= {"mem": mem["reward"], "p_mem": mem["p_mem"], "p_full": mem["p_full"],
              "mask_mem": mem["mask_mem"], "mask_full": mem["mask_full"], "empty": [mem["empty_frac"] * mem["n"]],
              "no_signal": [mem["no_signal_frac"] * mem["n"]]}
        # each pool's (std, sum |A_M|): the stds the advantages are divided by, and where their magnitude goes
        flat_adv = [adv_m[k] for k in mem["scored"]]
        pool_w = memory_pool_weights(mem["reward"], flat_adv, [group_ids[i] for i, _ in mem["scored"]], mem_adv_norm)
        no_signal = [a == 0 and b == 0 for a, b in zip(mem["mask_mem"], mem["mask_full"])]
        # the round each A_M lands on: an answer given early (before the question's last hop), another answer, a search
        kind = ["early" if trajs[i].rounds[t].action == "answer" and data.early_answer(trajs[i])
                else "answer" if trajs[i].rounds[t].action == "answer" else "search" for i, t in mem["scored"]]
        v |= {"pool_std": [s for s, _ in pool_w], "pool_w": pool_w, "adv_ns": list(zip(no_signal, flat_adv)),
              "adv_kind": list(zip(kind, flat_adv))}
    return v


def group_stats(outs: list[dict], mem: dict | None, group_ids: list[int],
                ks: list[int]) -> list[tuple[bool, bool, int]]:
    """Per group: (every rollout scored the same, its memory rewards still differ, its objective count K).

    A group of equal scores gets outcome advantage 0 on every token (GRPO learns nothing from it); its
    memory rewards, where they differ, are the only signal MemPO has there."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    rewards: dict[int, set] = {}                         # group -> the memory rewards of its rounds
    for (i, _), x in zip(mem["scored"], mem["reward"]) if mem is not None else ():
        rewards.setdefault(group_ids[i], set()).add(x)
    return [(len({outs[i]["score"] for i in idx}) == 1, len(rewards.get(g, ())) > 1, ks[idx[0]])
            for g, idx in members.items()]


def step_metrics(v: dict[str, list]) -> dict:
    """The step's metrics from ``metric_values`` (every rank's, concatenated): outcome, format, length, memory."""
    outs, mean = v["outs"], lambda xs: sum(xs) / len(xs) if xs else 0.0
    scores = torch.tensor([o["score"] for o in outs])
    m = dict(score=scores.mean().item(), score_std=scores.std().item() if len(scores) > 1 else 0.0,
             em=sum(o["em"] for o in outs) / len(outs), f1=sum(o["f1"] for o in outs) / len(outs),
             valid=sum(o["valid"] for o in outs) / len(outs), turns=sum(v["turns"]) / len(v["turns"]),
             tokens=sum(v["tokens"]), search_failures=sum(v["search_failures"]))
    groups = v["groups"]
    m["zero_var_frac"] = sum(z for z, _, _ in groups) / len(groups)
    m["zero_var_mem_frac"] = sum(z and d for z, d, _ in groups) / len(groups)   # where only the memory reward ranks
    for k in sorted(set(v["k"])):                                              # score per objective count K
        m[f"score_k{k}"] = mean([o["score"] for o, kk in zip(outs, v["k"]) if kk == k])
        m[f"zero_var_k{k}"] = mean([z for z, _, kk in groups if kk == k])
        m[f"zero_var_mem_k{k}"] = mean([z and d for z, d, kk in groups if kk == k])
    if v["early"]:                      # embedded world: answered after fewer searches than the question's hops
        m["early_frac"] = sum(v["early"]) / len(v["early"])
    if "mem" in v:
        flat, n_empty, n_none = v["mem"], sum(v["empty"]), sum(v["no_signal"])
        # pool_std: the mean over the advantage's pools (one per question; without its zero rewards at nonzero)
        m.update(mem_reward=mean(flat), p_mem=mean(v["p_mem"]), p_full=mean(v["p_full"]),
                 mask_mem=mean(v["mask_mem"]), mask_full=mean(v["mask_full"]),
                 empty_frac=n_empty / len(flat) if flat else 0.0, no_signal_frac=n_none / len(flat) if flat else 0.0,
                 mem_rounds=len(flat), pool_std=mean(v["pool_std"]))
    if "pool_w" in v:                   # where the memory advantage's magnitude goes
        stds, total = sorted(s for s, _ in v["pool_w"]) or [0.0], sum(w for _, w in v["pool_w"]) or 1.0
        m["pool_std_p10"], m["pool_std_p50"] = stds[len(stds) // 10], stds[len(stds) // 2]
        for thr, name in ((0.01, "01"), (0.05, "05")):      # share of sum |A_M| from pools of spread below thr
            m[f"mem_adv_share_std{name}"] = sum(w for s, w in v["pool_w"] if s < thr) / total
        ns, every = [a for none, a in v["adv_ns"] if none], [abs(a) for _, a in v["adv_ns"]]
        m["mem_adv_abs"] = mean(every)
        m["mem_adv_no_signal"] = mean(ns)                   # > 0: rounds with nothing to keep are pushed up
        m["mem_adv_no_signal_share"] = sum(abs(a) for a in ns) / (sum(every) or 1.0)
        for kind in ("search", "answer", "early"):          # mean A_M on the <mem> of rounds that end so
            m[f"mem_adv_{kind}"] = mean([a for k, a in v["adv_kind"] if k == kind])
    return m
