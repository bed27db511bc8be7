"""Performance of the rollout engine, the reward pass and one training step, measured side by side: the entry
point of the figures below. This file holds figures 1-4 (the rollout engine and the reward pass against a
reference), the table and the JSON line; ``bench_update.py`` holds figures 5-7 (what one RL step costs: its phases,
its padding, its processes); ``bench_search.py`` holds figure 8 (retrieval).

    python bench.py                 # CPU, tiny default model (a few minutes)
    python bench.py --quick         # CPU, fewer repeats and shorter rounds (under 3 minutes)
    python bench.py --device cuda --model-shape qwen2.5-0.5b     # a random Qwen2.5-0.5B-shaped model, bf16
    python bench.py --model smollm2  # figures 1-3 on a real pretrained model (or a folder, a .gguf file): ~4 min

Every speed figure is a ratio of two things timed in the same run, interleaved (A, B, A, B, ...),
the median of ``--repeats`` repeats, with the absolute numbers beside it:

1. **decode** (``decode_speedup``): ``engine.generate`` vs ``model.generate`` on the same model and
   the same 64 left-padded prompts, the same number of new tokens (no EOS, no stop), plain sampling
   at temperature 1 (``top_k=0`` for HF, so both sample the full softmax). Tokens/s of each and the
   ratio. Then greedy parity: both at temperature 0 must give identical tokens.
2. **multi-turn rollout** (``rollout_speedup``): ``rollout.rollout`` (G = 8 rollouts x 8 questions of
   the RL training distribution, BM25 search tool, snail context, 96 new tokens a round, temperature
   1) with the prefix cache on and off vs the same agent loop whose engine is replaced by a naive one:
   ``model.generate`` per round, every prompt prefilled in full, finished rows decoding until the longest
   is done. The three run interleaved, build the same per-round prompts (same bookkeeping code) and use the
   protocol prompt of the real-model path (``rollout.PROTOCOL_PROMPT``, 205 tokens: the prefix the cache
   saves; a word-level checkpoint reads most of its words as ``<unk>``) with the checkpoint ADAPTED to that
   prompt (``protocol_model``: a policy trained on its own short prompt answers at once under a long one it
   never saw, so the rows would time one round and nothing to reuse); then, sampled only, the checkpoint
   itself under its own system prompt (``rollout_speedup_own_prompt``). Trajectories/s of each, the ratios
   (``rollout_speedup_no_prefix_cache``, ``rollout_prefix_cache_gain`` = on / off). At temperature 0 all
   three must write identical trajectories (checked, and timed too).
3. **memory-reward scoring** (``scoring_speedup``): ``reward.answer_logprobs`` over the 2N
   (round_context, mem_traj) contexts of those trajectories in one call vs two calls of N; ratio of the
   two-call time to the one-call time (> 1: the batched pass is faster), plus the max abs difference.
   At ``memory_rewards``' default token budget (8192, ``scoring_speedup``) and at 65536
   (``scoring_speedup_budget_65536``). On CPU both are capped at ``reward.CPU_TOKENS`` (2048), so the two
   rows time the same batching there (their difference is the noise); on a GPU they differ. A call takes a
   fraction of a second, so this figure takes 5 x ``--repeats`` repeats.
4. **context growth** (``snail_round_cost_ratio_64_vs_8``): 8 long expert episodes (22 objectives x
   3 hops = 67 rounds) rendered as the agent would see them at rounds 8, 16, 32, 64; one round of
   generation (prefill + 30 new tokens, batch 8) timed at each, ``snail`` vs ``full`` context.
   The ratio is seconds at round 64 over seconds at round 8 for snail; the prompt-token ratio is
   printed beside it, since the snail prompt itself grows (``<mem>`` keeps one entry per objective).
5. **a training step** (5-7 in ``bench_update.py``): ``train.rl_step`` with the default config
   (``train.parse_args([])``) split into rollout / reward / update seconds, and the peak RSS of this
   process (peak CUDA memory on a GPU).
6. **padding waste** (``padding_waste``): the fraction of token positions of the update forward that
   are padding, for the round samples of one step cut unsorted into the same number of micro-batches
   (before) and by ``grpo.micro_batches`` (sorted by length, token budget; after); then, for
   comparison, ``grpo.micro_batches`` at a quarter of the budget.

7. **processes** (``step_sec_by_procs``): seconds per RL step (default config, its B questions split
   over the ranks) of ``torchrun --nproc_per_node N train.py --model M`` for each N of ``--procs``
   (default 1,2), each a fresh run of ``--proc-steps`` steps, the first left out as warm-up. On a
   2-core CPU the ranks share the cores: a smoke test of the torchrun path, not a speed figure; on a
   GPU node each rank has its own GPU.

8. **search** (``search``): retrieval as the corpus grows and its share of one RL step, in ``bench_search.py``
   (``--search-only`` prints it alone).

9. **against the machine's floor** (``sft_peak_share``, ``update_peak_share``, ``reward_peak_share``, in
   ``bench_update.py``): default SFT steps of each stage and figure 5's phases as shares of the fp32 matmul rate
   measured in the same run, the SFT's padding and tokens/s, and the default SFT's minutes they imply.

A table on stdout, then ONE JSON line last. The agent loop needs a model that writes valid rounds:
``--checkpoint``, else ``runs/default/final``, else ``runs/bench_sft/final``, which the first run
trains with ``config.SMALL_SFT_ARGS`` (the test suite's SFT recipe too; a few minutes; not counted in the
``--quick`` budget) and later runs reuse. With ``--model-shape qwen2.5-0.5b`` the model is random
(Qwen2.5-0.5B's body, the world tokenizer's vocabulary), so its rounds rarely end in an action:
trajectories are one round, nothing is scored in 3, and the update of 5 is skipped (all scores 0).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import replace
from unittest import mock

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from bench_search import bench_search, print_search, search_sizes, search_summary, step_searches
from bench_update import (bench_padding, bench_processes, bench_sft, bench_train_step, floors, matmul_peak,
                          print_floor, print_update, step_seconds, sync)
import config
import data
import models
import rollout
import train
from engine import generate, left_pad
from flags import Accepts, FlagParser
from memory import Record, mem_token_end, mem_traj, prepare_prompt, tool_record
from reward import answer_logprobs, answer_template
from rollout import PROTOCOL_PROMPT, AgentConfig, encode_chat, question_prefix
from search import SearchTool

DEFAULT_CHECKPOINTS = ["runs/default/final", "runs/bench_sft/final"]
# --quick on a fresh clone trains its own, cheaper policies (kept apart, so the full figures keep theirs)
QUICK_SFT, QUICK_PROTOCOL = "runs/bench_quick_sft/final", "runs/bench_quick_protocol/final"
QUICK_SFT_ARGS = ["--sft-copy-steps", "150", "--sft-steps", "250", "--sft-batch", "32", "--rl-steps", "0",
                  "--forget-p", "0.5", "--sft-objectives", "1-2", "--hops", "1-2",
                  "--eval-every", "0"] + config.EXPERT_ROWS_ONLY
QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, rope_theta=1_000_000.0, tie_word_embeddings=True)


# --------------------------------------------------------------------------- setup

def load(args, device: torch.device):
    """(model, tokenizer, what it is): a checkpoint, the bench's own SFT, or a random Qwen2.5-0.5B-shaped model."""
    if args.model_shape == "qwen2.5-0.5b":
        # Qwen2.5-0.5B's body and its padded vocabulary (151936 rows), a Qwen2-style BPE tokenizer over the world's
        # text; ids past the tokenizer's decode to nothing. fp32 master weights: models.autocast gives bf16 on CUDA.
        tok = data.build_bpe_tokenizer()
        cfg = Qwen2Config(vocab_size=151936, max_position_embeddings=32768, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, bos_token_id=None, **QWEN_05B)
        cfg._attn_implementation = models.attn_implementation(device)
        torch.manual_seed(0)
        return (Qwen2ForCausalLM(cfg).to(device).eval(), tok,
                f"random qwen2.5-0.5b shape ({cfg._attn_implementation}, fp32 weights)")
    own = QUICK_SFT if args.quick else DEFAULT_CHECKPOINTS[-1]
    path = args.checkpoint or next((p for p in DEFAULT_CHECKPOINTS + [own] if os.path.exists(p)), "")
    if not path:                       # train a policy once (quick: a shorter recipe); later runs reuse it
        recipe = QUICK_SFT_ARGS if args.quick else config.SMALL_SFT_ARGS
        train.main(["--run", os.path.dirname(own), "--device", device.type] + recipe)
        path = own
    return models.load_model(path, device).eval(), AutoTokenizer.from_pretrained(path), path


