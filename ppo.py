"""The update when a step is NOT plain on-policy REINFORCE: PPO's epochs and mini-batches, old log-probs, the clip,
the KL term, other loss aggregations, and torchrun. ``train.update`` sends a step here, and only here, when one of
them is asked for; the default single-process step never comes here (``train.reinforce_update``).

* **PPO as verl runs it** (``--ppo-epochs`` E, ``--ppo-minibatches`` N): N optimizer steps a pass over
  mini-batches of whole trajectories, E passes, every ratio taken to the log-probs before the first step (one
  no-grad forward, ``fixed_logprobs``), so the clip (``--clip-low/high``, ``--dual-clip``) acts from the second
  step on. Each optimizer step's loss is its mini-batch's own mean: a denominator over the whole rollout batch
  would shrink every step's gradient by the number of mini-batches.
* **A reference** (``--kl-coef`` > 0, or ``--log-kl``): its log-probs from the same no-grad pass; k3 KL in the loss
  (times ``--kl-coef``) and in the metrics.
* **``--agg``**: token-mean (the default), or the paper's Eq. 10 per trajectory (``grpo.policy_loss``).
* **torchrun** (dist.py): every loss denominator is the global mini-batch's (``dist.denominators``), each rank
  back-propagates its part of the global loss (``dist.backward``), gradients synchronise on a step's last
  micro-batch only (``dist.grad_sync``), every rank runs as many micro-batches (``dist.even_micro_batches``), and a
  step is skipped on every rank or none (``dist.any_rank``).

At one epoch, one mini-batch, no reference and token-mean, this computes the same gradient as
``train.reinforce_update`` (the ratio is exactly 1 and the clip never acts); under torchrun it is that update.
"""
from __future__ import annotations

import math

import torch

import dist
from grpo import Sample, collate, micro_batches, policy_loss, token_advantages, token_logprobs
from models import autocast


def ppo_update(model, ref_model, optimizer, samples: list[Sample], cfg, pad_id: int) -> dict:
    """The update on one step's rows (module docstring): -> the step's update metrics.

    Skipped (weights untouched, the reason in the metrics) when every advantage is zero on every rank; a non-finite
    loss or gradient norm stops the update before that optimizer step."""
    if not dist.any_rank(any(s.adv_t != 0 or any(a != 0 for *_, a in s.mem) for s in samples)):
        return {"skipped": "all advantages are zero"}
    minibatches, logged = plan_minibatches(samples, cfg, pad_id)
    n_all = sum(minibatch["n_tokens"] for minibatch in minibatches)
    off_policy = cfg.ppo_epochs > 1 or len(minibatches) > 1     # every ratio then goes to the logp before step 1
    fixed_logp = fixed_logprobs(model if off_policy else None, ref_model, minibatches, cfg, pad_id, model.device) \
        if off_policy or ref_model is not None else {}
    model.train()
    # "kl" only against a reference: without one it would read 0, as if the policy had not moved
    stats = {"clip_frac": 0.0, "approx_kl": 0.0, "entropy": 0.0} | ({"kl": 0.0} if ref_model is not None else {})
    for epoch in range(cfg.ppo_epochs):
        losses, norms = [], []
        for mi, minibatch in enumerate(minibatches):
            if not minibatch["n_tokens"]:        # a mini-batch without policy tokens on any rank: no step
                continue
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for bi, rows in enumerate(minibatch["micro"]):
                loss, loss_stats, n_policy = backward_micro_batch(model, rows, minibatch, fixed_logp, (mi, bi),
                                                                  bi == len(minibatch["micro"]) - 1, cfg, pad_id)
                total += loss
                for k in stats:
                    stats[k] += loss_stats[k] * (n_policy / n_all) / cfg.ppo_epochs
            total = dist.all_sum([total])[0]
            grad_norm = dist.grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
            if not (math.isfinite(total) and torch.isfinite(grad_norm)):
                optimizer.zero_grad(set_to_none=True)
                logged["skipped"] = f"non-finite loss {total} or grad norm {grad_norm.item()}"
                return logged | dict(zip(stats, dist.all_sum(list(stats.values()))))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)        # the gradients are not held through the next rollout
            losses.append(total)
            norms.append(grad_norm.item())
        if losses:      # the last pass's mean over its optimizer steps
            logged.update(loss=sum(losses) / len(losses), grad_norm=sum(norms) / len(norms))
    return logged | dict(zip(stats, dist.all_sum(list(stats.values()))))


