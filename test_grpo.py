"""Tests for grpo.py: hand-computed advantages, loss parity with a naive loop, tiny Qwen2 logprobs."""
import math

import pytest
import torch

from grpo import filter_groups, grouped_advantage, memory_advantage, policy_loss, token_advantages, token_logprobs


# ---------------------------------------------------------------- outcome advantage
def test_seed_group_example():
    adv = grouped_advantage(torch.tensor([1.0, 0, 1, 1, 0]), torch.zeros(5, dtype=torch.long))
    # mean 0.6, unbiased std sqrt(0.3) = 0.5477
    expected = torch.tensor([0.7303, -1.0954, 0.7303, 0.7303, -1.0954])
    assert torch.allclose(adv, expected, atol=1e-3)


def test_interleaved_groups_match_separate_calls():
    a, b, c = [1.0, 0, 1, 1, 0], [0.3, 0.9, 0.1], [2.0, 2.0]
    scores = torch.tensor([a[0], b[0], c[0], a[1], b[1], a[2], c[1], a[3], b[2], a[4]])
    gids = torch.tensor([7, 3, 11, 7, 3, 7, 11, 7, 3, 7])
    adv = grouped_advantage(scores, gids)
    for vals, g in ((a, 7), (b, 3), (c, 11)):
        alone = grouped_advantage(torch.tensor(vals), torch.zeros(len(vals), dtype=torch.long))
        assert torch.allclose(adv[gids == g], alone, atol=1e-6)


def test_singleton_and_constant_groups_are_zero():
    adv = grouped_advantage(torch.tensor([0.7, 1.0, 1.0, 1.0]), torch.tensor([0, 1, 1, 1]))
    assert torch.equal(adv, torch.zeros(4))
    assert torch.equal(grouped_advantage(torch.tensor([3]), torch.tensor([5])), torch.zeros(1))


def test_dr_grpo_is_score_minus_mean():
    adv = grouped_advantage(torch.tensor([1.0, 0, 1, 1, 0, 5.0]), torch.tensor([0, 0, 0, 0, 0, 1]),
                            norm_by_std=False)
    assert torch.allclose(adv, torch.tensor([0.4, -0.6, 0.4, 0.4, -0.6, 0.0]), atol=1e-6)


def test_filter_groups():
    keep = filter_groups(torch.tensor([1.0, 1, 0, 1, 0.5, 0.5, 2.0]), torch.tensor([0, 0, 1, 1, 2, 2, 3]))
    assert keep.tolist() == [False, False, True, True, False, False, False]


# ---------------------------------------------------------------- memory advantage
def _close(a, b, tol=1e-4):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y) and all(abs(u - v) < tol for u, v in zip(x, y)), (a, b)


