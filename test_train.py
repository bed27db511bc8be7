"""Training: SFT learns, an RL step updates weights and logs finite metrics, degenerate batches are
skipped, and a run killed with SIGKILL resumes to the same metrics as an uninterrupted one."""
import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import checkpoint
import data
import grpo
import metrics
import reward
import rollout
import sft
import train
from rollout import AgentConfig
from search import SearchTool

# The fixture policy answers no question right (every score 0), so an update needs the memory reward to
# vary: threshold 0 makes P a geometric mean over all gold tokens (never exactly 0). Measured on the
# fixture: with these settings every one of 4 steps updated; at threshold 0.5, T 1.5 and lr 1e-3 all were skipped.
RL_ARGS = ["--rl-steps", "4", "--questions", "2", "--group", "3", "--max-turns", "5", "--rl-objectives", "2",
           "--rl-hops", "1-2", "--eval-every", "0", "--save-every", "1", "--lr", "1e-4", "--max-new-tokens", "40",
           "--temperature", "0.5", "--threshold", "0"]


def read_metrics(path):
    rows = [json.loads(line) for line in open(path)]
    last = {}
    for r in rows:
        last[(r["stage"], r["step"])] = r                     # after a resume the newest row wins
    return last


def test_sft_loss_falls_and_the_policy_criterion_it_met_is_one_an_untrained_policy_fails(sft_run):
    """The fixture only returns a policy that meets ``conftest.policy_criterion`` (valid multi-round episodes);
    here: its SFT loss fell, its folders were written, and that criterion does reject a policy SFT never trained
    (asserting the criterion's own thresholds again, or weaker ones, on its own tasks could not fail)."""
    import conftest
    m = read_metrics(sft_run / "metrics.jsonl")
    losses = [r["loss"] for (stage, _), r in sorted(m.items()) if stage == "sft"]
    assert losses[-1] < 0.5 * losses[0]
    assert (sft_run / "final" / "config.json").exists() and (sft_run / "sft" / "trainer.pt").exists()
    tok = data.build_tokenizer()
    met, figures = conftest.policy_criterion(data.build_tiny_model(tok).eval(), tok)
    assert not met, figures