def backward_micro_batch(model, rows: list[Sample], minibatch: dict, fixed_logp: dict, key: tuple[int, int],
                         sync: bool, cfg, pad_id: int) -> tuple[float, dict, float]:
    """Forward + backward of one micro-batch's share of its mini-batch's loss -> (loss, policy_loss's metrics with
    ``entropy``, the micro-batch's policy tokens). ``fixed_logp``: the old / reference log-probs, by ``key``."""
    batch = collate(rows, pad_id, model.device)
    adv = token_advantages(batch["adv_t"], batch["mem_adv"], batch["loss_mask"], cfg.mem_weight)     # (B, T)
    seq_tokens = torch.tensor([minibatch["seq_tokens"].get(dist.seq_key(s), 0.0) for s in rows], device=model.device)
    with dist.grad_sync(model, sync):
        with autocast(cfg.precision, model.device):
            logp = token_logprobs(dist.update_module(model), batch["ids"], batch["attn"], cfg.temperature)
        old_logp = fixed_logp.get(("old", *key), logp.detach())          # one epoch, one mini-batch: the ratio is 1
        loss, loss_stats = policy_loss(logp, old_logp, adv, batch["loss_mask"], cfg.clip_low, cfg.clip_high,
                                       cfg.dual_clip or None, cfg.agg, fixed_logp.get(("ref", *key)), cfg.kl_coef,
                                       n_tokens=minibatch["n_tokens"], n_seqs=minibatch["n_seqs"],
                                       seq_tokens=seq_tokens)
        dist.backward(loss)
    n_policy = batch["loss_mask"].sum().item()
    # the sampled tokens' mean -log p: at the sampling temperature, an estimate of the policy's entropy
    loss_stats["entropy"] = -(logp.detach() * batch["loss_mask"]).sum().item() / max(n_policy, 1.0)
    return loss.item(), loss_stats, n_policy


def minibatch_split(samples: list[Sample], n: int) -> list[list[Sample]]:
    """``samples`` cut into ``n`` PPO mini-batches of whole trajectories (in order): a trajectory's rows share
    one optimizer step, so ``seq-mean-*`` sees each trajectory whole. ``n`` = 1: ``[samples]``, the same list."""
    if n == 1:
        return [samples]
    keys = list(dict.fromkeys(dist.seq_key(s) for s in samples))
    part = {k: i * n // len(keys) for i, k in enumerate(keys)}
    return [[s for s in samples if part[dist.seq_key(s)] == j] for j in range(n)]


def plan_minibatches(samples: list[Sample], cfg, pad_id: int) -> tuple[list[dict], dict]:
    """The optimizer steps of one pass: ``--ppo-minibatches`` mini-batches of whole trajectories, each with its
    length-sorted ``micro`` batches and its loss denominators (``n_tokens``, ``n_seqs``, ``seq_tokens``:
    dist.denominators, global under torchrun); and ``{"padding_waste"}`` over every rank's micro-batches."""
    split = minibatch_split(samples, cfg.ppo_minibatches)
    parts = [micro_batches(part, cfg.micro_tokens) for part in split]
    real, padded = dist.all_sum([sum(len(s.ids) for s in samples),
                                 sum(len(b) * len(b[-1].ids) for batches in parts for b in batches)])
    waste = {"padding_waste": 1 - real / max(padded, 1)}   # = grpo.padding_waste(batches), over every rank's batches
    parts = [dist.even_micro_batches(batches, pad_id) for batches in parts]  # torchrun: the same count on every rank
    return [{"micro": batches} | dist.denominators(part) for batches, part in zip(parts, split)], waste


def fixed_logprobs(policy, ref_model, minibatches: list[dict], cfg, pad_id: int, device: torch.device) -> dict:
    """No-grad log-probs (B, T) of micro-batch ``bi`` of mini-batch ``mi``, before the first optimizer step:
    ``("old", mi, bi)`` of ``policy`` (the off-policy ratio's denominator), ``("ref", mi, bi)`` of ``ref_model``
    (the KL reference); a None model gives none."""
    out = {}
    with torch.no_grad(), autocast(cfg.precision, device):
        for mi, minibatch in enumerate(minibatches):
            for bi, rows in enumerate(minibatch["micro"]):
                batch = collate(rows, pad_id, device)
                for key, model in (("old", policy), ("ref", ref_model)):
                    if model is not None:
                        out[(key, mi, bi)] = token_logprobs(model, batch["ids"], batch["attn"], cfg.temperature)
    return out
