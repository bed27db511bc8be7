"""MemPO training: an SFT cold start on the scripted expert's trajectories (sft.py), then RL, MemPO or plain GRPO.

    python train.py                                     # the embedded world: tiny tokenizer and model, CPU ok
    python train.py --model PATH --data qa.jsonl --corpus wiki.jsonl    # a real run (GPU)
    torchrun --standalone --nproc_per_node 8 train.py --run-dir runs/x ...    # one node, 8 GPUs (dist.py)

One RL step (``rl_step``): B questions x G rollouts with the search tool (rollout.py); each trajectory's outcome
score and, for MemPO, each round's memory reward from one no-grad pass over the 2N (context, answer) pairs
(reward.py); A_T grouped per question, A_M pooled per question over trajectories and rounds and written on each
round's <mem> span (grpo.py); then the update (``update``). **The default update is on-policy REINFORCE with the
group baseline** (``reinforce_update``): one optimizer step per batch, the loss -(A * log p) over the batch's policy
tokens. PPO's epochs, mini-batches, clip and KL, and torchrun, take one branch to ppo.py. The rows: a snail round is
a row ``context + forced prefix + output`` (loss on the output); a full-context trajectory is one growing row. Each
choice sits with its reason at the flag (config.py) or function it sets (measured: results/STUDIES.md).

Elsewhere: the flags (config.py), what each step logs (metrics.py), the KL reference, checkpoints, ``--resume`` and
``--report-to`` (checkpoint.py), LoRA (models.py), torchrun (dist.py), the SFT rows (sft.py), the other recipes
(recipes/). The system prompt: the embedded world's, ``rollout.PROTOCOL_PROMPT`` for a model from elsewhere, a
checkpoint's ``system_prompt.txt`` or ``--system-prompt FILE``.
"""
from __future__ import annotations

import math
import os
import random
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

import checkpoint
import data
import dist
import metrics
import viz
from config import Config, parse_args
from grpo import (Sample, collate, grouped_advantage, memory_advantage, micro_batches, padding_waste,
                  token_advantages, token_logprobs)
from models import autocast, is_lora, load_pretrained
from ppo import ppo_update
from reward import PROBE_THINK, memory_rewards, outcome_reward
from rollout import AgentConfig, checkpoint_prompt, rollout
from search import SearchTool, open_search
from sft import cold_start, held_out_f1
from variants import nonzero_memory_advantage


# --------------------------------------------------------------------------- one RL step

def rl_step(model, ref_model, tokenizer, optimizer, cfg: Config, step: int, agent: AgentConfig,
            real_tasks=None, real_tool=None) -> dict:
    """One RL step, MemPO's (or GRPO's with ``--algo grpo``): returns the step's metrics.

        1. B questions x G rollouts                      rollout.rollout
        2. each trajectory's outcome score -> A_T        reward.outcome_reward, grpo.grouped_advantage per question
        3. MemPO: each round's memory reward -> A_M      reward.memory_rewards, grpo.memory_advantage per question
        4. the training rows, advantages on them         build_samples
        5. the update                                    update

    ``agent``: the rollouts' settings (``agent_config``: T 0.7, snail, 16 rounds of 96 tokens); ``--viz-every`` is
    0 (no page) by default. Under torchrun (dist.py) the step meets the other ranks at three points:
    ``dist.my_share`` (each rank rolls out and scores its own questions: a group never spans ranks),
    ``metrics.rl_metrics`` (the values are gathered) and ``update`` (one update over all ranks)."""
    logged: dict = {"stage": "rl", "step": step}
    tasks, tool = rl_tasks(cfg, step, real_tasks, real_tool)
    failures = tool.failures
    with dist.my_share(model, tasks, f"rl step {step}") as (tasks, q0):     # plain python: every task, q0 = 0
        t0 = time.time()
        trajs = sample_rollouts(model, tokenizer, tasks, q0, cfg, step, tool, agent)
        logged["sec_rollout"] = time.time() - t0

        t0 = time.time()
        outs = [outcome_reward(t) for t in trajs]                     # score = objectives right / K
        question_ids = torch.tensor([t.group_id for t in trajs])      # each rollout's question: its group
        adv_t = grouped_advantage(torch.tensor([o["score"] for o in outs]), question_ids)
        mem, adv_m = memory_advantages(model, tokenizer, trajs, cfg) if cfg.algo == "mempo" \
            else (None, {})
        logged["sec_reward"] = time.time() - t0

    logged.update(metrics.rl_metrics(trajs, outs, mem, adv_m, tool.failures - failures, cfg.mem_adv_norm))
    t0 = time.time()
    samples = build_samples(trajs, adv_t, adv_m, one_row=cfg.train_context == "full")
    logged.update(update(model, ref_model, optimizer, samples, cfg, tokenizer.pad_token_id))
    logged["sec_update"] = time.time() - t0
    if cfg.viz_every and step % cfg.viz_every == 0:
        record = viz.step_record(trajs, tokenizer, adv_t, mem, adv_m, cfg.mem_weight, outs, metrics=logged,
                                 title=f"{cfg.run}: {cfg.algo} RL step {step}")
        checkpoint.write_page(os.path.join(cfg.run, "viz", f"step_{step:04d}.html"), viz.page_html(record), cfg.run)
    return logged