def load(path):
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_rl_step_logs_finite_metrics_and_updates_only_when_not_skipped(sft_run):
    model, tok = load(sft_run / "final")
    cfg = train.parse_args(RL_ARGS + ["--algo", "mempo"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    agent = AgentConfig(system_prompt=data.SYSTEM_PROMPT, context="snail", max_turns=cfg.max_turns,
                        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    updated = 0
    for step in range(2):
        before = [p.detach().clone() for p in model.parameters()]
        m = train.rl_step(model, None, tok, opt, cfg, step, agent)
        for k in ("score", "f1", "valid", "turns", "tokens", "sec_rollout", "sec_reward", "sec_update",
                  "p_mem", "p_full", "mem_reward", "empty_frac", "no_signal_frac", "pool_std", "pool_std_p50",
                  "mem_adv_share_std01", "mem_adv_share_std05", "mem_adv_abs", "mem_adv_no_signal"):
            assert k in m and m[k] == m[k] and abs(m[k]) < float("inf"), (k, m)
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert changed == ("skipped" not in m)
        updated += changed
        json.dumps(m)
    assert updated >= 1, "every step was skipped: nothing above tested an update"


def test_one_small_update_raises_the_surrogate_on_its_own_batch(sft_run):
    """Policy-gradient sanity: sampled rollouts of the trained policy, MemPO's advantages as rl_step
    builds them, one AdamW step at a small lr; re-scored on the same batch, sum(A * log pi) over the loss tokens
    must rise (first order: AdamW's first step moves each weight by lr * sign(grad), so the change is
    lr * sum|grad| > 0). A sign error, a misplaced advantage or a mask that hides the sampled tokens fails it."""
    from grpo import collate, token_advantages, token_logprobs
    from reward import outcome_reward
    model, tok = load(sft_run / "final")
    cfg = train.parse_args(["--lr", "1e-5", "--temperature", "1"])
    agent = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=8, max_new_tokens=60, temperature=cfg.temperature)
    # the fixture's weights differ by CPU kind, so one fixed batch can tie every group (no signal): take the first
    # of a few seeded batches (K 2-3) whose advantages are not all 0
    for attempt in range(8):
        world, tasks = data.make_tasks(21 + attempt, 6, [2, 3], (1, 3))
        torch.manual_seed(attempt)
        trajs = rollout.rollout(model.eval(), tok, tasks, 4, SearchTool(world.docs), agent)
        gids = torch.tensor([t.group_id for t in trajs])
        adv_t = grpo.grouped_advantage(torch.tensor([outcome_reward(t)["score"] for t in trajs]), gids)
        _, adv_m = train.memory_advantages(model, tok, trajs, cfg)
        samples = train.build_samples(trajs, adv_t, adv_m)
        if any(s.adv_t != 0 or any(a != 0 for *_, a in s.mem) for s in samples):     # what update tests
            break
    else:
        pytest.fail("no signal in 8 batches: nothing to test")

    def surrogate():
        x = collate(samples, tok.pad_token_id, "cpu")
        adv = token_advantages(x["adv_t"], x["mem_adv"], x["loss_mask"], cfg.mem_weight)
        with torch.no_grad():
            return (adv * token_logprobs(model, x["ids"], x["attn"], cfg.temperature)).sum().item()
    before = surrogate()
    m = train.update(model, None, torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0),
                         samples, cfg, tok.pad_token_id)
    assert "skipped" not in m
    assert surrogate() > before


def _round(context, prefix, output, mem_end, action="search", text=""):
    from rollout import Round
    return Round(context, prefix, output, text, mem_end, action)


def test_build_samples_and_collate_place_mem_span_and_memory_advantage_by_round_index():
    from rollout import Trajectory
    ctx0, ctx1, ctx2 = [1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 6, 7]
    t0 = Trajectory("q", [["a"]], 0, [1, 2], [], [
        _round(ctx0, [], [10, 11, 12], 0),                 # round 0: never scored
        _round(ctx1, [20], [21, 22, 23, 24], 3),           # round 1: <mem> span = prefix + 2 sampled tokens
        _round(ctx2, [20], [31], 0),                       # round 2: no closed </mem> -> no memory reward
        _round(ctx1, [20], [41, 42], 2, "answer")])        # round 3
    t1 = Trajectory("q", [["a"]], 0, [1, 2], [], [_round(ctx0, [], [], 0), _round(ctx2, [20], [51, 52], 1)])
    samples = train.build_samples([t0, t1], torch.tensor([0.5, -2.0]), {(0, 1): 1.5, (0, 3): -0.25, (1, 1): 7.0})
    # t1's round 0 sampled nothing: no row
    assert [(s.traj, s.adv_t, s.mem) for s in samples] == [(0, 0.5, []), (0, 0.5, [(5, 8, 1.5)]), (0, 0.5, []),
                                                         (0, 0.5, [(5, 7, -0.25)]), (1, -2.0, [(4, 5, 7.0)])]
    assert samples[1].ids == ctx1 + [20, 21, 22, 23, 24] and samples[1].policy == [(6, 10)]
    x = grpo.collate(samples, pad_id=0, device="cpu")
    assert x["ids"].shape == (5, 10) and x["attn"][1].tolist() == [1] * 10
    assert x["loss_mask"][1].tolist() == [0] * 6 + [1] * 4           # the forced prefix (position 5) is mask 0
    assert x["mem_adv"][1].tolist() == [0] * 5 + [1.5] * 3 + [0] * 2   # prefix + 2 sampled tokens
    assert x["mem_adv"][0].sum() == 0 and x["loss_mask"][0].tolist() == [0] * 3 + [1] * 3 + [0] * 4
    assert x["mem_adv"][4].tolist() == [0] * 4 + [7.0] + [0] * 5
    assert x["ids"][4].tolist() == ctx2 + [20, 51, 52, 0, 0, 0]
    assert x["adv_t"].tolist() == [0.5] * 4 + [-2.0]
    from grpo import token_advantages
    adv = token_advantages(x["adv_t"], x["mem_adv"], x["loss_mask"])
    assert adv[1].tolist() == [0] * 6 + [2.0, 2.0, 0.5, 0.5]            # A_T + A_M on sampled <mem> tokens only


def test_the_default_memory_reward_is_the_papers():
    d = train.parse_args([])
    assert (d.mem_mask, d.mem_adv_norm, d.mem_weight, d.threshold) == ("separate", "std", 1.0, 0.5)


def test_train_context_reaches_the_rollout_agent():
    assert train.agent_config(train.parse_args(["--train-context", "full"])).context == "full"
    agent = train.agent_config(train.parse_args(["--temperature", "0.5", "--max-turns", "3"]))
    assert (agent.context, agent.temperature, agent.max_turns) == ("snail", 0.5, 3)
    assert agent.prefix_cache and not train.agent_config(train.parse_args(["--no-prefix-cache"])).prefix_cache


TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--ffn", "64", "--sft-batch", "8", "--sft-steps", "12",
        "--sft-copy-steps", "4", "--sft-save-every", "5", "--rl-steps", "0", "--eval-every", "0",
        "--sft-objectives", "1-2", "--hops", "1-2"]


