"""MemPO training: SFT cold start on expert trajectories, then RL (MemPO or plain GRPO).

    python train.py                        # embedded default: tiny world, tokenizer and model, CPU ok
    python train.py --model PATH --data qa.jsonl --corpus wiki.jsonl   # a real run (GPU)

One RL step (the seed's timeline, A4 -> B -> A1 -> A2/A3 -> update):

    rollout    B questions x G rollouts, multi-turn, search tool          (rollout.py)
    reward     outcome score per trajectory; MemPO: mem_reward per round   (reward.py)
               from ONE batched no-grad forward over the 2N (context, answer) pairs
    advantage  A_T grouped per question; A_M pooled per question over      (grpo.py)
               trajectories and rounds, written on each round's <mem> span
    update     clipped PPO loss, micro-batches sorted by length, gradient accumulation with
               the WHOLE batch's token count as denominator, AdamW, grad-norm clipping

Every round is a training sample ``context + forced prefix + output`` (loss mask 1 on output).

Choices of this project (see also the module docstrings of rollout.py, reward.py, grpo.py):

* ``--train-context`` defaults to ``snail`` although the original trains with ``full`` context:
  the embedded SFT data and every evaluation use snail-shell context, and the seed's problem 4
  (train/eval drift) is exactly this difference. ``--train-context full`` reproduces the original.
* The memory reward defaults to ``--mem-mask full --mem-adv-norm nonzero``, the best MemPO
  variant on the validation worlds of the README's study on the default 3-layer model (the
  per-round pool, best on the older 2-layer model, made the 3-layer policy loop at K=4 in every
  seed; the paper's own reward, ``--faithful``, lowered held-out F1: its memory advantage paid for
  shorter memories). Plain GRPO (``--algo grpo``) was as good or better; the README states it
  plainly.
* One optimizer step per rollout batch by default (``--ppo-epochs 1``): then ``old_logp`` is the
  detached ``logp`` of the same forward (ratio 1, exactly on-policy) and no extra forward is spent.
  With more epochs ``old_logp`` is computed once, before the first update.
* A step whose advantages are all zero (every group tied, no memory signal), or whose loss or
  gradient is not finite, is skipped with the reason in the metrics; the weights are untouched.
* ``--algo memalpha`` (section at the end, own flags and config) trains Mem-alpha: SFT on a scripted
  tool-call writer + answerer, then GRPO with one group per instance over every chunk step of its G
  rollouts; it reuses ``ppo_update`` and ``grpo.grouped_advantage`` (rewards in float64, so equal
  rewards give exactly zero advantages and the step is skipped). No checkpoint / resume there yet.
* Checkpoints (``save_pretrained`` + optimizer + step + RNG) are written to a temporary folder and
  renamed into place, so a kill leaves either the old or the new one. Data order depends only on
  ``(seed, step)``, so ``--resume`` continues a killed run with the same batches.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass

import torch

import data
from grpo import grouped_advantage, memory_advantage, policy_loss, token_advantages, token_logprobs
from memory import Record, extract_mem, prepare_prompt, tool_record
from reward import memory_rewards, outcome_reward
from rollout import AgentConfig, SearchTool, encode_chat, load_model, pick_device, rollout


@dataclass
class Config:
    run: str = "runs/default"
    seed: int = 0
    device: str = "auto"
    model: str = ""            # HF model path; empty = build the tiny embedded model
    data: str = ""             # QA JSONL/parquet; empty = the embedded world
    corpus: str = ""           # corpus JSONL (required with --data)
    hidden: int = 128          # tiny embedded model
    layers: int = 3            # 3 thin layers, not 2 wide ones: see README (copying names from memory)
    heads: int = 8
    ffn: int = 256
    # SFT cold start (embedded default)
    sft_steps: int = 2900
    sft_batch: int = 64
    sft_lr: float = 1e-3
    sft_copy_steps: int = 800   # warm-up steps on a pure copy task (the 3-layer model learns to copy at ~650-850)
    forget_p: float = 0.5      # fraction of expert episodes whose <mem> forgets earlier objectives
    sft_objectives: str = "1-4"
    hops: str = "1-3"
    # RL
    algo: str = "mempo"        # mempo | grpo
    rl_steps: int = 60
    questions: int = 8         # B questions per step
    group: int = 8             # G rollouts per question
    rl_objectives: str = "1-4"  # the SFT's K and hops: RL on 2-4 / 1-2 taught 3-hop K=1 episodes to answer after 2 hops
    rl_hops: str = "1-3"
    lr: float = 1e-4
    train_context: str = "snail"
    max_turns: int = 16
    max_new_tokens: int = 96
    temperature: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = 0.0
    kl_coef: float = 0.0
    agg: str = "token-mean"
    ppo_epochs: int = 1
    micro_tokens: int = 2048   # padded tokens per micro-batch; on 2 cores 2048 beat 4096 by ~17% (less padding)
    grad_clip: float = 1.0
    threshold: float = 0.5
    mem_mask: str = "full"         # full (this project's default, README results) | separate (seed, --faithful)
    mem_adv_norm: str = "nonzero"  # nonzero (default: zero rewards left out) | std (paper) | none | round
    mem_weight: float = 1.0
    mem_gate: bool = False         # no memory credit for a <mem> with words from no earlier tool result
    faithful: bool = False         # exactly the paper's memory reward (overrides the four options above)
    sft_mem_answer: float = 0.0    # extra SFT rows per episode round: memory-only context -> answer
    # bookkeeping
    save_every: int = 20
    eval_every: int = 20
    eval_tasks: int = 32
    resume: bool = False


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    helps = {
        "run": "output folder (metrics.jsonl, checkpoints, final/)", "seed": "seed of data order and sampling",
        "device": "auto | cpu | cuda", "model": "HF model name or path (default: the tiny embedded model)",
        "data": "QA file, JSONL or parquet, fields question / golden_answers",
        "corpus": "corpus JSONL with id / contents for the search tool",
        "hidden": "hidden size of the tiny embedded model", "layers": "layers of the tiny embedded model",
        "heads": "attention heads of the tiny embedded model", "ffn": "MLP width of the tiny embedded model",
        "sft_steps": "SFT cold-start steps (embedded default only; 0 skips)", "sft_batch": "rounds per SFT step",
        "sft_lr": "SFT learning rate",
        "sft_copy_steps": "SFT warm-up steps that copy question entries into <mem> (teaches a tiny model to copy names)", "forget_p": "fraction of expert episodes with the forgetting flaw",
        "sft_objectives": "objective counts K of SFT questions, e.g. 1-10", "hops": "hops per objective, e.g. 1-3",
        "algo": "mempo (outcome + memory advantage) | grpo (outcome only) | memalpha (own flags: --algo memalpha --help)", "rl_steps": "RL steps (0 skips RL)",
        "questions": "questions per RL step", "group": "rollouts per question (G)",
        "rl_objectives": "objective counts K of RL questions", "rl_hops": "hops per objective in RL",
        "lr": "RL learning rate", "train_context": "snail | full: the context RL rollouts see",
        "max_turns": "max rounds per training rollout", "max_new_tokens": "max tokens per round",
        "temperature": "sampling temperature (also divides logits in the loss)",
        "clip_low": "PPO clip below 1", "clip_high": "PPO clip above 1", "dual_clip": "dual clip c for A<0 (0 = off)",
        "kl_coef": "k3 KL to the initial policy (0 = no reference model)",
        "agg": "token-mean | seq-mean-token-mean | seq-mean-token-sum", "ppo_epochs": "update passes per batch",
        "micro_tokens": "token budget of one update micro-batch", "grad_clip": "max grad norm",
        "threshold": "confidence threshold of the memory reward (log threshold cut)",
        "mem_mask": "separate (seed: each P over its own confident tokens) | full (both over P_full's)",
        "mem_adv_norm": "memory-pool normalisation: std | none | round | nonzero",
        "mem_weight": "weight of the memory advantage on <mem> tokens",
        "mem_gate": "faithfulness gate: a <mem> with invented words earns no positive memory reward",
        "faithful": "the paper's memory reward exactly: --mem-mask separate --mem-adv-norm std --mem-weight 1, no gate",
        "sft_mem_answer": "probability per expert round of an extra SFT row (prompt + <mem> -> answer), so P_mem is in distribution", "save_every": "checkpoint every N RL steps",
        "eval_every": "greedy eval every N RL steps (and every 500 SFT steps; 0 = off)", "eval_tasks": "tasks per K in the periodic eval",
        "resume": "continue from RUN/ckpt",
    }
    for name, default in asdict(Config()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=helps[name])
        else:
            p.add_argument(flag, type=type(default), default=default, help=helps[name])
    cfg = Config(**vars(p.parse_args(argv)))
    if cfg.faithful:
        cfg.mem_mask, cfg.mem_adv_norm, cfg.mem_weight, cfg.mem_gate, cfg.threshold = "separate", "std", 1.0, False, 0.5
    return cfg


def int_range(s: str) -> list[int]:
    """'1-3' -> [1, 2, 3]; '2,4' -> [2, 4]."""
    if "-" in s:
        a, b = s.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in s.split(",")]


# --------------------------------------------------------------------------- samples and batches

@dataclass
class Sample:
    """One round as a training row: ids = context + prefix + output; loss on output only."""
    ids: list[int]
    n_prompt: int            # context + forced prefix (mask 0)
    mem_end: int = 0         # tokens after n_prompt - len(prefix) that form the <mem> span
    n_prefix: int = 0
    adv_t: float = 0.0       # outcome advantage of its trajectory
    adv_m: float = 0.0       # memory advantage of this round


def expert_samples(tokenizer, task: data.Task, tool: SearchTool, forget: bool, mem_prefix: bool = True,
                   system_prompt: str = data.SYSTEM_PROMPT, mem_answer: float = 0.0,
                   rng: random.Random | None = None, rounds: set[int] | None = None) -> list[Sample]:
    """Render one expert episode as snail-shell training rows, exactly as the agent loop would see them.

    ``rounds`` (0-based round indices) renders only those rows; None renders all.

    With ``mem_answer`` > 0, each round >= 2 also yields (with that probability) a memory-only row:
    ``mem_traj`` (initial prompt + the round's ``<mem>``) -> ``<think> answer </think> <answer> ...``,
    answering from memory alone (``unknown`` where it holds no answer) -- the context P_mem scores.
    """
    prefix = tokenizer.encode("<mem>", add_special_tokens=False) if mem_prefix else []
    records, out = [Record("prompt", task.question)], []
    prompt_ids = encode_chat(tokenizer, prepare_prompt(records, system_prompt))
    for t, (text, query) in enumerate(data.expert_episode(task, forget)):
        if rounds is None or t in rounds:
            ctx = encode_chat(tokenizer, prepare_prompt(records, system_prompt))
            pre = prefix if t > 0 else []
            body = text[len("<mem>"):] if pre else text
            out.append(Sample(ctx + pre + tokenizer.encode(body, add_special_tokens=False), len(ctx) + len(pre)))
            if t > 0 and mem_answer > 0 and rng is not None and rng.random() < mem_answer:
                mem = extract_mem(text)
                answers = data.answers_from_mem(task, mem)
                ctx2 = prompt_ids + tokenizer.encode(f"<mem> {mem} </mem>", add_special_tokens=False)
                out.append(Sample(ctx2 + tokenizer.encode(f"<think> answer </think> <answer> {answers} </answer>",
                                                          add_special_tokens=False), len(ctx2)))
        records.append(Record("llm_gen", text))
        if query is not None:
            records.append(tool_record("search_results", tool.search(" ".join(query))))
    return out


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


# --------------------------------------------------------------------------- checkpoints

def save_checkpoint(path: str, model, tokenizer, optimizer, state: dict) -> None:
    """Atomic checkpoint: write to ``path.tmp`` then rename over ``path``."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({"optimizer": optimizer.state_dict() if optimizer else None, "state": state,
                "torch_rng": torch.get_rng_state()}, os.path.join(tmp, "trainer.pt"))
    old = path + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def log_jsonl(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


# --------------------------------------------------------------------------- SFT

def sft_batch(tokenizer, cfg: Config, step: int) -> list[Sample]:
    """A batch of ``cfg.sft_batch`` expert rounds from a world drawn for this step only."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    world = data.make_world(rng.randrange(10**9))
    tool = SearchTool(world.docs)
    ks, hops = int_range(cfg.sft_objectives), int_range(cfg.hops)
    # curriculum: one objective first (short contexts, where copying is learnt), all K by 40% of steps
    ks = ks[: max(1, round(len(ks) * (step - cfg.sft_copy_steps) / (0.4 * cfg.sft_steps)))]
    out: list[Sample] = []
    while len(out) < cfg.sft_batch:
        task = data.make_task(world, rng, rng.choice(ks), (hops[0], hops[-1]))
        n_rounds = len(data.expert_episode(task))                        # the same count with or without forgetting
        keep = set(rng.sample(range(n_rounds), min(n_rounds, 4)))        # a few rounds per episode: more episodes
        out += expert_samples(tokenizer, task, tool, rng.random() < cfg.forget_p, mem_answer=cfg.sft_mem_answer,
                              rng=rng, rounds=keep)
    return out[: cfg.sft_batch]


def copy_batch(tokenizer, cfg: Config, step: int) -> list[Sample]:
    """Warm-up rows: a random question -> its objectives copied as ``<mem>`` entries.

    A tiny model learns to copy a name from its context only after a long loss plateau. On these
    short rows the default 3-layer model sat at loss 0.46 until step ~650 and copied exactly (loss
    0.02) by step ~900, at 0.17 s a step; on expert episodes the same plateau costs 0.3 s a step and
    its end varied from step ~850 to ~1350 between two runs. (The expert episodes still need slots
    in the question and memory to be learnt: see data.py.)
    """
    rng = random.Random(cfg.seed * 3_000_017 + step)
    names = data.name_pool()
    out = []
    for _ in range(cfg.sft_batch):
        chains = [[rng.choice(names)] + [rng.choice(data.RELATIONS) for _ in range(rng.randint(1, 3))]
                  for _ in range(rng.randint(1, 4))]
        question = data.format_question(chains)
        ctx = encode_chat(tokenizer, prepare_prompt([Record("prompt", question)], data.SYSTEM_PROMPT))
        mem = data.format_mem({k: data.open_path(c) for k, c in enumerate(chains)})
        out.append(Sample(ctx + tokenizer.encode(f"<mem> {mem} </mem>", add_special_tokens=False), len(ctx)))
    return out


def sft_loss(model, batch: dict[str, torch.Tensor], n_tokens: float) -> torch.Tensor:
    """Next-token cross entropy summed over policy tokens (loss mask 1), divided by the whole batch's count."""
    logits = model(input_ids=batch["ids"], attention_mask=batch["attn"]).logits[:, :-1].float()
    target, mask = batch["ids"][:, 1:], batch["loss_mask"][:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                            reduction="none").view_as(mask)
    return (nll * mask).sum() / n_tokens


def run_sft(model, tokenizer, cfg: Config, start: int, optimizer, metrics_path: str, ckpt: str) -> None:
    from tqdm import tqdm
    device = model.device
    sched = lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / cfg.sft_steps))
    model.train()
    for step in tqdm(range(start, cfg.sft_steps), desc="sft", initial=start, total=cfg.sft_steps):
        for g in optimizer.param_groups:
            g["lr"] = cfg.sft_lr * sched(step)
        t0 = time.time()
        samples = copy_batch(tokenizer, cfg, step) if step < cfg.sft_copy_steps else sft_batch(tokenizer, cfg, step)
        n_tokens = float(sum(len(s.ids) - s.n_prompt for s in samples))
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for mb in micro_batches(samples, cfg.micro_tokens):          # sorted by length: little padding
            part = sft_loss(model, collate(mb, tokenizer.pad_token_id, device), n_tokens)
            part.backward()
            loss += part.item()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        if step % 50 == 0 or step == cfg.sft_steps - 1:
            row = {"stage": "sft", "step": step, "loss": loss, "grad_norm": gn.item(),
                   "lr": cfg.sft_lr * sched(step), "sec": time.time() - t0}
            if cfg.eval_every and (step % 500 == 0 or step == cfg.sft_steps - 1):     # under 1 s once the policy is good
                from eval import evaluate_embedded
                model.eval()
                row["val_f1_k2"] = evaluate_embedded(model, tokenizer, [2], cfg.eval_tasks, seed=cfg.seed)[2]["f1"]
                model.train()
            log_jsonl(metrics_path, row)
        if (step + 1) % 500 == 0 and step + 1 < cfg.sft_steps:
            save_checkpoint(ckpt, model, tokenizer, optimizer, {"stage": "sft", "step": step + 1})
    save_checkpoint(os.path.join(cfg.run, "sft"), model, tokenizer, None, {"stage": "sft", "step": cfg.sft_steps})


