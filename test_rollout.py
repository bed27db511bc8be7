"""The agent loop: the tools, action parsing, multi-round contexts, the prefix cache through the loop, and chat
templates that rewrite earlier turns (the engine's own tests: test_engine.py)."""
import pytest
import torch
from transformers import StaticCache

import data
import grpo
from reward import outcome_reward
from rollout import AgentConfig, parse_action, rollout
from search import SearchTool


@pytest.fixture(scope="module")
def tiny():
    tok = data.build_tokenizer()
    return tok, data.build_tiny_model(tok, seed=1).eval()


def test_search_tool_finds_the_fact_and_access_returns_the_page():
    w = data.make_world(4)
    tool = SearchTool(w.docs, top_k=3)
    for (s, r), o in list(w.facts.items())[:50]:
        res = tool.search(f"{s} {r}")
        assert res.startswith("<information>") and res.endswith("</information>")
        assert f"{s} {r} {o}" in res and res.count("|") == 2
    d = w.docs[7]
    assert tool.access(d["id"]) == f"<information> {d['id']} {d['contents']} </information>"
    assert "not found" in tool.access("nope")


def test_parse_action():
    assert parse_action("<mem> a </mem> <think> x </think> <search> q r </search>") == ("search", "q r")
    assert parse_action("<think> x </think> <answer> a ; b </answer>") == ("answer", "a ; b")
    assert parse_action("<think> x </think> <access> d3 </access>") == ("access", "d3")
    assert parse_action("<search> q") == (None, "")
    assert parse_action("garbage") == (None, "")


def test_untrained_model_output_never_crashes_and_scores_zero(tiny):
    tok, model = tiny
    w, tasks = data.make_tasks(11, 3, [2])
    cfg = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=4, max_new_tokens=40, temperature=1.0)
    trajs = rollout(model, tok, tasks, 4, SearchTool(w.docs), cfg, torch.Generator().manual_seed(0))
    assert len(trajs) == 12 and [t.group_id for t in trajs] == [0] * 4 + [1] * 4 + [2] * 4
    for t in trajs:
        assert t.done and len(t.rounds) >= 1
        o = outcome_reward(t)
        assert o["score"] == 0.0 and not o["valid"]
        r = t.rounds[0]
        assert r.context_ids == t.prompt_ids and r.prefix_ids == []   # round 1: no forced prefix


# ---------------------------------------------------------------- the agent loop over multi-round episodes
# (conftest.expert_rollout: the real loop over a model that writes the expert's rounds, by construction)
def _contains(ids: list[int], sub: list[int]) -> bool:
    return any(ids[i:i + len(sub)] == sub for i in range(len(ids) - len(sub) + 1))


def test_forced_prefix_from_round_two_is_context_not_policy(expert_rollout):
    import train
    w, tasks = data.make_tasks(3, 6, [2], (1, 2))
    cfg = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=4, max_new_tokens=60, temperature=0.0)
    trajs, tok = expert_rollout(tasks, SearchTool(w.docs), cfg)
    prefix = tok.encode("<mem>", add_special_tokens=False)
    later = [r for t in trajs for r in t.rounds[1:]]
    assert len(later) >= 6
    for t in trajs:
        assert t.rounds[0].prefix_ids == []
        for r in t.rounds[1:]:
            assert r.prefix_ids == prefix and r.text.startswith("<mem>") and tok.decode(prefix + r.output_ids) == r.text
            assert r.output_ids[:1] != prefix                                   # the model continues after <mem>
    assert all(r.mem_end > len(prefix) for r in later)                          # the span includes the prefix
    samples = train.build_samples(trajs, torch.ones(len(trajs)), {})
    x = grpo.collate(samples, tok.pad_token_id, "cpu")
    rounds = [r for t in trajs for r in t.rounds if r.output_ids]
    for i, (s, r) in enumerate(zip(samples, rounds)):
        start = r.mem_span[0]                                                   # where the round starts
        assert x["loss_mask"][i, :s.n_prompt].sum() == 0 and x["loss_mask"][i, s.n_prompt:len(s.ids)].all()
        assert s.ids[start:s.n_prompt] == r.prefix_ids and s.ids[:start] == r.context_ids
    assert sum(s.n_prompt - r.mem_span[0] == 1 for s, r in zip(samples, rounds)) == len(later)
    # mem_prefix=False: nothing is forced in any round
    off, _ = expert_rollout(tasks, SearchTool(w.docs), AgentConfig(
        system_prompt=data.SYSTEM_PROMPT, max_turns=4, max_new_tokens=60, temperature=0.0, mem_prefix=False))
    assert sum(len(t.rounds) for t in off) >= 12
    assert all(r.prefix_ids == [] and r.text == tok.decode(r.output_ids) for t in off for r in t.rounds)


