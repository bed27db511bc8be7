"""Evaluation: the metrics, mean_ci, --compare over seeds, the run's reward config."""
import json

import torch

import data
from eval import mean_ci, memory_retention, summarize
from rollout import AgentConfig
from search import SearchTool


def test_mean_ci():
    m, h = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and abs(h - 4.30 * 1.0 / 3 ** 0.5) < 1e-9
    assert mean_ci([5.0]) == (5.0, 0.0)


def test_compare_two_variants_over_seeds_and_plots(sft_run, tmp_path):
    """--compare: per-K mean +- CI over runs, retention by rounds-ago, and (when matplotlib is there) PNGs."""
    from eval import compare, plot_compare
    import torch
    run = str(sft_run)
    res = compare({"a": [run, run], "b": [run]}, [1, 2], 3, "valid", "snail", 6, (1, 1), torch.device("cpu"))
    assert set(res) == {"a", "b"} and set(res["a"]) == {1, 2, "by_ago"}
    f1, ci = res["a"][2]["f1"]
    assert ci == 0.0                                      # the same run twice: no spread
    from eval import embedded_tasks, greedy_agent, load
    from rollout import run_episodes
    model, tok, _ = load(run, torch.device("cpu"))
    tasks, tool = embedded_tasks(2, 3, 0, "valid", (1, 1))
    trajs = run_episodes(model, tok, tasks, tool, greedy_agent("snail", 6))
    assert f1 == summarize(trajs)["f1"]                   # the value, computed without compare()
    assert res["a"][2]["f1_runs"] == [f1, f1] and res["b"][2]["f1_runs"] == [f1]
    ret = memory_retention(trajs, tasks)["retention"]
    got = res["a"][2]["retention"][0]
    assert got == ret or (ret != ret and got != got)      # nan (no entity was needed yet) on both sides
    assert res["a"][2]["f1"][0] == res["b"][2]["f1"][0]    # greedy eval is deterministic
    assert "1-1" in res["a"]["by_ago"]
    paths = plot_compare(res, str(tmp_path / "plots"))
    try:
        import matplotlib  # noqa: F401
        assert len(paths) == 2 and all((tmp_path / "plots" / p.split("/")[-1]).stat().st_size > 0 for p in paths)
    except ImportError:
        assert paths == []


def test_run_reward_config_reads_the_run_not_the_model_config(tmp_path):
    import train
    from eval import run_reward_config
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    # a model from elsewhere: the reward's defaults, probed without a marker it never learnt
    assert run_reward_config(str(tmp_path / "final")) == (train.Config().mem_mask, train.Config().threshold, "answer")
    (tmp_path / "config.json").write_text(json.dumps({"mem_mask": "separate", "threshold": 0.3, "seed": 0}))
    assert run_reward_config(str(tmp_path)) == ("separate", 0.3, "answer")        # a run from before the marker
    assert run_reward_config(str(tmp_path / "final")) == ("separate", 0.3, "answer")
    assert run_reward_config(str(tmp_path / "final") + "/") == ("separate", 0.3, "answer")
    (tmp_path / "final" / "probe_think.txt").write_text("probe")                 # the marker its SFT taught
    assert run_reward_config(str(tmp_path)) == ("separate", 0.3, "probe")


def test_summarize_reports_the_early_answer_share(expert_rollout):
    w, tasks = data.make_tasks(6, 4, [2], (1, 3))
    cfg = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=12, max_new_tokens=60, temperature=0.0)
    trajs, _ = expert_rollout(tasks, SearchTool(w.docs), cfg)
    assert summarize(trajs)["early"] == 0.0 and summarize(trajs)["f1"] == 1.0
    trajs[0].rounds = trajs[0].rounds[:1] + trajs[0].rounds[-1:]        # one search, then the answer
    assert summarize(trajs)["early"] == 0.25


def test_a_question_in_unknown_words_stops_with_one_line_naming_them(tmp_path, capsys):
    import pytest
    import checkpoint
    import eval as ev
    tok = data.build_tokenizer()
    known = f"1 : {data.name_pool()[0]} {data.RELATIONS[0]} _ ?"
    assert data.unknown_words(tok, known) == []
    assert data.unknown_words(tok, "1 : kalo friend _ ? 2 : mira rival _ kalo ?") == ["kalo", "mira"]
    assert data.unknown_words(data.build_bpe_tokenizer(), "1 : kalo friend _ ?") == []     # BPE reads any word
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0)
    checkpoint.save_model(str(tmp_path), model, tok, data.SYSTEM_PROMPT)
    with pytest.raises(SystemExit) as stop:          # before any episode runs
        ev.main(["--checkpoint", str(tmp_path), "--device", "cpu",
                 "--question", "1 : kalo friend _ ? 2 : mira rival _ ?"])
    message = str(stop.value.code)                   # a string: Python prints it on stderr and exits with status 1
    assert "\n" not in message and "kalo mira" in message and "data.name_pool()" in message
    assert capsys.readouterr().out == ""


