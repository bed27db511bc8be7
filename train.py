"""MemPO training: SFT cold start on expert trajectories, then RL (MemPO or plain GRPO).

    python train.py                        # embedded default: tiny world, tokenizer and model, CPU ok
    python train.py --model PATH --data qa.jsonl --corpus wiki.jsonl   # a real run (GPU)
    torchrun --standalone --nproc_per_node 8 train.py --run-dir runs/x ...  # one node, 8 GPUs (section
                                           # "distributed (torchrun)": questions split over ranks, DDP / FSDP2)

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
* The memory reward defaults to the paper's own (``--mem-mask separate --mem-adv-norm std``, weight 1,
  no gate: what ``--faithful`` pins), the best of three arms on the validation worlds once both probes
  were fair (issue 13 study: MemPO faithful, MemPO ``--mem-mask full --mem-adv-norm nonzero``, GRPO;
  3 seeds each, intervals overlapping; README). Before the fair probe, ``full`` / ``nonzero`` was the
  best MemPO variant and the paper's reward lowered held-out F1 (its memory advantage paid for shorter
  memories, STUDIES.md).
* The SFT cold start adds probe rows (``--sft-probe``, issue 13): at random expert rounds >= 2, the
  round's context -> the answers it holds, and prompt + ``<mem>`` -> the answers memory holds, after a
  ``<think> probe </think> <answer>`` marker without loss, on top of the batch's policy rows. Without
  them the small policy cannot answer right after a context (it always writes ``<mem>`` there), so
  P_full was ~0 and the memory reward was P_mem alone (reward.py, "Where the probes sit").
* One optimizer step per rollout batch by default (``--ppo-epochs 1``): then ``old_logp`` is the
  detached ``logp`` of the same forward (ratio 1, exactly on-policy) and no extra forward is spent.
  With more epochs ``old_logp`` is computed once, before the first update.
* A step whose advantages are all zero (every group tied, no memory signal), or whose loss or
  gradient is not finite, is skipped with the reason in the metrics; the weights are untouched.
* ``--algo memtrain`` is MemTrain's self-supervised memory pre-training (masked reconstruction + IMR,
  Dr.GRPO + DAPO filter, every memory step a row; its choices are in the MemTrain section below). Its
  checkpoint feeds task RL through the existing ``--model RUN/final`` (no separate ``--init-from``):
  ``--model SFT/final --algo memtrain`` then ``--model MT/final --algo mempo``. This file is past the
  ~600 lines of STYLE.md; the fixed top-level file list leaves no ``sft.py`` / ``memtrain.py`` to move to.
* ``--algo memalpha`` (section at the end, own flags and config) trains Mem-alpha: SFT on a scripted
  tool-call writer + answerer, then GRPO with one group per instance over every chunk step of its G
  rollouts; it reuses ``ppo_update`` and ``grpo.grouped_advantage`` (rewards in float64, so equal
  rewards give exactly zero advantages and the step is skipped); ``--resume`` as below (its own section).
* Precision: weights (and so gradients and AdamW states) are fp32, the forward runs under bf16
  autocast on CUDA (``--precision``): AdamW stepping bf16 weights directly rounds an lr-1e-6 update
  away for most weights. A resumed run keeps the precision it was started with.
* The system prompt: the world's compact one for the embedded default, ``rollout.PROTOCOL_PROMPT`` for
  a model from elsewhere, a checkpoint's own ``system_prompt.txt`` (every save writes it), or
  ``--system-prompt FILE``. ``--sft-data`` rows are rendered with it (the file's system turn is ignored).
* Checkpoints (``save_pretrained`` + optimizer + step + RNG) are written to a temporary folder and
  renamed into place, so a kill leaves either the old or the new one. Data order depends only on
  ``(seed, step)``, so ``--resume`` continues a killed run with the same batches.
* The KL reference (``--kl-coef`` > 0) is the policy RL started from (the SFT result, or
  ``--model``). It is saved once, as ``RUN/ref/`` (``save_pretrained``), when RL starts, and every
  run, fresh or resumed, loads it from there: a resumed run pulls towards the same policy as an
  uninterrupted one (a copy of the current model would be the step-s checkpoint).
* ``--agg seq-mean-token-mean`` averages per trajectory (the paper's Eq. 10): every round is a
  row, and a row's loss is divided by its whole trajectory's policy-token count and by the number
  of trajectories in the batch (grpo.policy_loss, ``seq_tokens`` / ``n_seqs``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass

import torch

import data
from grpo import (grouped_advantage, memory_advantage, memory_pool_stds, policy_loss, token_advantages,
                  token_logprobs)
from memory import Record, extract_mem, prepare_prompt, tool_record
from reward import answer_template, memory_rewards, outcome_reward
from rollout import (AgentConfig, SearchTool, checkpoint_prompt, encode_chat, load_model, parse_action,
                     pick_device, rollout)


@dataclass
class Config:
    run: str = "runs/default"
    seed: int = 0
    device: str = "auto"
    model: str = ""            # HF model path; empty = build the tiny embedded model
    data: str = ""             # QA JSONL/parquet; empty = the embedded world
    corpus: str = ""           # corpus JSONL (required with --data)
    compose: int = 0           # join K single-objective questions of --data into one (MEM1); 0 = as in the file
    system_prompt: str = ""    # a text file; empty = the checkpoint's own, the protocol prompt, or the world's
    tokenizer: str = "word"    # embedded world: word (one token per word) | bpe (byte-level BPE, Qwen2 model)
    precision: str = "auto"    # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16; weights stay fp32
    sft_data: str = ""         # chat-format trajectory JSONL: SFT stage for any --model
    stage: str = "auto"        # where the run starts: auto (sft for the embedded model or --sft-data, else rl) | sft | rl
    hidden: int = 128          # tiny embedded model
    layers: int = 3            # 3 thin layers, not 2 wide ones: see README (copying names from memory)
    heads: int = 8
    ffn: int = 256
    # SFT cold start (embedded default)
    sft_steps: int = 2900
    sft_batch: int = 64
    sft_lr: float = 1e-3
    sft_copy_steps: int = 800   # warm-up steps on a pure copy task (the 3-layer model learns to copy at ~650-850)
    forget_p: float = 0.25     # fraction of expert episodes whose <mem> forgets earlier objectives (issue 13: 0.5 -> 0.25)
    sft_objectives: str = "1-4"
    hops: str = "1-3"
    # RL
    algo: str = "mempo"        # mempo | grpo | memtrain
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
    prefix_cache: bool = True      # prefill system + question once per question per step (rollout.PrefixCache)
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = 0.0
    kl_coef: float = 0.0
    agg: str = "token-mean"
    ppo_epochs: int = 1
    micro_tokens: int = 2048   # padded tokens per micro-batch; on 2 cores 2048 beat 4096 by ~17% (less padding)
    grad_clip: float = 1.0
    threshold: float = 0.5
    mem_mask: str = "separate"     # separate (the paper's, default since the fair probe) | full (both over P_full's)
    mem_adv_norm: str = "std"      # std (the paper's, default) | nonzero (zero rewards left out) | none | round
    mem_weight: float = 1.0
    mem_gate: bool = False         # no memory credit for a <mem> with words from no earlier tool result
    faithful: bool = False         # exactly the paper's memory reward (overrides the four options above)
    sft_mem_answer: float = 0.0    # extra SFT rows per episode round: memory-only context -> answer
    sft_probe: float = 0.3         # per expert round >= 2: probe rows for both memory-reward contexts (issue 13)
    probe_think: str = "probe"     # data.PROBE: the probes' think word (the marker the SFT probe rows teach)
    # bookkeeping
    save_every: int = 20
    sft_save_every: int = 500
    eval_every: int = 20
    eval_tasks: int = 32
    resume: bool = False
    # distributed (torchrun): see the "distributed (torchrun)" section
    fsdp: bool = False             # shard parameters, gradients and optimizer state with FSDP2 (default: DDP)
    seed_per_question: bool = False  # sample each question's rollouts from its own seed: any world size, same rollouts
    dist_timeout: int = 1800       # seconds a collective may wait for the slowest rank (its rollout) before failing
    # MemTrain (--algo memtrain): --questions tasks x --group G1 end-to-end rollouts per step
    imr_group: int = 2         # G2 IMR rollouts per trajectory (paper 8)
    imr_lam: float = 0.5       # lambda: weight of the IMR reward (0 = the ablation without IMR)
    mem_tokens: int = 48       # memory budget of the memory agent, tokens
    max_chunks: int = 4        # chunks per masked-reconstruction task (8 passages, grouped)
    memtrain_warmup: int = 0   # SFT steps on scripted memory-agent rounds before MemTrain RL (a tiny model's format)


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    helps = {
        "run": "output folder (metrics.jsonl, checkpoints, final/)", "seed": "seed of data order and sampling",
        "device": "auto | cpu | cuda", "model": "HF model name or path (default: the tiny embedded model)",
        "data": "QA file, JSONL or parquet, fields question / golden_answers",
        "corpus": "corpus JSONL with id / contents for the search tool",
        "compose": "MEM1-style multi-objective questions: join K questions of --data into one (0 = off)",
        "system_prompt": "text file with the system prompt (default: the checkpoint's system_prompt.txt, else the "
                         "protocol prompt for a real model, or the embedded world's compact one)",
        "tokenizer": "embedded world tokenizer: word | bpe (byte-level BPE, tags and names several tokens)",
        "precision": "auto | fp32 | bf16: bf16 autocast forward over fp32 master weights (auto = bf16 on CUDA)",
        "sft_data": "JSONL of chat-format trajectories (messages): SFT stage of --model before RL",
        "stage": "auto | sft | rl: sft runs the embedded-world SFT on --model too (e.g. after MemTrain, or to "
                 "adapt a checkpoint to --system-prompt); rl skips SFT; auto = sft unless --model without --sft-data",
        "hidden": "hidden size of the tiny embedded model", "layers": "layers of the tiny embedded model",
        "heads": "attention heads of the tiny embedded model", "ffn": "MLP width of the tiny embedded model",
        "sft_steps": "SFT cold-start steps (embedded default only; 0 skips)", "sft_batch": "rounds per SFT step",
        "sft_lr": "SFT learning rate",
        "sft_copy_steps": "SFT warm-up steps that copy question entries into <mem> (teaches a tiny model to copy names)", "forget_p": "fraction of expert episodes with the forgetting flaw",
        "sft_objectives": "objective counts K of SFT questions, e.g. 1-10", "hops": "hops per objective, e.g. 1-3",
        "algo": "mempo (outcome + memory advantage) | grpo (outcome only) | memtrain (self-supervised memory "
                "pre-training: masked reconstruction + IMR; start RL from its checkpoint with --model RUN/final) | "
                "memalpha (own flags: --algo memalpha --help)", "rl_steps": "RL steps (0 skips RL)",
        "questions": "questions per RL step", "group": "rollouts per question (G)",
        "rl_objectives": "objective counts K of RL questions", "rl_hops": "hops per objective in RL",
        "lr": "RL learning rate", "train_context": "snail | full: the context RL rollouts see",
        "max_turns": "max rounds per training rollout", "max_new_tokens": "max tokens per round",
        "temperature": "sampling temperature (also divides logits in the loss)",
        "prefix_cache": "prefill each question's system prompt + question once per step and reuse its KV cache in "
                        "every round and rollout (--no-prefix-cache: every round prefills its whole prompt)",
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
        "sft_probe": "probability per expert round >= 2 of two extra SFT rows, round context -> answer known so far and "
                     "prompt + <mem> -> answer held in memory, after a '<think> probe </think> <answer>' marker "
                     "that carries no loss: both memory-reward probes in distribution (0 = none)",
        "probe_think": "think word of the memory reward's answer template (the probe marker; 'answer' = no marker)",
        "sft_mem_answer": "probability per expert round of an extra SFT row (prompt + <mem> -> answer), so P_mem is in distribution", "save_every": "checkpoint every N RL steps",
        "sft_save_every": "checkpoint every N SFT steps",
        "eval_every": "greedy eval every N RL steps (and every 500 SFT steps; 0 = off)", "eval_tasks": "tasks per K in the periodic eval",
        "resume": "continue from RUN/ckpt",
        "fsdp": "torchrun only: shard the model with FSDP2 (each decoder layer, then the root) instead of DDP",
        "seed_per_question": "roll out one question at a time, seeded by (seed, step, question): the same rollouts "
                             "with any number of ranks (costs the batching across questions)",
        "dist_timeout": "torchrun only: seconds a collective waits for the other ranks before the run fails",
        "imr_group": "MemTrain: IMR rollouts per end-to-end trajectory (G2)",
        "imr_lam": "MemTrain: lambda, weight of the mean IMR reward in R = e2e + lambda * mean(IMR)",
        "mem_tokens": "MemTrain: memory budget of the memory agent in tokens",
        "max_chunks": "MemTrain: chunks per masked-reconstruction task (--corpus: that corpus; else embedded worlds)",
        "memtrain_warmup": "MemTrain: SFT steps (--sft-batch rows, --sft-lr) on scripted memory-agent rounds before "
                           "the RL steps, so a tiny model writes the step format (0 = none, as in the paper)",
    }
    for name, default in asdict(Config()).items():
        flag = "--" + name.replace("_", "-")
        if name == "run":      # torchrun reads any "--run..." as its own --run-path: --run-dir gets through
            p.add_argument("--run-dir", "--run", dest="run", default=default, help=helps[name] + " (alias --run)")
        elif isinstance(default, bool):        # on by default: --flag / --no-flag
            p.add_argument(flag, action=argparse.BooleanOptionalAction if default else "store_true", default=default,
                           help=helps[name])
        else:
            p.add_argument(flag, type=type(default), default=default, help=helps[name])
    cfg = Config(**vars(p.parse_args(argv)))
    if cfg.stage not in ("auto", "sft", "rl"):
        p.error(f"--stage {cfg.stage}: choose auto, sft or rl")
    if cfg.faithful:
        cfg.mem_mask, cfg.mem_adv_norm, cfg.mem_weight, cfg.mem_gate, cfg.threshold = "separate", "std", 1.0, False, 0.5
    return cfg


# A small SFT recipe (about 40 s on 2 CPU cores) whose policy already writes valid multi-round
# trajectories: the test suite's fixture (conftest.py) and bench.py's model when it has no checkpoint.
SMALL_SFT_ARGS = ["--sft-copy-steps", "200", "--sft-steps", "400", "--sft-batch", "32", "--rl-steps", "0",
                  "--forget-p", "0.5", "--sft-objectives", "1-2", "--hops", "1-2", "--eval-every", "0"]


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
    traj: int | None = None  # trajectory id (rows of one trajectory form one "sequence"); None = its own


def episode_records(question: str, rounds: list[tuple[str, str | None]]):
    """Walk one episode: yield ``(t, text, records before round t)``, the records the agent loop would hold.

    ``rounds[t] = (assistant text, tool result or None)``. The one walk behind the policy's SFT rows and
    the probe rows; a caller encodes the records it needs (``prepare_prompt``: snail or full context).
    """
    records = [Record("prompt", question)]
    for t, (text, tool_text) in enumerate(rounds):
        yield t, text, records
        records.append(Record("llm_gen", text))
        if tool_text is not None:
            kind = "webpage" if parse_action(text)[0] == "access" else "search_results"
            records.append(tool_record(kind, tool_text))


def episode_samples(tokenizer, question: str, rounds: list[tuple[str, str | None]], system_prompt: str,
                    mem_prefix: bool = True, keep: set[int] | None = None, context: str = "snail") -> list[Sample]:
    """Render one episode's rounds as training rows, exactly as the agent loop would see them.

    ``rounds[t] = (assistant text, tool result or None)``. Row t = the round's context (``context``: snail or
    full) + the forced ``<mem>`` prefix (rounds >= 2, loss mask 0) + the rest of the round. ``keep``
    (0-based round indices) renders only those rows; None renders all.
    """
    prefix = tokenizer.encode("<mem>", add_special_tokens=False) if mem_prefix else []
    out = []
    for t, text, records in episode_records(question, rounds):
        if keep is None or t in keep:
            ctx = encode_chat(tokenizer, prepare_prompt(records, system_prompt, None if context == "full" else 1))
            pre = prefix if t > 0 and text.startswith("<mem>") else []
            body = text[len("<mem>"):] if pre else text
            out.append(Sample(ctx + pre + tokenizer.encode(body, add_special_tokens=False), len(ctx) + len(pre)))
    return out


def expert_turns(task: data.Task, tool: SearchTool, forget: bool) -> list[tuple[str, tuple[str, str] | None, str | None]]:
    """The scripted expert's episode with the BM25 tool's real results: ``(round text, query, tool result)``."""
    return [(text, q, tool.search(" ".join(q)) if q is not None else None)
            for text, q in data.expert_episode(task, forget)]


def expert_samples(tokenizer, task: data.Task, tool: SearchTool, forget: bool, mem_prefix: bool = True,
                   system_prompt: str = data.SYSTEM_PROMPT, mem_answer: float = 0.0,
                   rng: random.Random | None = None, rounds: set[int] | None = None,
                   turns: list | None = None) -> list[Sample]:
    """Rows of one scripted expert episode (``episode_samples`` with the BM25 tool's real results).

    ``turns``: the episode's ``expert_turns`` when the caller has them (sft_batch shares them with the
    probe rows); else they are made here.

    With ``mem_answer`` > 0, each rendered round >= 2 also yields (with that probability) a memory-only
    row: ``mem_traj`` (initial prompt + the round's ``<mem>``) -> ``<think> answer </think> <answer> ...``,
    answering from memory alone (``unknown`` where it holds no answer) -- the context P_mem scores.
    """
    turns = turns if turns is not None else expert_turns(task, tool, forget)
    out = episode_samples(tokenizer, task.question, [(text, res) for text, _, res in turns], system_prompt,
                          mem_prefix, rounds)
    if mem_answer > 0 and rng is not None:
        prompt_ids = encode_chat(tokenizer, prepare_prompt([Record("prompt", task.question)], system_prompt))
        rows, k = [], 0
        for t, (text, _, _) in enumerate(turns):
            if rounds is not None and t not in rounds:
                continue
            rows.append(out[k])
            k += 1
            if t > 0 and rng.random() < mem_answer:
                mem = extract_mem(text)
                ctx2 = prompt_ids + tokenizer.encode(f"<mem> {mem} </mem>", add_special_tokens=False)
                answer = f"<think> answer </think> <answer> {data.answers_from_mem(task, mem)} </answer>"
                rows.append(Sample(ctx2 + tokenizer.encode(answer, add_special_tokens=False), len(ctx2)))
        out = rows
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

def save_checkpoint(path: str, model, tokenizer, optimizer, state: dict, system_prompt: str) -> None:
    """Atomic checkpoint: write to ``path.tmp`` then rename over ``path``. Torchrun: every rank calls it
    (FSDP2 gathers the full state), rank 0 writes."""
    model_sd, optimizer_sd = full_state(model, optimizer)
    if DIST.rank != 0:
        return
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, model, tokenizer, system_prompt, model_sd)
    torch.save({"optimizer": optimizer_sd, "state": state,
                "torch_rng": torch.get_rng_state()}, os.path.join(tmp, "trainer.pt"))
    old = path + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def log_jsonl(path: str, row: dict) -> None:
    if DIST.rank != 0:       # torchrun: rank 0 writes the (already reduced) metrics
        return
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


# --------------------------------------------------------------------------- SFT

def autocast(cfg: Config, device: torch.device):
    """The forward's precision: bf16 autocast over fp32 master weights (``--precision``), else a no-op.

    Weights, gradients and AdamW states stay fp32 (16 bytes a parameter), so an update of lr 1e-6 on
    weights of scale 0.02 is not rounded away, as it is when AdamW steps bf16 weights directly.
    """
    on = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


def probe_samples(tokenizer, task: data.Task, tool: SearchTool, forget: bool, rng: random.Random, p: float,
                  system_prompt: str = data.SYSTEM_PROMPT, rounds: set[int] | None = None,
                  context: str = "snail", think: str = data.PROBE, turns: list | None = None) -> list[Sample]:
    """Probe rows: teach the policy to answer from BOTH contexts the memory reward scores (issue 13).

    For each expert round t >= 2 (``rounds`` of them; with probability ``p``) two rows, so neither probe is
    favoured: ``full_traj`` (the round's context as the agent saw it, no forced prefix) -> the answers that
    context holds (``data.context_answers``), and ``mem_traj`` (prompt + the round's ``<mem>``) -> the
    answers that memory holds (``data.answers_from_mem``); ``unknown`` where there is none. Both end in
    the reward's own template ``<think> probe </think> <answer> a1 ; a2 </answer>``; the loss starts at the
    first answer word, so the marker (``<think> probe``) is never learnt as an output: the policy's own
    choice after ``</mem>`` (search or answer) gets no gradient from these rows and it does not learn to
    stop early (what ``--sft-mem-answer`` rows, which do train ``<think> answer``, did). ``turns``: as in
    ``expert_samples``.
    """
    turns = turns if turns is not None else expert_turns(task, tool, forget)
    episode = [(text, q) for text, q, _ in turns]
    prompt_ids = encode_chat(tokenizer, prepare_prompt([Record("prompt", task.question)], system_prompt))
    out = []
    for t, text, records in episode_records(task.question, [(text, res) for text, _, res in turns]):
        if t >= 1 and (rounds is None or t in rounds) and rng.random() < p:
            ctx = encode_chat(tokenizer, prepare_prompt(records, system_prompt, None if context == "full" else 1))
            mem_ctx = prompt_ids + tokenizer.encode(f"<mem> {extract_mem(text)} </mem>", add_special_tokens=False)
            for c, answer in ((ctx, data.context_answers(task, episode, t, context)),
                              (mem_ctx, data.answers_from_mem(task, extract_mem(text)))):
                ids, words = answer_template(tokenizer, [[a] for a in answer.split(" ; ")], think)
                first = next(j for j, w in enumerate(words) if w)
                out.append(Sample(c + ids, len(c) + first))
    return out


def file_batch(tokenizer, cfg: Config, step: int, trajectories: list[dict], system_prompt: str) -> list[Sample]:
    """A batch of ``cfg.sft_batch`` rounds from a chat-format trajectory file (``--sft-data``): 4 rounds an episode."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    out: list[Sample] = []
    while len(out) < cfg.sft_batch:
        tr = rng.choice(trajectories)
        keep = set(rng.sample(range(len(tr["rounds"])), min(len(tr["rounds"]), 4)))
        out += episode_samples(tokenizer, tr["question"], tr["rounds"], system_prompt, keep=keep,
                               context=cfg.train_context)
    return out[: cfg.sft_batch]


def sft_batch(tokenizer, cfg: Config, step: int, system_prompt: str = data.SYSTEM_PROMPT) -> list[Sample]:
    """A batch of ``cfg.sft_batch`` expert rounds from a world drawn for this step only."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    world = data.make_world(rng.randrange(10**9))
    tool = SearchTool(world.docs)
    ks, hops = int_range(cfg.sft_objectives), int_range(cfg.hops)
    # curriculum: one objective first (short contexts, where copying is learnt), all K by 40% of steps
    ks = ks[: max(1, round(len(ks) * (step - cfg.sft_copy_steps) / (0.4 * cfg.sft_steps)))]
    out: list[Sample] = []
    probes: list[Sample] = []
    while len(out) < cfg.sft_batch:
        task = data.make_task(world, rng, rng.choice(ks), (hops[0], hops[-1]))
        n_rounds = len(data.expert_episode(task))                        # the same count with or without forgetting
        keep = set(rng.sample(range(n_rounds), min(n_rounds, 4)))        # a few rounds per episode: more episodes
        forget = rng.random() < cfg.forget_p
        turns = expert_turns(task, tool, forget)                         # searched once for both kinds of row
        out += expert_samples(tokenizer, task, tool, forget, system_prompt=system_prompt,
                              mem_answer=cfg.sft_mem_answer, rng=rng, rounds=keep, turns=turns)
        if cfg.sft_probe > 0:                                            # on top of the batch: the policy's rows stay
            probes += probe_samples(tokenizer, task, tool, forget, rng, cfg.sft_probe, system_prompt, rounds=keep,
                                    context=cfg.train_context, think=cfg.probe_think, turns=turns)
    return out[: cfg.sft_batch] + probes


def copy_batch(tokenizer, cfg: Config, step: int, system_prompt: str = data.SYSTEM_PROMPT) -> list[Sample]:
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
        ctx = encode_chat(tokenizer, prepare_prompt([Record("prompt", question)], system_prompt))
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


def run_sft(model, tokenizer, cfg: Config, start: int, optimizer, metrics_path: str, ckpt: str,
            system_prompt: str = data.SYSTEM_PROMPT, trajectories: list[dict] | None = None) -> None:
    from tqdm import tqdm
    device = model.device
    sched = lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / cfg.sft_steps))
    model.train()
    train_model = update_module(model)
    for step in tqdm(range(start, cfg.sft_steps), desc="sft", initial=start, total=cfg.sft_steps, disable=DIST.rank > 0):
        for g in optimizer.param_groups:
            g["lr"] = cfg.sft_lr * sched(step)
        t0 = time.time()
        if trajectories is not None:
            samples = file_batch(tokenizer, cfg, step, trajectories, system_prompt)
        elif step < cfg.sft_copy_steps:
            samples = copy_batch(tokenizer, cfg, step, system_prompt)
        else:
            samples = sft_batch(tokenizer, cfg, step, system_prompt)
        n_tokens = float(sum(len(s.ids) - s.n_prompt for s in samples))     # every rank builds the whole batch
        samples = samples[DIST.rank::DIST.world]                              # torchrun: this rank's rows
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        batches = even_micro_batches(micro_batches(samples, cfg.micro_tokens), tokenizer.pad_token_id)
        for bi, mb in enumerate(batches):          # sorted by length: little padding
            with grad_sync(model, bi == len(batches) - 1):
                with autocast(cfg, device):
                    part = sft_loss(train_model, collate(mb, tokenizer.pad_token_id, device), n_tokens)
                (part * DIST.world).backward()     # DDP / FSDP2 average over ranks
            loss += part.item()
        loss = all_sum([loss])[0]
        gn = grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        optimizer.step()
        if step % 50 == 0 or step == cfg.sft_steps - 1:
            row = {"stage": "sft", "step": step, "loss": loss, "grad_norm": gn.item(),
                   "lr": cfg.sft_lr * sched(step), "sec": time.time() - t0}
            if cfg.eval_every and not cfg.model and (step % 500 == 0 or step == cfg.sft_steps - 1):  # under 1 s once good
                from eval import evaluate_embedded
                model.eval()
                with full_weights(model):
                    if DIST.rank == 0:
                        row["val_f1_k2"] = evaluate_embedded(model, tokenizer, [2], cfg.eval_tasks, seed=cfg.seed,
                                                             system_prompt=system_prompt)[2]["f1"]
                model.train()
            log_jsonl(metrics_path, row)
        if (step + 1) % cfg.sft_save_every == 0 and step + 1 < cfg.sft_steps:
            save_checkpoint(ckpt, model, tokenizer, optimizer, {"stage": "sft", "step": step + 1,
                                                                "precision": cfg.precision}, system_prompt)
    save_checkpoint(os.path.join(cfg.run, "sft"), model, tokenizer, None,
                    {"stage": "sft", "step": cfg.sft_steps, "precision": cfg.precision}, system_prompt)


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
                                  r.mem_end, len(r.prefix_ids), float(adv_t[i]), round_adv.get(r_idx, 0.0), i))
    return samples


def rl_step(model, ref_model, tokenizer, optimizer, cfg: Config, step: int, agent: AgentConfig,
            real_tasks=None, real_tool=None) -> dict:
    """One RL step: rollout -> rewards -> advantages -> PPO update. Returns the step's metrics."""
    m: dict = {"stage": "rl", "step": step}
    tasks, tool = rl_tasks(cfg, step, real_tasks, real_tool)
    share = my_questions(len(tasks))                   # torchrun: this rank's questions; plain: all of them
    tasks = tasks[share.start:share.stop]
    mem, mem_adv = None, None
    # collective-free phase (FSDP2: on unsharded weights); an error on one rank stops every rank
    with full_weights(model), all_ranks_or_none(f"rl step {step}"):
        t0 = time.time()
        model.eval()
        with autocast(cfg, model.device):
            trajs = rollout_share(model, tokenizer, tasks, share.start, cfg, step, tool, agent)
        m["sec_rollout"] = time.time() - t0

        t0 = time.time()
        outs = [outcome_reward(t) for t in trajs]
        scores = torch.tensor([o["score"] for o in outs])
        gids = torch.tensor([t.group_id for t in trajs])
        adv_t = grouped_advantage(scores, gids)
        if cfg.algo == "mempo":
            with autocast(cfg, model.device):
                mem = memory_rewards(model, tokenizer, trajs, threshold=cfg.threshold, mask_mode=cfg.mem_mask,
                                     think=cfg.probe_think, gate=cfg.mem_gate)
            mem_adv = memory_advantage(mem["rewards"], gids.tolist(), mem["rounds"], norm=cfg.mem_adv_norm)
        m["sec_reward"] = time.time() - t0

    # metrics over every rank's trajectories (gather: identity without torchrun)
    outs = gather(outs)
    scores = torch.tensor([o["score"] for o in outs])
    turns = gather([len(t.rounds) for t in trajs])
    m.update(score=scores.mean().item(), score_std=scores.std().item() if len(scores) > 1 else 0.0,
             em=sum(o["em"] for o in outs) / len(outs), f1=sum(o["f1"] for o in outs) / len(outs),
             valid=sum(o["valid"] for o in outs) / len(outs),
             turns=sum(turns) / len(turns),
             tokens=sum(gather([sum(r.n_tokens for t in trajs for r in t.rounds)])))
    if mem is not None:
        flat = gather([x for r in mem["rewards"] for x in r])
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
        n_empty, n_none = all_sum([mem["empty_frac"] * mem["n"], mem["no_signal_frac"] * mem["n"]])
        m.update(mem_reward=mean(flat), p_mem=mean(gather(mem["p_mem"])), p_full=mean(gather(mem["p_full"])),
                 mask_mem=mean(gather(mem["mask_mem"])), mask_full=mean(gather(mem["mask_full"])),
                 empty_frac=n_empty / len(flat) if flat else 0.0, no_signal_frac=n_none / len(flat) if flat else 0.0,
                 mem_rounds=len(flat), ungrounded=sum(gather([mem["ungrounded"]])),
                 # mean over the advantage's pools (per question; per round / nonzero as --mem-adv-norm) of the
                 # pool std; a group never spans ranks, so each rank's pools are whole: gather the per-pool stds
                 pool_std=mean(gather(memory_pool_stds(mem["rewards"], gids.tolist(), mem["rounds"], cfg.mem_adv_norm))))

    t0 = time.time()
    samples = build_samples(trajs, adv_t, mem, mem_adv)
    if not all_sum([float(any(s.adv_t != 0 or s.adv_m != 0 for s in samples))])[0]:   # on every rank
        m["skipped"] = "all advantages are zero"
    else:
        m.update(ppo_update(model, ref_model, optimizer, samples, cfg, tokenizer.pad_token_id))
    m["sec_update"] = time.time() - t0
    secs = ("sec_rollout", "sec_reward", "sec_update")
    m.update(zip(secs, all_max([m[k] for k in secs])))       # the slowest rank sets the step's time
    return m


def ppo_update(model, ref_model, optimizer, samples: list[Sample], cfg: Config, pad_id: int) -> dict:
    """Clipped PPO on round samples: micro-batches sorted by length, whole-batch token count as denominator."""
    m: dict = {}
    batches = micro_batches(samples, cfg.micro_tokens)
    real, padded = all_sum([sum(len(s.ids) for s in samples), sum(len(b) * len(b[-1].ids) for b in batches)])
    m["padding_waste"] = 1 - real / max(padded, 1)      # = padding_waste(batches), over every rank's batches
    batches = even_micro_batches(batches, pad_id)       # torchrun: the same count on every rank
    n = denominators(samples)                           # the GLOBAL batch's counts (all ranks)
    n_tokens, n_seqs, seq_tokens = n["n_tokens"], n["n_seqs"], n["seq_tokens"]
    device = model.device
    train_model = update_module(model)
    old = {}
    if cfg.ppo_epochs > 1 or ref_model is not None:
        with torch.no_grad(), autocast(cfg, device):
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
            with grad_sync(model, bi == len(batches) - 1):
                with autocast(cfg, device):
                    logp = token_logprobs(train_model, x["ids"], x["attn"], cfg.temperature)
                old_logp = old.get(("old", bi), logp.detach())
                loss, lm = policy_loss(logp, old_logp, adv, x["loss_mask"], cfg.clip_low, cfg.clip_high,
                                       cfg.dual_clip or None, cfg.agg, old.get(("ref", bi)), cfg.kl_coef,
                                       n_tokens=n_tokens, n_seqs=n_seqs,
                                       seq_tokens=torch.tensor([seq_tokens.get(seq_key(s), 0.0) for s in b], device=device))
                (loss * DIST.world).backward()      # DDP / FSDP2 average over ranks; the global loss is the sum
            total += loss.item()
            w = x["loss_mask"].sum().item() / n_tokens
            for k in stats:
                stats[k] += lm[k] * w / cfg.ppo_epochs
        total = all_sum([total])[0]
        gn = grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        if not (math.isfinite(total) and torch.isfinite(gn)):
            optimizer.zero_grad(set_to_none=True)
            m["skipped"] = f"non-finite loss {total} or grad norm {gn.item()}"
            break
        optimizer.step()
        m.update(loss=total, grad_norm=gn.item())
    return m | dict(zip(stats, all_sum(list(stats.values()))))


def agent_config(cfg: Config, system_prompt: str = data.SYSTEM_PROMPT) -> AgentConfig:
    """The agent of training rollouts: sampled at ``--temperature``, ``--train-context`` snail | full."""
    return AgentConfig(system_prompt=system_prompt, context=cfg.train_context, max_turns=cfg.max_turns,
                       max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, prefix_cache=cfg.prefix_cache)


def reference_model(model, cfg: Config, start: int):
    """The KL reference = the policy RL started from: saved as ``RUN/ref`` at RL step 0, always loaded from there.

    On ``--resume`` (start > 0) ``model`` is the step-s checkpoint, so the reference must come from disk.
    It is loaded in the policy's dtype, so at step 0 the KL is exactly 0.
    """
    from transformers import AutoModelForCausalLM
    path = os.path.join(cfg.run, "ref")
    if start == 0:                      # RL starts (or restarts before its first checkpoint): this is the reference
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    elif not os.path.isdir(path):
        raise SystemExit(f"--kl-coef > 0 on --resume needs the KL reference {path}, saved when RL started")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=model.dtype,
                                               attn_implementation=model.config._attn_implementation)
    return ref.to(model.device).eval().requires_grad_(False)


def run_rl(model, tokenizer, cfg: Config, start: int, optimizer, metrics_path: str, ckpt: str,
           real_tasks=None, real_tool=None, system_prompt: str = data.SYSTEM_PROMPT) -> None:
    from tqdm import tqdm
    from eval import evaluate_embedded
    ref_model = None
    if cfg.kl_coef > 0:
        if DIST.fsdp:
            raise SystemExit("--kl-coef > 0 with --fsdp is not supported (the reference model would need its own sharding)")
        ref_model = reference_model(model, cfg, start)
    agent = agent_config(cfg, system_prompt)
    bar = tqdm(range(start, cfg.rl_steps), desc=f"rl/{cfg.algo}", initial=start, total=cfg.rl_steps, disable=DIST.rank > 0)
    for step in bar:
        if cfg.algo == "memtrain":
            m = memtrain_step(model, ref_model, tokenizer, optimizer, cfg, step, real_tool)
        else:
            m = rl_step(model, ref_model, tokenizer, optimizer, cfg, step, agent, real_tasks, real_tool)
        if model.device.type == "cuda":
            m["peak_cuda_mb"] = torch.cuda.max_memory_allocated(model.device) / 2**20
        if cfg.eval_every and real_tasks is None and (step + 1) % cfg.eval_every == 0:
            with full_weights(model):
                if DIST.rank == 0:
                    res = evaluate_embedded(model, tokenizer, [4], cfg.eval_tasks, seed=cfg.seed, split="valid",
                                            system_prompt=system_prompt)
                    m["val_f1_k4"] = res[4]["f1"]
        log_jsonl(metrics_path, m)
        bar.set_postfix(score=f"{m['score']:.3f}", f1=f"{m.get('f1', m.get('e2e', 0.0)):.3f}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.rl_steps:
            save_checkpoint(ckpt, model, tokenizer, optimizer,
                            {"stage": "rl", "step": step + 1, "precision": cfg.precision}, system_prompt)


# --------------------------------------------------------------------------- distributed (torchrun)
#
#   torchrun --standalone --nproc_per_node 8 train.py --run-dir runs/x ...       (one node, 8 GPUs)
#
# ``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK; ``setup_distributed`` then opens a process group
# (nccl on CUDA, gloo on CPU) and binds GPU LOCAL_RANK. Without them (plain ``python train.py``) the
# functions below are identities: no process group, no wrapper, no communication.
#
# * Rollouts are split by question: rank r takes questions [r*B/W, (r+1)*B/W) of the step (the same
#   ``rl_tasks`` list on every rank) and all G rollouts of each, so a group never spans ranks and the
#   outcome advantage, the memory reward and its pool need no communication.
# * Seeding (a choice): by default rank r samples its share with one generator seeded from
#   (seed, step, r), one batched rollout per rank; rank 0 of 1 uses exactly the single-process seed.
#   A W-rank run therefore draws different (equally distributed) rollouts from a 1-rank run.
#   ``--seed-per-question`` rolls out one question at a time with a generator seeded from
#   (seed, step, question index): the rollouts are the same whichever rank (and how many ranks) run
#   them, at the cost of batching across questions (bench / README give the cost).
# * The update is the single-process update: every loss denominator is the GLOBAL batch's
#   (``denominators``: one all_reduce), each rank back-propagates loss * W (DDP and FSDP2 average
#   gradients over ranks; the sum over ranks of the per-rank losses is the global loss), gradients
#   are synchronised once per optimizer step (no_sync / ``set_requires_gradient_sync`` on all other
#   micro-batches), and every rank runs the same number of micro-batches (short ranks add an empty
#   one: loss 0) because FSDP2 all-gathers in every forward. Grad-norm clipping sees the global
#   gradient (DDP: identical on every rank; FSDP2: ``clip_grad_norm_`` reduces the DTensor norm).
# * Default DDP (weights replicated); ``--fsdp``: FSDP2 ``fully_shard`` on each decoder layer, then the
#   root. Generation and the memory-reward pass under FSDP2 run inside ``full_weights``: every layer is
#   unsharded once (one all-gather per layer) and kept unsharded until the rollout is scored, so the
#   ranks' different numbers of decode steps need no communication; memory during the rollout is then
#   the full model (bf16 weights of one replica) on every GPU, as with DDP, plus the sharded gradients
#   and optimizer state; it is freed (resharded) before the update.
# * Errors: the collective-free phase of a step (rollout, rewards) runs under ``all_ranks_or_none``:
#   a status flag is all-reduced after it, and if one rank raised, every rank stops with an error
#   naming it (the failing rank raises its own exception). A step skipped for zero advantages or a
#   non-finite loss / gradient is decided on global numbers, so every rank skips it. A collective that
#   waits longer than ``--dist-timeout`` seconds fails instead of hanging, and torchrun ends the other
#   workers when one exits with an error.
# * Metrics are computed from every rank's per-trajectory values (gathered) with the single-process
#   formulas; seconds are the slowest rank's; rank 0 writes metrics.jsonl, config.json and every
#   checkpoint. A checkpoint is a full ``save_pretrained`` model (FSDP2 gathers it to rank 0) and a
#   full optimizer state in the single-process format, so a run resumes with any world size, and
#   every rank reads it (multi-node: the run folder must be on a shared filesystem).
# * Evaluation (periodic evals here, and eval.py) runs on rank 0 only.

@dataclass
class Dist:
    """This process's place in the run; the defaults are plain ``python train.py``."""
    active: bool = False          # a process group is open (torchrun, any world size)
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    fsdp: bool = False
    comm_device: str = "cpu"      # where the small tensors of all_reduce live (cuda for nccl)
    ddp: object = None            # the DDP wrapper used for the update (the raw model does everything else)


DIST = Dist()


def setup_distributed(cfg: Config) -> torch.device:
    """Under torchrun: open the process group, bind a GPU, check B % W; always returns this rank's device."""
    global DIST
    if "WORLD_SIZE" not in os.environ:
        if cfg.fsdp:
            raise SystemExit("--fsdp needs torchrun (e.g. torchrun --standalone --nproc_per_node 2 train.py ...)")
        return pick_device(cfg.device)
    import datetime
    import torch.distributed as dist
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if cfg.questions % world:
        raise SystemExit(f"--questions {cfg.questions} is not divisible by the {world} ranks: each rank takes "
                         f"questions / ranks questions of a step")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg.dist_timeout))
    DIST = Dist(True, rank, world, local_rank, cfg.fsdp, str(device) if device.type == "cuda" else "cpu")
    return device


def is_dist() -> bool:
    return DIST.active


def all_sum(values: list[float]) -> list[float]:
    """Sum of each value over ranks (float64, one all_reduce)."""
    if not is_dist():
        return list(values)
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64, device=DIST.comm_device)
    dist.all_reduce(t)
    return t.tolist()