def test_full_context_keeps_every_round_and_tool_result_snail_drops_them(expert_rollout):
    w, tasks = data.make_tasks(4, 4, [2], (2, 2))
    for context in ("full", "snail"):
        cfg = AgentConfig(system_prompt=data.SYSTEM_PROMPT, context=context, max_turns=4, max_new_tokens=60,
                          temperature=0.0)
        trajs, tok = expert_rollout(tasks, SearchTool(w.docs), cfg)
        checked = 0
        for t in trajs:
            gens = [r.text for r in t.records if r.type == "llm_gen"]
            tools = [r.text for r in t.records if r.type != "llm_gen"][1:]
            for k in range(2, len(t.rounds)):          # round k saw rounds 0..k-1 and their tool results
                ctx = t.rounds[k].context_ids
                old = [tok.encode(gens[0], add_special_tokens=False), tok.encode(tools[0], add_special_tokens=False)]
                assert all(_contains(ctx, o) for o in old) == (context == "full")
                assert _contains(ctx, tok.encode(tools[k - 1], add_special_tokens=False))   # the newest is always there
                checked += 1
        assert checked == 8                            # 4 searches + an answer each, cut at 4 rounds: k = 2, 3


def test_accessed_page_reaches_the_next_snail_context_as_its_first_100_characters():
    """A tiny model overfit to one round that accesses a page; the real loop records and shows the page."""
    from memory import Record, prepare_prompt
    from rollout import encode_chat
    tok = data.build_tokenizer()
    names = data.name_pool()
    page = " ".join(names[:36])                        # 180 characters; names[35] lies beyond character 100
    tool = SearchTool([{"id": "d1", "contents": page}, {"id": "d2", "contents": " ".join(names[36:42])}])
    full_page = tool.access("d1")
    assert len(full_page) > 130 and names[35] not in full_page[:100]
    question = f"1 : {names[44]} friend _"
    ctx = encode_chat(tok, prepare_prompt([Record("prompt", question)], data.SYSTEM_PROMPT))
    out = tok.encode("<think> search </think> <access> d1 </access>", add_special_tokens=False)
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.tensor([ctx + out])
    labels = torch.tensor([[-100] * len(ctx) + out])
    for _ in range(60):
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    model.eval()
    task = data.Task(question, [[names[45]]])
    for context, shown in (("snail", full_page[:100]), ("full", full_page)):
        cfg = AgentConfig(system_prompt=data.SYSTEM_PROMPT, context=context, max_turns=2, max_new_tokens=12,
                          temperature=0.0)
        (traj,) = rollout(model, tok, [task], 1, tool, cfg)
        assert traj.rounds[0].action == "access" and len(traj.rounds) == 2
        rec = traj.records[2]                          # prompt, round 1, its tool result, round 2
        assert rec.type == "webpage" and rec.text == full_page and rec.short_text == full_page[:100]
        ctx2 = traj.rounds[1].context_ids
        assert _contains(ctx2, tok.encode(shown, add_special_tokens=False))
        assert _contains(ctx2, tok.encode(names[35], add_special_tokens=False)) == (context == "full")