def test_a_run_is_evaluated_in_the_context_it_trained_in_unless_told(tmp_path):
    from eval import run_context
    (tmp_path / "final").mkdir()
    assert run_context(None, str(tmp_path / "final")) == "snail"                  # no run config: the default
    (tmp_path / "config.json").write_text(json.dumps({"mem_mask": "separate", "train_context": "full"}))
    assert run_context(None, str(tmp_path / "final")) == "full"
    assert run_context("snail", str(tmp_path / "final")) == "snail"               # --context wins


def test_expert_peak_tokens_count_as_the_agent_loop_does(expert_rollout):
    """The expert's PT per context equals the PT of the real agent loop writing the expert's rounds; with one
    1-hop objective both contexts hold the same rounds, with more the full context grows past the snail shell."""
    from eval import embedded_tasks, expert_peak_tokens
    tok = data.build_tokenizer()
    for context in ("snail", "full"):
        cfg = AgentConfig(system_prompt=data.SYSTEM_PROMPT, context=context, max_turns=20, max_new_tokens=80,
                          temperature=0.0)
        tasks, tool = embedded_tasks(3, 2, 0, "test", (1, 2))
        trajs, _ = expert_rollout(tasks, tool, cfg)
        assert expert_peak_tokens(tok, [3], 2, "test", (1, 2))[context][3] == summarize(trajs)["pt"]
    one = expert_peak_tokens(tok, [1, 3], 4, "test", (1, 1))
    assert one["snail"][1] == one["full"][1] and one["full"][3] > one["snail"][3]


def test_compare_stops_on_a_run_without_a_checkpoint_before_any_episode(sft_run, tmp_path, capsys):
    import pytest
    import eval as ev
    (tmp_path / "config.json").write_text(json.dumps({"mem_mask": "separate"}))     # a run that has not saved yet
    with pytest.raises(SystemExit) as stop:
        ev.main(["--compare", f"a={sft_run}", f"b={sft_run},{tmp_path}", "--device", "cpu", "--objectives", "1"])
    assert str(tmp_path) in str(stop.value.code) and "\n" not in str(stop.value.code)
    assert capsys.readouterr().out == ""
    assert ev.is_model_dir(str(sft_run / "final")) and not ev.is_model_dir(str(tmp_path))


