"""Evaluation: run the agent greedily on held-out questions and report F1, EM, tokens and turns.

    python eval.py --checkpoint runs/default/final --objectives 1 2 4 6 8 10 --context snail
    python eval.py --checkpoint PATH --data qa.jsonl --corpus wiki.jsonl --context snail

Per objective count K (MEM1's multi-objective protocol): F1, EM, the fraction of objectives
matched (score), the format-valid rate, TT (total tokens: every prompt + generated token the
model processed, summed over the episode's rounds), PT (peak tokens: the longest single-round
context + output), and mean turns. TT and PT are means over episodes. A table on stdout, then
one JSON line last.

The agent is a memory agent: it plays in the snail context (``--context snail``, the default) whatever
context it trained in, as the paper trains with full context and evaluates snail at 64 turns; ``--context full``
plays a full-context agent, and ``--compare`` plays each run in its own training context.

Held-out sets of the embedded world are new worlds (new fact graphs and questions) over the same
pool of entity names as training; ``--split valid`` and ``--split test`` are disjoint world seeds:
pick settings on ``valid``, report on ``test``.

In the embedded world, where the facts are known, ``--compare`` also reports memory retention (``memory_retention``):
the share of found facts the agent's ``<mem>`` still holds, by rounds since it found them. A look inside the
episodes (the memory reward's probes, the stop value, what RL changed) is ``diagnostics.py``. Other recipes have
their own evaluations: ``python -m recipes.memalpha_eval``, ``python -m recipes.memtrain_eval``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from tqdm import tqdm

import data
import sft
from flags import Accepts, FlagParser
from memory import extract_mem
from models import gguf_file, load_pretrained, pick_device
from checkpoint import run_config, trained_probe_think
from reward import MEM_MASK, THRESHOLD, memory_rewards, outcome_reward
from rollout import AgentConfig, checkpoint_prompt, parse_action, run_episodes
from search import Retriever, SearchTool, open_search
import viz

SPLIT_SEEDS = data.SPLIT_SEEDS
AGO_BUCKETS = [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 64)]
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def run_reward_config(checkpoint: str) -> tuple[str, float, str]:
    """The memory reward's ``(mem_mask, threshold, probe_think)`` of the run that wrote ``checkpoint``; a checkpoint
    without a run config gets the reward's defaults and the marker it learnt (``checkpoint.trained_probe_think``)."""
    cfg = run_config(checkpoint)
    return (cfg.get("mem_mask", MEM_MASK), float(cfg.get("threshold", THRESHOLD)),
            trained_probe_think(checkpoint_dir(checkpoint)))


def run_context(context: str | None, checkpoint: str) -> str:
    """``--context`` if given, else the context the run trained in (a full-context agent is evaluated as one)."""
    return context or run_config(checkpoint).get("train_context", "snail")


# a floor, not only a default: held-out questions of more objectives than training's write longer rounds (the
# embedded expert's round at K = 10 is 111 tokens, its run trains at 96)
MAX_NEW_TOKENS = 128


def run_max_new_tokens(max_new_tokens: int | None, checkpoint: str) -> int:
    """``--max-new-tokens`` if given, else the run's own ``max_new_tokens`` (RUN/config.json), at least 128: a run
    that trained at 512 tokens a round is not cut at 128; a checkpoint without a run config gets 128."""
    if max_new_tokens is not None:
        return max_new_tokens
    return max(MAX_NEW_TOKENS, int(run_config(checkpoint).get("max_new_tokens", 0)))


def summarize(trajs: list) -> dict:
    """Mean F1, EM, score, format-valid rate, TT, PT and turns over trajectories, and the early-answer share
    (``data.early_answer``: answered after fewer searches than the question's hops; embedded world only)."""
    rows = []
    for t in trajs:
        o = outcome_reward(t)
        rows.append({"f1": o["f1"], "em": o["em"], "score": o["score"], "valid": float(o["valid"]),
                     "tt": sum(r.n_tokens for r in t.rounds),
                     "pt": max((r.n_tokens for r in t.rounds), default=0), "turns": len(t.rounds)})
    early = [e for e in map(data.early_answer, trajs) if e is not None]
    return ({k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} | {"n": len(rows)}
            | ({"early": sum(early) / len(early)} if early else {}))


