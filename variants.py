"""Variants of MemPO's advantages that the paper does not have, kept beside its path so that path reads alone.

* The memory advantage's pool (``--mem-adv-norm``, ``--mem-std-floor``). The paper's, ``std``, is every round of
  every trajectory of a question (``grpo.memory_advantage``). Here: ``none`` subtracts the pool mean only;
  ``round`` pools per question AND round index (round-1 memories compete only with round-1 memories);
  ``nonzero`` leaves zero rewards (usually both probes silent: no signal) out of the pool, with advantage 0;
  ``std_floor`` > 0 divides by max(std, floor), so a pool whose rewards differ by a hair gets advantages of that
  hair's size, not unit variance.
* Which rounds get a memory advantage (``--mem-adv-on``). The paper's, ``all``: every scored round. ``right``: only
  the rounds of trajectories whose outcome is right (all K objectives), pooled among themselves; a memory before
  a wrong answer (an early one, a slot filled from a dropped entry) is neither paid nor pushed down.
* The outcome score the advantage ranks (``--outcome``). The paper's, ``share``, is objectives right / K. Here:
  ``all`` is 1 only when all K are right; ``searched`` is the share, but 0 for an answer given after fewer searches
  than the question has hops (the embedded world's questions; elsewhere the share).

Each was measured against the paper's and none is the default (results/STUDIES.md); metrics.py reads the pools to
log where the memory advantage's magnitude goes.
"""
from __future__ import annotations

import data

NORMS = ("std", "none", "round", "nonzero")


def _unbiased_std(values: list[float]) -> float:
    """The unbiased std of >= 2 floats (torch.std's, as grpo.grouped_advantage uses)."""
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5


def memory_pools(rewards: list[float], question_ids: list[int], round_ids: list[int], norm: str,
                 keep: list[bool] | None = None) -> list[list[int]]:
    """Who competes with whom under ``norm``: the pools, as lists of positions in ``rewards`` (one per scored
    round; ``round_ids`` is each one's round index t). A round whose ``keep`` is False is in no pool."""
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}")
    pools: dict[tuple, list[int]] = {}
    for j, (r, q, t) in enumerate(zip(rewards, question_ids, round_ids)):
        if norm == "nonzero" and r == 0 or keep is not None and not keep[j]:
            continue
        pools.setdefault((q, t) if norm == "round" else (q,), []).append(j)
    return list(pools.values())


def pooled_memory_advantage(rewards: list[float], question_ids: list[int], round_ids: list[int], norm: str = "std",
                            std_floor: float = 0.0, keep: list[bool] | None = None, eps: float = 1e-6) -> list[float]:
    """A_M of each scored round under the pool ``norm`` and ``std_floor`` (module docstring); a pool of one gets 0,
    and so does a round ``keep`` leaves out (``--mem-adv-on right``: keep the rounds of right trajectories).
    ``norm="std"`` with no floor or keep is the paper's pool (``grpo.memory_advantage``)."""
    out = [0.0] * len(rewards)
    for members in memory_pools(rewards, question_ids, round_ids, norm, keep):
        pool = [rewards[j] for j in members]
        mean = sum(pool) / len(pool)
        if norm == "none":
            normed = [v - mean for v in pool]
        elif len(pool) == 1:
            normed = [0.0]
        else:
            std = max(_unbiased_std(pool), std_floor)
            normed = [(v - mean) / (std + eps) for v in pool]
        for j, a in zip(members, normed):
            out[j] = a
    return out


def memory_pool_weights(rewards: list[float], mem_adv: list[float], question_ids: list[int], round_ids: list[int],
                        norm: str = "std") -> list[tuple[float, float]]:
    """(unbiased reward std, sum of |A_M|) of each pool of >= 2 rewards: how much of the memory advantage's
    magnitude a pool of a given spread carries (a pool whose rewards differ by 1e-3 still gets unit variance)."""
    return [(_unbiased_std([rewards[j] for j in members]), sum(abs(mem_adv[j]) for j in members))
            for members in memory_pools(rewards, question_ids, round_ids, norm) if len(members) > 1]


def outcome_scores(outs: list[dict], trajs: list, rule: str = "share") -> list[float]:
    """The score each trajectory's outcome advantage ranks under ``rule`` (module docstring); ``outs`` are
    ``reward.outcome_reward``'s."""
    if rule == "all":
        return [o["em"] for o in outs]
    if rule == "searched":
        return [0.0 if data.early_answer(t) == 1.0 else o["score"] for o, t in zip(outs, trajs)]
    return [o["score"] for o in outs]