# --------------------------------------------------------------------------- RL

def rl_tasks(cfg: Config, step: int, real_tasks=None, real_tool=None):
    """The step's questions and search tool: a fresh embedded world, or a slice of the real QA set."""
    rng = random.Random(cfg.seed * 7_000_003 + step)
    if real_tasks is not None:
        return rng.sample(real_tasks, min(cfg.questions, len(real_tasks))), real_tool
    world = data.make_world(rng.randrange(10**9))
    ks, hops = int_range(cfg.rl_objectives), int_range(cfg.rl_hops)
    tasks = [data.make_task(world, rng, rng.choice(ks), (hops[0], hops[-1])) for _ in range(cfg.questions)]
    return tasks, SearchTool(world.docs)


def build_samples(trajs, adv_t: torch.Tensor, mem: dict | None, mem_adv: list[list[float]] | None) -> list[Sample]:
    """One Sample per round, carrying its trajectory's outcome advantage and the round's memory advantage."""
    samples = []
    for i, t in enumerate(trajs):
        round_adv = dict(zip(mem["rounds"][i], mem_adv[i])) if mem is not None else {}
        for r_idx, r in enumerate(t.rounds):
            if not r.output_ids:
                continue
            samples.append(Sample(r.context_ids + r.round_ids, len(r.context_ids) + len(r.prefix_ids),
                                  r.mem_end, len(r.prefix_ids), float(adv_t[i]), round_adv.get(r_idx, 0.0)))
    return samples