def retention_events(traj, task):
    """(round t, objective k, held, rounds ago, hop) for every round t >= 1 of ``traj`` and every objective with
    a needed entity: the newest object of its gold chain that an earlier search retrieved (its answer once the
    chain is complete; ``hop`` = its index in the chain); ``held`` = does ``<mem>`` hold it in objective k's
    entry, found how many rounds ago."""
    tools = [r.text for r in traj.records if r.type in ("search_results", "webpage")]
    found: dict[tuple[int, int], int] = {}           # (objective, hop) -> round that retrieved it
    for t, rnd in enumerate(traj.rounds):
        if t >= 1:
            entries = data.parse_mem(extract_mem(rnd.text) or "")
            for k, obj in enumerate(task.objectives):
                hops = [h for h in range(len(obj.chain)) if (k, h) in found]
                if hops:
                    h = max(hops)
                    yield t, k, int(obj.chain[h][2] in entries.get(k, [])), t - found[(k, h)], h
        if t < len(tools) and rnd.action == "search":
            query = parse_action(rnd.text)[1].split()
            for k, obj in enumerate(task.objectives):
                for h, f in enumerate(obj.chain):      # retrieved: searched for and shown
                    if query == list(f[:2]) and " ".join(f) in tools[t] and (k, h) not in found:
                        found[(k, h)] = t


def memory_retention(trajs: list, tasks: list) -> dict:
    """How much of what the agent found its ``<mem>`` keeps, measurable because the world's facts are known.

    Retention at round t >= 1 (from 0) = fraction of needed entities (``retention_events``) that ``<mem>`` holds
    in objective k's entry (``k = path``), by how many rounds ago the entity was retrieved (and pooled over 3+
    rounds ago: what only ``<mem>`` can still hold in the snail shell), and for rounds 1-7 vs 8-63 (turn drift:
    the paper trains 8 rounds, evaluates 64).
    """
    kept = {b: [0, 0] for b in AGO_BUCKETS}
    drift = {"rounds 1-7": [0, 0], "rounds 8-63": [0, 0]}
    for traj in trajs:
        for t, _, hit, ago, _ in retention_events(traj, tasks[traj.group_id]):
            for b in AGO_BUCKETS:
                if b[0] <= ago <= b[1]:
                    kept[b][0] += hit
                    kept[b][1] += 1
            d = drift["rounds 1-7" if t < 8 else "rounds 8-63"]
            d[0] += hit
            d[1] += 1
    ratio = lambda a: a[0] / a[1] if a[1] else float("nan")
    older = [v for (a, _), v in kept.items() if a >= 3]
    return {"retention": ratio([sum(v[0] for v in kept.values()), sum(v[1] for v in kept.values())]),
            "retention_3plus": ratio([sum(v[0] for v in older), sum(v[1] for v in older)]),
            "retention_by_ago": {f"{a}-{b}": ratio(v) for (a, b), v in kept.items()},
            "retention_drift": {k: ratio(v) for k, v in drift.items()}}


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (0 for one value)."""
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
    return m, T95.get(len(xs) - 1, 1.96) * sd / len(xs) ** 0.5


def evaluate(model, tokenizer, tasks: list, tool: Retriever, agent: AgentConfig, batch: int = 64,
             bar=None) -> dict:
    """Rollouts of ``tasks`` -> mean metrics."""
    return summarize(run_episodes(model, tokenizer, tasks, tool, agent, batch, bar))


def embedded_tasks(k: int, n: int, seed: int = 0, split: str = "test", hops: tuple[int, int] = (1, 3)):
    """``n`` held-out K-objective tasks of the embedded world and their search tool."""
    world, tasks = data.held_out_tasks(k, n, seed, split, hops)
    return tasks, SearchTool(world.docs)


def progress_bar(total: int):
    """ONE bar for a whole evaluation, counting episodes (a log file gets a few lines, not one bar per K)."""
    return tqdm(total=total, desc="eval", unit="episode", mininterval=10)


def greedy_agent(context: str = "snail", max_turns: int = 64, max_new_tokens: int = 128,
                 system_prompt: str = data.SYSTEM_PROMPT, temperature: float = 0.0) -> AgentConfig:
    """The agent every evaluation runs: greedy, the checkpoint's system prompt (default: the embedded world's).
    ``temperature`` > 0 samples instead (``--temperature 1 --max-turns 16``: the policy RL trains, scored as
    training scores it)."""
    return AgentConfig(system_prompt=system_prompt, context=context, max_turns=max_turns,
                       max_new_tokens=max_new_tokens, temperature=temperature)


def evaluate_embedded(model, tokenizer, ks: list[int], n: int, seed: int = 0, split: str = "valid",
                      context: str = "snail", max_turns: int = 64, hops: tuple[int, int] = (1, 3),
                      max_new_tokens: int = 128, progress: bool = False,
                      system_prompt: str = data.SYSTEM_PROMPT, temperature: float = 0.0) -> dict[int, dict]:
    """Metrics per objective count K on held-out embedded worlds, memory retention among them (``memory_retention``)."""
    agent = greedy_agent(context, max_turns, max_new_tokens, system_prompt, temperature)
    bar = progress_bar(len(ks) * n) if progress else None
    out = {}
    for k in ks:
        tasks, tool = embedded_tasks(k, n, seed, split, hops)
        trajs = run_episodes(model, tokenizer, tasks, tool, agent, bar=bar)
        out[k] = summarize(trajs) | memory_retention(trajs, tasks)
    if bar is not None:
        bar.close()
    return out


def print_table(results: dict, title: str = "") -> None:
    cols = ["f1", "em", "score", "valid", "tt", "pt", "turns", "n"]
    cols += ["early"] if all("early" in r for r in results.values()) else []
    if title:
        print(title)
    print("K    " + " ".join(f"{c:>8}" for c in cols))
    for k, r in results.items():
        print(f"{k:<4} " + " ".join(f"{r[c]:8.3f}" if isinstance(r[c], float) else f"{r[c]:8d}" for c in cols))


def checkpoint_dir(path: str) -> str:
    """A run folder (with ``final/``), a checkpoint folder, a ``.gguf`` file or ``smollm2`` (as it is)."""
    return os.path.join(path, "final") if os.path.isdir(os.path.join(path, "final")) else path


def is_model_dir(path: str) -> bool:
    """A folder with a model's ``config.json`` (a run folder's own config.json has no ``model_type``)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return "model_type" in json.load(f)
    except (OSError, ValueError):
        return False


