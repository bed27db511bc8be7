"""Figure 8 of ``bench.py``, **search** (``search``): retrieval as the corpus grows, a file of its own because it
times the retrieval backends, not the engine. For rank-bm25 in process (``search.SearchTool``, today's tool), the
local index in process (``search.BM25Index``) and the index behind ``search.py serve`` over loopback: build seconds, the
build's peak RSS above the process's start, and queries/s at batch 1 and batch 64, on synthetic corpora of
60-word passages (Zipf words over a 50k vocabulary; 4-word queries drawn the same way) of 10k and 100k
passages, 1M in full mode (not ``--quick``; rank-bm25 is not run there: ~1.8 s a query). Each corpus size
and backend runs in a fresh process (its peak RSS is its own). Then search's share of one default RL step:
the search seconds of one default-config rollout (the embedded world) over figure 5's step seconds, and
the same searches' seconds at each size and backend. ``--search-url`` adds a row for that server;
``--search-only`` prints figure 8 alone (the share row when a policy exists).
"""
from __future__ import annotations

import multiprocessing
import resource
import tempfile
import threading
import time

import numpy as np
import torch

import models
import rollout
import search
import train


def zipf_words(rng: np.random.Generator, n: int, vocab: int = 50_000) -> list[str]:
    """``n`` words of a Zipf(1) law over ``vocab`` words ``w0 .. w{vocab-1}``."""
    p = 1.0 / np.arange(1, vocab + 1)
    return [f"w{i}" for i in rng.choice(vocab, size=n, p=p / p.sum())]


def synthetic_corpus(n: int, seed: int = 0, words: int = 60) -> tuple[list[dict], list[str]]:
    """(``n`` passages of ``words`` Zipf words, 64 queries of 4 words), the same for a seed."""
    rng = np.random.default_rng(seed)
    docs = []
    for start in range(0, n, 10_000):                     # in chunks: one 60M-word list would double the RSS
        ws = zipf_words(rng, min(10_000, n - start) * words)
        docs += [{"id": str(start + i), "contents": " ".join(ws[i * words:(i + 1) * words])}
                 for i in range(len(ws) // words)]
    qs = zipf_words(rng, 64 * 4)
    return docs, [" ".join(qs[i:i + 4]) for i in range(0, len(qs), 4)]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def search_row(n: int, backend: str, url: str, out) -> None:
    """One row of figure 8 in this (fresh) process: build, peak RSS above the start, queries/s at batch 1 and 64."""
    docs, queries = synthetic_corpus(n)
    rss0 = rss_mb()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        if backend == "rank-bm25":
            tool = search.SearchTool(docs)
        elif backend == "url":
            tool = search.SearchClient(url)
        else:
            search.build_index(docs, tmp)
            tool = search.BM25Index(tmp)
        build = time.perf_counter() - t0
        del docs
        server = None
        if backend == "server":
            server = search.make_server(tool, "127.0.0.1", 0)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            tool = search.SearchClient(f"http://127.0.0.1:{server.server_port}/retrieve")
        one = queries[:16] if backend == "rank-bm25" and n > 10_000 else queries    # ~0.2 s a query there
        t0 = time.perf_counter()
        for q in one:
            tool.search_batch([q])
        qps1 = len(one) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        tool.search_batch(queries)
        qps64 = len(queries) / (time.perf_counter() - t0)
        if server is not None:
            server.shutdown()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
    out.put({"n": n, "backend": backend, "build_s": build, "peak_rss_mb": peak, "qps_1": qps1, "qps_64": qps64,
             "failures": tool.failures})


def step_searches(model, tok, device) -> dict:
    """The searches of one default-config rollout (embedded world): how many, and their seconds."""

    class Timed(search.SearchTool):
        seconds, queries = 0.0, 0

        def search_batch(self, queries):
            t0 = time.perf_counter()
            obs = super().search_batch(queries)
            self.seconds, self.queries = self.seconds + time.perf_counter() - t0, self.queries + len(queries)
            return obs

    cfg = train.parse_args([])
    tasks, tool = train.rl_tasks(cfg, 0)
    timed = Timed(tool.docs)
    agent = train.agent_config(cfg)
    with models.autocast(cfg.precision, device):
        rollout.rollout(model, tok, tasks, cfg.group, timed, agent, torch.Generator(device).manual_seed(0))
    return {"searches": timed.queries, "search_s": timed.seconds}


def bench_search(sizes: list[int], url: str = "") -> list[dict]:
    """Figure 8's rows, each in a fresh process."""
    ctx = multiprocessing.get_context("spawn")
    rows = []
    jobs = [(n, b, "") for n in sizes for b in ("rank-bm25", "index", "server")
            if not (b == "rank-bm25" and n > 100_000)]
    for n, b, u in jobs + ([(10_000, "url", url)] if url else []):
        out = ctx.Queue()
        p = ctx.Process(target=search_row, args=(n, b, u, out))
        p.start()
        rows.append(out.get())
        p.join()
    return rows


def print_search(rows: list[dict], step: dict | None, step_s: float | None) -> None:
    print("8 search, synthetic 60-word passages, 4-word queries (each row a fresh process)")
    print(f"  {'passages':>9s} {'backend':10s} {'build s':>8s} {'peak RSS MB':>11s} {'q/s batch 1':>11s} "
          f"{'q/s batch 64':>12s}" + (f" {'s / step':>9s}" if step else ""))
    for r in rows:
        per_step = f" {step['searches'] / r['qps_64']:9.3f}" if step else ""
        print(f"  {r['n']:9d} {r['backend']:10s} {r['build_s']:8.1f} {r['peak_rss_mb']:11.0f} {r['qps_1']:11.1f} "
              f"{r['qps_64']:12.1f}" + per_step + (f"  failures {r['failures']}" if r["failures"] else ""))
    if step:
        print(f"  one default RL step: {step['searches']} searches, {step['search_s']:.3f} s in the embedded world's "
              f"rank-bm25" + (f" = {step['search_s'] / step_s:.1%} of its {step_s:.2f} s" if step_s else "")
              + "; 's / step': those searches at each row's batch-64 rate")


def search_sizes(args) -> list[int]:
    return [10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000]


def search_summary(rows: list[dict], step: dict | None, step_s: float | None) -> dict:
    r3 = lambda x: round(x, 3)
    return {"search": [{k: r3(v) if isinstance(v, float) else v for k, v in r.items()} for r in rows],
            "search_step": step, "search_step_share": r3(step["search_s"] / step_s) if step and step_s else None}