# ---------------------------------------------------------------- the prefix cache through the agent loop
class SearchesAfter(torch.nn.Module):
    """A real model that writes ``free`` tokens of its own, then ``<search> name </search>``: from the ``free``-th
    new token of a ``generate`` call on, a row is pushed to ``chain[0]``, and after ``chain[i]`` to ``chain[i + 1]``
    (a Markov script: a cached forward sees only its newest token). Its own tokens may not repeat the newest one
    (a random tiny model copies its input), so they are runner-up choices of the real logits: rounds run on, one
    search each, and a cache that changed the logits would change what they write."""

    def __init__(self, inner, chain, free=4):
        super().__init__()
        self.inner, self.config, self.free, self.step = inner, inner.config, free, 0
        self.next = dict(zip(chain, chain[1:]))
        self.first = chain[0]

    @property
    def device(self):
        return self.inner.device

    def forward(self, input_ids, **kw):
        self.step = 0 if "logits_to_keep" in kw else self.step + 1   # a prefill starts a call; decode steps count
        out = self.inner(input_ids=input_ids, **kw)
        for b, t in enumerate(input_ids[:, -1].tolist()):          # the kept logit is the newest token's
            if self.step < self.free:
                out.logits[b, -1, t] -= 1e4
            else:
                out.logits[b, -1, self.next[t] if self.step > self.free and t in self.next else self.first] += 1e4
        return out


def distinct_ids(tok, text: str, avoid=frozenset()) -> list[int]:
    """Ids whose decoded pieces concatenate to ``text``, no id twice and none in ``avoid`` (so the Markov
    script is a function, and no prompt ends inside it)."""
    ids = tok.encode(text, add_special_tokens=False)
    if len(set(ids)) == len(ids) and not set(ids) & avoid and tok.decode(ids) == text:
        return ids
    pieces: dict[str, int] = {}
    for i, t in enumerate(tok.batch_decode([[i] for i in range(len(tok))])):
        if t and i not in tok.all_special_ids:
            pieces.setdefault(t, i)

    def split(rest, used):
        if not rest:
            return []
        for n in range(len(rest), 0, -1):
            i = pieces.get(rest[:n])
            if i is not None and i not in used and (tail := split(rest[n:], used | {i})) is not None:
                return [i] + tail
        return None
    return split(text, frozenset(avoid))


def searching_agent(tok, inner):
    bpe = "Ġ" in tok.convert_ids_to_tokens(tok.encode(" x", add_special_tokens=False))[0]
    name = data.name_pool()[0]          # BPE: ">" ends the forced "<mem>", so the tags close with ">." and ">\n"
    text = f"<search>. {name} </search>\n" if bpe else f"<search> {name} </search>"
    return SearchesAfter(inner, distinct_ids(tok, text, set(tok.encode("<mem>", add_special_tokens=False))))


def counted_rollout(model, tok, tasks, group, tool, cfg, seed=None):
    """rollout + the number of real (unpadded) tokens its prefill forwards took in."""
    seen = []

    def hook(module, args, kwargs):
        if "logits_to_keep" in kwargs:                           # a prefill; decode steps keep every logit
            q = kwargs["input_ids"].shape[1]
            seen.append(int(kwargs["attention_mask"][:, -q:].sum()))
    h = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        return rollout(model, tok, tasks, group, tool, cfg, gen), sum(seen)
    finally:
        h.remove()