def load(path: str, device):
    """(model, tokenizer, system prompt) of a checkpoint (or a model from elsewhere: ``models.load_pretrained``);
    bf16 weights on CUDA (no optimizer to feed)."""
    path = checkpoint_dir(path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tokenizer = load_pretrained(path, device, dtype)
    return model.eval(), tokenizer, checkpoint_prompt(path)


def compare(variants: dict[str, list[str]], ks: list[int], n: int, split: str, context: str | None,
            max_turns: int, hops: tuple[int, int], device, max_new_tokens: int | None = None) -> dict:
    """Per variant (a list of runs, one per seed) and K: mean and 95% interval of each metric, and each run's F1
    (``f1_runs``, in the order given: a gap between two variants trained from the same starts can be paired).

    Each run plays in ``context``, or when None in the context it trained in (``run_context``), so a
    memory agent and a full-context agent share one table; ``max_new_tokens`` None: each run's own
    (``run_max_new_tokens``).

    Besides the outcome metrics it keeps each run's memory retention by rounds-ago (pooled over K),
    so a variant that forgets shows it here and in the plot of ``plot_compare``.
    """
    metrics = ("f1", "em", "valid", "tt", "pt", "turns", "retention")
    out: dict = {}
    for name, runs in variants.items():
        per_run = []
        for run in runs:
            model, tok, prompt = load(run, device)
            agent = greedy_agent(run_context(context, run), max_turns, run_max_new_tokens(max_new_tokens, run),
                                 system_prompt=prompt)
            res, trajs_all, tasks_all = {}, [], []
            for k in ks:
                tasks, tool = embedded_tasks(k, n, 0, split, hops)
                trajs = run_episodes(model, tok, tasks, tool, agent)
                res[k] = summarize(trajs) | {"retention": memory_retention(trajs, tasks)["retention"]}
                for t in trajs:                                  # pool K: index into tasks_all
                    t.group_id += len(tasks_all)
                trajs_all += trajs
                tasks_all += tasks
            res["by_ago"] = memory_retention(trajs_all, tasks_all)["retention_by_ago"]
            per_run.append(res)
        nan_free = lambda xs: [x for x in xs if x == x] or [float("nan")]
        out[name] = {k: {m: mean_ci(nan_free([r[k][m] for r in per_run])) for m in metrics}
                        | {"f1_runs": [r[k]["f1"] for r in per_run]} for k in ks}    # per seed, for paired gaps
        out[name]["by_ago"] = {a: mean_ci(nan_free([r["by_ago"][a] for r in per_run])) for a in per_run[0]["by_ago"]}
    for k in ks:
        print(f"\nK = {k}  ({split} worlds, {n} questions, context={context or 'as trained'}, "
              f"mean +- 95% CI over seeds)")
        print(f"{'variant':<24}" + "".join(f"{m:>16}" for m in metrics))
        for name in variants:
            print(f"{name:<24}" + "".join(f"{out[name][k][m][0]:9.3f} +-{out[name][k][m][1]:5.3f}" for m in metrics))
    print("\nmemory retention by rounds since the fact was found (all K pooled)")
    ago = list(out[next(iter(variants))]["by_ago"])
    print(f"{'variant':<24}" + "".join(f"{a:>16}" for a in ago))
    for name in variants:
        print(f"{name:<24}" + "".join(f"{out[name]['by_ago'][a][0]:9.3f} +-{out[name]['by_ago'][a][1]:5.3f}"
                                      for a in ago))
    return out


def expert_peak_tokens(tokenizer, ks: list[int], n: int, split: str, hops: tuple[int, int],
                       system_prompt: str = data.SYSTEM_PROMPT) -> dict[str, dict[int, float]]:
    """``{"snail" | "full": {K: mean PT}}``: the peak tokens of a round (context + round, as the agent loop counts
    them) of the scripted expert's episodes on the same held-out questions, in each context. What a context
    costs an agent that finishes its episodes, whatever a trained agent learnt; no model runs."""
    out: dict[str, dict[int, float]] = {"snail": {}, "full": {}}
    for k in ks:
        tasks, tool = embedded_tasks(k, n, 0, split, hops)
        for context in out:
            peaks = [max(len(s.ids) for s in sft.expert_samples(tokenizer, t, tool, False, system_prompt=system_prompt,
                                                               context=context)) for t in tasks]
            out[context][k] = sum(peaks) / len(peaks)
    return out


def plot_compare(res: dict, folder: str, expert_pt: dict | None = None) -> list[str]:
    """PNG plots of a ``compare`` result (needs matplotlib): ``f1_vs_k.png``, F1 vs K beside peak tokens of a
    round (PT) vs K (with ``expert_pt``: the expert's, dashed), and ``retention_vs_ago.png``; the error bars
    are the 95% intervals over seeds."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    os.makedirs(folder, exist_ok=True)
    panels = {"f1_vs_k.png": [("f1", "F1 (held-out, greedy)"), ("pt", "peak tokens of a round (PT)")],
              "retention_vs_ago.png": [("by_ago", "fraction of needed facts still in <mem>")]}
    paths = []
    for fname, cols in panels.items():
        fig, axes = plt.subplots(1, len(cols), figsize=(5 * len(cols), 3.5), squeeze=False)
        for ax, (key, ylabel) in zip(axes[0], cols):
            for name, r in res.items():
                if key == "by_ago":
                    xs = list(r["by_ago"])
                    ys, es = zip(*(r["by_ago"][a] for a in xs))
                else:
                    xs = [k for k in r if k != "by_ago"]
                    ys, es = zip(*(r[k][key] for k in xs))
                ax.errorbar([str(x) for x in xs], ys, yerr=es, marker="o", capsize=3, label=name)
            for context, pts in (expert_pt or {}).items() if key == "pt" else ():
                ax.plot([str(k) for k in pts], list(pts.values()), "--", color="gray",
                        marker="s" if context == "full" else "^", label=f"expert, {context} context")
            ax.set_xlabel("rounds since the fact was found" if key == "by_ago" else "objectives K")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(folder, fname))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def show_episodes(model, tokenizer, prompt: str, args, hops: tuple[int, int]) -> None:
    """``--show`` / ``--viz`` / ``--question``: greedy episodes printed round by round (viz.format_episode) and
    / or written as one page (viz.write_page), with each round's P_full / P_mem as the run's reward saw them."""
    if args.question and (unknown := data.unknown_words(tokenizer, args.question)):
        raise SystemExit(f"--question: the model's tokenizer does not know {' '.join(unknown)} (it reads them as "
                         f"<unk>); the embedded world's names are data.name_pool() (python -c \"import data; "
                         f"print(*data.name_pool())\"), its relations {' '.join(data.RELATIONS)}")
    agent = greedy_agent(args.context, args.max_turns, args.max_new_tokens, prompt)
    k = args.objectives[0]
    if args.data or args.corpus or args.search_url:
        if not (args.corpus or args.search_url):
            raise SystemExit("--data needs --corpus or --search-url")
        tool = open_search(args.corpus, args.search_url)
        tasks = data.load_qa(args.data) if args.data else []
    else:
        tasks, tool = embedded_tasks(k, args.show or args.tasks, args.seed, args.split, hops)
    if args.question:
        tasks = [data.Task(args.question, [])]
    if not tasks:
        raise SystemExit("--show / --viz with --corpus need --data (or --question)")
    tasks = tasks[:args.show or args.tasks]                # a --data file: its first N
    trajs = run_episodes(model, tokenizer, tasks, tool, agent)
    mem = None
    if not args.question:                          # no gold, nothing to probe
        mask_mode, threshold, think = run_reward_config(args.checkpoint)
        mem = memory_rewards(model, tokenizer, trajs, threshold, mask_mode, think)
    record = viz.step_record(trajs, tokenizer, mem=mem, metrics=summarize(trajs),
                             title=f"{args.checkpoint}: greedy episodes, K={k if not args.data else 'file'}")
    if args.viz:
        print("wrote", viz.write_page(args.viz, record))
    for q in record["questions"][:args.show or (1 if args.question else 0)]:
        print(viz.format_episode(q, q["rollouts"][0]), end="\n\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = FlagParser(description="Evaluate MemPO checkpoints.")
    p.add_argument("--checkpoint", "--model", dest="checkpoint",
                   help="run folder or checkpoint folder saved by train.py (e.g. runs/default), or a model from "
                        "elsewhere: a model folder, a .gguf file, smollm2 (it gets rollout.PROTOCOL_PROMPT)")
    p.add_argument("--compare", nargs="+", metavar="NAME=RUN[,RUN...]",
                   help="side-by-side variants, each a comma-separated list of runs (one per seed)")
    p.add_argument("--objectives", type=Accepts(int, min=1), nargs="+", default=[1, 2, 4, 6, 8, 10],
                   help="objective counts K")
    p.add_argument("--context", default=None, type=Accepts(str, choices=("snail", "full")),
                   help="context mode (default: snail, as the paper evaluates however the agent trained; with "
                        "--compare each run's training context, so a full-context baseline plays as one)")
    p.add_argument("--max-turns", type=Accepts(int, min=1), default=64, help="max rounds per episode")
    p.add_argument("--max-new-tokens", type=Accepts(int, min=1), default=None,
                   help=f"max tokens per round (default: the run's own --max-new-tokens from its config.json, at "
                        f"least {MAX_NEW_TOKENS}; {MAX_NEW_TOKENS} for a model from elsewhere)")
    p.add_argument("--tasks", type=Accepts(int, min=1), default=64, help="questions per K (embedded world)")
    p.add_argument("--split", default="test", type=Accepts(str, choices=tuple(SPLIT_SEEDS)),
                   help="held-out world seeds")
    p.add_argument("--seed", type=Accepts(int, unbounded=True), default=0, help="which held-out worlds")
    p.add_argument("--hops", default="1-3", type=Accepts(str, int_range=True), help="hops per objective, e.g. 1-3")
    p.add_argument("--plot", default="", metavar="FOLDER", help="with --compare: write F1-vs-K and retention PNGs here")
    p.add_argument("--data", default="", help="QA file (JSONL/parquet) instead of the embedded world")
    p.add_argument("--corpus", default="", help="corpus JSONL for --data (or an index folder from search.py index)")
    p.add_argument("--search-url", default="", help="a Search-R1 retrieval server for --data, "
                                                      "http://HOST:PORT/retrieve (search.py serve)")
    p.add_argument("--compose", type=Accepts(int, min=1), nargs="+", default=[], metavar="K",
                   help="with --data: MEM1-style K-objective questions joined from the file's, one table row per K")
    p.add_argument("--system-prompt", default="", help="text file with the system prompt (default: the checkpoint's)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--temperature", type=Accepts(float, min=0), default=0.0,
                   help="0 = greedy (the reported eval); e.g. 1 with --max-turns 16: RL's own objective, sampled")
    p.add_argument("--show", type=Accepts(int, min=0), default=0, metavar="N",
                   help="print N held-out episodes (the first --objectives K) round by round instead of the table")
    p.add_argument("--viz", default="", metavar="FILE",
                   help="write the episodes (--show N, else --tasks) as one HTML page (viz.py) instead of the table")
    p.add_argument("--question", default="",
                   help="run the agent on this question against the corpus (--corpus, else the K-th test world)")
    args = p.parse_args(argv)
    if not args.compare and not args.checkpoint:
        p.error("give --checkpoint or --compare")
    runs = [r for v in args.compare or [] for r in v.split("=", 1)[-1].split(",")] or [args.checkpoint]
    for run in runs:                 # a missing folder would reach the model hub as a model name
        if not os.path.isdir(run) and gguf_file(run) is None:
            p.error(f"checkpoint folder {run} does not exist")
    if not args.compare:                     # --compare: each run's own, in compare
        args.max_new_tokens = run_max_new_tokens(args.max_new_tokens, args.checkpoint)
    return args


def compare_runs(args, hops: tuple[int, int], device) -> None:
    """``--compare NAME=RUN[,RUN...]``: the side-by-side tables, plots with ``--plot``, then one JSON line."""
    variants = dict(v.split("=", 1) for v in args.compare)
    for run in (r for runs in variants.values() for r in runs.split(",")):
        if os.path.isdir(run) and not is_model_dir(checkpoint_dir(run)):     # before an hour of episodes, not after
            raise SystemExit(f"--compare: {run} holds no model checkpoint (a run still training has no final/)")
    res = compare({k: v.split(",") for k, v in variants.items()}, args.objectives, args.tasks, args.split,
                  args.context, args.max_turns, hops, device, args.max_new_tokens)
    tokenizer = load(next(iter(variants.values())).split(",")[0], device)[1]
    pt = expert_peak_tokens(tokenizer, args.objectives, args.tasks, args.split, hops)
    print("\nthe expert's peak tokens of a round (no model): " + "   ".join(
        f"{c}: " + " ".join(f"K={k} {v:.0f}" for k, v in pts.items()) for c, pts in pt.items()))
    if args.plot:
        print("plots:", " ".join(plot_compare(res, args.plot, pt)))
    print(json.dumps({"compare": {n: {str(k): v for k, v in r.items()} for n, r in res.items()},
                      "expert_pt": pt, "split": args.split, "context": args.context}))


def report_table(model, tokenizer, prompt: str, args, hops: tuple[int, int]) -> None:
    """The default mode: the metrics table per K (or per ``--compose`` K of a ``--data`` file), then one JSON
    line."""
    if args.data:
        if not (args.corpus or args.search_url):
            raise SystemExit("--data needs --corpus or --search-url")
        tasks, tool = data.load_qa(args.data), open_search(args.corpus, args.search_url)
        sets = {k: data.compose_tasks(tasks, k, args.seed) for k in args.compose} or {"all": tasks}
        agent = greedy_agent(args.context, args.max_turns, args.max_new_tokens, prompt, args.temperature)
        bar = progress_bar(sum(len(t) for t in sets.values()))
        results = {k: evaluate(model, tokenizer, t, tool, agent, bar=bar) for k, t in sets.items()}
        bar.close()
        failures = tool.failures
        if failures:
            print(f"search: {failures} searches failed (their rounds saw the failure)", file=sys.stderr)
    else:
        failures = 0                     # the embedded world's tool is in memory
        results = evaluate_embedded(model, tokenizer, args.objectives, args.tasks, args.seed, args.split,
                                    args.context, args.max_turns, hops, args.max_new_tokens, progress=True,
                                    system_prompt=prompt, temperature=args.temperature)
    print_table(results, f"{args.checkpoint}  context={args.context}  max_turns={args.max_turns}  "
                         f"max_new_tokens={args.max_new_tokens}")
    out = {"checkpoint": args.checkpoint, "context": args.context, "max_turns": args.max_turns,
           "max_new_tokens": args.max_new_tokens,
           "results": {str(k): v for k, v in results.items()}, "search_failures": failures}
    print(json.dumps(out))


def main(argv=None) -> None:
    args = parse_args(argv)
    device = pick_device(args.device)
    hops = tuple(int(x) for x in args.hops.split("-"))
    if args.compare:
        return compare_runs(args, hops, device)
    args.context = args.context or "snail"          # the memory agent's context, whatever the run trained in
    model, tokenizer, prompt = load(args.checkpoint, device)
    torch.manual_seed(args.seed)                    # --temperature > 0: the same sampled episodes on a rerun
    if args.system_prompt:
        with open(args.system_prompt, encoding="utf-8") as f:
            prompt = f.read().strip()
    if args.show or args.viz or args.question:
        return show_episodes(model, tokenizer, prompt, args, hops)
    report_table(model, tokenizer, prompt, args, hops)


if __name__ == "__main__":
    data.exit_on_bad_input(main)         # a missing or broken input: one line, exit status 2
