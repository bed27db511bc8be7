"""The one variant of MemPO's memory advantage kept beside the paper's path: the ``nonzero`` pool.

The paper's pool (``grpo.memory_advantage``) normalises every scored round of every trajectory of a question
together. ``--mem-adv-norm nonzero`` leaves out the rounds whose memory reward is 0 (in practice both probes silent:
no signal) with A_M 0, and normalises the rest of the question's rounds among themselves. Where most rounds carry
no signal, the paper's pool ranks every silent round below every round with a signal; here they are neither paid
nor pushed down. Measured against the paper's pool in results/STUDIES.md; not the default.

``memory_pool_weights`` reads the pools for metrics.py: where the memory advantage's magnitude goes.
"""
from __future__ import annotations

import torch


def _unbiased_std(values: list[float]) -> float:
    """The unbiased std of >= 2 floats (torch.std's, as grpo.grouped_advantage uses)."""
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5


def memory_pools(rewards: list[float], question_ids: list[int], norm: str = "std") -> list[list[int]]:
    """Who competes with whom: the pools, as lists of positions in ``rewards`` (one per scored round), one pool per
    question; under ``nonzero`` a zero reward is in no pool."""
    pools: dict[int, list[int]] = {}
    for j, (r, q) in enumerate(zip(rewards, question_ids)):
        if not (norm == "nonzero" and r == 0):
            pools.setdefault(q, []).append(j)
    return list(pools.values())


def nonzero_memory_advantage(mem_reward: torch.Tensor, question_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A_M of each scored round, its question's nonzero rewards normalised among themselves (unbiased std, as the
    paper's pool); a zero reward, or a pool of one, gets 0. mem_reward, question_ids (M,) -> (M,) float64."""
    rewards = mem_reward.tolist()
    out = [0.0] * len(rewards)
    for members in memory_pools(rewards, question_ids.tolist(), "nonzero"):
        if len(members) > 1:
            pool = [rewards[j] for j in members]
            mean, std = sum(pool) / len(pool), _unbiased_std(pool)
            for j, v in zip(members, pool):
                out[j] = (v - mean) / (std + eps)
    return torch.tensor(out, dtype=torch.float64)


def memory_pool_weights(rewards: list[float], mem_adv: list[float], question_ids: list[int],
                        norm: str = "std") -> list[tuple[float, float]]:
    """(unbiased reward std, sum of |A_M|) of each pool of >= 2 rewards: how much of the memory advantage's
    magnitude a pool of a given spread carries (a pool whose rewards differ by 1e-3 still gets unit variance)."""
    return [(_unbiased_std([rewards[j] for j in members]), sum(abs(mem_adv[j]) for j in members))
            for members in memory_pools(rewards, question_ids, norm) if len(members) > 1]