def test_the_json_line_counts_the_searches_that_failed(tmp_path, capsys, monkeypatch):
    """A server that answers the start-up check and then fails: every search round is counted in the JSON line."""
    import threading
    import eval as ev
    import search
    from conftest import ExpertTape, expert_tape
    from search import Retriever, make_server

    class DownAfterCheck(Retriever):
        calls = 0

        def retrieve(self, queries, top_k):
            DownAfterCheck.calls += 1
            if DownAfterCheck.calls > 1:
                raise RuntimeError("index gone")
            return [[] for _ in queries]

    monkeypatch.setattr(search.time, "sleep", lambda s: None)           # the client's retries, without the wait
    server = make_server(DownAfterCheck(), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    world, tasks = data.held_out_tasks(1, 1)
    (tmp_path / "qa.jsonl").write_text(json.dumps({"question": tasks[0].question, "golden_answers": tasks[0].golds}))
    tok = data.build_tokenizer()
    rounds, tape = expert_tape(tok, tasks[0])
    policy = ExpertTape(data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval(), tape)
    args = ev.parse_args(["--checkpoint", str(tmp_path), "--data", str(tmp_path / "qa.jsonl"), "--context", "snail",
                          "--search-url", f"http://127.0.0.1:{server.server_port}/retrieve"])
    try:
        ev.report_table(policy, tok, data.SYSTEM_PROMPT, args, (1, 3))
    finally:
        server.shutdown()
    out = capsys.readouterr()
    searches = sum("<search>" in r for r in rounds)
    assert searches >= 1 and json.loads(out.out.strip().splitlines()[-1])["search_failures"] == searches
    assert f"{searches} searches failed" in out.err


def test_a_run_trained_in_full_context_is_evaluated_in_snail_unless_asked(tmp_path, capsys):
    import eval as ev
    import train
    run = tmp_path / "full"
    train.main(["--run", str(run), "--sft-steps", "0", "--rl-steps", "0", "--train-context", "full", "--hidden", "32",
                "--layers", "1", "--heads", "2", "--ffn", "64"])
    quick = ["--checkpoint", str(run), "--objectives", "1", "--tasks", "1", "--max-turns", "1", "--max-new-tokens", "2"]
    for extra, context in (([], "snail"), (["--context", "full"], "full")):
        capsys.readouterr()
        ev.main(quick + extra)
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["context"] == context
    assert ev.run_context(None, str(run)) == "full"                      # --compare: each run as it trained


def test_the_round_budget_is_the_runs_own_unless_told(tmp_path, capsys):
    """A run saved at --max-new-tokens 300 is evaluated at 300 tokens a round (its untrained policy writes to the
    budget: a longer peak round than at 128), --max-new-tokens wins; a run at 96 (the default) gets the floor 128,
    a model folder without a run config 128; --compare plays each run at its own."""
    import eval as ev
    import train
    tiny = ["--sft-steps", "0", "--rl-steps", "0", "--hidden", "32", "--layers", "1", "--heads", "2", "--ffn", "64"]
    train.main(["--run", str(tmp_path / "long"), "--max-new-tokens", "300"] + tiny)
    train.main(["--run", str(tmp_path / "short")] + tiny)
    quick = ["--checkpoint", str(tmp_path / "long"), "--objectives", "1", "--tasks", "1", "--max-turns", "1"]

    def result(extra):
        capsys.readouterr()
        ev.main(quick + extra)
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    own, told = result([]), result(["--max-new-tokens", "128"])
    assert (own["max_new_tokens"], told["max_new_tokens"]) == (300, 128)
    assert own["results"]["1"]["pt"] > told["results"]["1"]["pt"]            # the budget reached the agent
    assert ev.parse_args(["--checkpoint", str(tmp_path / "short")]).max_new_tokens == 128
    model_dir = data.save_random_checkpoint(str(tmp_path / "elsewhere"))
    assert ev.parse_args(["--checkpoint", model_dir]).max_new_tokens == 128
    assert ev.run_max_new_tokens(None, str(tmp_path / "long" / "final")) == 300
    assert ev.run_max_new_tokens(7, str(tmp_path / "long")) == 7
    res = ev.compare({"long": [str(tmp_path / "long")], "short": [str(tmp_path / "short")]}, [1], 1, "test", None, 1,
                     (1, 3), torch.device("cpu"))                            # the same weights (seed 0), two budgets
    peak = lambda r: r["results"]["1"]["pt"]
    assert (res["long"][1]["pt"][0], res["short"][1]["pt"][0]) == (peak(own), peak(told))


def test_an_episode_that_never_answers_is_cut_at_the_turn_cap_and_scored_invalid():
    """eval's agent (its 64-turn cap) over a policy that searches every round: the episode stops after its 64th
    round, round 63 (the policy's tape holds exactly 64 rounds, so a 65th fails), never answered, format-invalid,
    and scores 0
    with 64 turns in the table."""
    import eval as ev
    from conftest import ExpertTape
    from reward import outcome_reward
    from rollout import run_episodes
    tok = data.build_tokenizer()
    world, tasks = data.held_out_tasks(1, 1)
    search_round, _ = data.expert_episode(tasks[0])[0]
    ids = tok.encode(search_round, add_special_tokens=False)
    assert "<search>" in search_round and ids[:1] == tok.encode("<mem>", add_special_tokens=False)
    agent = ev.greedy_agent(system_prompt=data.SYSTEM_PROMPT)
    assert agent.max_turns == 64
    tape = ids + ids[1:] * (agent.max_turns - 1)            # the loop forces "<mem>" from round 2
    policy = ExpertTape(data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval(), tape)
    traj, = run_episodes(policy, tok, tasks, SearchTool(world.docs), agent)
    assert policy.n == len(tape) and len(traj.rounds) == 64 and traj.answer is None
    assert [r.action for r in traj.rounds] == ["search"] * 64
    o = outcome_reward(traj)
    assert not o["valid"] and o["reason"] == "rule 6: the last round ends with <search>, not <answer> (round 63)"
    row = summarize([traj])
    assert (row["turns"], row["valid"], row["score"], row["f1"], row["em"]) == (64, 0.0, 0.0, 0.0, 0.0)