def rl_step(model, ref_model, tokenizer, optimizer, cfg: Config, step: int, agent: AgentConfig,
            real_tasks=None, real_tool=None) -> dict:
    """One RL step: rollout -> rewards -> advantages -> PPO update. Returns the step's metrics."""
    m: dict = {"stage": "rl", "step": step}
    tasks, tool = rl_tasks(cfg, step, real_tasks, real_tool)
    gen = torch.Generator(device=model.device).manual_seed(cfg.seed * 9_000_011 + step)
    t0 = time.time()
    model.eval()
    trajs = rollout(model, tokenizer, tasks, cfg.group, tool, agent, gen)
    m["sec_rollout"] = time.time() - t0

    t0 = time.time()
    outs = [outcome_reward(t) for t in trajs]
    scores = torch.tensor([o["score"] for o in outs])
    gids = torch.tensor([t.group_id for t in trajs])
    m.update(score=scores.mean().item(), score_std=scores.std().item() if len(scores) > 1 else 0.0,
             em=sum(o["em"] for o in outs) / len(outs), f1=sum(o["f1"] for o in outs) / len(outs),
             valid=sum(o["valid"] for o in outs) / len(outs),
             turns=sum(len(t.rounds) for t in trajs) / len(trajs),
             tokens=sum(r.n_tokens for t in trajs for r in t.rounds))
    adv_t = grouped_advantage(scores, gids)
    mem, mem_adv = None, None
    if cfg.algo == "mempo":
        mem = memory_rewards(model, tokenizer, trajs, threshold=cfg.threshold, mask_mode=cfg.mem_mask,
                             gate=cfg.mem_gate)
        mem_adv = memory_advantage(mem["rewards"], gids.tolist(), norm=cfg.mem_adv_norm)
        flat = [x for r in mem["rewards"] for x in r]
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
        m.update(mem_reward=mean(flat), p_mem=mean(mem["p_mem"]), p_full=mean(mem["p_full"]),
                 mask_mem=mean(mem["mask_mem"]), mask_full=mean(mem["mask_full"]), empty_frac=mem["empty_frac"],
                 mem_rounds=len(flat), ungrounded=mem["ungrounded"], pool_std=torch.tensor(flat).std().item() if len(flat) > 1 else 0.0)
    m["sec_reward"] = time.time() - t0

    t0 = time.time()
    samples = build_samples(trajs, adv_t, mem, mem_adv)
    if not samples or all(s.adv_t == 0 and s.adv_m == 0 for s in samples):
        m["skipped"] = "all advantages are zero"
        m["sec_update"] = time.time() - t0
        return m
    m.update(ppo_update(model, ref_model, optimizer, samples, cfg, tokenizer.pad_token_id))
    m["sec_update"] = time.time() - t0
    return m