def test_resume_during_sft_gives_the_uninterrupted_weights(tmp_path, monkeypatch):
    train.main(["--run", str(tmp_path / "full")] + TINY)
    real = sft.sft_batch

    def crash_at_8(tokenizer, cfg, step, *args):    # the process dies in step 8, after the step-5 checkpoint
        if step == 8:
            raise KeyboardInterrupt
        return real(tokenizer, cfg, step, *args)
    monkeypatch.setattr(sft, "sft_batch", crash_at_8)
    with pytest.raises(KeyboardInterrupt):
        train.main(["--run", str(tmp_path / "killed")] + TINY)
    state = torch.load(tmp_path / "killed" / "ckpt" / "trainer.pt", weights_only=True)["state"]
    assert state == {"stage": "sft", "step": 5, "precision": "auto"}
    monkeypatch.setattr(sft, "sft_batch", real)
    train.main(["--run", str(tmp_path / "killed"), "--resume"] + TINY)
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "killed" / "final").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_stage_sft_trains_a_checkpoint_on_its_system_prompt(tmp_path):
    """--stage sft runs the embedded SFT on --model (auto would go straight to RL), and every SFT row,
    copy rows included, carries the run's system prompt, the one its rollouts will see."""
    train.main(["--run", str(tmp_path / "base")] + TINY)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("answer every question . search first")
    cfg = train.parse_args(TINY)
    tok = AutoTokenizer.from_pretrained(tmp_path / "base" / "final")
    head = tok.encode("<|system|> answer every question . search first <|end|>", add_special_tokens=False)
    for rows in (sft.copy_batch(tok, cfg, 0, prompt.read_text()), sft.sft_batch(tok, cfg, 10, prompt.read_text())):
        assert rows and all(r.ids[:len(head)] == head for r in rows)
    args = ["--model", str(tmp_path / "base" / "final"), "--system-prompt", str(prompt)] + TINY
    train.main(["--run", str(tmp_path / "auto")] + args)
    train.main(["--run", str(tmp_path / "sft"), "--stage", "sft"] + args)
    assert not os.path.exists(tmp_path / "auto" / "metrics.jsonl")             # auto with --model: no SFT (and no RL)
    stages = {r["stage"] for r in read_metrics(tmp_path / "sft" / "metrics.jsonl").values()}
    assert stages == {"sft"}
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "base" / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "sft" / "final").state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "sft" / "final" / "system_prompt.txt").read_text().strip() == prompt.read_text()
    with pytest.raises(SystemExit):
        train.parse_args(["--stage", "pretrain"])


def test_all_tied_batch_is_skipped_and_weights_untouched():
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok)          # untrained: every trajectory is invalid, scores all 0
    cfg = train.parse_args(RL_ARGS + ["--algo", "grpo"])
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    agent = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=3, max_new_tokens=20, temperature=1.0)
    m = train.rl_step(model, None, tok, opt, cfg, 0, agent)
    assert m["score"] == 0.0 and m["skipped"] == "all advantages are zero"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def run_cmd(run, extra):
    return [sys.executable, "train.py", "--run", str(run)] + RL_ARGS + extra


def logged_steps(path):
    """RL steps whose metrics row is complete in ``path`` (a line being written is skipped)."""
    steps = set()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("stage") == "rl":
                steps.add(row["step"])
    return steps