def protocol_model(args, model, tok, source: str, device: torch.device):
    """(model, tokenizer, what it is) for figure 2's protocol-prompt rows: a policy that writes multi-round
    episodes UNDER that prompt, so the prefix cache has rounds to save. A checkpoint of this project trained
    on its own short prompt answers at once under a 205-token prompt it never saw (1.0 rounds a rollout), which
    times one round and nothing to reuse. So the first run adapts the checkpoint to the protocol prompt
    (``train.py --stage sft --system-prompt``: 300 SFT steps of the default recipe, every row under that
    prompt; ~6-10 min on 2 CPU cores, not counted) and keeps it in ``--protocol-checkpoint``; later runs
    reuse it (``--quick`` without one: 40 steps of 16 rows, kept apart). A random model (``--model-shape``)
    is used as it is."""
    if args.model_shape != "tiny":
        return model, tok, source
    full = "runs/bench_protocol/final"
    path = args.protocol_checkpoint or (QUICK_PROTOCOL if args.quick and not os.path.exists(full) else full)
    if not os.path.exists(path):
        run = os.path.dirname(path)
        os.makedirs(run, exist_ok=True)
        prompt = os.path.join(run, "protocol_prompt.txt")
        with open(prompt, "w", encoding="utf-8") as f:
            f.write(PROTOCOL_PROMPT)
        steps = ["--sft-steps", "40", "--sft-batch", "16"] if args.quick else ["--sft-steps", "300"]
        train.main(["--run", run, "--model", source, "--stage", "sft", "--system-prompt", prompt,
                    "--sft-copy-steps", "0", "--sft-lr", "3e-4", "--rl-steps", "0", "--eval-every", "0",
                    "--device", device.type] + steps)
    return models.load_model(path, device).eval(), AutoTokenizer.from_pretrained(path), path