def ppo_update(model, ref_model, optimizer, samples: list[Sample], cfg: Config, pad_id: int) -> dict:
    """Clipped PPO on round samples: micro-batches sorted by length, whole-batch token count as denominator."""
    m: dict = {}
    batches = micro_batches(samples, cfg.micro_tokens)
    m["padding_waste"] = padding_waste(batches)
    n_tokens = float(sum(len(s.ids) - s.n_prompt for s in samples))
    n_seqs = float(len(samples))
    device = model.device
    old = {}
    if cfg.ppo_epochs > 1 or ref_model is not None:
        with torch.no_grad():
            for bi, b in enumerate(batches):
                x = collate(b, pad_id, device)
                if cfg.ppo_epochs > 1:
                    old[("old", bi)] = token_logprobs(model, x["ids"], x["attn"], cfg.temperature)
                if ref_model is not None:
                    old[("ref", bi)] = token_logprobs(ref_model, x["ids"], x["attn"], cfg.temperature)
    model.train()
    stats = {"clip_frac": 0.0, "approx_kl": 0.0, "kl": 0.0}
    for epoch in range(cfg.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for bi, b in enumerate(batches):
            x = collate(b, pad_id, device)
            adv = token_advantages(x["adv_t"], x["adv_m"], x["mem_span"], x["loss_mask"], cfg.mem_weight)
            logp = token_logprobs(model, x["ids"], x["attn"], cfg.temperature)
            old_logp = old.get(("old", bi), logp.detach())
            loss, lm = policy_loss(logp, old_logp, adv, x["loss_mask"], cfg.clip_low, cfg.clip_high,
                                   cfg.dual_clip or None, cfg.agg, old.get(("ref", bi)), cfg.kl_coef,
                                   n_tokens=n_tokens, n_seqs=n_seqs)
            loss.backward()
            total += loss.item()
            w = x["loss_mask"].sum().item() / n_tokens
            for k in stats:
                stats[k] += lm[k] * w / cfg.ppo_epochs
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if not (math.isfinite(total) and torch.isfinite(gn)):
            optimizer.zero_grad(set_to_none=True)
            m["skipped"] = f"non-finite loss {total} or grad norm {gn.item()}"
            break
        optimizer.step()
        m.update(loss=total, grad_norm=gn.item())
    return m | stats


def run_rl(model, tokenizer, cfg: Config, start: int, optimizer, metrics_path: str, ckpt: str,
           real_tasks=None, real_tool=None) -> None:
    from tqdm import tqdm
    from eval import evaluate_embedded
    ref_model = None
    if cfg.kl_coef > 0:
        import copy
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    agent = AgentConfig(system_prompt=data.SYSTEM_PROMPT, context=cfg.train_context, max_turns=cfg.max_turns,
                        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    bar = tqdm(range(start, cfg.rl_steps), desc=f"rl/{cfg.algo}", initial=start, total=cfg.rl_steps)
    for step in bar:
        m = rl_step(model, ref_model, tokenizer, optimizer, cfg, step, agent, real_tasks, real_tool)
        if cfg.eval_every and real_tasks is None and (step + 1) % cfg.eval_every == 0:
            res = evaluate_embedded(model, tokenizer, [4], cfg.eval_tasks, seed=cfg.seed, split="valid")
            m["val_f1_k4"] = res[4]["f1"]
        log_jsonl(metrics_path, m)
        bar.set_postfix(score=f"{m['score']:.3f}", f1=f"{m['f1']:.3f}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.rl_steps:
            save_checkpoint(ckpt, model, tokenizer, optimizer, {"stage": "rl", "step": step + 1})


# --------------------------------------------------------------------------- main

def main(argv=None) -> None:
    import sys
    args = sys.argv[1:] if argv is None else list(argv)
    if "memalpha" in args and args.index("memalpha") > 0 and args[args.index("memalpha") - 1] == "--algo":
        return run_memalpha(parse_memalpha_args(args))     # its own flags: see the Mem-alpha section
    cfg = parse_args(argv)
    os.makedirs(cfg.run, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)
    metrics_path, ckpt = os.path.join(cfg.run, "metrics.jsonl"), os.path.join(cfg.run, "ckpt")
    if not cfg.resume and os.path.exists(metrics_path):     # never mix two runs' metrics or overwrite a checkpoint
        raise SystemExit(f"{cfg.run} already holds a run ({metrics_path}); pass --resume to continue it, "
                         f"or choose another --run")
    state = {"stage": "sft", "step": 0}
    trainer = None
    if cfg.resume and os.path.exists(os.path.join(ckpt, "trainer.pt")):
        trainer = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=False)
        state = trainer["state"]
        model = load_model(ckpt, device)
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(ckpt)
        print(f"resuming {state['stage']} at step {state['step']} from {ckpt}")
    elif cfg.model:
        from transformers import AutoTokenizer
        model, tokenizer = load_model(cfg.model, device), AutoTokenizer.from_pretrained(cfg.model)
        state = {"stage": "rl", "step": 0}      # a real model brings its own cold start
    else:
        tokenizer = data.build_tokenizer()
        model = data.build_tiny_model(tokenizer, cfg.hidden, cfg.layers, cfg.heads, cfg.ffn, seed=cfg.seed).to(device)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    with open(os.path.join(cfg.run, "config.json"), "w") as f:
        json.dump(asdict(cfg), f, indent=1)
    real_tasks = real_tool = None
    if cfg.data:
        if not cfg.corpus:
            raise SystemExit("--data needs --corpus (the documents the search tool searches)")
        real_tasks, real_tool = data.load_qa(cfg.data), SearchTool(data.load_corpus(cfg.corpus))

    if state["stage"] == "sft" and cfg.sft_steps > 0:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
        if trainer is not None and trainer["optimizer"] is not None:
            opt.load_state_dict(trainer["optimizer"])
            torch.set_rng_state(trainer["torch_rng"])
        run_sft(model, tokenizer, cfg, state["step"], opt, metrics_path, ckpt)
        state, trainer = {"stage": "rl", "step": 0}, None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    if trainer is not None and state["stage"] == "rl":
        opt.load_state_dict(trainer["optimizer"])
        torch.set_rng_state(trainer["torch_rng"])
    if cfg.rl_steps > 0:
        run_rl(model, tokenizer, cfg, state["step"], opt, metrics_path, ckpt, real_tasks, real_tool)
    model.save_pretrained(os.path.join(cfg.run, "final"))
    tokenizer.save_pretrained(os.path.join(cfg.run, "final"))
    print(f"saved {cfg.run}/final")



# --- Mem-alpha: SFT cold start + GRPO over chunk steps (ALGORITHM.md section 2)
"""``python train.py --algo memalpha``: learn to build a core / semantic / episodic memory with tool calls.

    SFT   rows of two kinds, mixed in every batch: writer rows (the scripted writer's tool calls for
          one chunk, in the fresh context the loop shows: ``memory.writer_messages``) and answerer
          rows (core + BM25 top-k of each store of the writer's FINAL memory + question -> the
          answer that memory supports, ``data.memory_answer``). ``--flaw-p`` of the instances have
          the never-revising writer, so the cold-started writer has headroom on changed facts.
    r1's answerer = a frozen copy of the cold-started model (or ``--answerer PATH``).
    GRPO  per step: ``--instances`` fresh instances x ``--group`` rollouts (``rollout.memalpha_rollout``);
          reward per chunk step r1 + r2 + beta r3 + gamma r4 (``reward.memalpha_rewards``); ONE group =
          every chunk step of every rollout of an instance, std-normalised (``grpo.grouped_advantage``);
          every chunk step is a training row (context + output, loss on output) for the shared ``ppo_update``.

Choices: the tokenizer is the byte-level BPE of ``data.build_bpe_tokenizer`` trained on the world's and
this task's text (a word-level tokenizer cannot write JSON); every SFT step draws a new world (the
name pool is shared), so held-out worlds test generalisation to new facts; the generation ends at
EOS (``<|im_end|>``) or ``--max-new-tokens``; no KL by default (the paper uses none).
"""


@dataclass
class MemAlphaConfig:
    run: str = "runs/memalpha"
    seed: int = 0
    device: str = "auto"
    algo: str = "memalpha"
    hidden: int = 128
    layers: int = 3
    heads: int = 8
    ffn: int = 256
    vocab: int = 800
    answerer: str = ""           # HF path of r1's frozen answerer; empty = a frozen copy after SFT
    chunks: int = 4
    facts_per_chunk: int = 2
    questions_per_instance: int = 4
    flaw_p: float = 0.5
    sft_steps: int = 600
    sft_copy_steps: int = 300    # first steps on first-chunk writer rows only (copying names into JSON)
    sft_batch: int = 32
    sft_lr: float = 1e-3
    rl_steps: int = 20
    instances: int = 4
    group: int = 8
    lr: float = 1e-4
    max_new_tokens: int = 192
    temperature: float = 1.0
    top_k_memory: int = 3
    context_tokens: int = 64     # the long-context baseline's window (answerer rows over raw chunks in SFT)
    beta: float = 0.05
    gamma: float = 0.1
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = 0.0
    kl_coef: float = 0.0
    agg: str = "token-mean"
    ppo_epochs: int = 1
    micro_tokens: int = 4096
    grad_clip: float = 1.0
    mem_weight: float = 0.0      # no <mem> spans in Mem-alpha (ppo_update reads it)


MEMALPHA_HELP = {
    "run": "output folder", "seed": "seed of worlds, data order and sampling", "device": "auto | cpu | cuda",
    "algo": "memalpha", "hidden": "hidden size of the tiny model", "layers": "layers of the tiny model",
    "heads": "attention heads of the tiny model", "ffn": "MLP width of the tiny model",
    "vocab": "BPE vocabulary size", "answerer": "HF path of r1's frozen answerer (default: frozen copy after SFT)",
    "chunks": "chunks per instance", "facts_per_chunk": "new facts per chunk",
    "questions_per_instance": "questions per instance", "flaw_p": "share of SFT instances whose writer never revises",
    "sft_steps": "SFT cold-start steps (0 skips)",
    "sft_copy_steps": "first SFT steps on first-chunk writer rows only (learn to copy names into JSON)", "sft_batch": "rows per SFT step", "sft_lr": "SFT learning rate",
    "rl_steps": "GRPO steps (0 skips)", "instances": "instances per GRPO step", "group": "rollouts per instance (G)",
    "lr": "GRPO learning rate", "max_new_tokens": "max tokens the writer generates per chunk",
    "temperature": "sampling temperature of the writer", "top_k_memory": "BM25 top-k of each store for r1",
    "context_tokens": "long-context baseline's chunk-token window (its SFT answerer rows use it)",
    "beta": "weight of r3 (compression)", "gamma": "weight of r4 (content validity)",
    "clip_low": "PPO clip below 1", "clip_high": "PPO clip above 1", "dual_clip": "dual clip (0 = off)",
    "kl_coef": "k3 KL to the cold-started policy (0 = none, the paper)", "agg": "loss aggregation",
    "ppo_epochs": "update passes per batch", "micro_tokens": "token budget of one update micro-batch",
    "grad_clip": "max grad norm", "mem_weight": "unused by Mem-alpha",
}


def parse_memalpha_args(argv) -> MemAlphaConfig:
    p = argparse.ArgumentParser(description="Mem-alpha: SFT cold start + GRPO over chunk steps")
    for name, default in asdict(MemAlphaConfig()).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=MEMALPHA_HELP[name])
    return MemAlphaConfig(**vars(p.parse_args(argv)))


def memalpha_tokenizer(vocab: int = 800, seed: int = 0):
    """The byte-level BPE tokenizer trained on the world's text and this task's chunks and tool calls."""
    return data.build_bpe_tokenizer(data.world_texts(seed=seed) + data.memalpha_texts(seed=seed), vocab)


def memalpha_instances(cfg: MemAlphaConfig, world_seed: int, n: int, seed: int, flaw_p: float = 0.0):
    return data.make_memalpha_instances(world_seed, n, seed=seed, n_chunks=cfg.chunks,
                                        facts_per_chunk=cfg.facts_per_chunk,
                                        n_questions=cfg.questions_per_instance, flaw_p=flaw_p)


def memalpha_expert_samples(tokenizer, inst: data.MemInstance, k: int = 3, core_limit: int = 512,
                            context_tokens: int = 64) -> list[Sample]:
    """The scripted writer's rows (one per chunk), then the answerer's rows: one per question from the
    writer's final memory, one per question from raw chunks (``memalpha_raw_rows``)."""
    from memory import StructuredMemory, answerer_messages, writer_messages
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)
    mem = StructuredMemory(core_limit, lambda s: len(enc(s)), seed=0)     # ids as the loop draws them
    rows = []
    for chunk in inst.chunks:
        ctx = encode_chat(tokenizer, writer_messages(mem, chunk.text))
        rows.append(Sample(ctx + enc(data.writer_calls(mem, chunk, inst.flawed)) + [tokenizer.eos_token_id], len(ctx)))
    for q, _ in inst.questions:
        msgs = answerer_messages(mem, q, k)
        ctx = encode_chat(tokenizer, msgs)
        rows.append(Sample(ctx + enc(data.memory_answer(msgs[1]["content"], q)) + [tokenizer.eos_token_id], len(ctx)))
    return rows + memalpha_raw_rows(tokenizer, inst, context_tokens)


