"""torchrun path of train.py on CPU (gloo, 2 processes, tiny models): one update split over two ranks
equals one process updating on the whole batch (DDP and FSDP2), the ranks roll out disjoint shares of the
single process's questions, each with its own seed, the optimizer state converts between FSDP2 and the
single-process format, and a 2-rank run killed with SIGKILL resumes with 1 process to the metrics of the same
run stopped cleanly at that step and continued with 1 process."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp

import data
import dist
import grpo
import models
import train
from rollout import AgentConfig

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--ffn", "64"]
# micro-tokens 40 forces several micro-batches (a different number on each rank), grad-clip 0.05 makes
# clipping bind, two epochs add the old-logp forwards; seq-mean-token-mean checks n_seqs
UPDATE_ARGS = ["--micro-tokens", "40", "--grad-clip", "0.05", "--ppo-epochs", "2", "--lr", "0.1"]
ROLLOUT_ARGS = ["--questions", "4", "--group", "2", "--max-turns", "2", "--max-new-tokens", "12"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def samples(seed=0, n=7):
    """Hand-built round samples of different lengths and advantages (one is all-prompt: no tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(8, 20, (1,), generator=g))
        ids = torch.randint(5, 200, (L,), generator=g).tolist()
        out.append(grpo.Sample(ids, [(5, L)], [(4, 7, 0.5 * (-1.0) ** (i // 2))], adv_t=(-1.0) ** i * (1 + i / 7)))
    return out


def split(xs, rank):
    """Rank 0 takes the first two rows, rank 1 the other five: uneven token and micro-batch counts."""
    return xs[:2] if rank == 0 else xs[2:]


def tiny_model(tok):
    return data.build_tiny_model(tok, hidden=32, layers=2, heads=2, ffn=64, seed=0)


def full_params(model) -> dict:
    sd, _ = dist.full_state(model, None)
    return {k: v.detach().clone() for k, v in (sd if sd is not None else model.state_dict()).items()}


def single_process_update(agg: str, opt_cls) -> tuple[dict, dict, dict]:
    tok = data.build_tokenizer()
    model = tiny_model(tok)
    cfg = train.parse_args(UPDATE_ARGS + ["--agg", agg])
    opt = opt_cls(model.parameters(), lr=cfg.lr)
    m = train.update(model, None, opt, samples(), cfg, tok.pad_token_id)
    return model.state_dict(), m, opt.state_dict()


# --------------------------------------------------------------------------- the 2-rank worker

def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    cfg = train.parse_args(UPDATE_ARGS + ROLLOUT_ARGS + TINY + ["--device", "cpu"])
    dist.setup_distributed(cfg)
    tok = data.build_tokenizer()
    res = {}
    for mode in ("ddp", "fsdp"):
        dist.DIST.fsdp, dist.DIST.ddp = mode == "fsdp", None
        for agg in ("token-mean", "seq-mean-token-mean"):
            model = dist.wrap_for_training(tiny_model(tok), torch.device("cpu"))
            c = train.parse_args(UPDATE_ARGS + ["--agg", agg])
            m = train.update(model, None, torch.optim.SGD(model.parameters(), lr=c.lr), split(samples(), rank),
                                 c, tok.pad_token_id)
            res[(mode, agg)] = (full_params(model), m)
    # FSDP2 AdamW: the gathered optimizer state, in the single-process format, and loaded back
    model = dist.wrap_for_training(tiny_model(tok), torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    train.update(model, None, opt, split(samples(), rank), train.parse_args(UPDATE_ARGS), tok.pad_token_id)
    _, osd = dist.full_state(model, opt)
    import torch.distributed as tdist
    whole = [osd]
    tdist.broadcast_object_list(whole, 0)          # only rank 0 gathered it; every rank loads the file
    opt2 = torch.optim.AdamW(model.parameters(), lr=0.1)
    dist.load_optimizer(model, opt2, whole[0])
    _, osd2 = dist.full_state(model, opt2)
    res["adam"] = (osd, osd2)
    # LoRA under DDP as train_policy builds it: the plain model wrapped first (main), then DDP rebuilt over the
    # adapters when RL starts; the base is frozen, every adapter gets a gradient (no find_unused_parameters)
    dist.DIST.fsdp, dist.DIST.ddp = False, None
    model = dist.wrap_for_training(tiny_model(tok), torch.device("cpu"))
    model = dist.wrap_for_training(models.attach_lora(model, 4, 8), torch.device("cpu"))
    c = train.parse_args(UPDATE_ARGS)
    trainable = [p for p in model.parameters() if p.requires_grad]
    m = train.update(model, None, torch.optim.SGD(trainable, lr=c.lr), split(samples(), rank), c, tok.pad_token_id)
    res["lora"] = ({k: v.clone() for k, v in model.state_dict().items()}, m)
    # a non-finite loss on rank 1 only: every rank skips the step, no weight moves
    dist.DIST.fsdp, dist.DIST.ddp = False, None
    model = dist.wrap_for_training(tiny_model(tok), torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    bad = split(samples(), rank)
    if rank == 1:
        bad[0].adv_t = float("nan")
    m = train.update(model, None, torch.optim.SGD(model.parameters(), lr=0.1), bad, train.parse_args([]),
                         tok.pad_token_id)
    res["nan_skipped"] = m.get("skipped", "").startswith("non-finite") and all(
        torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # an exception on rank 1 in the collective-free phase: rank 0 stops too, naming it (no hang)
    try:
        with dist.all_ranks_or_none("test phase"):
            if rank == 1:
                raise KeyError("bad batch")
        res["error"] = "none"
    except Exception as e:
        res["error"] = repr(e)
    # rollouts: this rank's share of a step's questions, seeded by (seed, step, rank)
    dist.DIST.fsdp = False
    model = tiny_model(tok).eval()
    tasks, tool = train.rl_tasks(cfg, step=3)
    share = dist.my_questions(len(tasks))
    agent = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                        temperature=1.0)
    trajs = train.sample_rollouts(model, tok, tasks[share.start:share.stop], share.start, cfg, 3, tool, agent)
    res["rollouts"] = [(t.group_id, t.question, [r.round_ids for r in t.rounds]) for t in trajs]
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    tdist.destroy_process_group()


def test_two_ranks_update_and_rollouts_equal_one_process(tmp_path):
    tok = data.build_tokenizer()
    t0 = time.time()
    mp.spawn(worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    print(f"2-rank worker: {time.time() - t0:.1f} s")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for agg in ("token-mean", "seq-mean-token-mean"):
        ref_params, ref_m, _ = single_process_update(agg, torch.optim.SGD)
        for mode in ("ddp", "fsdp"):
            params, m = r0[(mode, agg)]
            assert m["grad_norm"] > 0.05, "clipping must bind for this test to check the global norm"
            for k in ("loss", "grad_norm", "clip_frac", "approx_kl"):     # padding depends on the split
                assert abs(m[k] - ref_m[k]) < 1e-5, (mode, agg, k, m[k], ref_m[k])
            assert r1[(mode, agg)][1]["loss"] == m["loss"]                       # every rank reports the global loss
            assert params.keys() == ref_params.keys()
            for k, v in params.items():
                assert torch.allclose(v, ref_params[k], atol=1e-6), (mode, agg, k, (v - ref_params[k]).abs().max())
            if mode == "ddp":       # replicated: rank 1 holds the same weights
                for k, v in r1[(mode, agg)][0].items():
                    assert torch.allclose(v, params[k], atol=1e-7)
    # LoRA under DDP: the single process's LoRA update, the same weights on both ranks
    model = models.attach_lora(tiny_model(tok), 4, 8)
    cfg = train.parse_args(UPDATE_ARGS)
    trainable = [p for p in model.parameters() if p.requires_grad]
    ref_m = train.update(model, None, torch.optim.SGD(trainable, lr=cfg.lr), samples(), cfg, tok.pad_token_id)
    (params, m), (params1, _) = r0["lora"], r1["lora"]
    assert abs(m["loss"] - ref_m["loss"]) < 1e-5 and abs(m["grad_norm"] - ref_m["grad_norm"]) < 1e-5
    for k, v in model.state_dict().items():
        assert torch.allclose(params[k], v, atol=1e-6) and torch.equal(params1[k], params[k]), k
    assert r0["nan_skipped"] and r1["nan_skipped"]
    assert "1 other rank(s) failed" in r0["error"] and "KeyError('bad batch')" == r1["error"]
    # AdamW state gathered from FSDP2 = the single-process optimizer's state after the same update
    _, _, ref_osd = single_process_update("token-mean", torch.optim.AdamW)
    osd, osd2 = r0["adam"]
    assert osd["state"].keys() == ref_osd["state"].keys() and len(osd["state"]) > 10
    for i, s in ref_osd["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(osd["state"][i][k], s[k], atol=1e-7, rtol=1e-4), (i, k)
            assert torch.equal(osd2["state"][i][k], osd["state"][i][k])          # load -> gather round trip
    # rollouts: disjoint question sets whose union (in rank order) is the single process's; each rank's are what one
    # process draws for that share with the rank's seed (rank 0: the single process's own seed)
    cfg = train.parse_args(ROLLOUT_ARGS + ["--device", "cpu"])
    tasks, tool = train.rl_tasks(cfg, step=3)
    agent = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                        temperature=1.0)

    def alone(rank: int, share: range) -> list:
        dist.DIST = dist.Dist(rank=rank, world=2)         # only the seed reads it: no process group
        try:
            trajs = train.sample_rollouts(tiny_model(tok).eval(), tok, tasks[share.start:share.stop], share.start, cfg,
                                        3, tool, agent)
        finally:
            dist.DIST = dist.Dist()
        return [(t.group_id, t.question, [r.round_ids for r in t.rounds]) for t in trajs]
    single = alone(0, range(4))
    g0, g1 = {g for g, _, _ in r0["rollouts"]}, {g for g, _, _ in r1["rollouts"]}
    assert g0 == {0, 1} and g1 == {2, 3}
    assert {q for _, q, _ in r0["rollouts"]}.isdisjoint({q for _, q, _ in r1["rollouts"]})
    assert [(g, q) for g, q, _ in r0["rollouts"] + r1["rollouts"]] == [(g, q) for g, q, _ in single]
    assert r0["rollouts"] == alone(0, range(2)) and r1["rollouts"] == alone(1, range(2, 4))
    assert len(single) == 8 and len({str(x) for _, _, x in single}) > 1          # really sampled


def test_uneven_question_split_fails_clearly():
    dist.DIST = dist.Dist(True, 0, 3)
    try:
        import pytest
        with pytest.raises(ValueError, match="cannot be split evenly over 3 ranks"):
            dist.my_questions(8)
        assert dist.my_questions(9) == range(0, 3)
    finally:
        dist.DIST = dist.Dist()


# --------------------------------------------------------------------------- torchrun, kill, resume

RUN_ARGS = ["--sft-steps", "0", "--rl-steps", "30", "--save-every", "1", "--eval-every", "0", "--algo", "grpo",
            "--device", "cpu"] + ROLLOUT_ARGS + TINY


def kill_torchrun(p: subprocess.Popen) -> None:
    """SIGKILL to torchrun and to its workers, which it starts each in a session of its own (out of reach of
    killpg: they would go on training and writing the run beside its resume); returns once none runs."""
    workers = [int(d) for d in filter(str.isdigit, os.listdir("/proc")) if proc_stat(int(d))[1:2] == [str(p.pid)]]
    assert len(workers) == 2, workers
    os.killpg(p.pid, signal.SIGKILL)
    for w in workers:
        os.killpg(w, signal.SIGKILL)
    p.wait()
    while any(proc_stat(w)[:1] not in ([], ["Z"]) for w in workers):      # gone, or dead and not yet reaped
        time.sleep(0.01)


def proc_stat(pid: int) -> list[str]:
    """``/proc/PID/stat`` after the command name: [state, ppid, ...]; [] once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def metrics(path):
    last = {}
    for line in open(path):
        r = json.loads(line)
        last[(r["stage"], r["step"])] = r
    return last


def test_torchrun_two_ranks_killed_then_resumed_with_one(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # the README's command form: torchrun ... train.py --run-dir DIR (torchrun rejects --run)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py"]
    killed = tmp_path / "killed"
    p = subprocess.Popen(torchrun + ["--run-dir", str(killed)] + RUN_ARGS, cwd=HERE, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    state = killed / "ckpt" / "trainer.pt"
    deadline = time.time() + 90
    while time.time() < deadline and p.poll() is None:
        try:
            if torch.load(state, weights_only=True)["state"]["step"] >= 2:
                break
        except Exception:       # not written yet, or being renamed into place
            pass
        time.sleep(0.05)
    assert p.poll() is None, p.stderr.read().decode()[-3000:]
    kill_torchrun(p)
    assert not (killed / "final").exists(), "the run finished before it could be killed"
    done = torch.load(state, weights_only=True)["state"]["step"]
    assert 2 <= done < 30
    # the same run stopped cleanly at that step: 2 ranks for its first steps, then 1 process
    full = tmp_path / "full"
    runs = [torchrun + ["--run-dir", str(full)] + RUN_ARGS + ["--rl-steps", str(done)]]
    runs += [[sys.executable, "train.py", "--run", str(run), "--resume"] + RUN_ARGS for run in (full, killed)]
    for cmd in runs:
        out = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True)
        assert out.returncode == 0, f"{' '.join(cmd[-12:])} -> {out.returncode}\n{out.stderr[-3000:]}"
    a, b = metrics(full / "metrics.jsonl"), metrics(killed / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [("rl", s) for s in range(30)]
    for key in a:                                 # both: 2 ranks before step `done`, 1 process from it
        for k in ("score", "turns", "tokens", "valid"):
            assert a[key][k] == b[key][k], (key, k)
    assert (killed / "final" / "config.json").exists()
    assert json.load(open(killed / "config.json"))["run"] == str(killed)
