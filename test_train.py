"""Training: SFT learns, an RL step updates weights and logs finite metrics, degenerate batches are
skipped, and a run killed with SIGKILL resumes to the same metrics as an uninterrupted one."""
import json
import os
import signal
import subprocess
import sys
import time

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


def test_rl_step_changes_weights_with_finite_metrics(sft_run):
    model, tok = load(sft_run / "final")
    cfg = train.parse_args(RL_ARGS + ["--algo", "mempo", "--rl-objectives", "2", "--temperature", "1.5"])
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    agent = AgentConfig(system_prompt=data.SYSTEM_PROMPT, context="snail", max_turns=cfg.max_turns,
                        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    changed = False
    for step in range(3):
        m = train.rl_step(model, None, tok, opt, cfg, step, agent)
        for k in ("score", "f1", "sec_rollout", "sec_reward", "sec_update", "p_mem", "p_full", "mem_reward"):
            assert k in m and m[k] == m[k] and abs(m[k]) < float("inf"), (k, m)
        if "skipped" not in m:
            assert m["grad_norm"] == m["grad_norm"] and 0 <= m["clip_frac"] <= 1
            changed = True
    after = list(model.parameters())
    assert changed == any(not torch.equal(a, b) for a, b in zip(before, after))
    assert changed, "three sampled steps at temperature 1.5 should not all tie"


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