def memalpha_raw_rows(tokenizer, inst: data.MemInstance, context_tokens: int = 64) -> list[Sample]:
    """Answerer rows over RAW chunks (the baselines' contexts), so one answerer serves memory and baselines:
    question i sees the long-context window when i is even, the BM25 top-2 chunks when odd."""
    from eval import chunks_messages, long_context_chunks, rag_chunks
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)
    texts = [c.text for c in inst.chunks]
    window = long_context_chunks(texts, lambda s: len(enc(s)), context_tokens)
    rows = []
    for i, (q, _) in enumerate(inst.questions):
        seen = window if i % 2 == 0 else rag_chunks(texts, q, 2)
        ctx = encode_chat(tokenizer, chunks_messages(seen, q))
        rows.append(Sample(ctx + enc(data.chunks_answer(seen, q)) + [tokenizer.eos_token_id], len(ctx)))
    return rows


def memalpha_sft_batch(tokenizer, cfg: MemAlphaConfig, step: int) -> list[Sample]:
    """``cfg.sft_batch`` rows from instances of a world drawn for this step only.

    During the first ``cfg.sft_copy_steps`` steps only the FIRST chunk's writer row of each instance
    (empty memory: the shortest prompt) is used: the tiny model must first learn to copy names from the
    chunk into JSON, and a measured 300-step cold start on all rows wrote one constant memory whatever
    the chunk said (see the README's Mem-alpha section)."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    insts = memalpha_instances(cfg, rng.randrange(10**9), cfg.sft_batch, rng.randrange(10**9), cfg.flaw_p)
    if step < cfg.sft_copy_steps:
        return [memalpha_expert_samples(tokenizer, data.MemInstance(inst.chunks[:1], []))[0] for inst in insts]
    rows = [r for inst in insts for r in memalpha_expert_samples(tokenizer, inst, cfg.top_k_memory,
                                                                 context_tokens=cfg.context_tokens)]
    return rng.sample(rows, cfg.sft_batch)


def memalpha_step(model, answerer, tokenizer, optimizer, cfg: MemAlphaConfig, step: int, instances=None) -> dict:
    """One GRPO step: rollouts -> r1..r4 -> advantages grouped per instance over chunk steps -> ppo_update."""
    from reward import memalpha_rewards
    from rollout import WriterConfig, memalpha_rollout
    if instances is None:
        rng = random.Random(cfg.seed * 7_000_003 + step)
        instances = memalpha_instances(cfg, rng.randrange(10**9), cfg.instances, rng.randrange(10**9))
    gen = torch.Generator(device=model.device).manual_seed(cfg.seed * 9_000_011 + step)
    t0 = time.time()
    model.eval()
    rolls = memalpha_rollout(model, tokenizer, instances, cfg.group,
                             WriterConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature), gen)
    m: dict = {"stage": "rl", "step": step, "sec_rollout": time.time() - t0}
    t0 = time.time()
    rw = memalpha_rewards(answerer, tokenizer, rolls, instances, cfg.top_k_memory, cfg.beta, cfg.gamma)
    steps = [(r.group_id, s, x) for r, xs in zip(rolls, rw["reward"]) for s, x in zip(r.steps, xs)]
    # float64: equal rewards must give exactly-zero advantages, not float32 noise / (std + eps)
    adv = grouped_advantage(torch.tensor([x for _, _, x in steps], dtype=torch.float64),
                            torch.tensor([g for g, _, _ in steps]))
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
    m.update(reward=mean([x for _, _, x in steps]), r1=mean(rw["r1"]), r3=mean(rw["r3"]),
             r2=mean([x for xs in rw["r2"] for x in xs]), r4=mean([x for xs in rw["r4"] for x in xs]),
             mem_tokens=mean(rw["mem_tokens"]), calls=mean([len(s.calls) for _, s, _ in steps]),
             sec_reward=time.time() - t0)
    samples = [Sample(s.context_ids + s.output_ids, len(s.context_ids), adv_t=float(a))
               for (_, s, _), a in zip(steps, adv) if s.output_ids]
    t0 = time.time()
    if not samples or all(abs(s.adv_t) < 1e-6 for s in samples):
        m["skipped"] = "all advantages are zero"
    else:
        m.update(ppo_update(model, None, optimizer, samples, cfg, tokenizer.pad_token_id))
    m["sec_update"] = time.time() - t0
    return m


def run_memalpha(cfg: MemAlphaConfig) -> None:
    """SFT cold start on the scripted writer + answerer, then GRPO with a frozen answerer for r1."""
    import copy
    from tqdm import tqdm
    os.makedirs(cfg.run, exist_ok=True)
    metrics_path = os.path.join(cfg.run, "metrics.jsonl")
    if os.path.exists(metrics_path):
        raise SystemExit(f"{cfg.run} already holds a run ({metrics_path}); choose another --run")
    with open(os.path.join(cfg.run, "config.json"), "w") as f:
        json.dump(asdict(cfg), f, indent=1)
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)
    tokenizer = memalpha_tokenizer(cfg.vocab, cfg.seed)
    model = data.build_tiny_model(tokenizer, cfg.hidden, cfg.layers, cfg.heads, cfg.ffn, seed=cfg.seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / cfg.sft_steps))
    model.train()
    t_start = time.time()
    for step in tqdm(range(cfg.sft_steps), desc="memalpha sft"):
        for g in opt.param_groups:
            g["lr"] = cfg.sft_lr * sched(step)
        samples = memalpha_sft_batch(tokenizer, cfg, step)
        n_tokens = float(sum(len(s.ids) - s.n_prompt for s in samples))
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for mb in micro_batches(samples, cfg.micro_tokens):
            part = sft_loss(model, collate(mb, tokenizer.pad_token_id, device), n_tokens)
            part.backward()
            loss += part.item()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if step % 50 == 0 or step == cfg.sft_steps - 1:
            log_jsonl(metrics_path, {"stage": "sft", "step": step, "loss": loss, "grad_norm": gn.item(),
                                     "sec_total": time.time() - t_start})
    model.save_pretrained(os.path.join(cfg.run, "sft"))
    tokenizer.save_pretrained(os.path.join(cfg.run, "sft"))
    answerer = (load_model(cfg.answerer, device) if cfg.answerer else copy.deepcopy(model)).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    bar = tqdm(range(cfg.rl_steps), desc="memalpha grpo")
    for step in bar:
        m = memalpha_step(model, answerer, tokenizer, opt, cfg, step)
        log_jsonl(metrics_path, m)
        bar.set_postfix(reward=f"{m['reward']:.3f}", r1=f"{m['r1']:.3f}")
    model.save_pretrained(os.path.join(cfg.run, "final"))
    tokenizer.save_pretrained(os.path.join(cfg.run, "final"))
    print(f"saved {cfg.run}/final")


if __name__ == "__main__":
    main()