def test_sigkill_then_resume_matches_uninterrupted(sft_run, tmp_path):
    """KL to the reference and two PPO epochs: a resumed run must keep the reference RL started from."""
    here = os.path.dirname(os.path.abspath(__file__))
    model_args = ["--model", str(sft_run / "final"), "--algo", "mempo", "--rl-objectives", "2",
                  "--kl-coef", "0.05", "--ppo-epochs", "2"]
    full = tmp_path / "full"
    subprocess.run(run_cmd(full, model_args), cwd=here, check=True, capture_output=True)
    killed = tmp_path / "killed"
    p = subprocess.Popen(run_cmd(killed, model_args), cwd=here, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # step 2's row is logged after the step-2 checkpoint was renamed into place (never read a checkpoint itself)
    deadline = time.time() + 300
    while time.time() < deadline and 2 not in logged_steps(killed / "metrics.jsonl") and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (killed / "final").exists(), "the run finished before it could be killed"
    assert 3 not in logged_steps(killed / "metrics.jsonl")
    subprocess.run(run_cmd(killed, model_args + ["--resume"]), cwd=here, check=True, capture_output=True)
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(killed / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [("rl", s) for s in range(4)]
    updated = 0
    for key in a:
        assert set(a[key]) == set(b[key]), (key, set(a[key]) ^ set(b[key]))
        assert "skipped" in a[key] or {"loss", "kl", "p_mem", "pool_std"} <= set(a[key]), (key, a[key])
        updated += "skipped" not in a[key]
        for k, v in a[key].items():
            if isinstance(v, (int, float)) and not k.startswith("sec_"):
                assert abs(v - b[key][k]) < 1e-5, (key, k, v, b[key][k])
    assert updated >= 3 and max(a[("rl", s)].get("kl", 0.0) for s in (2, 3)) > 1e-6   # the reference matters


def test_fresh_run_refuses_a_folder_that_holds_a_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"stage": "sft", "step": 0}\n')
    with pytest.raises(SystemExit, match="already holds a run"):
        train.main(["--run", str(tmp_path), "--sft-steps", "0", "--rl-steps", "0"])
    assert (tmp_path / "metrics.jsonl").read_text() == '{"stage": "sft", "step": 0}\n'


def test_rl_logs_kl_to_its_start_entropy_and_early_answers_whatever_kl_coef(sft_run, tmp_path):
    """--log-kl at --kl-coef 0 loads the reference: "kl" is 0 before the first update, > 0 after it."""
    run = tmp_path / "run"
    train.main(["--run", str(run), "--model", str(sft_run / "final"), "--log-kl"] + RL_ARGS[:1] + ["3"] + RL_ARGS[2:])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and (run / "ref" / "config.json").exists()
    updated = [r for r in rows if "skipped" not in r]
    assert updated and updated[0]["step"] < 2, "no update before the last step: nothing to measure"
    for r in updated:
        assert r["entropy"] > 0 and "early_frac" in r     # the value: test_group_stats_and_zero_variance_metrics
    assert rows[0].get("kl", 0.0) == 0.0                       # step 0: the policy is its reference
    assert rows[updated[0]["step"] + 1]["kl"] > 0             # after an update the policy has moved
    off = tmp_path / "off"
    train.main(["--run", str(off), "--model", str(sft_run / "final")] + RL_ARGS[:1] + ["1"] + RL_ARGS[2:])
    assert not (off / "ref").exists()


def test_a_default_rl_run_at_kl_coef_0_holds_one_model(tmp_path, monkeypatch):
    """No second copy unless asked: the KL reference is loaded only with --log-kl or --kl-coef > 0."""
    loads = []
    real = checkpoint.reference_model
    monkeypatch.setattr(checkpoint, "reference_model", lambda *a: loads.append(a) or real(*a))
    args = ["--sft-steps", "0", "--questions", "2", "--group", "2", "--max-turns", "2", "--max-new-tokens", "8",
            "--eval-every", "0", "--hidden", "32", "--layers", "1", "--heads", "2", "--ffn", "64"]
    train.main(["--run", str(tmp_path / "default"), "--rl-steps", "2"] + args)
    rows = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    assert loads == [] and not (tmp_path / "default" / "ref").exists() and len(rows) == 2
    assert not any("kl" in r for r in rows)                   # no reference, no "kl" that would read 0
    train.main(["--run", str(tmp_path / "logged"), "--rl-steps", "1", "--log-kl"] + args)
    assert len(loads) == 1 and (tmp_path / "logged" / "ref").exists()


def test_group_stats_and_zero_variance_metrics():
    """Hand-computed: group 0 scores [1, 1] (no outcome signal) with memory rewards that differ, group 1
    [0, 0] with equal memory rewards, group 2 [1, 0]; K = 2, 2, 3, 3, 1, 1."""
    outs = [{"score": s, "em": s, "f1": s, "valid": 1.0} for s in (1.0, 1.0, 0.0, 0.0, 1.0, 0.0)]
    mem = {"scored": [(0, 1), (0, 2), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)],
           "reward": [0.1, 0.0, 0.3, 0.2, 0.2, 0.4, 0.5]}
    gids = [0, 0, 1, 1, 2, 2]
    ks = [2, 2, 3, 3, 1, 1]
    stats = metrics.group_stats(outs, mem, gids, ks)
    assert stats == [(True, True, 2), (True, False, 3), (False, True, 1)]
    assert metrics.group_stats(outs, None, gids, ks) == [(True, False, 2), (True, False, 3), (False, False, 1)]
    v = {"outs": outs, "turns": [1] * 6, "tokens": [10], "early": [], "k": ks, "groups": stats,
         "search_failures": [0]}
    m = metrics.step_metrics(v)
    assert "early_frac" not in m                              # no trajectory answered: no share to report
    assert metrics.step_metrics(v | {"early": [1.0, 0.0, 0.0, 1.0, 1.0]})["early_frac"] == pytest.approx(0.6)
    assert m["zero_var_frac"] == pytest.approx(2 / 3)
    assert m["zero_var_mem_frac"] == pytest.approx(1 / 3)
    assert (m["score_k1"], m["score_k2"], m["score_k3"]) == (0.5, 1.0, 0.0)
    assert (m["zero_var_k1"], m["zero_var_k2"], m["zero_var_k3"]) == (0.0, 1.0, 1.0)       # per K, as above
    assert (m["zero_var_mem_k1"], m["zero_var_mem_k2"], m["zero_var_mem_k3"]) == (0.0, 1.0, 0.0)