def rl_tasks(cfg: Config, step: int, real_tasks=None, real_tool=None):
    """The step's questions and search tool: a fresh embedded world (``--questions`` 16 of K in ``--rl-objectives``
    1-4, ``--rl-hops`` 1-3 hops each; BM25 over its documents, top 3), or a slice of the real QA set."""
    rng = random.Random(cfg.seed * 7_000_003 + step)
    if real_tasks is not None:
        return rng.sample(real_tasks, min(cfg.questions, len(real_tasks))), real_tool
    world = data.make_world(rng.randrange(10**9))
    ks, hops = data.int_range(cfg.rl_objectives), data.int_range(cfg.rl_hops)
    tasks = [data.make_task(world, rng, rng.choice(ks), (hops[0], hops[-1])) for _ in range(cfg.questions)]
    return tasks, SearchTool(world.docs)


def sample_rollouts(model, tokenizer, tasks: list, q0: int, cfg: Config, step: int, tool, agent: AgentConfig) -> list:
    """``--group`` (8) sampled rollouts of each of ``tasks``, whose question ids count from q0 (torchrun: this rank's
    share starts there), in eval mode under ``--precision`` (auto: fp32 on CPU, bf16 autocast on CUDA); seeded from
    (``--seed`` 0, step, q0); the sampling settings are ``agent``'s (``agent_config``)."""
    gen = torch.Generator(device=model.device).manual_seed(cfg.seed * 9_000_011 + step + q0 * 10**12)
    model.eval()
    with autocast(cfg.precision, model.device):
        trajs = rollout(model, tokenizer, tasks, cfg.group, tool, agent, gen)
    for t in trajs:
        t.group_id += q0
    return trajs


def memory_advantages(model, tokenizer, trajs: list, cfg: Config) -> tuple[dict, dict]:
    """MemPO's memory reward of every round after the first whose ``<mem>`` closed (``reward.memory_rewards``, at the
    defaults ``--threshold`` 0.5, ``--mem-mask`` separate, and ``--probe-think`` auto = ``probe``, the marker the
    embedded SFT teaches: ``resolve_probe_think``) and its advantage A_M (``grpo.memory_advantage``, the paper's
    pool over the question's rounds, at the default ``--mem-adv-norm`` std; ``variants.nonzero_memory_advantage``
    at nonzero: ``metrics.rl_metrics`` reads the same flag), keyed by (trajectory, round)."""
    with autocast(cfg.precision, model.device):
        mem = memory_rewards(model, tokenizer, trajs, threshold=cfg.threshold, mask_mode=cfg.mem_mask,
                             think=cfg.probe_think)
    question_ids = torch.tensor([trajs[i].group_id for i, _ in mem["scored"]])      # each scored round's question
    pool = nonzero_memory_advantage if cfg.mem_adv_norm == "nonzero" else memory_advantage     # the paper's: std
    adv = pool(torch.tensor(mem["reward"], dtype=torch.float64), question_ids).tolist()
    return mem, dict(zip(mem["scored"], adv))


def grows(rounds) -> bool:
    """Does every round's context extend the one before it by exactly that round's tokens (the full context, with
    a chat template that renders each message as the model wrote it)?"""
    return all(b.context_ids[:len(a.context_ids) + len(a.round_ids)] == a.context_ids + a.round_ids
               for a, b in zip(rounds, rounds[1:]))


