"""MemTrain: self-supervised memory pre-training of the memory agent (the MemTrain paper's recipe).

    python -m recipes.memtrain --model SFT_RUN/final --run runs/memtrain    # then: train.py --model runs/memtrain/final

Built from the shared pieces: the engine (``engine.generate``), ``grpo.py`` (Dr.GRPO advantages, the DAPO
filter, rows), ``sft.run_sft`` and train.py's run (model loading, ``update``, the RL loop, checkpoints).
The proxy tasks are in ``recipes/memtrain_tasks.py``; the evaluation in ``recipes/memtrain_eval.py``.

**The training step.** --questions masked-reconstruction tasks (a fresh embedded world each step, or
--corpus), G1 = --group memory-agent rollouts per task, G2 = --imr-group IMR rollouts per trajectory, then

    R_i = 1[e2e_i] + lam / G2 * sum_j 1[imr_ij]          (``memtrain_reward``)
    A_i = R_i - mean_group(R)                            (Dr.GRPO: grpo.grouped_advantage(norm_by_std=False))
    groups whose R are all equal are dropped             (DAPO: grpo.filter_groups; count logged)

and every memory-update step of a kept trajectory is a training row carrying A_i, through the shared
update. Choices: each of the G2 IMR rollouts draws its own (k, l, target), so they probe different
memories; IMR rollouts are not training rows (their only job is the reward); KL and lr are the common
flags (paper: KL 1e-3, lr 1e-6 on 7B). There is no --init-from: --model RUN/final already loads a
checkpoint (tokenizer with [MASK] included) and starts RL from it, so MemPO / GRPO after MemTrain is
``python train.py --model MT_RUN/final``; MemTrain after SFT is
``python -m recipes.memtrain --model SFT_RUN/final``. ``--memtrain-warmup`` SFT steps on scripted memory-agent
rounds (``memtrain_expert_rounds``, through ``sft.run_sft``) teach a tiny model the step format first.

**Where MemTrain goes: before the search agent's SFT.** One run does, in order: the search agent's SFT when it
starts from the embedded model with ``--sft-steps`` above 0 (its expert episodes), the warm-up, MemTrain RL. As
pre-training on the world's corpus alone (masked-reconstruction tasks and IMR: no question, no expert episode),
from a random init, then the agent's SFT and RL on its checkpoint (``--sft-episodes N``: on N episodes):

    python -m recipes.memtrain --run MT --sft-steps 0 --memtrain-warmup 3000 --rl-steps 100
    python train.py --run A --model MT/final --stage sft --sft-episodes N       # SFT on N episodes, then RL

So the agent's own SFT is the last supervised stage and sets its format: placed after that SFT, the warm-up's
memory-agent rounds overwrote the tiny model's search agent and RL did not bring it back (results/MEMTRAIN.md,
the first run); placed before it, the format held (valid 1.00) but entities were misread after an SFT of
unlimited episodes (results/MEMTRAIN.md, past the horizon). The paper claims its gain where the task's data is
scarce, which ``--sft-episodes`` sets up.

**The memory agent.** MemAgent-style overwrite memory in MemPO's format, so the skill transfers to the
search agent. Step t (one per chunk) sees

    system + problem  +  assistant "<mem> o_{t-1} </mem>"  +  user "<information> chunk_t </information>"

i.e. exactly the snail-shell prompt of a MemPO round (question + the last round + its tool result), the
chunk arriving as a tool result does, and writes (after the forced "<mem>" prefix)

    <mem> o_t </mem>                                                 steps before the last
    <mem> o_t </mem> <think> answer </think> <answer> x </answer>    the last step (MemPO's answer round)

Choices: the forced "<mem>" prefix is on at every step (step 1 too: there is no question to copy, the
memory starts from the first chunk); a step that does not close "</mem>" within the budget keeps what
it wrote as its memory (truncated to the budget) and the trajectory goes on; o_t is capped at
``mem_tokens`` tokens when it is carried to the next step. An IMR rollout is the same last step with the
problem "which entity is [TARGET] ?", memory o_k and the masked chunk l, so the (trained) answer step
and the IMR step share one format; IMR rollouts earn reward only and are not training rows.

**The reward.**

    e2e_i   = 1[pred_i == entity]              the masked entity, answered from the final memory
    imr_ij  = 1[pred_ij == target]             IMR rollout j of trajectory i: memory o_k + chunk l -> [TARGET]
    R_i     = e2e_i + (lam / G2) * sum_j imr_ij          lam = 0.5 (paper)

Choices: "==" is exact match after SQuAD normalisation (``normalize_answer``: "Gustave Eiffel." matches
"gustave eiffel"); no answer (None: the trajectory never closed ``</answer>``) scores 0. An IMR rollout
that could not be built (no earlier chunk with an entity) scores 0 too; the caller passes 0 for it.
"""
from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