def test_memory_pool_over_rounds_and_trajectories():
    # the paper's pool is the question: rounds of trajectories 0 and 1 of question 0 -> {0.2, 0.4, 0.0}: mean 0.2,
    # unbiased std 0.2; question 1 {5, 7}: mean 6, std sqrt(2); question 2's one reward gets 0
    out = memory_advantage(torch.tensor([0.2, 0.4, 0.0, 5.0, 7.0, 0.3], dtype=torch.float64),
                           torch.tensor([0, 0, 0, 1, 1, 2]))
    s = math.sqrt(2.0)
    _close([out.tolist()], [[0.0, 1.0, -1.0, -1 / s, 1 / s, 0.0]])
    assert memory_advantage(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0
    _close([memory_advantage(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([3, 3, 3])).tolist()], [[0.0, 0.0, 0.0]])


# ---------------------------------------------------------------- token advantages
def test_token_advantages_hand_built():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0]])
    mem_adv = torch.tensor([[0, 2.0, 2.0, 2.0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])  # A_M on the span, incl. forced prefix
    adv = token_advantages(torch.tensor([0.5, -1.0]), mem_adv, loss_mask, mem_weight=0.5)
    expected = torch.tensor([[0, 0, 1.5, 1.5, 0.5, 0.5, 0], [0, -1, -1, -1, 0, 0, 0]])
    assert torch.allclose(adv, expected)


# ---------------------------------------------------------------- policy loss
def _naive_loss(logp, old, adv, mask, cl, ch, dual, agg, ref, kl_coef):
    """Per-token python loop version of policy_loss (what the vectorised code must equal)."""
    B, T = len(logp), len(logp[0])
    rows, total, n_tok = [], 0.0, 0
    for b in range(B):
        row_sum, row_n = 0.0, 0
        for t in range(T):
            if not mask[b][t]:
                continue
            lr = max(min(logp[b][t] - old[b][t], 20.0), -20.0)
            r, a = math.exp(lr), adv[b][t]
            pg = max(-a * r, -a * min(max(r, 1 - cl), 1 + ch))
            if dual is not None and a < 0:
                pg = min(pg, -a * dual)
            if ref is not None:
                d = max(min(ref[b][t] - logp[b][t], 20.0), -20.0)
                pg += kl_coef * max(min(math.exp(d) - d - 1, 10.0), -10.0)
            row_sum, row_n = row_sum + pg, row_n + 1
        if row_n:
            rows.append((row_sum, row_n))
        total, n_tok = total + row_sum, n_tok + row_n
    if agg == "token-mean":
        return total / n_tok
    if agg == "seq-mean-token-mean":
        return sum(s / n for s, n in rows) / len(rows)
    return sum(s for s, _ in rows) / len(rows)


def _random_batch(B=6, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # log-ratios in [-0.6, 0.6]: ratios from 0.55 to 1.8, so both clip bounds are hit
    logp = old + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 1.2
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[2] = 0  # one row with no policy tokens
    return logp, old, adv, mask, ref


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dual", [None, 1.5])
@pytest.mark.parametrize("use_ref", [False, True])
def test_policy_loss_matches_naive_loop(agg, dual, use_ref):
    logp, old, adv, mask, ref = _random_batch()
    ratio = torch.exp(logp - old)[mask.bool()]
    assert (ratio > 1.2).any() and (ratio < 0.8).any()
    sel = mask.bool()
    assert ((ratio > 1.2) & (adv[sel] > 0)).any() and ((ratio < 0.8) & (adv[sel] < 0)).any()
    ref_ = ref if use_ref else None
    loss, metrics = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual,
                                agg=agg, ref_logp=ref_, kl_coef=0.1)
    expected = _naive_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28,
                           dual, agg, ref_.tolist() if use_ref else None, 0.1)
    assert abs(loss.item() - expected) < 1e-9
    assert 0 < metrics["clip_frac"] < 1
    assert (metrics["kl"] > 0) == use_ref
    r = torch.exp(logp - old)
    assert abs(metrics["ratio_mean"] - (r * mask).sum().item() / mask.sum().item()) < 1e-9
    assert abs(metrics["approx_kl"] - (0.5 * (logp - old) ** 2 * mask).sum().item() / mask.sum().item()) < 1e-9


def test_dual_clip_bounds_negative_advantage():
    logp, old = torch.tensor([[0.0]]), torch.tensor([[-2.0]])  # ratio e^2 = 7.39
    adv, mask = torch.tensor([[-1.0]]), torch.ones(1, 1)
    assert abs(policy_loss(logp, old, adv, mask)[0].item() - math.exp(2)) < 1e-5
    loss, m = policy_loss(logp, old, adv, mask, dual_clip=3.0)
    assert abs(loss.item() - 3.0) < 1e-6 and m["clip_frac"] == 1.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_sum_to_full_batch(agg):
    logp, old, adv, mask, ref = _random_batch(B=8, seed=1)
    kw = dict(agg=agg, ref_logp=None, kl_coef=0.0, dual_clip=3.0)
    full, _ = policy_loss(logp, old, adv, mask, **kw)
    n_tokens, n_seqs = mask.sum().item(), (mask.sum(-1) > 0).sum().item()
    parts = [policy_loss(logp[s], old[s], adv[s], mask[s], n_tokens=n_tokens, n_seqs=n_seqs, **kw)[0]
             for s in (slice(0, 3), slice(3, 5), slice(5, 8))]
    assert abs(sum(p.item() for p in parts) - full.item()) < 1e-10
    # a per-micro-batch denominator would NOT match (the bug this API exists to avoid)
    naive = sum(policy_loss(logp[s], old[s], adv[s], mask[s], **kw)[0].item()
                for s in (slice(0, 3), slice(3, 5), slice(5, 8))) / 3
    assert abs(naive - full.item()) > 1e-6


def test_zero_mask_is_finite():
    logp, old, adv, _, ref = _random_batch()
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        loss, m = policy_loss(logp, old, adv, torch.zeros_like(logp), agg=agg, ref_logp=ref,
                              kl_coef=0.1)
        assert loss.item() == 0.0 and all(math.isfinite(v) for v in m.values())