def all_max(values: list[float]) -> list[float]:
    """Max of each value over ranks."""
    if not is_dist():
        return list(values)
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64, device=DIST.comm_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def gather(xs: list) -> list:
    """Concatenation of every rank's list, in rank order (= question order); plain: ``xs`` itself."""
    if not is_dist():
        return xs
    import torch.distributed as dist
    parts = [None] * DIST.world
    dist.all_gather_object(parts, xs)
    return [x for p in parts for x in p]


def my_questions(n: int) -> range:
    """Indices of this rank's share of a step's ``n`` questions."""
    if n % DIST.world:
        raise ValueError(f"{n} questions cannot be split evenly over {DIST.world} ranks")
    k = n // DIST.world
    return range(DIST.rank * k, (DIST.rank + 1) * k)


def seq_key(s: Sample) -> tuple:
    """The sequence a row belongs to for ``seq-mean-*``: its trajectory (a row without one is its own)."""
    return ("traj", s.traj) if s.traj is not None else ("row", id(s))


def denominators(samples: list[Sample]) -> dict:
    """Every loss denominator of ``ppo_update`` for the WHOLE batch (micro-batches split trajectories) and, under
    torchrun, the GLOBAL one: policy tokens and sequences summed over ranks in one all_reduce; per sequence
    (= trajectory) its policy tokens, local, since a trajectory's rows never leave its rank."""
    seq_tokens: dict = {}
    for s in samples:
        seq_tokens[seq_key(s)] = seq_tokens.get(seq_key(s), 0.0) + len(s.ids) - s.n_prompt
    local = [float(sum(seq_tokens.values())), float(sum(1 for n in seq_tokens.values() if n > 0))]
    n_tokens, n_seqs = all_sum(local)
    return {"n_tokens": n_tokens, "n_seqs": n_seqs, "seq_tokens": seq_tokens}