def test_report_to_tensorboard_holds_every_number_of_metrics_jsonl(tmp_path):
    """--report-to tensorboard: each row's numbers as ``stage/key`` scalars at the row's step, SFT rows and RL rows,
    read back with tensorboard's own reader; the run's config as text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = tmp_path / "run"
    train.main(["--run", str(run), "--report-to", "tensorboard"] + TINY
               + ["--rl-steps", "2", "--questions", "2", "--group", "2", "--max-turns", "2", "--max-new-tokens", "12"])
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert {r["stage"] for r in rows} == {"sft", "rl"}
    want = {(f"{r['stage']}/{k}", r["step"]): float(v) for r in rows for k, v in r.items()
            if k != "step" and isinstance(v, (int, float))}
    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    got = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(v, rel=1e-6, abs=1e-30) for k, v in want.items())     # stored as float32
    assert "config/text_summary" in events.Tags()["tensors"]


def test_report_to_wandb_logs_offline_and_without_the_package_stops_in_one_line(tmp_path, monkeypatch):
    """wandb is not installed here: a stand-in module records the calls (offline by default, the run's name and
    config, each stage on its own step axis); without any module, one line says what to install."""
    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw, os.environ.get("WANDB_MODE"))) or fake,
                                 define_metric=lambda *a, **kw: calls.append(("axis", a, kw)),
                                 log=lambda row: calls.append(("log", row)), finish=lambda: calls.append(("finish",)))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    train.main(["--run", str(tmp_path / "run"), "--report-to", "wandb"] + TINY)
    (_, init, mode), logs = calls[0], [c[1] for c in calls if c[0] == "log"]
    assert mode == "offline" and init["name"] == "run" and init["config"]["report_to"] == "wandb"
    assert ("axis", ("sft/*",), {"step_metric": "sft/step"}) in calls and calls[-1] == ("finish",)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [(r["sft/step"], r["sft/loss"]) for r in logs] == [(r["step"], r["loss"]) for r in rows]
    monkeypatch.setitem(sys.modules, "wandb", None)       # as if not installed
    with pytest.raises(SystemExit, match="pip install wandb"):
        train.main(["--run", str(tmp_path / "run2"), "--report-to", "wandb"] + TINY)
    with pytest.raises(SystemExit):
        train.parse_args(["--report-to", "tensorboard,mlflow"])


def test_probe_think_auto_is_the_marker_the_policy_learnt(tmp_path):
    """The embedded run and any SFT with probe rows: probe (as before auto); a model from elsewhere: answer; a
    checkpoint: the marker it recorded; an explicit value wins."""
    resolve = lambda argv, stage, source: train.resolve_probe_think(train.parse_args(argv), stage, source)
    assert resolve([], "sft", "") == resolve(["--stage", "rl"], "rl", "") == "probe" == reward.PROBE_THINK
    assert resolve(["--model", str(tmp_path), "--sft-data", "x"], "sft", str(tmp_path)) == "probe"
    assert resolve(["--model", str(tmp_path)], "rl", str(tmp_path)) == "answer"            # never taught a marker
    assert resolve(["--model", "smollm2"], "rl", "smollm2") == "answer"
    assert resolve(["--model", str(tmp_path), "--sft-data", "x", "--sft-probe", "0"], "sft", str(tmp_path)) == "answer"
    (tmp_path / "probe_think.txt").write_text("probe")
    assert resolve(["--model", str(tmp_path)], "rl", str(tmp_path)) == "probe"
    assert resolve(["--model", str(tmp_path), "--probe-think", "answer"], "rl", str(tmp_path)) == "answer"
    # the embedded run records it where its checkpoints and config say what its reward used
    train.main(["--run", str(tmp_path / "run"), "--sft-steps", "0", "--rl-steps", "0", "--hidden", "32",
                "--layers", "1", "--heads", "2", "--ffn", "64"])
    assert (tmp_path / "run" / "final" / "probe_think.txt").read_text() == "probe"
    assert json.loads((tmp_path / "run" / "config.json").read_text())["probe_think"] == "probe"


def test_keep_checkpoints_keeps_each_saved_model(tmp_path):
    args = ["--sft-steps", "0", "--questions", "2", "--group", "2", "--max-turns", "2", "--max-new-tokens", "8",
            "--eval-every", "0", "--hidden", "32", "--layers", "1", "--heads", "2", "--ffn", "64", "--rl-steps", "3",
            "--save-every", "2", "--lr", "1e-2"]
    train.main(["--run", str(tmp_path / "run"), "--keep-checkpoints"] + args)
    run = tmp_path / "run"
    kept = sorted(p.name for p in run.glob("step_*"))
    assert kept == ["step_0002", "step_0003"] and not (run / "step_0002" / "trainer.pt").exists()
    final = (run / "ckpt" / "model.safetensors").read_bytes()
    assert (run / "step_0003" / "model.safetensors").read_bytes() == final
    train.main(["--run", str(tmp_path / "plain")] + args)
    assert not list((tmp_path / "plain").glob("step_*"))


def test_step_metrics_split_the_memory_advantage_by_what_its_round_does():
    """mem_adv_search / answer / early: the mean A_M on the <mem> of rounds that search, answer after the question's
    last hop, or answer before it (hand-built: a 2-hop question, one trajectory answers after one search)."""
    from metrics import metric_values, step_metrics
    from rollout import Trajectory
    q = "1 : fuzi boss _ rival _ ?"                          # two hops
    full = Trajectory(q, [["a"]], 0, [1], [], [_round([1], [], [5], 0), _round([1], [9], [5], 1),
                                               _round([1], [9], [5], 1), _round([1], [9], [5], 1, "answer")])
    early = Trajectory(q, [["a"]], 0, [1], [], [_round([1], [], [5], 0), _round([1], [9], [5], 1, "answer")])
    mem = {"reward": [0.1, 0.2, 0.3, 0.4], "scored": [(0, 1), (0, 2), (0, 3), (1, 1)],
           "p_mem": [0.0] * 4, "p_full": [0.0] * 4, "mask_mem": [1] * 4, "mask_full": [1] * 4, "empty_frac": 0.0,
           "no_signal_frac": 0.0, "n": 4}
    outs = [{"score": 1.0, "em": 1.0, "f1": 1.0, "valid": True}, {"score": 0.0, "em": 0.0, "f1": 0.0, "valid": True}]
    v = metric_values([full, early], outs, mem, [0, 0], {(0, 1): 1.0, (0, 2): -3.0, (0, 3): 0.5, (1, 1): 2.5})
    m = step_metrics(v | {"search_failures": [0]})
    assert (m["mem_adv_search"], m["mem_adv_answer"], m["mem_adv_early"]) == (-1.0, 0.5, 2.5)
    assert m["early_frac"] == 0.5