def test_gradient_flows_to_logp():
    logp, old, adv, mask, ref = _random_batch()
    logp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.1)
    loss.backward()
    assert logp.grad.abs().sum() > 0
    assert (logp.grad[mask == 0] == 0).all()
    # unclipped token with A>0: d loss / d logp = -A * ratio / n_tokens (+ KL term)
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    policy_loss(lp, torch.tensor([[-1.0, -1.0]]), torch.tensor([[2.0, 0.0]]), torch.ones(1, 2))[0].backward()
    assert torch.allclose(lp.grad, torch.tensor([[-1.0, 0.0]]))


# ---------------------------------------------------------------- token logprobs
@pytest.fixture(scope="module")
def tiny_qwen():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(cfg).eval()


def test_left_padding_matches_unpadded_rows(tiny_qwen):
    torch.manual_seed(1)
    rows = [torch.randint(1, 50, (n,)) for n in (7, 4, 10)]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    attn = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r):], attn[b, T - len(r):] = r, 1
    with torch.no_grad():
        batched = token_logprobs(tiny_qwen, ids, attn, temperature=0.7)
        for b, r in enumerate(rows):
            alone = token_logprobs(tiny_qwen, r[None], torch.ones(1, len(r), dtype=torch.long),
                                   temperature=0.7)[0]
            assert torch.allclose(batched[b, T - len(r):], alone, atol=1e-5)
            assert (batched[b, : T - len(r)] == 0).all() and alone[0] == 0
            assert (alone[1:] < 0).all()


def test_temperature_is_applied(tiny_qwen):
    torch.manual_seed(2)
    ids = torch.randint(0, 50, (2, 6))
    attn = torch.ones_like(ids)
    with torch.no_grad():
        logits = tiny_qwen(input_ids=ids, attention_mask=attn).logits.float()
        for temp in (1.0, 0.5):
            manual = torch.log_softmax(logits[:, :-1] / temp, -1).gather(-1, ids[:, 1:, None])[..., 0]
            out = token_logprobs(tiny_qwen, ids, attn, temperature=temp)
            assert torch.allclose(out[:, 1:], manual, atol=1e-5) and (out[:, 0] == 0).all()
        assert not torch.allclose(token_logprobs(tiny_qwen, ids, attn, temperature=0.5),
                                  token_logprobs(tiny_qwen, ids, attn, temperature=1.0))


# ---------------------------------------------------------------- seq-mean-token-mean per trajectory
def test_seq_mean_token_mean_averages_per_trajectory_across_micro_batches():
    """Rows are rounds; a sequence is a trajectory. Naive: per trajectory, the mean loss of all its
    policy tokens; then the mean over trajectories. Micro-batches split trajectories 0 and 1."""
    logp, old, adv, mask, _ = _random_batch(B=7, seed=3)
    traj = [0, 0, 1, 1, 1, 2, 3]                    # row 2 (traj 1) has no policy tokens
    mask[6] = 0                                     # trajectory 3: no policy tokens at all -> not counted
    leaf = logp.clone().requires_grad_(True)
    per_traj: dict[int, list] = {}
    for b in range(7):
        for t in range(logp.shape[1]):
            if mask[b, t]:
                r = torch.exp(leaf[b, t] - old[b, t])
                pg = torch.maximum(-adv[b, t] * r, -adv[b, t] * r.clamp(0.8, 1.2))
                per_traj.setdefault(traj[b], []).append(pg)
    naive = sum(sum(v) / len(v) for v in per_traj.values()) / len(per_traj)
    naive.backward()
    naive_grad = leaf.grad.clone()

    seq_tokens = torch.tensor([float(sum(mask[j].sum() for j in range(7) if traj[j] == traj[b])) for b in range(7)])
    n_tokens, n_seqs = mask.sum().item(), float(len(per_traj))
    leaf.grad = None
    total = 0.0
    for sl in (slice(0, 1), slice(1, 3), slice(3, 7)):
        part, _ = policy_loss(leaf[sl], old[sl], adv[sl], mask[sl], agg="seq-mean-token-mean",
                              n_tokens=n_tokens, n_seqs=n_seqs, seq_tokens=seq_tokens[sl])
        part.backward()
        total += part.item()
    assert abs(total - naive.item()) < 1e-10
    assert torch.allclose(leaf.grad, naive_grad, atol=1e-12)
    # per-round rows (the old behaviour: each row its own sequence) give a different loss here
    rows, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean")
    assert abs(rows.item() - naive.item()) > 1e-3