def even_micro_batches(batches: list[list[Sample]], pad_id: int) -> list[list[Sample]]:
    """Append empty micro-batches (one row of padding, loss mask 0) until every rank has as many."""
    n = int(all_max([len(batches)])[0])
    return batches + [[Sample([pad_id, pad_id], 2)] for _ in range(n - len(batches))]


def update_module(model):
    """The module to run forward + backward of the update through: the DDP wrapper, else the model."""
    return DIST.ddp if DIST.ddp is not None else model


@contextlib.contextmanager
def grad_sync(model, sync: bool):
    """Synchronise gradients in this backward only when ``sync`` (the optimizer step's last micro-batch)."""
    if DIST.ddp is not None and not sync:
        with DIST.ddp.no_sync():
            yield
        return
    if DIST.fsdp:
        model.set_requires_gradient_sync(sync)
    yield


def wrap_for_training(model, device: torch.device):
    """DDP (default) or FSDP2 (``--fsdp``) under torchrun; returns the model (FSDP2 wraps it in place)."""
    if not is_dist():
        return model
    import torch.distributed as dist
    if DIST.fsdp:
        from torch.distributed.fsdp import fully_shard
        for t in model.state_dict().values():      # identical weights on every rank before sharding
            dist.broadcast(t, 0)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel
    # no buffer sync: rotary buffers are constants, and a broadcast per forward would be a collective in every
    # forward (DDP broadcasts the parameters from rank 0 once, here). torch 2.13 names it forward_sync_buffers
    # (broadcast_buffers is deprecated there); older torch has only broadcast_buffers.
    import inspect
    no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else "broadcast_buffers")
    DIST.ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       **{no_sync: False})
    return model


