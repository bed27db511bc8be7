"""Tests for variants.py: the nonzero pool of the memory advantage and the pool weights metrics.py logs,
hand-computed; with no zero reward the nonzero pool is the paper's (grpo.memory_advantage)."""
import random

import pytest
import torch

from grpo import memory_advantage
from variants import memory_pool_weights, nonzero_memory_advantage


def _close(a, b, tol=1e-4):
    assert len(a) == len(b) and all(abs(u - v) < tol for u, v in zip(a, b)), (a, b)


def nonzero(rewards, questions):
    return nonzero_memory_advantage(torch.tensor(rewards, dtype=torch.float64), torch.tensor(questions)).tolist()


def test_without_a_zero_reward_the_nonzero_pool_is_the_papers():
    rng = random.Random(0)
    rewards = [rng.uniform(-1, 1) for _ in range(40)]
    questions = [rng.randrange(5) for _ in rewards]
    paper = memory_advantage(torch.tensor(rewards, dtype=torch.float64), torch.tensor(questions)).tolist()
    assert nonzero(rewards, questions) == pytest.approx(paper, abs=1e-12)


def test_the_nonzero_pool_leaves_zero_rewards_out_with_advantage_0():
    # question 0's pool {0.2, 0.4, 0.6}: mean 0.4, std 0.2; its two zeros get 0 and move nobody's mean or std
    _close(nonzero([0.2, 0.0, 0.4, 0.0, 0.6], [0] * 5), [-1.0, 0.0, 0.0, 0.0, 1.0])
    # a pool left with one reward, or none, gets 0; the paper's pool would rank the zeros
    _close(nonzero([0.0, 0.0, 0.3], [0, 0, 0]), [0.0, 0.0, 0.0])
    paper = memory_advantage(torch.tensor([0.0, 0.0, 0.3], dtype=torch.float64), torch.tensor([0, 0, 0])).tolist()
    assert paper[2] > 0 > paper[0]
    # questions pool apart: question 1's {1.0, 3.0}: mean 2, std sqrt(2)
    _close(nonzero([0.2, 1.0, 0.4, 3.0], [0, 1, 0, 1]), [-0.7071, -0.7071, 0.7071, 0.7071])


def test_pool_weights_are_each_pools_std_and_advantage_mass():
    rewards, questions = [0.2, 0.4, 0.0, 0.5, 0.501, 0.499, 7.0], [0, 0, 0, 1, 1, 1, 2]
    adv = memory_advantage(torch.tensor(rewards, dtype=torch.float64), torch.tensor(questions)).tolist()
    # pools of >= 2 rewards: question 0 (std 0.2, |A| 0 + 1 + 1), question 1 (std 0.001, also 2); question 2 is alone
    (s0, w0), (s1, w1) = memory_pool_weights(rewards, adv, questions)
    assert (s0, w0, s1, w1) == pytest.approx((0.2, 2.0, 0.001, 2.0), rel=1e-3)   # the eps: 2 * 0.001 / 0.001001
    # nonzero, fed the nonzero pool's own advantages: question 0's pool is {0.2, 0.4} without its zero (A = -+0.7071,
    # mass 1.4142), question 1's as before
    adv_nz = nonzero(rewards, questions)
    (s0, w0), (s1, w1) = memory_pool_weights(rewards, adv_nz, questions, "nonzero")
    assert (s0, w0, s1, w1) == pytest.approx((0.1 * 2 ** 0.5, 2 ** 0.5, 0.001, 2.0), rel=1e-3)
    assert memory_pool_weights([0.5], [0.0], [0]) == []
