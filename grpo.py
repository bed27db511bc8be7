"""GRPO advantages and the clipped PPO loss, with MemPO's memory advantage.

GRPO samples G rollouts per question (a *group*) and uses the group itself as the baseline:

    A_T[i] = (score_i - mean_g) / (std_g + eps)            outcome advantage, one per rollout

MemPO adds a second advantage for the tokens of each round's <mem>...</mem> span. Every
memory reward mem_reward[i, t] (P_mem - P_full, see reward.py) of every trajectory i AND every
round t of the same question goes into one pool, normalised the same way:

    A_M[i, t] = (mem_reward[i, t] - mean_pool) / (std_pool + eps)

and the per-token advantage is  A = A_T + w * A_M  on round t's mem span, A_T on the other
sampled tokens, 0 on prompt / tool output / padding (mask convention: 1 = sampled by policy).

The loss is PPO's clipped surrogate on per-token ratios rho = exp(logp - logp_old):

    L_tok = max(-A * rho, -A * clip(rho, 1 - eps_low, 1 + eps_high))       (+ dual clip, + KL)

aggregated over tokens ("token-mean", verl's default) or per sequence first
("seq-mean-token-mean", the paper's Eq. 10; "seq-mean-token-sum").

Choices and deviations (the paper does not fix these):
* std is the UNBIASED one (torch.std, as in verl): a group [1,0,1,1,0] gets std 0.5477 -> +0.7303 /
  -1.0954 (the population std would give +0.8 / -1.2). A group (or pool) of one value gets advantage 0
  (mean = itself, std := 1). A constant group gets 0, never NaN (the eps in the denominator).
* norm_by_std=False is Dr.GRPO (score - mean); filter_groups is DAPO's filter (rows of groups whose
  scores are all equal are dropped). MemPO uses neither; they are here for recipes that do.
* memory_advantage offers four pooling modes: "std" (the paper's pool over trajectories and
  rounds), "none" (pool mean only), "round" (a separate pool per round index k, so round 2
  memories compete only with round 2 memories; keyed on the real round index that
  reward.memory_rewards returns in out["rounds"], since a round without a closed </mem> is not
  scored and list positions then skip it), "nonzero" (zero rewards -- usually both
  probabilities 0, i.e. no signal -- are left out of the pool and get advantage 0).
  memory_pool_stds gives the unbiased std of each of those pools (>= 2 rewards): the std the
  advantages are divided by (train.py logs their mean).
* The mem span may include the forced "<mem>" prefix (it belongs to the span), but the
  advantage is multiplied by the loss mask, so forced tokens never receive gradient.
* token_logprobs returns 0 at t = 0 and wherever the token or its predecessor is padding, so a
  left-padded row gives exactly the numbers of the same row run alone.
* clip_frac counts tokens whose loss differs from the unclipped -A*rho (PPO clip or dual clip
  active, i.e. no gradient from that token).
* KL to the reference is verl's "low_var_kl" (k3) estimator exp(d) - d - 1, d = ref - logp
  clamped to [-20, 20] and the result to [-10, 10], added to every token's loss before
  aggregation.
* Loss denominators (n_tokens, n_seqs, seq_tokens) are for the WHOLE batch: when a batch is split
  into micro-batches for gradient accumulation, the caller passes the full batch's counts, so the
  sum of the micro-batch losses equals the full-batch loss (nanochat divides per micro-batch,
  which weights short micro-batches up). Defaults are this call's own counts.
* A *sequence* in the seq-* modes is a trajectory (Eq. 10 normalises per trajectory), which the
  trainer stores as several rows (one per round). ``seq_tokens[b]`` is the policy-token count of
  the whole trajectory row b belongs to and ``n_seqs`` the number of trajectories, so
  seq-mean-token-mean = mean over trajectories of (mean over that trajectory's policy tokens).
  Default: every row is a sequence of its own (seq_tokens = the row's count).

Rows and batches (``Sample``, ``collate``, ``micro_batches``): every round is one training row
``context + forced prefix + output`` with loss mask 1 on ``output``; ``collate`` right-pads rows into
the (B, T) tensors the loss reads, and ``micro_batches`` sorts rows by length and cuts them into
micro-batches of at most ``token_budget`` padded tokens (little padding; the denominators above stay
the whole batch's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids (N,) to dense indices 0..G-1; return (index (N,), G)."""
    _, index = torch.unique(group_ids, return_inverse=True)
    return index, int(index.max()) + 1 if index.numel() else 0


def grouped_advantage(scores: Tensor, group_ids: Tensor, eps: float = 1e-6,
                      norm_by_std: bool = True) -> Tensor:
    """(score - group mean) / (unbiased group std + eps) per row; scores, group_ids (N,) -> (N,)."""
    scores = scores.float() if not scores.is_floating_point() else scores
    if scores.numel() == 0:
        return scores.clone()
    index, n_groups = _group_index(group_ids)
    count = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, index, torch.ones_like(scores))
    mean = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, index, scores) / count  # (G,)
    centred = scores - mean[index]                                                     # (N,)
    if not norm_by_std:
        return centred
    sq = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, index, centred ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.ones_like(sq))
    return centred / (std[index] + eps)