@contextlib.contextmanager
def full_weights(model):
    """FSDP2: unshard every layer for generation / scoring (ranks may then run different numbers of
    forwards with no communication), reshard after. Other modes: nothing to do."""
    if not DIST.fsdp:
        yield
        return
    from torch.distributed.fsdp import FSDPModule
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.unshard()
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
        model.set_reshard_after_forward(True)


@contextlib.contextmanager
def all_ranks_or_none(what: str):
    """Run a collective-free block on every rank; if it raised on any rank, raise on every rank."""
    failed = True
    try:
        yield
        failed = False
    finally:
        if is_dist():
            n_failed = all_sum([float(failed)])[0]
            if n_failed and not failed:
                raise RuntimeError(f"{what}: {int(n_failed)} other rank(s) failed; stopping this rank too")


def grad_norm_value(gn: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_``'s total norm as a plain tensor (FSDP2 returns a DTensor)."""
    return gn.full_tensor() if hasattr(gn, "full_tensor") else gn


def full_state(model, optimizer) -> tuple[dict | None, dict | None]:
    """(model state dict or None = the model's own, optimizer state dict in single-process format);
    under FSDP2 both are gathered (every rank must call this) and only rank 0 gets them."""
    if not DIST.fsdp:
        return None, optimizer.state_dict() if optimizer else None
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(model, options=opts)
    osd = None
    if optimizer is not None:
        full = get_optimizer_state_dict(model, optimizer, options=opts)
        names = [n for g in full.get("param_groups", []) for n in g["params"]]
        index = {n: i for i, n in enumerate(names)}      # parameter name -> position, as optimizer.state_dict()
        osd = {"state": {index[n]: s for n, s in full.get("state", {}).items()},
               "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in full.get("param_groups", [])]}
    return sd, osd


def load_optimizer(model, optimizer, osd: dict) -> None:
    """Load a single-process-format optimizer state (as ``save_checkpoint`` writes it) into any mode."""
    if not DIST.fsdp:
        optimizer.load_state_dict(osd)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    model.zero_grad(set_to_none=True)     # torch initialises an empty optimizer state only when no grads exist
    names = [n for n, p in model.named_parameters()]      # the order the optimizer was built in
    full = {"state": {names[i]: s for i, s in osd["state"].items()},
            "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in osd["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))


def save_model(path: str, model, tokenizer, system_prompt: str, state_dict: dict | None = None) -> None:
    """``save_pretrained`` of the (full) model and the tokenizer, plus the system prompt the model was trained
    with (``system_prompt.txt``, read back by ``rollout.checkpoint_prompt``); rank 0 only."""
    model.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "system_prompt.txt"), "w", encoding="utf-8") as f:
        f.write(system_prompt)
    if DIST.fsdp:   # FSDP2 renames the class (FSDPLlamaForCausalLM); the config must name the HF class
        cfg_path = os.path.join(path, "config.json")
        conf = json.load(open(cfg_path))
        conf["architectures"] = [a.removeprefix("FSDP") for a in conf.get("architectures", [])]
        json.dump(conf, open(cfg_path, "w"), indent=2)