def check_prefix_cache(model, tok, system_prompt, temperature):
    from rollout import question_prefix
    w, tasks = data.make_tasks(5, 3, [1, 2, 3])
    tool = SearchTool(w.docs)
    runs = {}
    for on in (False, True):
        cfg = AgentConfig(system_prompt=system_prompt, max_turns=4, max_new_tokens=24, temperature=temperature,
                          prefix_cache=on)
        runs[on] = counted_rollout(model, tok, tasks, 3, tool, cfg, seed=0 if temperature > 0 else None)
    (off, n_off), (on, n_on) = runs[False], runs[True]
    assert [[r.round_ids for r in t.rounds] for t in on] == [[r.round_ids for r in t.rounds] for t in off]
    assert [[r.context_ids for r in t.rounds] for t in on] == [[r.context_ids for r in t.rounds] for t in off]
    rounds = [len(t.rounds) for t in off]
    assert sum(n >= 2 for n in rounds) >= len(rounds) // 2 and max(rounds) == 4          # multi-round
    # hand count of prefilled tokens: off = every distinct prompt of every round in full; on = each question's
    # prefix once + what follows it in every distinct prompt
    P = [len(question_prefix(tok, system_prompt, t.question)) for t in tasks]
    assert len(set(P)) > 1 and min(P) > 0                        # prefixes of different lengths
    want_off = want_on = 0
    for turn in range(max(rounds)):
        prompts = {tuple(t.rounds[turn].context_ids + t.rounds[turn].prefix_ids): t.group_id
                   for t in off if len(t.rounds) > turn}
        for ids, g in prompts.items():
            assert list(ids[:P[g]]) == question_prefix(tok, system_prompt, tasks[g].question)
            want_off += len(ids)
            want_on += len(ids) - P[g]
    assert n_off == want_off and n_on == want_on + sum(P)
    return off, n_on / n_off


def test_prefix_cache_equals_plain_prefill_and_prefills_each_question_once(tiny):
    tok, inner = tiny
    model = searching_agent(tok, inner)
    off, ratio = check_prefix_cache(model, tok, data.SYSTEM_PROMPT, 0.0)
    assert ratio < 0.7
    out = [r.output_ids for t in off for r in t.rounds]
    assert len({tuple(o[:3]) for o in out}) >= 4                 # the model's own tokens differ by context
    check_prefix_cache(model, tok, data.SYSTEM_PROMPT, 1.0)      # sampled: rollouts of a question differ


def test_generation_in_chunks_writes_the_one_batch_rollouts(tiny):
    """generation_batch 3: each round's 8 rows (4 questions x 2) generate in chunks of at most 3 rows (the widest
    forward: 3 rows, 8 in one batch), and the greedy multi-round trajectories are those of one batch."""
    tok, inner = tiny
    model = searching_agent(tok, inner)
    w, tasks = data.make_tasks(5, 4, [1, 2, 3])
    runs, widths = {}, {}
    for n in (0, 3):
        cfg = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=4, max_new_tokens=24, temperature=0.0,
                          generation_batch=n)
        rows = []

        def width(module, args, kw, rows=rows):     # generate's forwards (a static cache; the prefix store's: dynamic)
            if isinstance(kw["past_key_values"], StaticCache):
                rows.append(kw["input_ids"].shape[0])
        h = model.register_forward_pre_hook(width, with_kwargs=True)
        runs[n] = rollout(model, tok, tasks, 2, SearchTool(w.docs), cfg)
        h.remove()
        widths[n] = max(rows)
    assert widths == {0: 8, 3: 3}
    assert max(len(t.rounds) for t in runs[0]) == 4                                         # multi-round
    for part in ("context_ids", "prefix_ids", "output_ids"):
        assert [[getattr(r, part) for r in t.rounds] for t in runs[3]] == \
            [[getattr(r, part) for r in t.rounds] for t in runs[0]]