import checkpoint
import data
import dist
import train
from engine import generate, stop_strings
from flags import flag
from grpo import Sample, filter_groups, grouped_advantage, target_row
from memory import Record, extract_mem, mem_token_end, prepare_prompt, tool_record
from recipes.memtrain_tasks import (MEMTRAIN_WORDS, add_words, imr_task, masked_reconstruction_tasks,
                                    memtrain_expert_rounds, world_memtrain_tasks)
from reward import em_score
from rollout import Round, cut_at_stop, encode_chat
from search import SearchTool
from sft import run_sft


@dataclass
class MemTrainConfig(train.Config):
    """MemTrain: self-supervised memory pre-training (masked reconstruction + IMR)."""
    run: str = flag("runs/memtrain", "output folder (metrics.jsonl, checkpoints, final/)")
    algo: str = flag("memtrain", "memtrain (this recipe; the step's log name)", choices=("memtrain",))
    # lr 1e-5 and 60 steps of 16 tasks at T 0.7: the RL step MemTrain was measured at (results/MEMTRAIN.md, "At
    # the new RL step" and "The same pipeline on another machine")
    lr: float = flag(1e-5, "RL learning rate", above=0)
    rl_steps: int = flag(60, "RL steps (0 skips RL)", min=0)
    questions: int = flag(16, "masked-reconstruction tasks per RL step", min=1)
    # --questions tasks x --group G1 end-to-end rollouts per step
    imr_group: int = flag(2, "IMR rollouts per end-to-end trajectory (G2; paper 8)", min=1)
    imr_lam: float = flag(0.5, "lambda, weight of the mean IMR reward in R = e2e + lambda * mean(IMR) (0 = the "
                               "ablation without IMR)", min=0)
    mem_tokens: int = flag(48, "memory budget of the memory agent in tokens", min=1)
    max_chunks: int = flag(4, "chunks per masked-reconstruction task (--corpus: that corpus; else embedded worlds)",
                           min=1)
    memtrain_warmup: int = flag(0, "SFT steps (--sft-batch rows, --sft-lr) on scripted memory-agent rounds before "
                                   "the RL steps, so a tiny model writes the step format (0 = none, as in the paper)",
                                   min=0)

    def conflicts(self) -> tuple[list[str], list[str]]:
        """train.Config's, and a group of one: its advantage R - mean(R) is 0 and the DAPO filter drops it."""
        errors, warnings = super().conflicts()
        if self.group == 1 and self.rl_steps > 0:
            errors.append("--group 1: every group of one is dropped (advantage 0), RL has nothing to learn "
                          "(must be >= 2)")
        return errors, warnings


# --------------------------------------------------------------------------- the memory agent

MEM_STOP, ANSWER_STOP = ("</mem>",), ("</answer>",)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S)


@dataclass
class MemAgentConfig:
    system_prompt: str
    mem_tokens: int = 64         # memory budget: o_t is cut to this many tokens
    answer_tokens: int = 16      # extra tokens the last step may write after </mem>
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class MemTrajectory:
    """One memory-agent rollout over a task's chunks: a Round per step, the memory after each, the answer."""
    problem: str
    gold: str
    group_id: int
    chunks: list[str]
    rounds: list[Round] = field(default_factory=list)
    memories: list[str] = field(default_factory=list)
    answer: str | None = None


def memory_step_context(tokenizer, system_prompt: str, problem: str, memory: str | None, chunk: str) -> list[int]:
    """Ids of one memory-agent step's prompt: system + problem (+ previous ``<mem>``) + the chunk as a tool result."""
    records = [Record("prompt", problem)]
    if memory is not None:
        records.append(Record("llm_gen", f"<mem> {memory} </mem>"))
    records.append(tool_record("search_results", f"<information> {chunk} </information>"))
    return encode_chat(tokenizer, prepare_prompt(records, system_prompt, keep_rounds=1))


def written_memory(tokenizer, text: str, mem_tokens: int) -> str:
    """The ``<mem>`` body a step wrote (what follows ``<mem>`` when it never closed), cut to ``mem_tokens``."""
    body = extract_mem(text)
    if body is None:
        body = text.split("<mem>", 1)[-1].split("</mem>", 1)[0].strip()
    ids = tokenizer.encode(body, add_special_tokens=False)
    return tokenizer.decode(ids[:mem_tokens]).strip() if len(ids) > mem_tokens else body


