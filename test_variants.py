"""Tests for variants.py: the memory advantage's other pools and the outcome rules, hand-computed; the paper's
pool through them equals grpo.memory_advantage."""
import math
import random

import pytest
import torch

from grpo import memory_advantage
from rollout import Round, Trajectory
from variants import memory_pool_weights, outcome_scores, pooled_memory_advantage


def _close(a, b, tol=1e-4):
    assert len(a) == len(b) and all(abs(u - v) < tol for u, v in zip(a, b)), (a, b)


def test_std_pool_is_the_papers_memory_advantage():
    rng = random.Random(0)
    rewards = [rng.uniform(-1, 1) for _ in range(40)]
    questions = [rng.randrange(5) for _ in rewards]
    rounds = [rng.randrange(1, 6) for _ in rewards]
    paper = memory_advantage(torch.tensor(rewards, dtype=torch.float64), torch.tensor(questions)).tolist()
    assert pooled_memory_advantage(rewards, questions, rounds, "std") == pytest.approx(paper, abs=1e-12)


def test_norm_none_subtracts_the_pool_mean_only():
    _close(pooled_memory_advantage([0.2, 0.4, 0.0, 9.0], [0, 0, 0, 1], [1, 2, 1, 1], norm="none"),
           [0.0, 0.2, -0.2, 0.0])


def test_norm_round_pools_by_question_and_round_index():
    # question 0: round-1 pool {0.2, 0.0, 0.6}: mean 0.2667, std 0.3055; round-2 pool {0.4, 0.8}: mean 0.6, std 0.2828
    out = pooled_memory_advantage([0.2, 0.4, 0.0, 0.6, 0.8], [0, 0, 0, 0, 0], [1, 2, 1, 1, 2], norm="round")
    m0, s0 = 0.8 / 3, math.sqrt(((0.2 - 0.8 / 3) ** 2 + (0.8 / 3) ** 2 + (0.6 - 0.8 / 3) ** 2) / 2)
    s1 = math.sqrt(0.08)
    _close(out, [(0.2 - m0) / s0, -0.2 / s1, (0.0 - m0) / s0, (0.6 - m0) / s0, 0.2 / s1])
    # a round alone in its pool gets 0, whatever its reward
    assert pooled_memory_advantage([0.1, 0.5, 0.3], [0, 0, 0], [1, 2, 1], norm="round")[1] == 0.0


def test_norm_nonzero_leaves_zero_rewards_out_with_advantage_0():
    # pool {0.2, 0.4, 0.6}: mean 0.4, std 0.2
    _close(pooled_memory_advantage([0.2, 0.0, 0.4, 0.0, 0.6], [0] * 5, [1, 2, 3, 1, 2], norm="nonzero"),
           [-1.0, 0.0, 0.0, 0.0, 1.0])
    _close(pooled_memory_advantage([0.0, 0.0, 0.3], [0, 0, 0], [1, 1, 2], norm="nonzero"), [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="unknown norm"):
        pooled_memory_advantage([0.1], [0], [1], norm="rounds")


def test_keep_pools_only_the_kept_rounds_and_gives_the_others_0():
    # --mem-adv-on right keeps the rounds of right trajectories. Question 0's kept rounds {0.2, 0.4, 0.0}: mean 0.2,
    # std 0.2; its left-out round (0.9) is neither in the pool nor paid; question 1's one kept round is a pool of
    # one (0), its left-out one 0
    rewards, questions, rounds = [0.2, 0.4, 0.9, 0.0, 0.6, -0.5], [0, 0, 0, 0, 1, 1], [1, 2, 1, 3, 1, 2]
    right = [True, True, False, True, True, False]
    _close(pooled_memory_advantage(rewards, questions, rounds, keep=right), [0.0, 1.0, 0.0, -1.0, 0.0, 0.0])
    # with every round kept it is the pool without keep; with none, all 0
    assert pooled_memory_advantage(rewards, questions, rounds, "nonzero", keep=[True] * 6) == \
        pooled_memory_advantage(rewards, questions, rounds, "nonzero")
    assert pooled_memory_advantage(rewards, questions, rounds, keep=[False] * 6) == [0.0] * 6


def test_std_floor_bounds_a_pool_of_tiny_spread():
    # {0.2, 0.4, 0.0}: mean 0.2, std 0.2; a floor below the std changes nothing, above it scales down
    _close(pooled_memory_advantage([0.2, 0.4, 0.0], [0, 0, 0], [1, 2, 1], std_floor=0.1), [0.0, 1.0, -1.0])
    _close(pooled_memory_advantage([0.2, 0.4, 0.0], [0, 0, 0], [1, 2, 1], std_floor=0.5), [0.0, 0.4, -0.4])
    # {0.5, 0.501, 0.499}: std 0.001 -> unit variance under the paper's pool, a hundredth under a floor of 0.1
    a = 0.001 / (0.001 + 1e-6)       # the eps in the denominator
    _close(pooled_memory_advantage([0.5, 0.501, 0.499], [0, 0, 0], [1, 2, 1]), [0.0, a, -a])
    _close(pooled_memory_advantage([0.5, 0.501, 0.499], [0, 0, 0], [1, 2, 1], std_floor=0.1), [0.0, 0.01, -0.01])


def test_pool_weights_are_each_pools_std_and_advantage_mass():
    rewards, questions, rounds = [0.2, 0.4, 0.0, 0.5, 0.501, 0.499, 7.0], [0, 0, 0, 1, 1, 1, 2], [1, 2, 1, 1, 2, 1, 1]
    adv = pooled_memory_advantage(rewards, questions, rounds)
    # pools of >= 2 rewards: question 0 (std 0.2, |A| 0 + 1 + 1), question 1 (std 0.001, also 2); question 2 is alone
    (s0, w0), (s1, w1) = memory_pool_weights(rewards, adv, questions, rounds)
    assert (s0, w0, s1, w1) == pytest.approx((0.2, 2.0, 0.001, 2.0), rel=1e-3)   # the eps: 2 * 0.001 / 0.001001
    # round pools with >= 2 rewards: question 0 round 1 {0.2, 0.0}, question 1 round 1 {0.5, 0.499}
    assert [s for s, _ in memory_pool_weights(rewards, adv, questions, rounds, "round")] == \
        pytest.approx([math.sqrt(0.02), math.sqrt(0.0000005)])
    assert memory_pool_weights([0.5], [0.0], [0], [1]) == []


def test_outcome_rules_share_all_and_searched():
    """share: the objectives right / K; all: 1 only when all are; searched: the share, but 0 for an answer given
    after fewer searches than the question's hops (here 2)."""
    def traj(actions):
        return Trajectory("1 : fuzi boss _ rival _ ?", [["a"]], 0, [1], [],
                          [Round([1], [], [5], "", 0, a) for a in actions])
    trajs = [traj(["search", "search", "answer"]), traj(["search", "answer"]), traj(["search", "search", "answer"])]
    outs = [{"score": 1.0, "em": 1.0}, {"score": 0.5, "em": 0.0}, {"score": 0.5, "em": 0.0}]
    assert outcome_scores(outs, trajs) == [1.0, 0.5, 0.5]
    assert outcome_scores(outs, trajs, "all") == [1.0, 0.0, 0.0]
    assert outcome_scores(outs, trajs, "searched") == [1.0, 0.0, 0.5]