def test_prefix_cache_on_a_bpe_qwen2_with_the_protocol_prompt(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from rollout import PROTOCOL_PROMPT
    path = data.save_random_checkpoint(str(tmp_path / "qwen"))
    tok, inner = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    model = searching_agent(tok, inner)
    _, ratio = check_prefix_cache(model, tok, PROTOCOL_PROMPT, 0.0)
    assert ratio < 0.4                                           # the protocol prompt is most of every round
    check_prefix_cache(model, tok, PROTOCOL_PROMPT, 1.0)


# ---------------------------------------------------------------- templates that rewrite earlier turns
# Qwen3's rule: of every assistant turn before the last user message only what follows </think> is kept; the
# newest turn's reasoning goes back inside <think> (a mimic of its template, turn markers given)
QWEN3_RULE = ("""{%- set ns = namespace(last=0) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- set content = m.content -%}
{%- if m.role == 'assistant' and '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- if loop.index0 > ns.last -%}"""
"""{%- set content = '<think>\\n' + reasoning.strip() + '\\n</think>\\n\\n' + content -%}{%- endif -%}
{%- endif -%}
{{- OPEN ~ m.role ~ MID ~ content ~ CLOSE -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- OPEN ~ 'assistant' ~ MID -}}{%- endif -%}""")


def qwen3_style(open_: str, mid: str, close: str) -> str:
    """``QWEN3_RULE`` with each turn written ``open_ + role + mid + content + close``."""
    quote = lambda s: "'" + s.replace("\n", "\\n") + "'"
    return QWEN3_RULE.replace("OPEN", quote(open_)).replace("MID", quote(mid)).replace("CLOSE", quote(close))


def test_a_template_that_cuts_earlier_turns_at_think_is_rendered_with_every_message_as_written(monkeypatch, capsys):
    import models
    from models import PROBE_CHAT, encode_chat, needs_verbatim, rewrites_messages
    monkeypatch.setattr(models, "_VERBATIM", {})
    assert not rewrites_messages(data.build_tokenizer())                   # the embedded template keeps them
    tok = data.build_bpe_tokenizer()
    assert not rewrites_messages(tok) and not needs_verbatim(tok)          # ChatML as written: the template itself
    assert encode_chat(tok, PROBE_CHAT) == tok.encode(
        tok.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    assert capsys.readouterr().out == ""
    tok.chat_template = qwen3_style("<|im_start|>", "\n", "<|im_end|>\n")
    plain = tok.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, tokenize=False)
    assert "probe memory 1" not in plain and "<|im_start|>assistant\n <search> q1 </search><|im_end|>" in plain
    assert rewrites_messages(tok) and needs_verbatim(tok) and needs_verbatim(tok)
    text = tok.decode(encode_chat(tok, PROBE_CHAT))
    assert text == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in PROBE_CHAT) \
        + "<|im_start|>assistant\n"                                         # the template's own turn markers
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "rewrites earlier assistant turns" in out and "as written" in out


def test_round_two_sees_round_one_memory_under_a_qwen3_style_template(monkeypatch, capsys):
    """Acceptance: the ids of round 2's context hold round 1's <mem> body, and one line says how it is rendered."""
    import models
    from conftest import ExpertTape, expert_tape
    monkeypatch.setattr(models, "_VERBATIM", {})
    tok = data.build_tokenizer()
    tok.chat_template = qwen3_style("<|", "|> ", " <|end|> ")
    inner = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval()
    w, tasks = data.make_tasks(3, 1, [2], (2, 2))
    rounds, tape = expert_tape(tok, tasks[0])
    cfg = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=3, max_new_tokens=60, temperature=0.0)
    traj, = rollout(ExpertTape(inner, tape), tok, tasks, 1, SearchTool(w.docs), cfg)
    assert [r.text for r in traj.rounds] == rounds[:3]
    body = rounds[0].split("<mem>")[1].split("</mem>")[0]
    assert "</think>" in rounds[0] and body.strip()
    for t in (1, 2):     # each round's context holds the previous round whole, its <mem> first
        assert _contains(traj.rounds[t].context_ids, tok.encode(f"<mem>{body}</mem>" if t == 1 else rounds[1],
                                                                 add_special_tokens=False))
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "rewrites earlier assistant turns" in out