def _step_batch(model, tokenizer, contexts: list[list[int]], last: bool, cfg: MemAgentConfig,
                generator) -> list[tuple[list[int], list[int], str]]:
    """One batched generation of memory steps -> (prefix ids, output ids, text) per context."""
    prefix = tokenizer.encode("<mem>", add_special_tokens=False)
    strings = ANSWER_STOP if last else MEM_STOP
    close = len(tokenizer.encode(" </mem>", add_special_tokens=False))
    outs = generate(model, [c + prefix for c in contexts], cfg.mem_tokens + close + (cfg.answer_tokens if last else 0),
                    pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                    stops=stop_strings(tokenizer, strings), temperature=cfg.temperature, top_p=cfg.top_p,
                    generator=generator)
    return [(prefix, o, cut_at_stop(tokenizer.decode(prefix + o), strings)) for o in outs]


def memory_rollout(model, tokenizer, tasks: list, group_size: int, cfg: MemAgentConfig,
                   generator: torch.Generator | None = None) -> list[MemTrajectory]:
    """``group_size`` memory-agent rollouts per task (``memtrain_tasks.MemTrainTask``), batched across rollouts,
    step by step."""
    trajs = [MemTrajectory(task.problem, task.answer, gid, task.chunks)
             for gid, task in enumerate(tasks) for _ in range(group_size)]
    for t in range(max(len(x.chunks) for x in trajs)):
        for last in (False, True):
            live = [x for x in trajs if t < len(x.chunks) and (t == len(x.chunks) - 1) == last]
            if not live:
                continue
            contexts = [memory_step_context(tokenizer, cfg.system_prompt, x.problem,
                                            x.memories[-1] if x.memories else None, x.chunks[t]) for x in live]
            for x, ctx, (pre, out, text) in zip(live, contexts, _step_batch(model, tokenizer, contexts, last, cfg,
                                                                              generator)):
                m = ANSWER_RE.search(text)
                x.rounds.append(Round(ctx, pre, out, text, mem_token_end(tokenizer, pre + out),
                                      ("answer" if m else None) if last else "mem"))
                x.memories.append(written_memory(tokenizer, text, cfg.mem_tokens))
                if last:
                    x.answer = m.group(1).strip() if m else None
    return trajs


def imr_rollout(model, tokenizer, items: list[tuple[str, str, str]], cfg: MemAgentConfig,
                generator: torch.Generator | None = None) -> list[str | None]:
    """IMR answers: each item ``(problem, memory o_k, masked chunk l)`` is one last step -> the ``<answer>`` body."""
    if not items:
        return []
    contexts = [memory_step_context(tokenizer, cfg.system_prompt, p, mem, chunk) for p, mem, chunk in items]
    out = []
    for _, _, text in _step_batch(model, tokenizer, contexts, True, cfg, generator):
        m = ANSWER_RE.search(text)
        out.append(m.group(1).strip() if m else None)
    return out


# --------------------------------------------------------------------------- the reward

def reconstruction_reward(pred: str | None, entity: str) -> float:
    """End-to-end / IMR reward: 1.0 iff the normalised prediction equals the normalised entity."""
    return 0.0 if pred is None else em_score(pred, [entity])


def memtrain_reward(e2e: Tensor, imr: Tensor, lam: float = 0.5) -> Tensor:
    """R_i = e2e_i + lam / G2 * sum_j imr_ij; e2e (G1,), imr (G1, G2) -> (G1,)."""
    if imr.dim() != 2 or imr.shape[0] != e2e.shape[0]:
        raise ValueError(f"imr must be (G1, G2) with G1 = {e2e.shape[0]}, got {tuple(imr.shape)}")
    g2 = max(imr.shape[1], 1)
    return e2e.float() + lam / g2 * imr.float().sum(-1)


# --------------------------------------------------------------------------- training

def memtrain_tasks(cfg: MemTrainConfig, step: int, real_tool=None) -> tuple[list, frozenset | None]:
    """The step's masked-reconstruction tasks and entity names (None = the real-text heuristic)."""
    rng = random.Random(cfg.seed * 5_000_011 + step)
    if real_tool is not None:
        return masked_reconstruction_tasks(real_tool.docs, cfg.questions, rng.randrange(10**9), cfg.max_chunks,
                                                bm25=real_tool.bm25), None
    return (world_memtrain_tasks(rng.randrange(10**9), cfg.questions, rng.randrange(10**9), cfg.max_chunks),
            frozenset(data.name_pool()))


