"""Training: SFT learns, an RL step updates weights and logs finite metrics, degenerate batches are
skipped, and a run killed with SIGKILL resumes to the same metrics as an uninterrupted one."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import data
import train
from rollout import AgentConfig

RL_ARGS = ["--rl-steps", "4", "--questions", "2", "--group", "3", "--max-turns", "5", "--rl-objectives", "1",
           "--rl-hops", "1-2", "--eval-every", "0", "--save-every", "1", "--lr", "1e-3", "--max-new-tokens", "40"]


def read_metrics(path):
    rows = [json.loads(line) for line in open(path)]
    last = {}
    for r in rows:
        last[(r["stage"], r["step"])] = r                     # after a resume the newest row wins
    return last


def test_sft_loss_falls_and_policy_writes_valid_rounds(sft_run):
    m = read_metrics(sft_run / "metrics.jsonl")
    losses = [r["loss"] for (stage, _), r in sorted(m.items()) if stage == "sft"]
    assert losses[-1] < 0.5 * losses[0]
    assert (sft_run / "final" / "config.json").exists() and (sft_run / "sft" / "trainer.pt").exists()


def load(path):
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_rl_step_logs_finite_metrics_and_updates_only_when_not_skipped(sft_run):
    model, tok = load(sft_run / "final")
    cfg = train.parse_args(RL_ARGS + ["--algo", "mempo", "--rl-objectives", "2", "--temperature", "1.5"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    agent = AgentConfig(system_prompt=data.SYSTEM_PROMPT, context="snail", max_turns=cfg.max_turns,
                        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    for step in range(2):
        before = [p.detach().clone() for p in model.parameters()]
        m = train.rl_step(model, None, tok, opt, cfg, step, agent)
        for k in ("score", "f1", "valid", "turns", "tokens", "sec_rollout", "sec_reward", "sec_update",
                  "p_mem", "p_full", "mem_reward", "empty_frac", "pool_std"):
            assert k in m and m[k] == m[k] and abs(m[k]) < float("inf"), (k, m)
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert changed == ("skipped" not in m)
        json.dumps(m)


def hand_built_samples(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L, P = int(torch.randint(8, 20, (1,), generator=g)), 5
        ids = torch.randint(5, 200, (L,), generator=g).tolist()
        out.append(train.Sample(ids, P, mem_end=3, n_prefix=1, adv_t=(-1.0) ** i, adv_m=0.5 * (-1.0) ** (i // 2)))
    return out


def test_ppo_update_changes_weights_on_policy_without_clipping():
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
    cfg = train.parse_args(["--lr", "1e-2", "--micro-tokens", "40"])      # forces several micro-batches
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    before = [p.detach().clone() for p in model.parameters()]
    m = train.ppo_update(model, None, opt, hand_built_samples(), cfg, tok.pad_token_id)
    assert "skipped" not in m and m["clip_frac"] == 0.0 and abs(m["approx_kl"]) < 1e-12   # ratio is exactly 1
    assert 0 <= m["padding_waste"] < 1 and m["loss"] == m["loss"]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_ppo_update_with_two_epochs_and_kl_reference_is_finite():
    import copy
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
    ref = copy.deepcopy(model)
    cfg = train.parse_args(["--lr", "1e-2", "--ppo-epochs", "2", "--kl-coef", "0.1", "--agg", "seq-mean-token-mean"])
    m = train.ppo_update(model, ref, torch.optim.AdamW(model.parameters(), lr=cfg.lr), hand_built_samples(seed=1),
                         cfg, tok.pad_token_id)
    assert "skipped" not in m and m["kl"] >= 0 and m["clip_frac"] > 0      # epoch 2 moved off-policy


def test_non_finite_update_is_skipped_and_weights_untouched():
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
    samples = hand_built_samples()
    samples[0].adv_t = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    m = train.ppo_update(model, None, torch.optim.AdamW(model.parameters()), samples, train.parse_args([]),
                         tok.pad_token_id)
    assert m["skipped"].startswith("non-finite")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_all_tied_batch_is_skipped_and_weights_untouched():
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok)          # untrained: every trajectory is invalid, scores all 0
    cfg = train.parse_args(RL_ARGS + ["--algo", "grpo"])
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    agent = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=3, max_new_tokens=20)
    m = train.rl_step(model, None, tok, opt, cfg, 0, agent)
    assert m["score"] == 0.0 and m["skipped"] == "all advantages are zero"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def run_cmd(run, extra):
    return [sys.executable, "train.py", "--run", str(run)] + RL_ARGS + extra


def test_sigkill_then_resume_matches_uninterrupted(sft_run, tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    model_args = ["--model", str(sft_run / "final"), "--algo", "mempo", "--rl-objectives", "2"]
    full = tmp_path / "full"
    subprocess.run(run_cmd(full, model_args), cwd=here, check=True, capture_output=True)
    killed = tmp_path / "killed"
    p = subprocess.Popen(run_cmd(killed, model_args), cwd=here, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt_state = killed / "ckpt" / "trainer.pt"
    deadline = time.time() + 300
    while time.time() < deadline:
        if ckpt_state.exists() and torch.load(ckpt_state, weights_only=False)["state"]["step"] >= 2:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (killed / "final").exists(), "the run finished before it could be killed"
    subprocess.run(run_cmd(killed, model_args + ["--resume"]), cwd=here, check=True, capture_output=True)
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(killed / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [("rl", s) for s in range(4)]
    for key in a:
        for k in ("score", "f1", "tokens", "loss", "mem_reward", "p_mem", "p_full"):
            if k in a[key]:
                assert abs(a[key][k] - b[key][k]) < 1e-5, (key, k, a[key][k], b[key][k])


def test_fresh_run_refuses_a_folder_that_holds_a_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"stage": "sft", "step": 0}\n')
    with pytest.raises(SystemExit, match="already holds a run"):
        train.main(["--run", str(tmp_path), "--sft-steps", "0", "--rl-steps", "0"])
    assert (tmp_path / "metrics.jsonl").read_text() == '{"stage": "sft", "step": 0}\n'


def test_expert_samples_renders_only_the_requested_rounds_identically():
    import random
    from rollout import SearchTool
    tok, rng = data.build_tokenizer(), random.Random(0)
    world = data.make_world(1)
    tool = SearchTool(world.docs)
    for _ in range(10):
        task = data.make_task(world, rng, rng.randint(1, 4), (1, 3))
        full = train.expert_samples(tok, task, tool, forget=True)
        assert len(full) == sum(len(o.relations) for o in task.objectives) + 1     # one search per hop + answer
        keep = {0, len(full) // 2, len(full) - 1}
        part = train.expert_samples(tok, task, tool, forget=True, rounds=keep)
        assert [(s.ids, s.n_prompt) for s in part] == [(full[t].ids, full[t].n_prompt) for t in sorted(keep)]