def _normalise(values: list[float], eps: float, by_std: bool, std_floor: float = 0.0) -> list[float]:
    """Normalise one pool of floats: (v - mean) / (max(unbiased std, std_floor) + eps); a pool of one -> [0]."""
    n = len(values)
    if n == 0:
        return []
    mean = sum(values) / n
    if not by_std:
        return [v - mean for v in values]
    if n == 1:
        return [0.0]
    return [(v - mean) / (max(_unbiased_std(values), std_floor) + eps) for v in values]


def _unbiased_std(values: list[float]) -> float:
    """The unbiased std of >= 2 floats (torch.std's, as grouped_advantage uses)."""
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5


def _memory_pools(mem_rewards: list[list[float]], group_ids: list[int], rounds: list[list[int]] | None,
                  norm: str) -> list[list[tuple[int, int]]]:
    """The pools memory_advantage normalises over: lists of (trajectory i, position k in mem_rewards[i])."""
    if norm not in ("std", "none", "round", "nonzero"):
        raise ValueError(f"unknown norm {norm!r}")
    if norm == "round" and rounds is None:
        raise ValueError("norm='round' needs the round index of every reward (memory_rewards' out['rounds'])")
    pools: dict[tuple, list[tuple[int, int]]] = {}   # pool key -> members; the key decides who competes
    for i, (rewards, g) in enumerate(zip(mem_rewards, group_ids)):
        for k, r in enumerate(rewards):
            if norm == "nonzero" and r == 0:
                continue
            key = (g, rounds[i][k]) if norm == "round" else (g,)   # the REAL round index, not position k
            pools.setdefault(key, []).append((i, k))
    return list(pools.values())


def memory_advantage(mem_rewards: list[list[float]], group_ids: list[int],
                     rounds: list[list[int]] | None = None, eps: float = 1e-6,
                     norm: str = "std", std_floor: float = 0.0) -> list[list[float]]:
    """Normalise per-round memory rewards over a pool per group; same nested shape out.

    ``rounds[i][k]`` is the round index of ``mem_rewards[i][k]`` (needed by ``norm="round"`` only:
    a trajectory may skip a round that wrote no ``<mem>``, so list position is not the round).
    ``std_floor`` > 0 divides by max(std, std_floor): a pool whose rewards differ by a hair gets
    advantages of that hair's size, not unit variance (0 = the paper's pool).
    """
    out = [[0.0] * len(rewards) for rewards in mem_rewards]
    for members in _memory_pools(mem_rewards, group_ids, rounds, norm):
        normed = _normalise([mem_rewards[i][k] for i, k in members], eps, by_std=norm != "none",
                            std_floor=std_floor)
        for (i, k), a in zip(members, normed):
            out[i][k] = a
    return out


def memory_pool_stds(mem_rewards: list[list[float]], group_ids: list[int],
                     rounds: list[list[int]] | None = None, norm: str = "std") -> list[float]:
    """The unbiased std of each pool of ``memory_advantage(norm=norm)`` that holds >= 2 rewards."""
    pools = [[mem_rewards[i][k] for i, k in members] for members in _memory_pools(mem_rewards, group_ids, rounds, norm)]
    return [_unbiased_std(vals) for vals in pools if len(vals) > 1]


def memory_pool_weights(mem_rewards: list[list[float]], mem_adv: list[list[float]], group_ids: list[int],
                        rounds: list[list[int]] | None = None, norm: str = "std") -> list[tuple[float, float]]:
    """(unbiased reward std, sum of |A_M|) of each pool of >= 2 rewards: how much of the memory advantage's
    magnitude a pool of a given spread carries (a pool whose rewards differ by 1e-3 still gets unit variance)."""
    return [(_unbiased_std([mem_rewards[i][k] for i, k in members]), sum(abs(mem_adv[i][k]) for i, k in members))
            for members in _memory_pools(mem_rewards, group_ids, rounds, norm) if len(members) > 1]


def token_advantages(outcome_adv: Tensor, mem_adv: Tensor, mem_span: Tensor, loss_mask: Tensor,
                     mem_weight: float = 1.0) -> Tensor:
    """A_T on every token + w * A_M on the mem span, times the loss mask -> (B, T)."""
    adv = outcome_adv.float()[:, None] + mem_weight * mem_adv.float()[:, None] * mem_span.float()
    return adv * loss_mask.float()                                                     # (B, T)


