"""SFT rows: the expert's rounds, the probe rows of both memory-reward contexts, and the copy and fill rows
that show a round's <mem> past the expert's K, each going on to the round's action."""
import random

import pytest

import config
import data
import sft
import train
from memory import extract_mem
from search import SearchTool


def test_expert_samples_renders_only_the_requested_rounds_identically():
    import random
    from search import SearchTool
    tok, rng = data.build_tokenizer(), random.Random(0)
    world = data.make_world(1)
    tool = SearchTool(world.docs)
    for _ in range(10):
        task = data.make_task(world, rng, rng.randint(1, 4), (1, 3))
        full = sft.expert_samples(tok, task, tool, forget=True)
        assert len(full) == sum(len(o.relations) for o in task.objectives) + 1     # one search per hop + answer
        picked = {0, len(full) // 2, len(full) - 1}
        part = sft.expert_samples(tok, task, tool, forget=True, picked_rounds=picked)
        assert [(s.ids, s.n_prompt) for s in part] == [(full[t].ids, full[t].n_prompt) for t in sorted(picked)]


def test_probe_samples_two_contexts_answer_known_and_no_loss_on_the_marker():
    import random as _random
    from memory import extract_mem
    tok = data.build_tokenizer()
    world = data.make_world(3)
    task = data.make_task(world, _random.Random(1), 2, (1, 2))
    tool = SearchTool(world.docs)
    ep = data.expert_episode(task, True)
    rows = sft.probe_samples(tok, task, tool, True, _random.Random(0), 1.0)
    assert len(rows) == 2 * (len(ep) - 1)                       # two rows for every round >= 2, none for round 1
    policy = sft.expert_samples(tok, task, tool, True)
    for t in range(1, len(ep)):
        full, mem = rows[2 * (t - 1)], rows[2 * (t - 1) + 1]
        ctx = policy[t].ids[:policy[t].n_prompt - 1]             # the round's context, without the forced <mem>
        assert full.ids[:len(ctx)] == ctx
        assert tok.decode(full.ids[len(ctx):full.n_prompt]) == "<think> probe </think> <answer>"
        assert tok.decode(full.ids[full.n_prompt:]) == f"{data.context_answers(task, ep, t)} </answer>"
        assert tok.decode(mem.ids[mem.n_prompt:]) == f"{data.answers_from_mem(task, extract_mem(ep[t][0]))} </answer>"
        assert tok.decode(mem.ids[:mem.n_prompt]).endswith(
            f"<mem> {extract_mem(ep[t][0])} </mem> <think> probe </think> <answer>")
    assert sft.probe_samples(tok, task, tool, True, _random.Random(0), 0.0) == []
    # on top of the batch: the policy rows of a step are the same count with or without probe rows
    plain = ["--sft-steps", "100", "--sft-copy-steps", "0", "--sft-batch", "16"] + config.EXPERT_ROWS_ONLY
    cfg = train.parse_args(plain)
    assert len(sft.sft_batch(tok, cfg, 99)) > 16
    cfg0 = train.parse_args(plain + ["--sft-probe", "0"])
    assert len(sft.sft_batch(tok, cfg0, 99)) == 16


def test_copy_rows_count_their_entries():
    """A copy row's <mem> holds one numbered entry per objective of its question: the warm-up draws K in
    1-4, the rows mixed into later batches (--sft-copy-mix) K in --sft-copy-objectives."""
    tok = data.build_tokenizer()
    cfg = train.parse_args(["--sft-batch", "64"])

    def entry_counts(rows):
        texts = [tok.decode(r.ids[r.n_prompt:]) for r in rows]
        return {len(t.split("</mem>")[0].split(";")) for t in texts}
    assert entry_counts(sft.copy_batch(tok, cfg, 0)) == {1, 2, 3, 4}
    mixed = sft.copy_batch(tok, cfg, 0, n=200, objectives=(5, 8))
    assert len(mixed) == 200 and entry_counts(mixed) == {5, 6, 7, 8}


def test_sft_batch_renders_the_policy_rows_in_the_training_context():
    """--train-context full: a row's context holds every earlier round's tool result (snail: at most one),
    and the round it trains on is the same text in both."""
    tok = data.build_tokenizer()
    rows = {c: sft.sft_batch(tok, train.parse_args(["--train-context", c, "--sft-objectives", "2", "--sft-batch", "16",
                                                   "--sft-probe", "0"]), 2000) for c in ("snail", "full")}
    info = tok.convert_tokens_to_ids("<information>")
    n_info = {c: [r.ids[:r.n_prompt].count(info) for r in rs] for c, rs in rows.items()}
    assert max(n_info["snail"]) == 1 and max(n_info["full"]) >= 3
    assert [r.ids[r.n_prompt:] for r in rows["snail"]] == [r.ids[r.n_prompt:] for r in rows["full"]]


def test_sft_full_share_renders_that_share_of_episodes_in_the_full_context():
    """--sft-full-share 0.5: some rows see more than one earlier tool result (full context), others exactly one at
    a round >= 3 (the snail shell); the share 0 batch is the snail batch row for row."""
    tok = data.build_tokenizer()
    info = tok.convert_tokens_to_ids("<information>")
    args = ["--sft-objectives", "2", "--sft-batch", "64", "--sft-probe", "0"]
    mixed = sft.sft_batch(tok, train.parse_args(args + ["--sft-full-share", "0.5"]), 2000)
    n_info = [r.ids[:r.n_prompt].count(info) for r in mixed]
    assert sum(n >= 2 for n in n_info) >= 8 and n_info.count(1) >= 8
    snail = sft.sft_batch(tok, train.parse_args(args), 2000)
    assert [r.ids for r in sft.sft_batch(tok, train.parse_args(args + ["--sft-full-share", "0"]), 2000)] == \
        [r.ids for r in snail]
    assert max(r.ids[:r.n_prompt].count(info) for r in snail) == 1


def test_sft_full_share_renders_that_share_of_file_trajectories_in_the_full_context(tmp_path):
    """--sft-data rows follow --sft-full-share as the expert's do: at 0.5 some rows see two or more earlier tool
    results (full context) and others exactly one at a round >= 2 (the snail shell); at 1 every probe row of a
    round context sees its trajectory's whole history too; at 0 the batch is the snail rendering of the same draws,
    row for row (no extra draw)."""
    tok = data.build_tokenizer()
    info = tok.convert_tokens_to_ids("<information>")
    path = sft.export(str(tmp_path), ks=(1,), n=2, episodes=32)[-1]
    trajs = data.load_trajectories(path)
    base = ["--sft-data", path, "--sft-batch", "64"]

    def batch(extra, step=3):
        return sft.file_batch(tok, train.parse_args(base + extra), step, trajs, data.SYSTEM_PROMPT)
    n_info = [r.ids[:r.n_prompt].count(info) for r in batch(["--sft-full-share", "0.5", "--sft-probe", "0"])]
    assert sum(n >= 2 for n in n_info) >= 8 and n_info.count(1) >= 8
    probes = batch(["--sft-full-share", "1", "--sft-probe", "1"])[64:]
    assert max(r.ids[:r.n_prompt].count(info) for r in probes) >= 2
    rng, expected = random.Random(0 * 1_000_003 + 3), []      # file_batch's own draws: --seed 0, step 3
    while len(expected) < 64:
        tr = rng.choice(trajs)
        picked = set(rng.sample(range(len(tr["rounds"])), min(len(tr["rounds"]), 4)))
        expected += sft.episode_samples(tok, tr["question"], tr["rounds"], data.SYSTEM_PROMPT, picked_rounds=picked)
    assert [r.ids for r in batch(["--sft-probe", "0"])] == [r.ids for r in expected[:64]]
    assert max(r.ids[:r.n_prompt].count(info) for r in expected) == 1


def test_sft_full_answers_context_makes_the_forgetting_expert_answer_what_the_full_context_shows():
    """K = 2, every episode forgets (objective 1's entry is dropped once objective 2 finishes). By default its answer
    round says ``unknown`` for objective 1 in both contexts; with ``--sft-full-answers context`` the full-context
    answer is both golds while its ``<mem>`` still drops the entry, and snail rows are unchanged."""
    tok = data.build_tokenizer()
    world = data.make_world(3)
    task = data.make_task(world, random.Random(1), 2, (1, 2))
    turns = sft.expert_turns(task, SearchTool(world.docs), forget=True)
    assert turns[-1][0].endswith(f"<answer> {data.UNKNOWN} ; {task.golds[1][0]} </answer>")
    fixed = sft.answer_from_context(task, turns)
    golds = f"{task.golds[0][0]} ; {task.golds[1][0]}"
    assert fixed[-1][0] == turns[-1][0].split("<answer>")[0] + f"<answer> {golds} </answer>"
    assert fixed[:-1] == turns[:-1] and extract_mem(fixed[-1][0]) == extract_mem(turns[-1][0])

    answer = tok.convert_tokens_to_ids("<answer>")
    unknown = tok.convert_tokens_to_ids(data.UNKNOWN)
    args = ["--sft-objectives", "2", "--sft-batch", "64", "--sft-probe", "0", "--forget-p", "1"]

    def answers(extra):     # the answer rows' targets of one batch
        rows = sft.sft_batch(tok, train.parse_args(args + extra), 2000)
        return [r.ids[r.n_prompt:] for r in rows if answer in r.ids[r.n_prompt:]]
    by_mem = answers(["--sft-full-share", "1"])
    by_context = answers(["--sft-full-share", "1", "--sft-full-answers", "context"])
    assert len(by_mem) == len(by_context) >= 8
    assert all(unknown in a for a in by_mem) and not any(unknown in a for a in by_context)
    assert answers(["--sft-full-answers", "context"]) == answers([])            # snail rows: as before
    assert answers(["--sft-full-share", "1", "--sft-full-answers", "mem"]) == by_mem


def test_first_open_pair_is_the_experts_next_search():
    """On every search round of the expert's episodes (K 1-6, 1-3 hops), the pair before the first open slot of
    that round's <mem> is the pair it searches."""
    world, tasks = data.make_tasks(41, 60, [1, 2, 3, 4, 5, 6], (1, 3))
    n = 0
    for task in tasks:
        for text, query in data.expert_episode(task):
            entries = data.parse_mem(extract_mem(text))
            if query is not None:
                assert data.first_open_pair(entries) == query
                k, j = data.first_open_slot(entries)
                assert entries[k][j] == data.SLOT and all(data.SLOT not in entries[i] for i in entries if i < k)
                n += 1
            else:
                assert data.first_open_pair(entries) is None                    # every entry finished: it answers
                assert data.first_open_slot(entries) is None
    assert n > 200


def test_row_action_rows_go_on_to_the_rounds_search():
    """--sft-row-action: copy and fill rows end with the round's action, read from the row's own <mem> (as the
    expert's: data.expert_episode's last round answers each entry's last word)."""
    tok = data.build_tokenizer()
    cfg = train.parse_args(["--sft-row-action"])
    rows = sft.copy_batch(tok, cfg, 900, n=100, objectives=(3, 6), action=True)
    rows += sft.fill_batch(tok, cfg, 900, 100, (3, 6), action=True)
    for r in rows:
        target = tok.decode(r.ids[r.n_prompt:])
        mem, rest = target.split("</mem>")
        entries = data.parse_mem(mem.replace("<mem>", ""))
        pair = data.first_open_pair(entries)
        if pair is None:                                                    # the last slot filled: every entry finished
            answers = " ; ".join(entries[k][-1] for k in sorted(entries))
            assert rest.strip() == f"<think> answer </think> <answer> {answers} </answer>"
        else:
            assert rest.strip() == f"<think> search </think> <search> {pair[0]} {pair[1]} </search>"
        assert len(entries) >= 3
    plain = sft.copy_batch(tok, cfg, 900, n=100, objectives=(3, 6))          # the same draws, cut at </mem>
    assert [tok.decode(p.ids).split("</mem>")[0] for p in plain] == [tok.decode(r.ids).split("</mem>")[0]
                                                                    for r in rows[:100]]


def test_fill_rows_fill_the_slot_their_search_found_and_nothing_else():
    tok = data.build_tokenizer()
    cfg = train.parse_args(["--sft-fill-mix", "0.25", "--sft-row-action"])
    counts = set()
    for r in sft.fill_batch(tok, cfg, 900, 200, (3, 6), action=True):
        context, target = tok.decode(r.ids[:r.n_prompt]), tok.decode(r.ids[r.n_prompt:])
        previous = data.parse_mem(extract_mem(context.split("<|assistant|>")[-2].strip()))
        query = context.split("<search>")[-1].split("</search>")[0].split()
        assert tuple(query) == data.first_open_pair(previous)                  # it searched its next pair
        docs = context.split("<information>")[-1].split("</information>")[0].split("|")
        facts = [d.split()[1:] for d in docs if d.split()[1:3] == query]
        assert len(facts) == 1                                                 # ... and the result shows it
        new = data.parse_mem(target.split("</mem>")[0])
        k = next(k for k in sorted(previous) if data.SLOT in previous[k])
        j = previous[k].index(data.SLOT)
        assert new[k][j] == facts[0][2] and new[k][:j] + new[k][j + 1:] == previous[k][:j] + previous[k][j + 1:]
        assert {i: p for i, p in new.items() if i != k} == {i: p for i, p in previous.items() if i != k}
        assert target.split("</mem>")[1].strip() == sft.round_action(new).strip()
        counts.add(len(new))
    assert counts == {3, 4, 5, 6}


def test_file_probe_rows_answer_what_the_context_and_the_memory_hold(tmp_path):
    """--sft-data: probe rows from the file's own rounds, the answers read off the text, the marker taught."""
    tok = data.build_tokenizer()
    names = data.name_pool()
    rounds = [(f"<think> search </think> <search> {names[0]} boss </search>",
               f"<information> d1 {names[0]} boss {names[1]} </information>"),
              (f"<mem> 1 = {names[0]} boss {names[1]} </mem> <think> search </think> "
               f"<search> {names[1]} rival </search>",
               f"<information> d2 {names[2]} rival {names[3]} </information>"),
              (f"<mem> 1 = {names[0]} boss {names[1]} </mem> <think> answer </think> "
               f"<answer> {names[1]} </answer>", None)]
    traj = {"question": f"1 : {names[0]} boss _ ?", "rounds": rounds, "golds": [[names[1]]]}
    cfg = train.parse_args(["--sft-data", "x"])
    rows = sft.file_probe_samples(tok, traj, random.Random(0), 1.0, data.SYSTEM_PROMPT, {0, 1, 2},
                                  think=sft.taught_marker(cfg))
    assert len(rows) == 4                                       # rounds 2 and 3, two contexts each
    for r in rows:
        assert tok.decode(r.ids[:r.n_prompt]).endswith("<think> probe </think> <answer>")
        assert tok.decode(r.ids[r.n_prompt:]) == f"{names[1]} </answer>"     # round 1's result, then the memory
    amnesic = {**traj, "rounds": [rounds[0], (rounds[1][0].replace(f" boss {names[1]}", " boss _"), rounds[1][1]),
                                  rounds[2]]}
    rows = sft.file_probe_samples(tok, amnesic, random.Random(0), 1.0, data.SYSTEM_PROMPT, {1}, think="probe")
    assert [tok.decode(r.ids[r.n_prompt:]) for r in rows] == [f"{names[1]} </answer>", "unknown </answer>"]
    no_golds = {**traj, "golds": None}                           # the trajectory's own last answer
    assert sft.file_probe_samples(tok, no_golds, random.Random(0), 1.0, data.SYSTEM_PROMPT, {1, 2}) \
        == sft.file_probe_samples(tok, traj, random.Random(0), 1.0, data.SYSTEM_PROMPT, {1, 2})
    # in a batch: on top of the policy rows, which stay the rows of a batch without probes
    path = sft.export(str(tmp_path), ks=(1,), n=2, episodes=8)[-1]
    trajs = data.load_trajectories(path)
    assert all(t["golds"] for t in trajs)
    base = ["--sft-data", path, "--sft-batch", "8"]
    with_probes = sft.file_batch(tok, train.parse_args(base), 3, trajs, data.SYSTEM_PROMPT)
    without = sft.file_batch(tok, train.parse_args(base + ["--sft-probe", "0"]), 3, trajs, data.SYSTEM_PROMPT)
    assert with_probes[:8] == without and len(with_probes) > 8


def test_sft_episodes_draws_every_expert_and_probe_row_from_n_episodes_fixed_by_the_seed(monkeypatch, capsys):
    """--sft-episodes 3: every expert and probe row of any step is a round of one of 3 episodes drawn once from the
    seed (the same 3 again for that seed, others for another seed); the curriculum's K = 1 steps take the K = 1
    episodes of the set; the copy and fill rows of the cold start are those of the unlimited run."""
    tok = data.build_tokenizer()
    args = ["--sft-episodes", "3", "--sft-batch", "8", "--sft-objectives", "1-2", "--sft-probe", "0.5"]
    cfg = train.parse_args(args)
    episodes = sft.fixed_episodes(cfg)
    assert len(episodes) == 3
    question = lambda eps: [e.task.question for e in eps]
    assert question(sft.fixed_episodes(train.parse_args(args))) == question(episodes)
    assert set(question(sft.fixed_episodes(train.parse_args(args + ["--seed", "1"])))).isdisjoint(question(episodes))
    assert len({e.task.question for e in sft.fixed_episodes(train.parse_args(args[:-4] + ["--sft-episodes", "40"]))}) \
        == 40                                           # one world each: no two episodes alike
    # every row the set can give: each round of each episode, as a policy row and as its two probe rows
    possible, by_k = set(), {1: set(), 2: set()}
    for e in episodes:
        rows = sft.expert_samples(tok, e.task, None, e.forget, turns=e.turns) + \
            sft.probe_samples(tok, e.task, None, e.forget, random.Random(0), 1.0, turns=e.turns)
        possible |= {tuple(r.ids) for r in rows}
        by_k[len(e.task.golds)] |= {tuple(r.ids) for r in rows}
    seen = set()
    for step in range(2000, 2030):                      # past 40% of the steps: K 1-2
        rows = sft.sft_batch(tok, cfg, step, episodes=episodes)
        assert {tuple(r.ids) for r in rows} <= possible and len(rows) > 8        # policy rows + probe rows
        seen |= {tuple(r.ids) for r in rows}
    assert all(seen & {tuple(r.ids) for r in sft.expert_samples(tok, e.task, None, e.forget, turns=e.turns)}
               for e in episodes)                                               # each of the 3 episodes is used
    assert by_k[1] and by_k[2]                         # the curriculum's first steps: the K = 1 episodes only
    for step in range(800, 820):
        assert {tuple(r.ids) for r in sft.sft_batch(tok, cfg, step, episodes=episodes)} <= by_k[1]
    # --sft-ramp: K = 2 comes in at 800 + 0.75 x ramp x 2900 (ramp 0.1: step 1018, the default 0.4: step 1670)
    rows_at = lambda c, steps: set().union(*({tuple(r.ids) for r in sft.sft_batch(tok, c, s, episodes=episodes)}
                                             for s in steps))
    assert rows_at(train.parse_args(args + ["--sft-ramp", "0"]), range(800, 820)) & by_k[2]
    assert rows_at(train.parse_args(args + ["--sft-ramp", "0.1"]), range(1100, 1120)) & by_k[2]
    assert rows_at(cfg, range(1100, 1120)) <= by_k[1]
    assert [r.ids for r in sft.sft_batch(tok, train.parse_args(args[2:]), 2000)] != \
        [r.ids for r in sft.sft_batch(tok, cfg, 2000, episodes=episodes)]
    # the cold start builds the set once and feeds it to every expert batch; its copy and fill rows are unlimited
    built, batches = [], {}
    real = sft.fixed_episodes
    monkeypatch.setattr(sft, "fixed_episodes", lambda c: built.append(real(c)) or built[-1])
    monkeypatch.setattr(sft, "save_checkpoint", lambda *a, **k: None)

    def fake_run_sft(model, opt, batch, steps, lr, c, pad, on_step, desc="sft"):
        batches[c.sft_episodes] = [[tuple(r.ids) for r in batch(s)] for s in (0, 2000)]
    monkeypatch.setattr(sft, "run_sft", fake_run_sft)
    for n in (3, 0):
        sft.cold_start(None, tok, train.parse_args(args[:1] + [str(n)] + args[2:]), 0, None, "/dev/null", "/tmp")
    assert len(built) == 1 and question(built[0]) == question(episodes)
    extra = round(0.25 * 8) * 2                                              # --sft-copy-mix, --sft-fill-mix 0.25
    assert batches[3][0] == batches[0][0] and batches[3][1][-extra:] == batches[0][1][-extra:]
    assert set(batches[3][1][:-extra]) <= possible
    # out of range: one line; set beside --sft-data, a warning
    with pytest.raises(SystemExit):
        train.parse_args(["--sft-episodes", "-1"])
    assert capsys.readouterr().err == "error: --sft-episodes -1: must be >= 0\n"
    train.parse_args(["--sft-episodes", "8", "--sft-data", "x.jsonl"])
    assert capsys.readouterr().err.startswith("warning: --sft-episodes 8: unused with --sft-data")