def rollout_share(model, tokenizer, tasks: list, q0: int, cfg: Config, step: int, tool, agent: AgentConfig) -> list:
    """This rank's rollouts of ``tasks`` (global question indices q0, q0+1, ...); group ids are global."""
    if cfg.seed_per_question:
        trajs = []
        for q, task in enumerate(tasks, start=q0):
            gen = torch.Generator(device=model.device).manual_seed((cfg.seed * 9_000_011 + step) * 1_000_003 + q)
            part = rollout(model, tokenizer, [task], cfg.group, tool, agent, gen)
            for t in part:
                t.group_id = q
            trajs += part
        return trajs
    gen = torch.Generator(device=model.device).manual_seed(cfg.seed * 9_000_011 + step + DIST.rank * 10**12)
    trajs = rollout(model, tokenizer, tasks, cfg.group, tool, agent, gen)
    for t in trajs:
        t.group_id += q0
    return trajs


# --- MemTrain: self-supervised memory pre-training (ALGORITHM.md section 3)
#
# One step: --questions masked-reconstruction tasks (a fresh embedded world each step, or --corpus),
# G1 = --group memory-agent rollouts per task, G2 = --imr-group IMR rollouts per trajectory, then
#
#     R_i = 1[e2e_i] + lam / G2 * sum_j 1[imr_ij]          (reward.memtrain_reward)
#     A_i = R_i - mean_group(R)                            (Dr.GRPO: grpo.grouped_advantage(norm_by_std=False))
#     groups whose R are all equal are dropped             (DAPO: grpo.filter_groups; count logged)
#
# and every memory-update step of a kept trajectory is a training row carrying A_i, through the shared
# ppo_update. Choices: each of the G2 IMR rollouts draws its own (k, l, target), so they probe different
# memories; IMR rollouts are not training rows (their only job is the reward); KL and lr are the common
# flags (paper: KL 1e-3, lr 1e-6 on 7B). There is no --init-from: --model RUN/final already loads a
# checkpoint (tokenizer with [MASK] included) and starts RL from it, so MemPO / GRPO after MemTrain is
# ``train.py --model MT_RUN/final --algo mempo``; MemTrain after SFT is ``--model SFT_RUN/final --algo memtrain``.