def token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0,
                   position_ids: Tensor | None = None) -> Tensor:
    """out[:, t] = log p(input_ids[:, t] | input_ids[:, :t]) at this temperature -> (B, T)."""
    if position_ids is None:  # left padding: real tokens count from 0
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids).logits[:, :-1]                           # (B, T-1, V)
    logits = logits.float() / temperature
    target = input_ids[:, 1:]                                                          # (B, T-1)
    # log_softmax at the target only: logit[target] - logsumexp(logits), no (B, T, V) copy kept
    logp = logits.gather(-1, target[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    valid = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()  # token and its context
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)                     # (B, T)


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                agg: str = "token-mean", ref_logp: Tensor | None = None, kl_coef: float = 0.0,
                n_tokens: float | None = None, n_seqs: float | None = None,
                seq_tokens: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Clipped PPO surrogate (+ dual clip, + k3 KL) aggregated by `agg`; inputs (B, T), seq_tokens (B,)."""
    mask = mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)                                                       # (B, T)
    unclipped = -advantages * ratio
    pg = torch.maximum(unclipped, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high))
    if dual_clip is not None:  # bound the loss of negative-advantage tokens with huge ratios
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * dual_clip), pg)
    loss_tok = pg
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        d = (ref_logp - logp).clamp(-20.0, 20.0)
        kl = (torch.exp(d) - d - 1).clamp(-10.0, 10.0)                                 # (B, T)
        loss_tok = loss_tok + kl_coef * kl

    row_tokens = mask.sum(-1)                                                          # (B,)
    if n_tokens is None:
        n_tokens = mask.sum().item()
    if n_seqs is None:
        n_seqs = (row_tokens > 0).sum().item()
    if seq_tokens is None:
        seq_tokens = row_tokens
    n_tokens, n_seqs = max(float(n_tokens), 1.0), max(float(n_seqs), 1.0)
    row_sum = (loss_tok * mask).sum(-1)                                                # (B,)
    if agg == "token-mean":
        loss = row_sum.sum() / n_tokens
    elif agg == "seq-mean-token-mean":
        loss = (row_sum / seq_tokens.to(row_sum.dtype).clamp(min=1)).sum() / n_seqs
    elif agg == "seq-mean-token-sum":
        loss = row_sum.sum() / n_seqs
    else:
        raise ValueError(f"unknown agg {agg!r}")

    with torch.no_grad():
        denom = mask.sum().clamp(min=1)
        mean = lambda x: ((x * mask).sum() / denom).item()  # noqa: E731  masked mean, this call
        metrics = {
            "pg_loss": mean(pg),
            "clip_frac": mean((pg != unclipped).to(mask.dtype)),
            "approx_kl": mean(0.5 * log_ratio ** 2),
            "kl": mean(kl),
            "ratio_mean": mean(ratio),
        }
    return loss, metrics


def filter_groups(scores: Tensor, group_ids: Tensor) -> Tensor:
    """DAPO filter: True for rows whose group has non-identical scores; (N,) -> (N,) bool."""
    if scores.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    index, n_groups = _group_index(group_ids)
    scores = scores.float()
    hi = torch.full((n_groups,), -torch.inf).scatter_reduce(0, index, scores, "amax")
    lo = torch.full((n_groups,), torch.inf).scatter_reduce(0, index, scores, "amin")
    return (hi > lo)[index]


# --------------------------------------------------------------------------- rows and batches

@dataclass
class Sample:
    """One round as a training row: ids = context + prefix + output; loss on output only."""
    ids: list[int]
    n_prompt: int            # context + forced prefix (mask 0)
    mem_end: int = 0         # tokens after n_prompt - len(prefix) that form the <mem> span
    n_prefix: int = 0
    adv_t: float = 0.0       # outcome advantage of its trajectory
    adv_m: float = 0.0       # memory advantage of this round
    traj: int | None = None  # trajectory id (rows of one trajectory form one "sequence"); None = its own


def collate(samples: list[Sample], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Right-pad rows -> ids, attention mask, loss mask, mem span, per-row advantages. All (B, T) or (B,)."""
    T = max(len(s.ids) for s in samples)
    B = len(samples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T))
    mem_span = torch.zeros((B, T))
    for i, s in enumerate(samples):
        n = len(s.ids)
        ids[i, :n] = torch.tensor(s.ids)
        attn[i, :n] = 1
        loss_mask[i, s.n_prompt:n] = 1
        start = s.n_prompt - s.n_prefix
        mem_span[i, start:start + s.mem_end] = 1
    adv_t = torch.tensor([s.adv_t for s in samples])
    adv_m = torch.tensor([s.adv_m for s in samples])
    return {k: v.to(device) for k, v in dict(ids=ids, attn=attn, loss_mask=loss_mask, mem_span=mem_span,
                                              adv_t=adv_t, adv_m=adv_m).items()}


def micro_batches(samples: list[Sample], token_budget: int) -> list[list[Sample]]:
    """Sort rows by length and cut into micro-batches of at most ``token_budget`` padded tokens."""
    order = sorted(samples, key=lambda s: len(s.ids))
    batches, cur = [], []
    for s in order:
        if cur and (len(cur) + 1) * len(s.ids) > token_budget:
            batches.append(cur)
            cur = []
        cur.append(s)
    if cur:
        batches.append(cur)
    return batches


def padding_waste(batches: list[list[Sample]]) -> float:
    """Fraction of computed token positions that are padding."""
    real = sum(len(s.ids) for b in batches for s in b)
    total = sum(len(b) * max(len(s.ids) for s in b) for b in batches)
    return 1 - real / max(total, 1)