def imr_scores(model, tokenizer, trajs, n_imr: int, agent: MemAgentConfig, rng: random.Random, names,
               gen) -> torch.Tensor:
    """IMR rewards (N, G2): for each trajectory, G2 draws of (step k, chunk l < k, target), answered from o_k."""
    items, where = [], []
    for i, x in enumerate(trajs):
        for j in range(n_imr):
            task = imr_task(x.chunks, len(x.memories), rng, names)
            if task is not None:
                items.append((task.problem, x.memories[task.k], task.chunk, task.target))
                where.append((i, j))
    imr = torch.zeros(len(trajs), n_imr)
    preds = imr_rollout(model, tokenizer, [it[:3] for it in items], agent, gen)
    for (i, j), it, pred in zip(where, items, preds):
        imr[i, j] = reconstruction_reward(pred, it[3])
    return imr


def memtrain_warmup_batch(tokenizer, cfg: MemTrainConfig, step: int, real_tool=None) -> list[Sample]:
    """``cfg.sft_batch`` rows of scripted memory-agent steps (``data.memtrain_expert_rounds``), drawn for this step."""
    rows: list[Sample] = []
    prefix = tokenizer.encode("<mem>", add_special_tokens=False)
    while len(rows) < cfg.sft_batch:
        tasks, _ = memtrain_tasks(cfg, 10**6 + 1000 * step + len(rows), real_tool)
        for task in tasks:
            mem = None
            for chunk, text in zip(task.chunks, memtrain_expert_rounds(task, cfg.mem_tokens * 4 // 5)):
                ctx = memory_step_context(tokenizer, data.SYSTEM_PROMPT, task.problem, mem, chunk) + prefix
                rows.append(target_row(ctx, tokenizer.encode(text[len("<mem>"):], add_special_tokens=False)))
                mem = text.split("<mem>", 1)[1].split("</mem>", 1)[0].strip()
    return rows[: cfg.sft_batch]


def run_memtrain_warmup(model, tokenizer, cfg: MemTrainConfig, metrics_path: str, real_tool=None) -> None:
    """``cfg.memtrain_warmup`` SFT steps on scripted memory-agent rounds (constant lr ``cfg.sft_lr``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)

    def on_step(step: int, loss: float, gn: float, sec: float) -> None:
        if step % 50 == 0 or step == cfg.memtrain_warmup - 1:
            checkpoint.log_jsonl(metrics_path, {"stage": "memtrain_warmup", "step": step, "loss": loss, "sec": sec})

    run_sft(model, opt, lambda step: memtrain_warmup_batch(tokenizer, cfg, step, real_tool), range(cfg.memtrain_warmup),
            lambda step: cfg.sft_lr, cfg, tokenizer.pad_token_id, on_step, desc="memtrain warmup")


def memtrain_step(model, ref_model, tokenizer, optimizer, cfg: MemTrainConfig, step: int, real_tool=None) -> dict:
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
    samples = [Sample(ids=r.context_ids + r.round_ids, policy=[r.policy_span], adv_t=float(adv[i]))
               for i, x in enumerate(trajs) if keep[i] for r in x.rounds if r.output_ids]
    t0 = time.time()
    if not samples or all(s.adv_t == 0 for s in samples):
        m["skipped"] = "every group dropped by the DAPO filter"
        m["sec_update"] = time.time() - t0
        return m
    m.update(train.update(model, ref_model, optimizer, samples, cfg, tokenizer.pad_token_id))
    m["sec_update"] = time.time() - t0
    return m


def main(argv=None) -> None:
    cfg = train.parse_args(argv, MemTrainConfig)
    torch.manual_seed(cfg.seed)
    device = dist.setup_distributed(cfg)
    metrics_path = checkpoint.check_run(cfg.run, cfg.resume)
    real_tool = SearchTool(data.load_corpus(cfg.corpus)) if cfg.corpus else None   # unlabeled text: its BM25 reused
    trajectories = data.load_trajectories(cfg.sft_data) if cfg.sft_data else None
    model, tokenizer, prompt, state, trainer = train.load_policy(cfg, device)
    add_words(tokenizer, model, MEMTRAIN_WORDS)        # [MASK], [TARGET], ... (no-op for BPE)
    model = dist.wrap_for_training(model, device)
    checkpoint.write_config(cfg.run, asdict(cfg))

    def take_step(model, ref_model, optimizer, s: int) -> dict:      # one MemTrain RL step
        return memtrain_step(model, ref_model, tokenizer, optimizer, cfg, s, real_tool)

    warmup = (lambda: run_memtrain_warmup(model, tokenizer, cfg, metrics_path, real_tool)) \
        if cfg.memtrain_warmup else None
    train.train_policy(cfg, model, tokenizer, prompt, state, trainer, metrics_path, take_step, trajectories, warmup,
                       validate=not cfg.data)


if __name__ == "__main__":
    data.exit_on_bad_input(main)         # a missing or broken input: one line, exit status 2