def build_samples(trajs, adv_t: torch.Tensor, adv_m: dict[tuple[int, int], float],
                  one_row: bool = False) -> list[Sample]:
    """The update's rows: every round a row ``context + forced prefix + output``, its trajectory's outcome advantage
    A_T on the policy tokens and the round's A_M (``adv_m[(trajectory, round)]``) on its ``<mem>`` span. With
    ``one_row`` (full context) a trajectory whose rounds grow (``grows``) is ONE row, its last round's context +
    output, each round's spans at the same positions: the same tokens and conditioning at its length once."""
    samples = []
    for i, t in enumerate(trajs):
        rounds = [(k, r) for k, r in enumerate(t.rounds) if r.output_ids]
        mems = {k: [(*r.mem_span, adv_m[(i, k)])] if (i, k) in adv_m else [] for k, r in rounds}
        if one_row and rounds and grows(t.rounds):
            last = t.rounds[-1]
            samples.append(Sample(ids=last.context_ids + last.round_ids, policy=[r.policy_span for _, r in rounds],
                                  mem=[s for k, _ in rounds for s in mems[k]], adv_t=float(adv_t[i]), traj=i))
            continue
        samples += [Sample(ids=r.context_ids + r.round_ids, policy=[r.policy_span], mem=mems[k], adv_t=float(adv_t[i]),
                           traj=i) for k, r in rounds]
    return samples


# --------------------------------------------------------------------------- the update

def update(model, ref_model, optimizer, samples: list[Sample], cfg: Config, pad_id: int) -> dict:
    """The update on one step's rows -> its metrics. The default is ``reinforce_update``. ONE branch leaves it:
    PPO's epochs or mini-batches (a second optimizer step on the same rollouts makes the ratio differ from 1, so
    it needs old log-probs and the clip), a KL term in the loss (``--kl-coef`` > 0), another ``--agg``, or torchrun
    (global denominators, gradient sync): each is ``ppo.ppo_update``. At the defaults none holds: 1 epoch, 1
    mini-batch, no KL term, token-mean, plain python. ``--log-kl`` only logs: its reference (``ref_model``, loaded
    by ``run_rl`` for it) is read for the ``kl`` metric and leaves the update as it is."""
    if cfg.ppo_epochs > 1 or cfg.ppo_minibatches > 1 or cfg.kl_coef > 0 or cfg.agg != "token-mean" \
            or dist.is_dist():
        return ppo_update(model, ref_model, optimizer, samples, cfg, pad_id)
    return reinforce_update(model, optimizer, samples, cfg, pad_id, ref_model)


def reinforce_update(model, optimizer, samples: list[Sample], cfg: Config, pad_id: int, ref_model=None) -> dict:
    """One optimizer step on the whole batch: on-policy REINFORCE with the group baseline (the advantages A are
    already centred per question). The loss is -(A * log p) summed over the batch's policy tokens and divided by
    their count (the batch's, not each micro-batch's), so micro-batches (``--micro-tokens`` 2048, sorted by length)
    change the memory it takes, not the gradient; then the gradient clipped to norm ``--grad-clip`` 1 and one step
    of ``optimizer`` (AdamW at ``--lr`` 3e-5, weight decay 0, torch's default betas and eps, built once when RL
    starts in ``train_policy``). log p is at the sampling temperature (logits / T, as sampled); the rollouts ran
    in eval mode and this in train mode: the same log-probs for a model without dropout (the embedded one, Llama's
    and Qwen's configs at their 0.0 default). The same gradient as PPO's clipped loss at its first step, where
    every ratio is exactly 1 and the clip never acts (``ppo.py``). Skipped, weights untouched, when every advantage
    is 0 or the loss or gradient norm is not finite. ``ref_model`` (``--log-kl``): the k3 KL of the policy tokens
    to it, before the step, logged as ``kl`` (the same number ppo.py logs); it never enters the loss."""
    if not any(s.adv_t != 0 or any(a != 0 for *_, a in s.mem) for s in samples):
        return {"skipped": "all advantages are zero"}
    n_tokens = max(float(sum(s.n_policy for s in samples)), 1.0)
    micro = micro_batches(samples, cfg.micro_tokens)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total, sampled_logp, kl = 0.0, 0.0, 0.0
    for rows in micro:
        batch = collate(rows, pad_id, model.device)
        mask = batch["loss_mask"]                                                              # (B, T)
        adv = token_advantages(batch["adv_t"], batch["mem_adv"], mask, cfg.mem_weight)  # (B, T); --mem-weight 1
        with autocast(cfg.precision, model.device):
            logp = token_logprobs(model, batch["ids"], batch["attn"], cfg.temperature)         # (B, T)
        loss = (-(adv * logp) * mask).sum(-1).sum() / n_tokens
        loss.backward()
        total += loss.item()
        sampled_logp += (logp.detach() * mask).sum().item()
        if ref_model is not None:
            kl += (k3_kl(ref_model, batch, logp.detach(), cfg) * mask).sum().item()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    if not (math.isfinite(total) and torch.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        return {"skipped": f"non-finite loss {total} or grad norm {grad_norm.item()}"}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)        # the gradients are not held through the next rollout
    # entropy: the sampled tokens' mean -log p, at the sampling temperature an estimate of the policy's entropy
    return {"loss": total, "grad_norm": grad_norm.item(), "entropy": -sampled_logp / n_tokens,
            "padding_waste": padding_waste(micro)} | ({"kl": kl / n_tokens} if ref_model is not None else {})


