"""GRPO advantages with MemPO's memory advantage, the per-token advantages and log-probs, the training rows, and
PPO's clipped loss: pure functions, to copy out.

GRPO samples G rollouts per question (a *group*) and uses the group itself as the baseline; MemPO adds an
advantage for each round's memory, its reward (P_mem - P_full, reward.py) normalised the same way over a pool of
every trajectory AND every round of the same question:

    A_T[i]    = (score_i - mean_group) / (std_group + eps)               outcome, one per rollout
    A_M[i, t] = (mem_reward[i, t] - mean_pool) / (std_pool + eps)        memory, one per round
    A         = A_T + w * A_M on round t's <mem>...</mem> tokens, A_T on the other sampled tokens

train.py's default update needs no more than these: -(A * logp) over the policy tokens, one optimizer step
(``train.reinforce_update``). ``policy_loss`` is PPO's clipped surrogate on per-token ratios rho = exp(logp -
logp_old), aggregated over tokens (verl's default) or per trajectory first (the paper's Eq. 10), for ppo.py's
epochs and mini-batches; at its first step rho = 1 and the clip never acts, the same gradient.
Mask convention: 1 = sampled by the policy, 0 = prompt, tool output, padding. std is the unbiased one
(torch.std, verl's): a group of scores [1,0,1,1,0] gets +0.7303 / -1.0954, not the population std's +0.8165 /
-1.2247.

Left out: sampling, the reference model and the optimizer (the caller's); a value model (GRPO has none). Here
for every recipe: Dr.GRPO's and DAPO's options and the training rows (``Sample``, ``collate``, ``micro_batches``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids (N,) to dense indices 0..G-1; return (index (N,), G)."""
    _, index = torch.unique(group_ids, return_inverse=True)
    return index, int(index.max()) + 1 if index.numel() else 0


def grouped_advantage(scores: Tensor, group_ids: Tensor, eps: float = 1e-6,
                      norm_by_std: bool = True) -> Tensor:
    """(score - group mean) / (unbiased group std + eps) per row; scores, group_ids (N,) -> (N,).

    A group of one gets 0 (its mean is itself, std := 1), a constant group 0, never NaN (eps). ``norm_by_std=False``
    is Dr.GRPO's (score - mean); MemPO normalises.
    """
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


def memory_advantage(mem_reward: Tensor, question_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """A_M: each round's memory reward normalised over its pool, every round of every trajectory of its question;
    mem_reward, question_ids (M,) one entry per scored round -> (M,).

    The paper's pool is GRPO's group normalisation with the question as the group, over the flattened per-round
    rewards: a pool of one gets 0, a constant pool 0. Pools the paper does not have: variants.py.
    """
    return grouped_advantage(mem_reward, question_ids, eps)


def token_advantages(outcome_adv: Tensor, mem_adv: Tensor, loss_mask: Tensor, mem_weight: float = 1.0) -> Tensor:
    """A_T (B,) on every token + w * A_M (B, T) (nonzero on the mem spans), times the loss mask -> (B, T).

    A mem span holds the forced ``<mem>`` prefix (it belongs to the span); the loss mask zeroes it, so
    forced tokens never receive gradient.
    """
    adv = outcome_adv.float()[:, None] + mem_weight * mem_adv.float()
    return adv * loss_mask.float()                                                     # (B, T)


def token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0,
                   position_ids: Tensor | None = None) -> Tensor:
    """out[:, t] = log p(input_ids[:, t] | input_ids[:, :t]) at this temperature -> (B, T).

    0 at t = 0 and wherever the token or its predecessor is padding, so a left-padded row gives exactly the
    numbers of the same row run alone.
    """
    if position_ids is None:  # padding on either side: real tokens count from 0 (collate pads right)
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
    """Clipped PPO surrogate (+ dual clip, + k3 KL) aggregated by `agg`; inputs (B, T), seq_tokens (B,).

        L_tok = max(-A * rho, -A * clip(rho, 1 - clip_low, 1 + clip_high))      rho = exp(logp - old_logp)

    ``dual_clip`` c bounds a negative-advantage token's loss by -A * c. The KL to the reference is verl's
    ``low_var_kl`` (k3) exp(d) - d - 1, d = ref_logp - logp clamped to [-20, 20] and the result to [-10, 10],
    added to every token's loss (times ``kl_coef``) before aggregation. ``agg``: ``token-mean`` (verl's default),
    ``seq-mean-token-mean`` (the paper's Eq. 10) or ``seq-mean-token-sum``. A *sequence* is a trajectory, which
    the trainer may store as several rows (a snail round a row): ``seq_tokens[b]`` is the policy-token count of the
    trajectory row b belongs to and ``n_seqs`` the number of trajectories (default: every row its own sequence).
    The denominators (``n_tokens``, ``n_seqs``, ``seq_tokens``) are the WHOLE batch's: a caller that splits it
    into micro-batches passes the full batch's counts, so the micro-batch losses sum to the full-batch loss
    (nanochat divides per micro-batch, which weights short micro-batches up); the defaults are this call's.
    ``clip_frac`` counts tokens whose loss differs from -A * rho (a clip acts: no gradient from that token).
    """
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
    """DAPO's filter: True for rows whose group has non-identical scores; (N,) -> (N,) bool. MemPO keeps all rows."""
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
    """One training row. Spans are [start, end) positions in ``ids``: ``policy``, the tokens the policy sampled (loss
    mask 1); ``mem``, each round's ``<mem>...</mem>`` (its forced ``<mem>`` prefix included) with that round's memory
    advantage A_M. ``adv_t`` is the outcome advantage of trajectory ``traj`` (None: the row is a sequence of its own).
    A snail round is one row, ``context + forced prefix + output``; a full-context trajectory is one growing row."""
    ids: list[int]
    policy: list[tuple[int, int]]
    mem: list[tuple[int, int, float]] = field(default_factory=list)
    adv_t: float = 0.0
    traj: int | None = None

    @property
    def n_prompt(self) -> int:
        """Where the first policy token sits (a one-span row: the length of its context)."""
        return self.policy[0][0] if self.policy else len(self.ids)

    @property
    def n_policy(self) -> int:
        """Policy tokens of the row: its share of a loss denominator."""
        return sum(b - a for a, b in self.policy)


def target_row(context: list[int], target: list[int], **kw) -> Sample:
    """``context + target`` with the loss on ``target`` (an SFT row)."""
    return Sample(list(context) + list(target), [(len(context), len(context) + len(target))], **kw)


def collate(samples: list[Sample], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Right-pad rows -> ids, attention mask, loss mask, A_M on each mem span (all (B, T)), A_T (B,)."""
    T = max(len(s.ids) for s in samples)
    B = len(samples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T))
    mem_adv = torch.zeros((B, T))
    for i, s in enumerate(samples):
        n = len(s.ids)
        ids[i, :n] = torch.tensor(s.ids)
        attn[i, :n] = 1
        for a, b in s.policy:
            loss_mask[i, a:b] = 1
        for a, b, adv in s.mem:
            mem_adv[i, a:b] = adv
    adv_t = torch.tensor([s.adv_t for s in samples])
    return {k: v.to(device) for k, v in dict(ids=ids, attn=attn, loss_mask=loss_mask, mem_adv=mem_adv,
                                              adv_t=adv_t).items()}


def micro_batches(samples: list[Sample], token_budget: int) -> list[list[Sample]]:
    """Sort rows by length and cut into micro-batches of at most ``token_budget`` padded tokens (little padding;
    policy_loss's denominators stay the whole batch's)."""
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