from reward import memtrain_reward, reconstruction_reward                     # noqa: E402
from grpo import filter_groups                                                 # noqa: E402
from rollout import MemAgentConfig, imr_rollout, memory_rollout               # noqa: E402


def memtrain_tasks(cfg: Config, step: int, real_tool=None) -> tuple[list, frozenset | None]:
    """The step's masked-reconstruction tasks and entity names (None = the real-text heuristic)."""
    rng = random.Random(cfg.seed * 5_000_011 + step)
    if real_tool is not None:
        return data.masked_reconstruction_tasks(real_tool.docs, cfg.questions, rng.randrange(10**9), cfg.max_chunks,
                                                bm25=real_tool.bm25), None
    return (data.world_memtrain_tasks(rng.randrange(10**9), cfg.questions, rng.randrange(10**9), cfg.max_chunks),
            frozenset(data.name_pool()))


def imr_scores(model, tokenizer, trajs, n_imr: int, agent: MemAgentConfig, rng: random.Random, names, gen) -> torch.Tensor:
    """IMR rewards (N, G2): for each trajectory, G2 draws of (step k, chunk l < k, target), answered from o_k."""
    items, where = [], []
    for i, x in enumerate(trajs):
        for j in range(n_imr):
            task = data.imr_task(x.chunks, len(x.memories), rng, names)
            if task is not None:
                items.append((task.problem, x.memories[task.k], task.chunk, task.target))
                where.append((i, j))
    imr = torch.zeros(len(trajs), n_imr)
    preds = imr_rollout(model, tokenizer, [it[:3] for it in items], agent, gen)
    for (i, j), it, pred in zip(where, items, preds):
        imr[i, j] = reconstruction_reward(pred, it[3])
    return imr


