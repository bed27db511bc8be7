"""Tests for viz.py: the page's numbers (scores, memory rewards, every token's advantage, the count of
coloured tokens) equal what the step computed, read back with ``html.parser``; a failed format shows its
rule; the page holds no URL; ``format_episode`` fits 100 columns. Real parts throughout: the word-level
tokenizer, the expert's episodes replayed through the agent loop's record path, an untrained tiny model's
sampled rollout, and the real reward and advantage functions."""
import json
import re
from html.parser import HTMLParser

import pytest
import torch

import data
from grpo import grouped_advantage, memory_advantage
from memory import Record, mem_token_end, prepare_prompt, tool_record
from reward import memory_rewards, outcome_reward
from rollout import AgentConfig, Round, Trajectory, encode_chat, parse_action, rollout
from search import SearchTool
from viz import format_episode, page_html, signed, step_record, token_pieces, write_page

W = 0.5       # a memory weight other than 1, so A_T + w * A_M is not A_T + A_M


def replay(tok, task, texts: list[str], tool: SearchTool, gid: int, prompt: str = data.SYSTEM_PROMPT) -> Trajectory:
    """A trajectory whose rounds write ``texts``, built as ``rollout.rollout`` builds one (snail context,
    forced ``<mem>`` prefix from round 2, tool results as records)."""
    records = [Record("prompt", task.question)]
    traj = Trajectory(task.question, task.golds, gid, encode_chat(tok, prepare_prompt(records, prompt)), list(records))
    mem_prefix = tok.encode("<mem>", add_special_tokens=False)
    for t, text in enumerate(texts):
        ctx = encode_chat(tok, prepare_prompt(traj.records, prompt))
        pre = mem_prefix if t > 0 else []
        out = tok.encode(text[len("<mem>"):] if t > 0 else text, add_special_tokens=False)
        kind, body = parse_action(text)
        traj.rounds.append(Round(ctx, pre, out, text, mem_token_end(tok, pre + out), kind))
        traj.records.append(Record("llm_gen", text))
        if kind == "search":
            traj.records.append(tool_record("search_results", tool.search(body)))
        else:
            traj.answer, traj.done = (body if kind == "answer" else None), True
            break
    return traj


class Page(HTMLParser):
    """Collects the rollout heads (``th``), the round cells (``td.r``) and each cell's tokens."""

    def __init__(self):
        super().__init__()
        self.heads, self.cells, self.stack, self.urls = [], [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]
        cls = a.get("class", "") or ""
        if tag == "th":
            self.heads.append(dict(a, text=""))
        if tag == "td" and "r" in cls.split():
            self.cells.append(dict(a, tokens=[], text="", context=""))
        if tag == "div" and cls == "t":
            self.cells[-1]["values"] = {k[5:]: float(v) for k, v in a.items() if k.startswith("data-c")}
        if tag == "div" and cls == "pr" and "data-p-full" in a:
            self.cells[-1]["probe"] = a
        self.stack.append((tag, cls))

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop()[0] != tag:
            pass

    def handle_data(self, d):
        if self.stack and self.stack[-1][0] == "span" and any(t == "div" and c == "t" for t, c in self.stack):
            self.cells[-1]["tokens"].append((self.stack[-1][1], d))
        if any(t == "pre" for t, _ in self.stack):
            self.cells[-1]["context"] += d
        if any(t == "th" for t, _ in self.stack):
            self.heads[-1]["text"] += d
        elif self.cells and any(t == "td" for t, _ in self.stack):
            self.cells[-1]["text"] += d


def parse(page: str) -> Page:
    p = Page()
    p.feed(page)
    return p