def side_by_side(fns: dict, repeats: int, device: torch.device, warm_up: bool = True) -> dict[str, float]:
    """Median seconds of each function, run interleaved ``repeats`` times after one warm-up each (``warm_up``)."""
    times = {k: [] for k in fns}
    for k, f in fns.items() if warm_up else ():
        f()
    for _ in range(repeats):
        for k, f in fns.items():
            sync(device)
            t0 = time.perf_counter()
            f()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


# --------------------------------------------------------------------------- the naive reference engine

def hf_generate(model, prompts, max_new_tokens, *, pad_id, eos_id=None, stop_seqs=(), stops=None, temperature=1.0,
                top_p=1.0, generator=None, prefix_cache=None):
    """``engine.generate``'s contract on top of ``model.generate``: re-prefill all (``prefix_cache`` unused),
    cut each row after its stop."""
    ids, attn = left_pad(prompts, pad_id, model.device)
    ends = [s[0] for s in stop_seqs if len(s) == 1] + ([eos_id] if eos_id is not None else [])
    if stops is not None:     # a stop string that is one token (word-level vocabularies) ends a row in HF too;
        for s in stops.strings:   # others are cut below (HF's own stop_strings cannot read a word-level vocabulary)
            one = stops.tokenizer.encode(s, add_special_tokens=False)
            ends += one if len(one) == 1 else []
    sample = temperature > 0
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=sample,
                         temperature=temperature if sample else None, top_p=top_p if sample else None,
                         top_k=0 if sample else None, pad_token_id=pad_id, eos_token_id=ends or None)
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        for i, t in enumerate(row):
            if (t == eos_id or any(row[max(0, i + 1 - len(s)):i + 1] == s for s in stop_seqs)
                    or (stops is not None and stops.ended(row[max(0, i + 1 - stops.window):i + 1]))):
                row = row[:i + 1]
                break
        rows.append(row)
    return rows


def naive_rollout(*args, **kwargs):
    """The agent loop of ``rollout.rollout`` with ``hf_generate`` as its engine."""
    with mock.patch.object(rollout, "generate", hf_generate):
        return rollout.rollout(*args, **kwargs)


# --------------------------------------------------------------------------- figures 1-4 (5-7: bench_update.py)

def bench_decode(model, tok, device, n_new: int, repeats: int, batch: int = 64) -> dict:
    """Figure 1: tokens/s of ``generate`` vs ``model.generate`` (B=64, sampling), and greedy parity."""
    rng = random.Random(0)
    prompts = [[rng.randrange(5, len(tok)) for _ in range(rng.randint(8, 64))] for _ in range(batch)]
    pad = tok.pad_token_id
    seeds = iter(range(10**6))

    def ours():
        return generate(model, prompts, n_new, pad_id=pad, generator=torch.Generator(device).manual_seed(next(seeds)))

    def hf():
        torch.manual_seed(next(seeds))
        return hf_generate(model, prompts, n_new, pad_id=pad)

    assert all(len(r) == n_new for r in ours() + hf())       # same work: no row stops early
    t = side_by_side({"ours": ours, "hf": hf}, repeats, device)
    greedy_ours = generate(model, prompts, n_new, pad_id=pad, temperature=0.0)
    greedy_hf = hf_generate(model, prompts, n_new, pad_id=pad, temperature=0.0)
    n = len(prompts) * n_new
    return {"ours_tok_s": n / t["ours"], "hf_tok_s": n / t["hf"], "speedup": t["hf"] / t["ours"],
            "greedy_parity": greedy_ours == greedy_hf}