def memtrain_warmup_batch(tokenizer, cfg: Config, step: int, real_tool=None) -> list[Sample]:
    """``cfg.sft_batch`` rows of scripted memory-agent steps (``data.memtrain_expert_rounds``), drawn for this step."""
    from rollout import memory_step_context
    rows: list[Sample] = []
    prefix = tokenizer.encode("<mem>", add_special_tokens=False)
    while len(rows) < cfg.sft_batch:
        tasks, _ = memtrain_tasks(cfg, 10**6 + 1000 * step + len(rows), real_tool)
        for task in tasks:
            mem = None
            for chunk, text in zip(task.chunks, data.memtrain_expert_rounds(task, cfg.mem_tokens * 4 // 5)):
                ctx = memory_step_context(tokenizer, data.SYSTEM_PROMPT, task.problem, mem, chunk) + prefix
                rows.append(Sample(ctx + tokenizer.encode(text[len("<mem>"):], add_special_tokens=False), len(ctx)))
                mem = text.split("<mem>", 1)[1].split("</mem>", 1)[0].strip()
    return rows[: cfg.sft_batch]


def run_memtrain_warmup(model, tokenizer, cfg: Config, metrics_path: str, real_tool=None) -> None:
    """``cfg.memtrain_warmup`` SFT steps on scripted memory-agent rounds (constant lr ``cfg.sft_lr``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    for step in range(cfg.memtrain_warmup):
        t0 = time.time()
        samples = memtrain_warmup_batch(tokenizer, cfg, step, real_tool)
        n_tokens = float(sum(len(s.ids) - s.n_prompt for s in samples))
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for mb in micro_batches(samples, cfg.micro_tokens):
            part = sft_loss(model, collate(mb, tokenizer.pad_token_id, model.device), n_tokens)
            part.backward()
            loss += part.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if step % 50 == 0 or step == cfg.memtrain_warmup - 1:
            log_jsonl(metrics_path, {"stage": "memtrain_warmup", "step": step, "loss": loss, "sec": time.time() - t0})


def memtrain_step(model, ref_model, tokenizer, optimizer, cfg: Config, step: int, real_tool=None) -> dict:
    """One MemTrain step: memory rollouts -> e2e + IMR rewards -> Dr.GRPO + DAPO filter -> PPO update."""
    m: dict = {"stage": "memtrain", "step": step}
    tasks, names = memtrain_tasks(cfg, step, real_tool)
    agent = MemAgentConfig(data.SYSTEM_PROMPT, mem_tokens=cfg.mem_tokens, temperature=cfg.temperature)
    gen = torch.Generator(device=model.device).manual_seed(cfg.seed * 9_000_011 + step)
    t0 = time.time()
    model.eval()
    trajs = memory_rollout(model, tokenizer, tasks, cfg.group, agent, gen)
    e2e = torch.tensor([reconstruction_reward(x.answer, x.gold) for x in trajs])
    imr = imr_scores(model, tokenizer, trajs, cfg.imr_group, agent, random.Random(cfg.seed * 6_000_007 + step),
                     names, gen)
    m["sec_rollout"] = time.time() - t0
    scores = memtrain_reward(e2e, imr, cfg.imr_lam)                          # (N,)
    gids = torch.tensor([x.group_id for x in trajs])
    keep = filter_groups(scores, gids)                                        # (N,) bool
    adv = grouped_advantage(scores, gids, norm_by_std=False)                  # (N,)
    n_groups = len(tasks)
    m.update(score=scores.mean().item(), e2e=e2e.mean().item(), imr=imr.mean().item(),
             answered=sum(x.answer is not None for x in trajs) / len(trajs),
             mem_closed=sum(r.mem_end > 0 for x in trajs for r in x.rounds) / sum(len(x.rounds) for x in trajs),
             kept_groups=len(set(gids[keep].tolist())), dropped_groups=n_groups - len(set(gids[keep].tolist())))
    samples = [Sample(r.context_ids + r.round_ids, len(r.context_ids) + len(r.prefix_ids), r.mem_end,
                      len(r.prefix_ids), float(adv[i]))
               for i, x in enumerate(trajs) if keep[i] for r in x.rounds if r.output_ids]
    t0 = time.time()
    if not samples or all(s.adv_t == 0 for s in samples):
        m["skipped"] = "every group dropped by the DAPO filter"
        m["sec_update"] = time.time() - t0
        return m
    m.update(ppo_update(model, ref_model, optimizer, samples, cfg, tokenizer.pad_token_id))
    m["sec_update"] = time.time() - t0
    return m


# --------------------------------------------------------------------------- main

def main(argv=None) -> None:
    import sys
    args = sys.argv[1:] if argv is None else list(argv)
    if "memalpha" in args and args.index("memalpha") > 0 and args[args.index("memalpha") - 1] == "--algo":
        return run_memalpha(parse_memalpha_args(args))     # its own flags: see the Mem-alpha section
    cfg = parse_args(argv)
    os.makedirs(cfg.run, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device = setup_distributed(cfg)          # plain python: pick_device; torchrun: process group, GPU LOCAL_RANK
    metrics_path, ckpt = os.path.join(cfg.run, "metrics.jsonl"), os.path.join(cfg.run, "ckpt")
    if not cfg.resume and os.path.exists(metrics_path):     # never mix two runs' metrics or overwrite a checkpoint
        raise SystemExit(f"{cfg.run} already holds a run ({metrics_path}); pass --resume to continue it, "
                         f"or choose another --run")
    real_tasks = real_tool = trajectories = None          # data files first: a bad file fails before a model loads
    if cfg.data:
        if not cfg.corpus:
            raise SystemExit("--data needs --corpus (the documents the search tool searches)")
        real_tasks, real_tool = data.load_qa(cfg.data), SearchTool(data.load_corpus(cfg.corpus))
        if cfg.compose:
            real_tasks = data.compose_tasks(real_tasks, cfg.compose, cfg.seed)
    elif cfg.algo == "memtrain" and cfg.corpus:
        real_tool = SearchTool(data.load_corpus(cfg.corpus))         # unlabeled text: its BM25 index is reused
    if cfg.sft_data:
        trajectories = data.load_trajectories(cfg.sft_data)
    from transformers import AutoTokenizer
    start = cfg.stage if cfg.stage != "auto" else "sft" if cfg.sft_data or not cfg.model else "rl"
    state = {"stage": start, "step": 0}         # auto: a --model goes straight to RL unless --sft-data
    trainer = None
    if cfg.resume and os.path.exists(os.path.join(ckpt, "trainer.pt")):
        trainer = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=False)
        state = trainer["state"]
        if state.get("precision", cfg.precision) != cfg.precision:       # the same forward as before the kill
            print(f"--precision {cfg.precision} ignored: resuming in the run's {state['precision']}")
            cfg.precision = state["precision"]
        model, tokenizer, prompt = load_model(ckpt, device), AutoTokenizer.from_pretrained(ckpt), checkpoint_prompt(ckpt)
        print(f"resuming {state['stage']} at step {state['step']} from {ckpt}")
    elif cfg.model:
        model, tokenizer = load_model(cfg.model, device), AutoTokenizer.from_pretrained(cfg.model)
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
    if cfg.algo == "memtrain":
        data.add_words(tokenizer, model, data.MEMTRAIN_WORDS)        # [MASK], [TARGET], ... (no-op for BPE)
    model = wrap_for_training(model, device)       # torchrun: DDP or FSDP2; plain: unchanged
    if DIST.rank == 0:
        with open(os.path.join(cfg.run, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=1)

    if state["stage"] == "sft" and cfg.sft_steps > 0:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
        if trainer is not None and trainer["optimizer"] is not None:
            load_optimizer(model, opt, trainer["optimizer"])
            torch.set_rng_state(trainer["torch_rng"])
        run_sft(model, tokenizer, cfg, state["step"], opt, metrics_path, ckpt, prompt, trajectories)
        state, trainer = {"stage": "rl", "step": 0}, None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    if trainer is not None and state["stage"] == "rl":
        load_optimizer(model, opt, trainer["optimizer"])
        torch.set_rng_state(trainer["torch_rng"])
    if cfg.algo == "memtrain" and cfg.memtrain_warmup > 0 and state["step"] == 0:
        run_memtrain_warmup(model, tokenizer, cfg, metrics_path, real_tool)
    if cfg.rl_steps > 0:
        run_rl(model, tokenizer, cfg, state["step"], opt, metrics_path, ckpt, real_tasks, real_tool, prompt)
    model_sd, _ = full_state(model, None)
    if DIST.rank == 0:
        save_model(os.path.join(cfg.run, "final"), model, tokenizer, prompt, model_sd)
        print(f"saved {cfg.run}/final")
    if is_dist():
        import torch.distributed as dist
        dist.destroy_process_group()



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

Choices: the tokenizer is ``data.build_memalpha_tokenizer`` (word-level, JSON glue as tokens: a name is the
same one token in the chunk and in the call, so copying is a pointer step); ``--tokenizer bpe`` is the
byte-level BPE of ``data.build_bpe_tokenizer`` trained on the world's and this task's text, with which
the 3-layer model did not learn to copy (results/MEMALPHA.md). The first ``--sft-copy-steps`` steps see
first-chunk writer rows only: the copy plateau (loss ~0.4-0.48) ended at step ~350 on seed 0 but at ~900-1000
on seed 1 (seeds 1 and 2 had not left it at step 500), hence 1200 of 2200 SFT steps. Every SFT
step draws a new world (the name pool is shared), so held-out worlds test generalisation to new facts;
the generation ends at EOS (``<|im_end|>``) or ``--max-new-tokens``; no KL by default (the paper uses none).
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
    tokenizer: str = "word"      # word: data.build_memalpha_tokenizer (names are one token) | bpe
    vocab: int = 800
    answerer: str = ""           # HF path of r1's frozen answerer; empty = a frozen copy after SFT
    chunks: int = 4
    facts_per_chunk: int = 2
    questions_per_instance: int = 4
    flaw_p: float = 0.5
    sft_steps: int = 2200
    sft_copy_steps: int = 1200   # first steps on first-chunk writer rows only (copying names into JSON)
    sft_batch: int = 32
    sft_lr: float = 1e-3
    rl_steps: int = 40
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
    precision: str = "auto"      # auto (bf16 autocast on CUDA) | fp32 | bf16 (ppo_update reads it)
    ckpt_every: int = 100        # steps (SFT or GRPO) between checkpoints in RUN/ckpt; 0 = only when SFT ends
    resume: bool = False


MEMALPHA_HELP = {
    "run": "output folder", "seed": "seed of worlds, data order and sampling", "device": "auto | cpu | cuda",
    "algo": "memalpha", "hidden": "hidden size of the tiny model", "layers": "layers of the tiny model",
    "heads": "attention heads of the tiny model", "ffn": "MLP width of the tiny model",
    "tokenizer": "word (one token per word of the task, JSON glue as tokens) | bpe (byte-level BPE, --vocab)",
    "vocab": "BPE vocabulary size (--tokenizer bpe)", "answerer": "HF path of r1's frozen answerer (default: frozen copy after SFT)",
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
    "grad_clip": "max grad norm", "mem_weight": "unused by Mem-alpha", "precision": "auto | fp32 | bf16: bf16 autocast forward over fp32 weights",
    "ckpt_every": "steps (SFT or GRPO) between checkpoints in RUN/ckpt (0: only when SFT ends)",
    "resume": "continue a killed run from RUN/ckpt (same batches; the answerer from RUN/sft)",
}


def parse_memalpha_args(argv) -> MemAlphaConfig:
    p = argparse.ArgumentParser(description="Mem-alpha: SFT cold start + GRPO over chunk steps")
    for name, default in asdict(MemAlphaConfig()).items():
        if isinstance(default, bool):
            p.add_argument("--" + name.replace("_", "-"), action="store_true", help=MEMALPHA_HELP[name])
            continue
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=MEMALPHA_HELP[name])
    return MemAlphaConfig(**vars(p.parse_args(argv)))


def memalpha_tokenizer(vocab: int = 800, seed: int = 0, kind: str = "bpe"):
    """``kind`` word: ``data.build_memalpha_tokenizer``; bpe: the byte-level BPE tokenizer trained on the
    world's text and this task's chunks and tool calls."""
    if kind == "word":
        return data.build_memalpha_tokenizer()
    if kind != "bpe":
        raise ValueError(f"--tokenizer must be word or bpe, not {kind!r}")
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


def memalpha_truncate_metrics(path: str, state: dict) -> None:
    """Drop the metrics rows a killed run logged after its checkpoint ``state`` (they are logged again)."""
    if not os.path.exists(path):
        return
    order = {"sft": 0, "rl": 1}
    keep = lambda row: (order[row["stage"]], row["step"]) < (order[state["stage"]], state["step"])
    rows = [ln for ln in open(path) if ln.strip() and keep(json.loads(ln))]
    with open(path, "w") as f:
        f.writelines(rows)


def run_memalpha(cfg: MemAlphaConfig) -> None:
    """SFT cold start on the scripted writer + answerer, then GRPO with a frozen answerer for r1.

    Checkpoints: ``RUN/ckpt`` (``save_checkpoint``: model, tokenizer, optimizer, stage + step, torch RNG;
    written atomically) every ``--ckpt-every`` steps of either stage and when SFT ends; ``--resume``
    continues from it with the same batches (data and sampling depend only on seed and step) and the
    answerer saved in ``RUN/sft`` when SFT ended."""
    from memory import WRITER_SYSTEM
    from transformers import AutoTokenizer
    from tqdm import tqdm
    os.makedirs(cfg.run, exist_ok=True)
    metrics_path, ckpt = os.path.join(cfg.run, "metrics.jsonl"), os.path.join(cfg.run, "ckpt")
    if not cfg.resume and os.path.exists(metrics_path):
        raise SystemExit(f"{cfg.run} already holds a run ({metrics_path}); pass --resume to continue it, "
                         f"or choose another --run")
    with open(os.path.join(cfg.run, "config.json"), "w") as f:
        json.dump(asdict(cfg), f, indent=1)
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)
    state, trainer = {"stage": "sft", "step": 0}, None
    if cfg.resume and os.path.exists(os.path.join(ckpt, "trainer.pt")):
        trainer = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=False)
        state = trainer["state"]
        model, tokenizer = load_model(ckpt, device), AutoTokenizer.from_pretrained(ckpt)
        memalpha_truncate_metrics(metrics_path, state)
        print(f"resuming memalpha {state['stage']} at step {state['step']} from {ckpt}")
    else:
        tokenizer = memalpha_tokenizer(cfg.vocab, cfg.seed, cfg.tokenizer)
        model = data.build_tiny_model(tokenizer, cfg.hidden, cfg.layers, cfg.heads, cfg.ffn, seed=cfg.seed).to(device)
    save = lambda opt, st: save_checkpoint(ckpt, model, tokenizer, opt, st, WRITER_SYSTEM)
    t_start = time.time()
    if state["stage"] == "sft":
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
        if trainer is not None:
            opt.load_state_dict(trainer["optimizer"])
            torch.set_rng_state(trainer["torch_rng"])
        sched = lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / cfg.sft_steps))
        model.train()
        for step in tqdm(range(state["step"], cfg.sft_steps), desc="memalpha sft"):
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
            if cfg.ckpt_every > 0 and (step + 1) % cfg.ckpt_every == 0 and step + 1 < cfg.sft_steps:
                save(opt, {"stage": "sft", "step": step + 1})
        model.save_pretrained(os.path.join(cfg.run, "sft"))
        tokenizer.save_pretrained(os.path.join(cfg.run, "sft"))
        state, trainer = {"stage": "rl", "step": 0}, None
        save(None, state)                   # SFT done: a kill from here on resumes at RL step 0
    answerer = load_model(cfg.answerer or os.path.join(cfg.run, "sft"), device).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    if trainer is not None:
        if trainer["optimizer"] is not None:           # None: the checkpoint written when SFT ended
            opt.load_state_dict(trainer["optimizer"])
        torch.set_rng_state(trainer["torch_rng"])
    bar = tqdm(range(state["step"], cfg.rl_steps), desc="memalpha grpo")
    for step in bar:
        m = memalpha_step(model, answerer, tokenizer, opt, cfg, step)
        m["sec_total"] = time.time() - t_start
        log_jsonl(metrics_path, m)
        bar.set_postfix(reward=f"{m['reward']:.3f}", r1=f"{m['r1']:.3f}")
        if cfg.ckpt_every > 0 and (step + 1) % cfg.ckpt_every == 0 and step + 1 < cfg.rl_steps:
            save(opt, {"stage": "rl", "step": step + 1})
    model.save_pretrained(os.path.join(cfg.run, "final"))
    tokenizer.save_pretrained(os.path.join(cfg.run, "final"))
    print(f"saved {cfg.run}/final")


if __name__ == "__main__":
    try:
        main()
    except data.DataError as e:          # a bad data file: one line naming file and line, exit status 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