@pytest.fixture(scope="module")
def step():
    """One step's worth: two questions, G = 4; rewards and advantages computed as rl_step computes them."""
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64).eval()
    world = data.make_world(3)
    tool = SearchTool(world.docs)
    rng = __import__("random").Random(0)
    tasks = [data.make_task(world, rng, 2, (1, 2)), data.make_task(world, rng, 1, (1, 2))]
    trajs = []
    for gid, task in enumerate(tasks):
        expert = [text for text, _ in data.expert_episode(task)]
        forget = [text for text, _ in data.expert_episode(task, forget=True)]
        stray = [expert[0].replace("</mem> <think>", "</mem> search <think>")] + expert[1:]   # rule 5 in round 0
        trajs += [replay(tok, task, expert, tool, gid), replay(tok, task, forget, tool, gid),
                  replay(tok, task, stray, tool, gid)]
        sampled = rollout(model, tok, [task], 1, tool, AgentConfig(data.SYSTEM_PROMPT, max_turns=2, max_new_tokens=12,
                                                                    temperature=1.0),
                          torch.Generator().manual_seed(gid))[0]
        sampled.group_id = gid
        trajs.append(sampled)
    outs = [outcome_reward(t) for t in trajs]
    gids = torch.tensor([t.group_id for t in trajs])
    adv_t = grouped_advantage(torch.tensor([o["score"] for o in outs]), gids)
    mem = memory_rewards(model, tok, trajs, threshold=0.0)          # every gold word counts: P > 0 on both sides
    question = torch.tensor([trajs[i].group_id for i, _ in mem["scored"]])
    adv_m = dict(zip(mem["scored"], memory_advantage(torch.tensor(mem["reward"]), question).tolist()))
    score = sum(o["score"] for o in outs) / len(outs)
    metrics = {"step": 7, "score": score}
    record = step_record(trajs, tok, adv_t, mem, adv_m, W, metrics=metrics, title="step 7")
    return dict(tok=tok, trajs=trajs, outs=outs, adv_t=adv_t, mem=mem, adv_m=adv_m, record=record, score=score,
                page=page_html(record))


def test_scores_and_outcome_advantages_on_the_page(step):
    p = parse(step["page"])
    heads = sorted(p.heads, key=lambda h: int(re.search(r"trajectory (\d+)", h["text"]).group(1)))
    assert len(heads) == len(step["trajs"])
    for h, o, a in zip(heads, step["outs"], step["adv_t"]):
        assert float(h["data-score"]) == o["score"] and float(h["data-adv-t"]) == float(a)
        assert f"score {o['score']:.3f}" in h["text"] and f"A_T {float(a):+.3f}" in h["text"]
    assert {o["score"] for o in step["outs"]} >= {0.0, 1.0} and any(float(a) != 0 for a in step["adv_t"])
    header = re.search(r"<div class=mt>(.*?)</div>", step["page"]).group(1)       # the step's logged metrics
    pairs = re.findall(r"<span>(\w+) <b>([^<]*)</b></span>", header)
    assert pairs == [("step", "7"), ("score", f"{step['score']:.4g}")]


def test_memory_rewards_on_the_page(step):
    mem, cells = step["mem"], {(int(c["data-traj"]), int(c["data-round"])): c for c in parse(step["page"]).cells}
    assert len(cells) == sum(len(t.rounds) for t in step["trajs"]) and mem["n"] >= 4
    for r, (i, t) in enumerate(mem["scored"]):
        pr = cells[(i, t)]["probe"]
        assert float(pr["data-p-full"]) == mem["p_full"][r] and float(pr["data-p-mem"]) == mem["p_mem"][r]
        assert float(pr["data-mem-reward"]) == mem["reward"][r] and float(pr["data-adv-m"]) == step["adv_m"][(i, t)]
        assert f"r_mem {signed(mem['reward'][r])}" in cells[(i, t)]["text"]
    assert any(r != 0 for r in mem["reward"])
    unscored = [c for key, c in cells.items() if key not in set(mem["scored"])]
    assert unscored and all("probe" not in c and "no memory reward" in c["text"] for c in unscored)


def test_every_token_carries_the_advantage_it_was_trained_with(step):
    """A_T on every sampled token, + w * A_M on the <mem> span, nothing on the forced prefix (rl_step's rows)."""
    tok = step["tok"]
    cells = {(int(c["data-traj"]), int(c["data-round"])): c for c in parse(step["page"]).cells}
    n_coloured = 0
    for i, traj in enumerate(step["trajs"]):
        a_m = {t: a for (j, t), a in step["adv_m"].items() if j == i}
        for t, rnd in enumerate(traj.rounds):
            cell = cells[(i, t)]
            assert len(cell["tokens"]) == len(rnd.round_ids)
            for j, (cls, _) in enumerate(cell["tokens"]):
                if j < len(rnd.prefix_ids):
                    assert cls == "n"                          # forced prefix: loss mask 0
                    continue
                want = float(step["adv_t"][i]) + W * a_m.get(t, 0.0) * (j < rnd.mem_end)
                assert cell["values"][cls] == pytest.approx(want, abs=1e-6)
                n_coloured += 1
            assert "".join(text for _, text in cell["tokens"]) == tok.decode(rnd.round_ids)
    n_loss = sum(len(r.output_ids) for t in step["trajs"] for r in t.rounds)      # the update's loss tokens
    assert n_coloured == n_loss == len(re.findall(r"<span class=c\d>", step["page"]))
    assert any(t.rounds[1].mem_end > len(t.rounds[1].prefix_ids) for t in step["trajs"] if len(t.rounds) > 1)