def k3_kl(ref_model, batch: dict, logp: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Per-token k3 KL (B, T) of the policy's ``logp`` to ``ref_model`` on ``batch``, as ``grpo.policy_loss`` takes
    it (``--log-kl``; the caller masks)."""
    with torch.no_grad(), autocast(cfg.precision, logp.device):
        ref_logp = token_logprobs(ref_model, batch["ids"], batch["attn"], cfg.temperature)
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1).clamp(-10.0, 10.0)

# --------------------------------------------------------------------------- the RL loop

def agent_config(cfg: Config, system_prompt: str = data.SYSTEM_PROMPT) -> AgentConfig:
    """The agent of training rollouts, at the defaults: sampled at ``--temperature`` 0.7, ``--train-context`` snail,
    at most ``--max-turns`` 16 rounds of ``--max-new-tokens`` 96 tokens, each question's prompt prefilled once
    (``--prefix-cache``), a round's rows generated in one batch (``--generation-batch`` 0)."""
    return AgentConfig(system_prompt=system_prompt, context=cfg.train_context, max_turns=cfg.max_turns,
                       max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, prefix_cache=cfg.prefix_cache,
                       generation_batch=cfg.generation_batch)


SECONDS = ("sec_rollout", "sec_reward", "sec_update")


def run_rl(model, tokenizer, cfg: Config, start: int, optimizer, metrics_path: str, ckpt: str, take_step,
           system_prompt: str = data.SYSTEM_PROMPT, validate: bool = True) -> None:
    """RL steps ``start .. --rl-steps``: ``take_step(model, ref_model, optimizer, s)`` -> the step's metrics
    (``rl_step``, or a recipe's step), a greedy K=4 check every ``--eval-every`` steps when ``validate``, a
    checkpoint every ``--save-every``."""
    ref_model = None
    logged = cfg.log_kl and not dist.DIST.fsdp and (start == 0 or is_lora(model)
                                                    or os.path.isdir(os.path.join(cfg.run, "ref")))
    if cfg.kl_coef > 0 or logged:       # logged: how far RL moved, as "kl" (a run resumed from before it: none)
        if dist.DIST.fsdp:
            raise SystemExit("--kl-coef > 0 with --fsdp is not supported (the reference model would need its own "
                             "sharding)")
        ref_model = checkpoint.reference_model(model, cfg.run, start)
    if cfg.keep_checkpoints and start > 0:     # resumed from the step-``start`` checkpoint: its copy, if a kill or
        checkpoint.keep_step(cfg.run, start)    # a full disk came before it was made
    bar = tqdm(range(start, cfg.rl_steps), desc=f"rl/{cfg.algo}", initial=start, total=cfg.rl_steps,
               disable=dist.DIST.rank > 0)
    for s in bar:
        m = take_step(model, ref_model, optimizer, s)
        m.update(dist.slowest(m, tuple(k for k in SECONDS if k in m)))      # the slowest rank sets the step's time
        if model.device.type == "cuda":
            m["peak_cuda_mb"] = torch.cuda.max_memory_allocated(model.device) / 2**20
        if cfg.eval_every and validate and (s + 1) % cfg.eval_every == 0:
            with dist.full_weights(model):
                if dist.DIST.rank == 0:
                    m["val_f1_k4"] = held_out_f1(model, tokenizer, 4, cfg.eval_tasks, cfg.seed, "valid", system_prompt)
        checkpoint.log_jsonl(metrics_path, m)
        bar.set_postfix(score=f"{m['score']:.3f}", f1=f"{m.get('f1', m.get('e2e', 0.0)):.3f}")
        if (s + 1) % cfg.save_every == 0 or s + 1 == cfg.rl_steps:
            checkpoint.save_checkpoint(ckpt, model, tokenizer, optimizer,
                                       {"stage": "rl", "step": s + 1, "precision": cfg.precision}, system_prompt,
                                       cfg.probe_think)
            if cfg.keep_checkpoints:
                checkpoint.keep_step(cfg.run, s + 1)


# --------------------------------------------------------------------------- a run

def load_data(cfg: Config):
    """(real tasks, their search tool, SFT trajectories) from ``--data`` / ``--corpus`` / ``--sft-data``; Nones
    for the embedded world. Read before any model loads, so a bad file fails at once."""
    real_tasks = real_tool = trajectories = None
    if cfg.data:
        if not (cfg.corpus or cfg.search_url):
            raise SystemExit("--data needs --corpus or --search-url (the documents the search tool searches)")
        real_tasks, real_tool = data.load_qa(cfg.data), open_search(cfg.corpus, cfg.search_url)
        if cfg.compose:
            real_tasks = data.compose_tasks(real_tasks, cfg.compose, cfg.seed)
    if cfg.sft_data:
        trajectories = data.load_trajectories(cfg.sft_data)
    return real_tasks, real_tool, trajectories


def load_policy(cfg: Config, device: torch.device):
    """(model, tokenizer, system prompt, state, trainer): RUN/ckpt on ``--resume`` (``checkpoint.resume``),
    else ``--model``, else the tiny embedded model, its layers checkpointed with ``--gradient-checkpointing`` (every
    recipe that loads its policy here); ``state`` = where the run starts (stage, step)."""
    start = cfg.stage if cfg.stage != "auto" else "sft" if cfg.sft_data or not cfg.model else "rl"
    state, ckpt = {"stage": start, "step": 0}, os.path.join(cfg.run, "ckpt")    # auto: --model skips SFT
    trainer = checkpoint.resume(cfg.run) if cfg.resume else None
    if trainer is not None:
        state = trainer["state"]
        if state.get("precision", cfg.precision) != cfg.precision:       # the same forward as before the kill
            print(f"--precision {cfg.precision} ignored: resuming in the run's {state['precision']}")
            cfg.precision = state["precision"]
        (model, tokenizer), prompt = checkpoint.load_checkpoint(cfg.run, device), checkpoint_prompt(ckpt)
        print(f"resuming {state['stage']} at step {state['step']} from {ckpt}")
    elif cfg.model:
        try:
            model, tokenizer = load_pretrained(cfg.model, device)      # a folder, a .gguf file or smollm2
        except OSError as e:     # not a folder here, and the model hub cannot give it: one line, not a traceback
            where = "no such folder" if not os.path.isdir(cfg.model) else "not a model folder"
            raise SystemExit(f"--model {cfg.model}: {where}, and it does not load as a hub model "
                             f"({str(e).splitlines()[0]})") from None
        prompt = checkpoint_prompt(cfg.model)
    else:
        tokenizer = data.build_bpe_tokenizer() if cfg.tokenizer == "bpe" else data.build_tokenizer()
        model = data.build_tiny_model(tokenizer, cfg.hidden, cfg.layers, cfg.heads, cfg.ffn, seed=cfg.seed).to(device)
        prompt = data.SYSTEM_PROMPT
    if cfg.system_prompt:
        with open(cfg.system_prompt, encoding="utf-8") as f:
            prompt = f.read().strip()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.gradient_checkpointing:      # acts in train mode only: generation and no-grad scoring run as before
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    cfg.probe_think = resolve_probe_think(cfg, state["stage"], ckpt if trainer is not None else cfg.model)
    return model, tokenizer, prompt, state, trainer


def resolve_probe_think(cfg: Config, stage: str, source: str) -> str:
    """``--probe-think``, or for ``auto`` the marker the policy answers after: ``probe`` where SFT probe rows teach
    it (this run's SFT, or the embedded model, whose SFT always has them), else the one the checkpoint ``source``
    learnt (``checkpoint.trained_probe_think``: ``answer`` for a model from elsewhere). A marker the policy never
    learnt leaves P_full ~0 and the memory reward P_mem alone."""
    if cfg.probe_think != "auto":
        return cfg.probe_think
    if not source or (stage == "sft" and cfg.sft_steps > 0 and cfg.sft_probe > 0):
        return PROBE_THINK
    return checkpoint.trained_probe_think(source)


def train_policy(cfg: Config, model, tokenizer, prompt: str, state: dict, trainer: dict | None, metrics_path: str,
                 take_step, trajectories=None, before_rl=None, validate: bool = True) -> None:
    """The stages of a run after its model is loaded and wrapped: SFT (``sft.cold_start``), then RL with
    ``take_step(model, ref_model, optimizer, s)`` (``run_rl``), then ``RUN/final``. ``before_rl()``: a recipe's
    hook, called once before the first RL step."""
    ckpt = os.path.join(cfg.run, "ckpt")
    if state["stage"] == "sft" and cfg.sft_steps > 0:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
        if trainer is not None and trainer["optimizer"] is not None:
            dist.load_optimizer(model, opt, trainer["optimizer"])
            torch.set_rng_state(trainer["torch_rng"])
        cold_start(model, tokenizer, cfg, state["step"], opt, metrics_path, ckpt, prompt, trajectories)
        state, trainer = {"stage": "rl", "step": 0}, None
    if cfg.lora_rank and cfg.rl_steps > 0 and not is_lora(model):    # RL starts: adapters over SFT's (or --model's)
        model = checkpoint.lora_policy(model, cfg.run, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.seed)
        model = dist.wrap_for_training(model, model.device)     # torchrun: DDP rebuilt over the adapters alone
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    if trainer is not None and state["stage"] == "rl":
        dist.load_optimizer(model, opt, trainer["optimizer"])
        torch.set_rng_state(trainer["torch_rng"])
    if before_rl is not None and state["step"] == 0:
        before_rl()
    if cfg.rl_steps > 0:
        run_rl(model, tokenizer, cfg, state["step"], opt, metrics_path, ckpt, take_step, prompt, validate)
    if is_lora(model):
        model = model.merge_and_unload()        # RUN/final: one plain transformers model, adapters merged in
    model_sd, _ = dist.full_state(model, None)
    if dist.DIST.rank == 0:
        checkpoint.save_final(cfg.run, model, tokenizer, prompt, model_sd, cfg.probe_think)
        print(f"saved {cfg.run}/final")
    checkpoint.close_reporters()
    dist.close()


def main(argv=None) -> None:
    cfg = parse_args(argv)
    torch.manual_seed(cfg.seed)
    device = dist.setup_distributed(cfg)     # plain python: pick_device; torchrun: process group, GPU LOCAL_RANK
    metrics_path = checkpoint.check_run(cfg.run, cfg.resume)     # never mix two runs' metrics
    real_tasks, real_tool, trajectories = load_data(cfg)
    model, tokenizer, prompt, state, trainer = load_policy(cfg, device)
    model = dist.wrap_for_training(model, device)       # torchrun: DDP or FSDP2; plain: unchanged
    checkpoint.write_config(cfg.run, asdict(cfg))
    agent = agent_config(cfg, prompt)

    def take_step(model, ref_model, optimizer, s: int) -> dict:      # one MemPO (or GRPO) step on this run's data
        return rl_step(model, ref_model, tokenizer, optimizer, cfg, s, agent, real_tasks, real_tool)

    train_policy(cfg, model, tokenizer, prompt, state, trainer, metrics_path, take_step, trajectories,
                 validate=real_tasks is None)


if __name__ == "__main__":
    data.exit_on_bad_input(main)         # a missing or broken input: one line, exit status 2