def bench_rollout(model, tok, device, cfg: train.Config, repeats: int, max_new: int, system_prompt: str,
                  greedy: bool = True) -> dict:
    """Figure 2: trajectories/s of the agent loop with the prefix cache on and off vs the same loop on
    ``model.generate``, all three interleaved; sampled, then greedy (where all three must write the same)."""
    tasks, tool = train.rl_tasks(cfg, step=0)
    res = {"prefix_tokens": statistics.mean(len(question_prefix(tok, system_prompt, t.question)) for t in tasks)}
    for temp in (1.0, 0.0) if greedy else (1.0,):
        agent = AgentConfig(system_prompt=system_prompt, context="snail", max_turns=cfg.max_turns,
                            max_new_tokens=max_new, temperature=temp)
        loops = {"on": (rollout.rollout, agent), "off": (rollout.rollout, replace(agent, prefix_cache=False)),
                 "naive": (naive_rollout, replace(agent, prefix_cache=False))}     # nothing to reuse there
        seeds = {name: iter(range(10**6)) for name in loops}
        last = {}

        def run(name):
            def f():
                seed = next(seeds[name])
                torch.manual_seed(seed)
                gen = torch.Generator(device).manual_seed(seed)
                loop, a = loops[name]
                last[name] = loop(model, tok, tasks, cfg.group, tool, a, gen)
            return f

        t = side_by_side({name: run(name) for name in loops}, repeats if temp > 0 else max(1, repeats // 2), device)
        n = len(last["on"])
        key = "sampled" if temp > 0 else "greedy"
        res[key] = {"on_traj_s": n / t["on"], "off_traj_s": n / t["off"], "naive_traj_s": n / t["naive"],
                    "speedup": t["naive"] / t["on"], "speedup_off": t["naive"] / t["off"],
                    "on_vs_off": t["off"] / t["on"]} | {f"rounds_{k}": sum(len(x.rounds) for x in v) / n
                                                        for k, v in last.items()}
        if temp == 0:
            rounds = {k: [[r.round_ids for r in x.rounds] for x in v] for k, v in last.items()}
            res[key]["identical"] = rounds["on"] == rounds["off"] == rounds["naive"]
        else:
            res["trajs"] = last["on"]
    return res


def scoring_pairs(tok, trajs) -> tuple[list, list, list]:
    """(round_context, mem_traj, answer ids) of every round after the first with a ``<mem>`` span: what
    ``memory_rewards`` scores."""
    scored = [(t, r) for t in trajs for i, r in enumerate(t.rounds) if i >= 1 and r.mem_end > 0]
    return ([r.context_ids for _, r in scored], [mem_traj(t.prompt_ids, r.round_ids, r.mem_end) for t, r in scored],
            [answer_template(tok, t.golds)[0] for t, _ in scored])


def expert_pairs(tok, n: int, system_prompt: str) -> tuple[list, list, list]:
    """``scoring_pairs`` of ``n`` expert rounds after the first (K = 2, 1-2 hops) under ``system_prompt``, rendered as
    the agent loop renders them: for a model from elsewhere, whose own zero-shot rounds hold no ``<mem>`` span to
    score."""
    world, tasks = data.make_tasks(11, n, [2], (1, 2))
    tool, prefix = SearchTool(world.docs), tok.encode("<mem>", add_special_tokens=False)
    full, mem, ans = [], [], []
    for task in tasks:
        records = [Record("prompt", task.question)]
        prompt_ids = encode_chat(tok, prepare_prompt(records, system_prompt))
        for t, (text, query) in enumerate(data.expert_episode(task)):
            if t >= 1 and len(full) < n:
                round_ids = prefix + tok.encode(text[len("<mem>"):], add_special_tokens=False)
                full.append(encode_chat(tok, prepare_prompt(records, system_prompt)))
                mem.append(mem_traj(prompt_ids, round_ids, mem_token_end(tok, round_ids)))
                ans.append(answer_template(tok, task.golds)[0])
            records.append(Record("llm_gen", text))
            if query is not None:
                records.append(tool_record("search_results", tool.search(" ".join(query))))
    return full, mem, ans


def bench_scoring(model, tok, device, pairs: tuple[list, list, list], repeats: int, budgets=(65536, 8192)) -> dict:
    """Figure 3: one ``answer_logprobs`` call over the 2N contexts of ``pairs`` vs two calls over N, per token
    budget."""
    full, mem, ans = pairs
    if not full:
        return {"n": 0}
    pad = tok.pad_token_id
    res = {"n": len(full)}
    for b in budgets:        # 8192 = memory_rewards' default token budget
        out = {}
        def one():
            out["one"] = answer_logprobs(model, full + mem, ans + ans, pad, b)

        def two():
            out["two"] = answer_logprobs(model, full, ans, pad, b) + answer_logprobs(model, mem, ans, pad, b)

        t = side_by_side({"one_2n": one, "two_n": two}, repeats, device)
        diff = max((x - y).abs().max().item() for x, y in zip(out["one"], out["two"]))
        res[b] = {"one_2n_s": t["one_2n"], "two_n_s": t["two_n"], "speedup": t["two_n"] / t["one_2n"],
                  "max_abs_diff": diff}
    return res


def long_contexts(tok, rounds: list[int], n_episodes: int = 8) -> dict[str, dict[int, list[list[int]]]]:
    """Prompt ids (context + forced ``<mem>``) of expert episodes at the given rounds, snail and full."""
    world = data.make_world(7)
    rng = random.Random(7)
    tool = SearchTool(world.docs)
    prefix = tok.encode("<mem>", add_special_tokens=False)
    out = {"snail": {r: [] for r in rounds}, "full": {r: [] for r in rounds}}
    for _ in range(n_episodes):
        task = data.make_task(world, rng, 22, (3, 3))
        records = [Record("prompt", task.question)]
        for t, (text, query) in enumerate(data.expert_episode(task)):
            if t + 1 in rounds:
                for mode, keep in (("snail", 1), ("full", None)):
                    ctx = encode_chat(tok, prepare_prompt(records, data.SYSTEM_PROMPT, keep))
                    out[mode][t + 1].append(ctx + prefix)
            records.append(Record("llm_gen", text))
            if query is not None:
                records.append(tool_record("search_results", tool.search(" ".join(query))))
    return out


def bench_context(model, tok, device, repeats: int, quick: bool, n_new: int = 30) -> dict:
    """Figure 4: seconds of one round (batch 8) at rounds 8..64 of long episodes, snail vs full."""
    rounds = [8, 16, 32, 64]
    ctx = long_contexts(tok, rounds)
    res = {}
    for mode in ("snail", "full"):
        for r in rounds:
            prompts = ctx[mode][r]
            n = 2 * repeats if mode == "snail" else (1 if quick else repeats)    # snail rounds are cheap
            t = side_by_side({"round": lambda: generate(model, prompts, n_new, pad_id=tok.pad_token_id,
                                                        generator=torch.Generator(device).manual_seed(0))},
                             n, device, warm_up=not (quick and mode == "full"))["round"]   # quick: full once, cold
            res[f"{mode}_{r}"] = {"prompt_tokens": sum(map(len, prompts)) / len(prompts), "sec": t}
    for mode in ("snail", "full"):
        res[f"{mode}_ratio_64_vs_8"] = res[f"{mode}_64"]["sec"] / res[f"{mode}_8"]["sec"]
    return res


# --------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = FlagParser(description="Benchmark the rollout engine, reward scoring and a training step.")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--quick", action="store_true", help="fewer repeats and shorter decodes (under 3 minutes on CPU)")
    p.add_argument("--checkpoint", default="",
                   help="model folder (default: runs/default/final, else runs/bench_sft/final, trained on first use)")
    p.add_argument("--protocol-checkpoint", default="",
                   help="figure 2's policy under the protocol prompt: the checkpoint adapted to it (default "
                        "runs/bench_protocol/final; --quick without it: runs/bench_quick_protocol/final; "
                        "made on first use)")
    p.add_argument("--model", default="",
                   help="a model from elsewhere: a model folder, a .gguf file or smollm2 (SmolLM2-135M-Instruct): "
                        "figures 1-3 only, at the sizes of REAL_SIZES (a few minutes on one CPU thread)")
    p.add_argument("--model-shape", default="tiny", type=Accepts(str, choices=("tiny", "qwen2.5-0.5b")),
                   help="tiny: the checkpoint; qwen2.5-0.5b: a random model of that shape (bf16 on CUDA)")
    p.add_argument("--repeats", type=Accepts(int, min=0), default=0,
                   help="timed repeats per figure (default 5, quick 3)")
    p.add_argument("--train-steps", type=Accepts(int, min=0), default=0,
                   help="RL steps timed in figure 5 (default 2, quick 1)")
    p.add_argument("--procs", default="1,2", type=Accepts(str, int_range=True),
                   help="figure 7: torchrun process counts to time, e.g. 1,2,4,8 (GPUs: one each)")
    p.add_argument("--proc-steps", type=Accepts(int, min=0), default=0,
                   help="RL steps per run in figure 7 (default 4, quick 3)")
    p.add_argument("--search-url", default="", help="figure 8: also time this Search-R1 server, http://HOST:PORT/retrieve")
    p.add_argument("--search-only", action="store_true", help="figure 8 alone (its share row needs a policy: "
                                                             "--checkpoint or an existing default)")
    return p.parse_args(argv)


def figures(args, device: torch.device, repeats: int) -> dict:
    """Every figure's numbers (the policies are loaded, or trained on first use, first)."""
    model, tok, source = load(args, device)
    p_model, p_tok, p_source = protocol_model(args, model, tok, source, device)
    cfg = train.parse_args([])
    n_new = 64 if args.quick else cfg.max_new_tokens

    with models.autocast(cfg.precision, device):         # the training forward: bf16 autocast on CUDA, fp32 on CPU
        dec = bench_decode(model, tok, device, n_new, repeats)
        # the real-model path's protocol prompt (hundreds of tokens), then the checkpoint's own prompt (what it
        # trained on)
        own_prompt = rollout.checkpoint_prompt(source) if os.path.isdir(source) else PROTOCOL_PROMPT
        ro = bench_rollout(p_model, p_tok, device, cfg, repeats, cfg.max_new_tokens, PROTOCOL_PROMPT)
        ro_own = (bench_rollout(model, tok, device, cfg, repeats, cfg.max_new_tokens, own_prompt, greedy=False)
                  if own_prompt != PROTOCOL_PROMPT else None)
        trajs = (ro_own or ro).pop("trajs")       # one sampled 8x8 rollout: scored in 3, collated in 6
        sc = bench_scoring(model, tok, device, scoring_pairs(tok, trajs), 5 * repeats)   # a call is short: more repeats
        pad = bench_padding(trajs, cfg)
        st = bench_train_step(model, tok, device, args.train_steps or (1 if args.quick else 2))   # before 4: peak RSS
        cx = bench_context(model, tok, device, repeats, args.quick)
    peak = matmul_peak(device)
    sf = bench_sft(model, tok, device, 3 if args.quick else 6, peak)
    fl = floors(st, sf["n_params"], peak)
    procs = [int(x) for x in args.procs.split(",")]
    pr = bench_processes(model, tok, source, device, procs, args.proc_steps or (3 if args.quick else 4))
    se = bench_search(search_sizes(args), args.search_url)
    ss = step_searches(model, tok, device)
    return dict(dec=dec, ro=ro, ro_own=ro_own, sc=sc, pad=pad, st=st, cx=cx, pr=pr, procs=procs, n_new=n_new,
                source=source, p_source=p_source, micro_tokens=cfg.micro_tokens, se=se, ss=ss, sf=sf, fl=fl)


# --model: figures 1-3 sized for a 135M model on one CPU thread (SmolLM2: ~4 minutes with the load; 1 repeat =
# one warm-up + 1 timed run of each side). decode: B prompts of 8-64 random tokens; rollout: Q questions x G
# rollouts of the RL distribution under the protocol prompt; scoring: N expert rounds (2N contexts).
REAL_SIZES = dict(batch=16, new_tokens=32, questions=2, group=4, max_new_tokens=32, max_turns=2, pairs=4)


def real_model_figures(args, device: torch.device, repeats: int) -> dict:
    """Figures 1-3 on a model from elsewhere (``--model``), at ``REAL_SIZES``.

    1 as above at batch ``batch``. 2: the protocol prompt; a zero-shot model answers in prose, so a trajectory is
    one round and the prefix cache has no later round to save: the ratio to the naive loop is what identical
    prompts prefilled once and finished rows leaving the batch buy. 3: such a model writes no ``<mem>`` span to
    score, so the 2N contexts come from expert rounds rendered under the protocol prompt (``expert_pairs``), at
    the default budget (on CPU both budgets are capped at ``reward.CPU_TOKENS``)."""
    z = REAL_SIZES
    model, tok = models.load_pretrained(args.model, device)
    model.eval()
    cfg = replace(train.parse_args([]), questions=z["questions"], group=z["group"], max_turns=z["max_turns"])
    with models.autocast(cfg.precision, device):
        dec = bench_decode(model, tok, device, z["new_tokens"], repeats, batch=z["batch"])
        ro = bench_rollout(model, tok, device, cfg, repeats, z["max_new_tokens"], PROTOCOL_PROMPT)
        ro.pop("trajs")
        sc = bench_scoring(model, tok, device, expert_pairs(tok, z["pairs"], PROTOCOL_PROMPT), repeats, (8192,))
    return dict(dec=dec, ro=ro, sc=sc, source=args.model)


def print_real_table(f: dict, device: torch.device, repeats: int) -> None:
    dec, ro, sc, z = f["dec"], f["ro"], f["sc"], REAL_SIZES
    print(f"# python bench.py --model {f['source']}  device={device}  threads={torch.get_num_threads()}  "
          f"repeats={repeats}  {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'figure':44s} {'ours':>10s} {'reference':>10s} {'ratio':>6s}")
    row = lambda name, a, b, r, note: print(f"{name:44s} {a:10.3f} {b:10.3f} {r:6.2f}   {note}")
    row(f"1 decode tok/s (B={z['batch']}, {z['new_tokens']} new, T=1)", dec["ours_tok_s"], dec["hf_tok_s"],
        dec["speedup"], f"vs model.generate; greedy parity {dec['greedy_parity']}")
    for key, temp in (("sampled", "T=1"), ("greedy", "T=0")):
        x = ro[key]
        row(f"2 rollout traj/s ({z['questions']} x G={z['group']}, {temp})", x["on_traj_s"], x["naive_traj_s"],
            x["speedup"], f"protocol prompt ({ro['prefix_tokens']:.0f}-token prefix) vs model.generate per round; "
            f"cache off {x['off_traj_s']:.3f} traj/s, on/off {x['on_vs_off']:.2f}; rounds/traj {x['rounds_on']:.2f}"
            + (f"; identical trajectories {x['identical']}" if "identical" in x else ""))
    if sc["n"]:
        x = sc[8192]
        row(f"3 scoring s, 2N={2 * sc['n']} expert contexts", x["one_2n_s"], x["two_n_s"], x["speedup"],
            f"one 2N pass vs two N passes; max |dlogp| {x['max_abs_diff']:.1e}")


def real_summary(f: dict, device: torch.device, repeats: int, seconds: float) -> dict:
    """The JSON line of ``--model``: the three ratios, then the numbers behind them."""
    dec, ro, sc, r3 = f["dec"], f["ro"], f["sc"], lambda x: round(x, 3)
    return {"decode_speedup": r3(dec["speedup"]), "rollout_speedup": r3(ro["sampled"]["speedup"]),
            "rollout_greedy_speedup": r3(ro["greedy"]["speedup"]),
            "scoring_speedup": r3(sc[8192]["speedup"]) if sc["n"] else None,
            "decode_tok_s": {"ours": r3(dec["ours_tok_s"]), "hf": r3(dec["hf_tok_s"])},
            "greedy_parity": dec["greedy_parity"], "rollout_greedy_identical": ro["greedy"]["identical"],
            "rollout_traj_s": {k: r3(ro["sampled"][f"{k}_traj_s"]) for k in ("on", "off", "naive")},
            "rollout_rounds_per_traj": r3(ro["sampled"]["rounds_on"]),
            "rollout_prefix_tokens": round(ro["prefix_tokens"]),
            "scoring_s": {k: r3(sc[8192][k]) for k in ("one_2n_s", "two_n_s")} if sc["n"] else None,
            "sizes": REAL_SIZES, "model": f["source"], "device": str(device), "threads": torch.get_num_threads(),
            "repeats": repeats, "date": time.strftime("%Y-%m-%d"), "seconds": round(seconds)}


def print_table(f: dict, args, device: torch.device, repeats: int) -> None:
    dec, ro, ro_own, sc, pad, st, cx, pr = (f[k] for k in ("dec", "ro", "ro_own", "sc", "pad", "st", "cx", "pr"))
    n_new, source, p_source, procs, micro = f["n_new"], f["source"], f["p_source"], f["procs"], f["micro_tokens"]
    s, g = ro["sampled"], ro["greedy"]
    print(f"# python bench.py{' --quick' if args.quick else ''}  device={device}  model={source}  "
          f"threads={torch.get_num_threads()}  repeats={repeats}  {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'figure':40s} {'ours':>10s} {'reference':>10s} {'ratio':>6s}")
    row = lambda name, a, b, r, note: print(f"{name:40s} {a:10.3f} {b:10.3f} {r:6.2f}   {note}")
    row(f"1 decode tok/s/1000 (B=64, {n_new} new, T=1)", dec["ours_tok_s"] / 1e3, dec["hf_tok_s"] / 1e3,
        dec["speedup"], f"vs model.generate; greedy parity {dec['greedy_parity']}")
    cache_note = lambda x: (f"cache off {x['off_traj_s']:.2f} traj/s ({x['speedup_off']:.2f}x naive), on/off "
                            f"{x['on_vs_off']:.2f}; rounds/traj {x['rounds_on']:.2f} vs {x['rounds_naive']:.2f}")
    row("2 rollout traj/s (8 x G=8, snail, T=1)", s["on_traj_s"], s["naive_traj_s"], s["speedup"],
        f"protocol prompt ({ro['prefix_tokens']:.0f}-token prefix; {p_source}), prefix cache on vs "
        f"model.generate per round; " + cache_note(s))
    row("  rollout traj/s (same, greedy)", g["on_traj_s"], g["naive_traj_s"], g["speedup"],
        f"{cache_note(g)}; identical trajectories {g['identical']}")
    if ro_own is not None:
        o = ro_own["sampled"]
        row("  rollout traj/s (own prompt, T=1)", o["on_traj_s"], o["naive_traj_s"], o["speedup"],
            f"the checkpoint's system prompt ({ro_own['prefix_tokens']:.0f}-token prefix); " + cache_note(o))
    print("  on: system prompt + question prefilled once per question per rollout call (prefix cache), each\n"
          "  round prefilling only what follows; identical prompts prefilled once (cache rows repeated); finished\n"
          "  rows dropped; tool output prefilled with the next prompt as one chunk; static KV cache; 4D mask passed\n"
          "  through; inverse-CDF sampling")
    for b in (65536, 8192):
        if b in sc:
            x = sc[b]
            row(f"3 scoring s, 2N={2 * sc['n']}, budget {b}", x["one_2n_s"], x["two_n_s"], x["speedup"],
                f"one 2N pass vs two N passes; max |dlogp| {x['max_abs_diff']:.1e}")
    print("4 context growth: one round, batch 8, prefill + 30 new tokens")
    print(f"  {'round':>6s} {'snail tok':>10s} {'snail s':>8s} {'full tok':>9s} {'full s':>8s}")
    for r in (8, 16, 32, 64):
        a, b = cx[f"snail_{r}"], cx[f"full_{r}"]
        print(f"  {r:6d} {a['prompt_tokens']:10.0f} {a['sec']:8.3f} {b['prompt_tokens']:9.0f} {b['sec']:8.3f}")
    tok_growth = cx["snail_64"]["prompt_tokens"] / cx["snail_8"]["prompt_tokens"]
    print(f"  round 64 / round 8 seconds: snail {cx['snail_ratio_64_vs_8']:.2f} (its prompt grows {tok_growth:.2f}x: "
          f"<mem> keeps one entry per objective)   full {cx['full_ratio_64_vs_8']:.2f}")
    print_update(st, pad, pr, procs, micro, args.train_steps or (1 if args.quick else 2), device)
    print_search(f["se"], f["ss"], step_seconds(st))
    print_floor(f["sf"], f["fl"], st, ro["sampled"]["speedup"])


def summary(f: dict, args, device: torch.device, repeats: int, seconds: float) -> dict:
    """The JSON line: every ratio, then the absolute numbers behind them."""
    dec, ro, ro_own, sc, pad, st, cx, pr = (f[k] for k in ("dec", "ro", "ro_own", "sc", "pad", "st", "cx", "pr"))
    s, g = ro["sampled"], ro["greedy"]
    tok_growth = cx["snail_64"]["prompt_tokens"] / cx["snail_8"]["prompt_tokens"]
    r3 = lambda x: round(x, 3)
    return {
        "decode_speedup": r3(dec["speedup"]), "rollout_speedup": r3(s["speedup"]),
        "rollout_speedup_no_prefix_cache": r3(s["speedup_off"]), "rollout_prefix_cache_gain": r3(s["on_vs_off"]),
        "rollout_prefix_tokens": round(ro["prefix_tokens"]), "rollout_model": f["p_source"],
        "rollout_rounds_per_traj": r3(s["rounds_on"]),
        "rollout_speedup_own_prompt": r3(ro_own["sampled"]["speedup"]) if ro_own else None,
        "scoring_speedup": r3(sc[8192]["speedup"]) if sc["n"] else None,
        "snail_round_cost_ratio_64_vs_8": r3(cx["snail_ratio_64_vs_8"]), "padding_waste": r3(pad["after"]),
        "full_round_cost_ratio_64_vs_8": r3(cx["full_ratio_64_vs_8"]), "snail_prompt_growth_64_vs_8": r3(tok_growth),
        "scoring_speedup_budget_65536": r3(sc[65536]["speedup"]) if sc["n"] else None,
        "padding_waste_unsorted": r3(pad["before"]), "padding_waste_small_budget": r3(pad["small_budget"]),
        "decode_tok_s": {"ours": round(dec["ours_tok_s"]), "hf": round(dec["hf_tok_s"])},
        "greedy_parity": dec["greedy_parity"],
        "rollout_traj_s": {"on": r3(s["on_traj_s"]), "off": r3(s["off_traj_s"]), "naive": r3(s["naive_traj_s"])},
        "rollout_greedy_speedup": r3(g["speedup"]), "rollout_greedy_identical": g["identical"],
        "train_step": {k: r3(v) for k, v in st.items()}, "device": str(device), "model": f["source"],
        "step_sec_by_procs": {str(n): r3(x["sec_step"]) for n, x in pr.items()},
        "quick": args.quick, "repeats": repeats, "date": time.strftime("%Y-%m-%d"),
        "sft_peak_share": {k: r3(f["sf"][k]["peak_share"]) for k in f["sf"]["stages"]},
        "sft_padding": {k: r3(f["sf"][k]["padding"]) for k in f["sf"]["stages"]},
        "sft_tok_s": {k: round(f["sf"][k]["tok_s"]) for k in f["sf"]["stages"]},
        "sft_sec_default": round(f["sf"]["sft_sec"]), "matmul_gflops": round(f["sf"]["peak_flops"] / 1e9, 1),
        **{k: r3(v) for k, v in f["fl"].items()},
        "seconds": round(seconds)} | search_summary(f["se"], f["ss"], step_seconds(st))


def main(argv=None) -> None:
    args = parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 5)
    device = torch.device(args.device)
    t_start = time.time()
    if args.model:
        repeats = args.repeats or 1
        f = real_model_figures(args, device, repeats)
        print_real_table(f, device, repeats)
        print(f"# total {time.time() - t_start:.0f} s")
        print(json.dumps(real_summary(f, device, repeats, time.time() - t_start)))
        return
    if args.search_only:
        rows = bench_search(search_sizes(args), args.search_url)
        step = step_s = None
        path = args.checkpoint or next((p for p in DEFAULT_CHECKPOINTS if os.path.exists(p)), "")
        if path:
            model, tok = models.load_model(path, device).eval(), AutoTokenizer.from_pretrained(path)
            step_s = step_seconds(bench_train_step(model, tok, device, 1))
            step = step_searches(model, tok, device)
        print(f"# python bench.py --search-only{' --quick' if args.quick else ''}  model={path or 'none'}  "
              f"{time.strftime('%Y-%m-%d %H:%M')}")
        print_search(rows, step, step_s)
        print(f"# total {time.time() - t_start:.0f} s")
        print(json.dumps(search_summary(rows, step, step_s) | {"quick": args.quick, "date": time.strftime("%Y-%m-%d"),
                                                             "seconds": round(time.time() - t_start)}))
        return
    f = figures(args, device, repeats)
    print_table(f, args, device, repeats)
    print(f"# total {time.time() - t_start:.0f} s")
    print(json.dumps(summary(f, args, device, repeats, time.time() - t_start)))


if __name__ == "__main__":
    data.exit_on_bad_input(main)         # a missing or broken input: one line, exit status 2