@pytest.mark.parametrize("text", ["<mem> 1 = kalo é 日本 </mem>\n<think> x </think>", "naïve 日", "<search> q"])
def test_token_pieces_rebuild_the_text(text):
    """One piece per token, in order, that joined give the decoded text: word-level and byte-level BPE."""
    for tok in (data.build_tokenizer(), data.build_bpe_tokenizer()):
        ids = tok.encode(text, add_special_tokens=False)
        pieces = token_pieces(tok, ids)
        assert len(pieces) == len(ids) and "".join(pieces) == tok.decode(ids)


@pytest.mark.parametrize("context", ["snail", "full"])
def test_context_as_the_policy_saw_it(step, context):
    """Each round's context decodes its context_ids; a repeated previous context is named, and expands back."""
    tok, trajs = step["tok"], step["trajs"][:3]          # the replayed expert episodes, snail context
    if context == "full":                                 # the same episodes, each round seeing everything before it
        trajs = [Trajectory(t.question, t.golds, t.group_id, t.prompt_ids, t.records) for t in trajs]
        for t, snail in zip(trajs, step["trajs"]):
            n_records = 1                                 # the records before round k: prompt, then round + tool
            for r in snail.rounds:
                ctx = encode_chat(tok, prepare_prompt(t.records[:n_records], data.SYSTEM_PROMPT, None))
                t.rounds.append(Round(ctx, r.prefix_ids, r.output_ids, r.text, r.mem_end, r.action))
                n_records += 1 + (r.action in ("search", "access"))
    cells = {(int(c["data-traj"]), int(c["data-round"])): c for c in parse(page_html(step_record(trajs, tok))).cells}
    named = 0
    for (i, t), cell in sorted(cells.items()):
        m = re.match(r"\[round (\d+)'s context: (\d+) characters\]", cell["context"])
        if m:
            named += 1
            assert int(m.group(1)) == t - 1 and len(cells[(i, t - 1)]["context"]) == int(m.group(2))
            cell["context"] = cells[(i, t - 1)]["context"] + cell["context"][m.end():]
        assert cell["context"] == tok.decode(trajs[i].rounds[t].context_ids)
    assert named >= (sum(len(t.rounds) - 1 for t in trajs) if context == "full" else len(trajs))


def test_failed_format_shows_its_rule(step):
    p = parse(step["page"])
    heads = sorted(p.heads, key=lambda h: int(re.search(r"trajectory (\d+)", h["text"]).group(1)))
    failed = [(h, o) for h, o in zip(heads, step["outs"]) if not o["valid"]]
    assert step["outs"][2]["reason"].startswith("rule 5: text outside tags") and len(failed) >= 2
    for h, o in failed:
        assert h["data-rule"] == o["reason"].split(":")[0] and o["reason"] in h["text"]
    assert all(h["data-rule"] == "" and "format ok" in h["text"] for h, o in zip(heads, step["outs"]) if o["valid"])
    fails = {(int(c["data-traj"]), int(c["data-round"])) for c in p.cells if "fail" in c["class"].split()}
    assert fails == {(i, int(re.search(r"\(round (\d+)\)", o["reason"]).group(1)))
                     for i, o in enumerate(step["outs"]) if not o["valid"]}


def test_page_is_self_contained(step, tmp_path):
    page = step["page"]
    for bad in ("http:", "https:", "//", "@import", "url("):
        assert bad not in page, bad
    assert parse(page).urls == [] and " src=" not in page and "<link" not in page
    assert page.count("<script>") == 1 and len(re.search(r"<script>(.*?)</script>", page, re.S).group(1)) < 400
    path = write_page(str(tmp_path / "viz" / "step_0007.html"), step["record"])
    assert open(path, encoding="utf-8").read() == page
    json.loads(json.dumps(step["record"]))                          # the record is plain data


def test_evaluation_and_grpo_pages(step):
    tok, trajs = step["tok"], step["trajs"]
    plain = page_html(step_record(trajs, tok))                      # eval episodes: no advantages, no probes
    rounds = re.findall(r"<div class=t[ >].*?</div>", plain)
    assert "no advantages" in plain and rounds and not any(re.search(r"class=[cn]", r) for r in rounds)
    grpo = step_record(trajs, tok, step["adv_t"], mem_weight=W)    # GRPO: A_T only, even on <mem>
    for i, ro in ((ro["index"], ro) for q in grpo["questions"] for ro in q["rollouts"]):
        assert all(a == pytest.approx(float(step["adv_t"][i]))
                   for rd in ro["rounds"] for a in rd["adv"] if a is not None)
    assert "no memory reward (GRPO)" in page_html(grpo)


def test_format_episode_fits_100_columns(step):
    record = step["record"]
    for q in record["questions"]:
        for ro in q["rollouts"]:
            text = format_episode(q, ro)
            assert all(len(line) <= 100 for line in text.splitlines())
            assert f"score {ro['score']:.3f}" in text and q["question"][:40] in text.replace("\n  ", " ")
            for t, rd in enumerate(ro["rounds"]):
                assert f"-- round {t} " in text
                if rd["action"]:
                    assert f"<{rd['action']}> {rd['action_body']} </{rd['action']}>" in text
                if rd.get("p_full") is not None:
                    assert f"P_full {rd['p_full']:.3f}  P_mem {rd['p_mem']:.3f}" in text
            if not ro["valid"]:
                assert ro["rule"] in text
    free = dict(record["questions"][0], golds=[])                  # eval --question: a question with no gold
    assert "no gold to score against" in format_episode(free, free["rollouts"][0])
    long = dict(record["questions"][0]["rollouts"][0])
    long["rounds"] = [dict(long["rounds"][0], mem="x" * 250)]       # an unbroken word still wraps
    assert all(len(line) <= 100 for line in format_episode(record["questions"][0], long).splitlines())


# -------------------------------------------------------------- the hooks: train.py --viz-every, eval.py --show / --viz
def test_train_viz_every_writes_the_pages_of_the_steps_it_logged(sft_run, tmp_path):
    import train
    run = tmp_path / "run"
    train.main(["--run", str(run), "--model", str(sft_run / "final"), "--rl-steps", "3", "--questions", "2",
                "--group", "2", "--max-turns", "4", "--rl-objectives", "2", "--rl-hops", "1-2", "--eval-every", "0",
                "--max-new-tokens", "40", "--threshold", "0", "--viz-every", "2"])
    assert sorted(p.name for p in (run / "viz").iterdir()) == ["step_0000.html", "step_0002.html"]
    logged = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    for step in (0, 2):
        text = (run / "viz" / f"step_{step:04d}.html").read_text()
        page = Page()
        page.feed(text)
        assert len(page.heads) == 4                              # 2 questions x 2 rollouts, all on the page
        assert f"RL step {step}" in text and f"{logged[step]['score']:.4g}" in text   # the logged score in its header


def test_eval_show_prints_episodes_and_viz_writes_the_page(sft_run, tmp_path, capsys):
    import eval as ev
    ev.main(["--checkpoint", str(sft_run), "--objectives", "2", "--hops", "1-2", "--show", "2",
             "--viz", str(tmp_path / "ep.html")])
    out = capsys.readouterr().out
    assert out.count("== trajectory") == 2 and "-- round 0 " in out and "action" in out
    assert all(len(line) <= 100 for line in out.splitlines() if not line.startswith("wrote"))
    page = Page()
    page.feed((tmp_path / "ep.html").read_text())
    assert len(page.heads) == 2
    ev.main(["--checkpoint", str(sft_run), "--objectives", "1", "--question", "1 : bobi friend _ ?"])
    out = capsys.readouterr().out
    assert out.count("== trajectory") == 1 and "question: 1 : bobi friend _ ?" in out and "(none given)" in out
