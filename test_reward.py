"""Tests for reward.py: answer matching, the format rules, the answer template, P, the one-pass
log-probs against a naive per-row reference, and the sign of the memory reward on a tiny model
trained to copy an entity from its context."""
import math
import random

import pytest
import torch

import data
from memory import mem_token_end
from reward import (answer_logprobs, answer_prob, answer_template, em_score, f1_score,
                    memory_rewards, normalize_answer, outcome_reward, score_answer,
                    validate_format)
from rollout import Round, Trajectory

NAMES = data.name_pool()[:16]          # in the world vocabulary, one token each
R1 = "<think> search </think> <search> kalo friend </search>"
R2 = "<mem> 1 : kalo friend mira </mem> <think> answer </think> <answer> mira </answer>"


@pytest.fixture(scope="module")
def tok():
    return data.build_tokenizer()


# ---------------------------------------------------------------- answer matching
def test_normalize_answer():
    assert normalize_answer("The Eiffel  Tower!") == "eiffel tower"
    assert normalize_answer("  A cat, an apple. ") == "cat apple"
    assert normalize_answer("theater") == "theater"          # articles only as whole words
    assert normalize_answer("") == ""


def test_em_and_f1():
    assert em_score("the Cat.", ["dog", "cat"]) == 1.0
    assert em_score("cats", ["cat"]) == 0.0
    assert em_score("x", []) == 0.0
    # pred {big, red, dog}, gold {red, dog}: P 2/3, R 1 -> F1 0.8
    assert f1_score("the big red dog", ["red dog"]) == pytest.approx(0.8)
    # max over aliases: "red dog house" gives P 1, R 2/3 -> 0.8
    assert f1_score("red dog", ["blue cat", "red dog house"]) == pytest.approx(0.8)
    assert f1_score("", ["x"]) == 0.0
    assert f1_score("the", ["a"]) == 1.0                      # both empty after normalisation
    assert f1_score("x", []) == 0.0


def test_score_answer_multi_objective():
    golds = [["mira"], ["lena"], ["kalo"]]
    assert score_answer("Mira ; lena ; bobo", golds) == pytest.approx(
        {"score": 2 / 3, "em": 0.0, "f1": 2 / 3})
    assert score_answer("mira ; lena ; kalo", golds) == {"score": 1.0, "em": 1.0, "f1": 1.0}
    assert score_answer("mira", golds) == pytest.approx({"score": 1 / 3, "em": 0.0, "f1": 1 / 3})
    assert score_answer("a ; b ; extra", [["a"], ["b"]]) == {"score": 1.0, "em": 1.0, "f1": 1.0}
    assert score_answer("Kathryn Bigelow ; 2010", [["bigelow", "kathryn bigelow"], ["2010"]])["em"] == 1.0
    assert score_answer("big red dog ; x", [["red dog"], ["y"]]) == pytest.approx(
        {"score": 0.0, "em": 0.0, "f1": 0.4})
    assert score_answer(None, golds) == {"score": 0.0, "em": 0.0, "f1": 0.0}


# ---------------------------------------------------------------- format
def test_expert_episodes_are_valid():
    _, tasks = data.make_tasks(0, 6, [1, 2, 3])
    for task in tasks:
        for forget in (False, True):
            texts = [text for text, _ in data.expert_episode(task, forget)]
            assert validate_format(texts) == (True, "ok"), texts


@pytest.mark.parametrize("rounds, rule", [
    ([R1, "<mem> x </mem> <think> a <answer> mira </answer> </think>"], 1),   # nested
    ([R1, "<mem> x </mem> <think> a </think> <answer> mira"], 1),              # unclosed
    ([R1, "<mem> x </mem> </think> <think> a </think> <answer> mira </answer>"], 1),
    ([R1, "<mem> x </mem> <think> a </think> <search> q </search> <answer> m </answer>"], 2),
    ([R1, "<mem> x </mem> <mem> y </mem> <think> a </think> <answer> mira </answer>"], 2),
    ([R1, "<mem> x </mem> <answer> mira </answer>"], 2),                      # no think
    ([R1, "<think> a </think> <mem> x </mem> <answer> mira </answer>"], 3),
    ([R1, "<mem> x </mem> <answer> mira </answer> <think> a </think>"], 3),
    ([R1, R2 + " <information> d1 kalo friend mira </information>"], 4),
    ([R1, "<mem> x </mem> so <think> a </think> <answer> mira </answer>"], 5),
    ([R1, R2 + " done"], 5),
    ([R1], 6),                                                                 # never answers
    ([R2, R2], 6),                                                             # answers early
    ([], 6),
    ([R1, "<mem> x </mem> <think> a </think> <answer>   </answer>"], 7),
    (["<think> a </think> <search> </search>", R2], 7),                        # empty query
    ([R1, "<think> answer </think> <answer> mira </answer>"], 8),
    ([R1, R1.replace("kalo", "mira"), R2], 8),                                 # round 1 of 0-2
])
def test_each_rule(rounds, rule):
    ok, why = validate_format(rounds)
    assert not ok and why.startswith(f"rule {rule}:"), why


def test_mem_rule_boundaries():
    assert validate_format([R1, R2]) == (True, "ok")                         # round 0 needs no mem
    assert validate_format(["<think> answer </think> <answer> mira </answer>"]) == (True, "ok")
    no_mem = [R1, "<think> answer </think> <answer> mira </answer>"]
    assert validate_format(no_mem, mem_from=2) == (True, "ok")
    assert validate_format([R1, "<mem></mem><think></think><answer>m</answer>"]) == (True, "ok")


def test_garbage_never_raises():
    bad = [
        "\x00\xff<<>>\ufffd", "<mem", "</", "<mem> x",
        "<think> a </think> <search> a </search> <search> b </search>",
        "<mem> <think> a </think> </mem> <answer> x </answer>", "x" * 10_000,
        "<think> a </think> <answer> " + "<" * 10_000 + " </answer> >",
        "기억 <mem> 기억 </mem> <think> é </think> <answer> ü </answer> 끝", "<MEM> a </MEM>",
    ]
    for text in bad:
        ok, why = validate_format([R1, text])
        assert ok is False and why.startswith("rule "), (text[:40], why)
    long_ok = "<mem> " + "kalo " * 2000 + "</mem> <think> a </think> <answer> 1 < 2 </answer>"
    assert len(long_ok) > 10_000 and validate_format([R1, long_ok]) == (True, "ok")
    rng = random.Random(0)
    alphabet = ["<", ">", "/", " ", "a", "\n", "é", "<mem>", "</mem>", "<think>", "</think>",
                "<search>", "</search>", "<answer>", "</answer>", "<information>", "<access>"]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        ok, why = validate_format([text])
        assert isinstance(ok, bool) and isinstance(why, str)


def _round(tok, context: str, text: str, action: str | None, prefix: bool = True) -> Round:
    """A Round as rollout records it: the text's ids split into the forced "<mem>" prefix and output."""
    ids = tok.encode(text, add_special_tokens=False)
    pre = ids[:1] if prefix and text.startswith("<mem>") else []
    return Round(tok.encode(context, add_special_tokens=False), pre, ids[len(pre):], text,
                 mem_token_end(tok, ids), action)


def test_outcome_reward(tok):
    def traj(texts, answer, golds):
        rounds = [_round(tok, "<|user|> q <|end|> <|assistant|>", t, None) for t in texts]
        return Trajectory("q", golds, 0, [], [], rounds, answer, True)
    good = outcome_reward(traj([R1, R2], "mira", [["mira"]]))
    assert good == {"score": 1.0, "em": 1.0, "f1": 1.0, "valid": True, "reason": "ok"}
    half = outcome_reward(traj([R1, R2], "mira ; kalo", [["mira"], ["lena"]]))
    assert (half["score"], half["em"], half["f1"]) == (0.5, 0.0, 0.5)
    bad = outcome_reward(traj([R1, "<think> answer </think> <answer> mira </answer>"], "mira", [["mira"]]))
    assert (bad["score"], bad["em"], bad["f1"], bad["valid"]) == (0.0, 0.0, 0.0, False)
    assert bad["reason"].startswith("rule 8:")


# ---------------------------------------------------------------- answer template and P
def test_answer_template_marks_gold_tokens(tok):
    a, b, c = NAMES[:3]
    ids, mask = answer_template(tok, [[a, "other"], [f"{b} {c}"]], think="answer")
    assert tok.decode(ids) == f"<think> answer </think> <answer> {a} ; {b} {c} </answer>"
    assert mask == [0, 0, 0, 0, 1, 0, 2, 3, 0]                 # gold WORDS numbered in order
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == f"{a} {b} {c}"
    ids, mask = answer_template(tok, [[a]], think="search")
    assert tok.decode(ids) == f"<think> search </think> <answer> {a} </answer>" and sum(mask) == 1


def test_answer_prob_hand_values():
    l8, l9, l1, l6 = math.log(0.8), math.log(0.9), math.log(0.1), math.log(0.6)
    logp = torch.tensor([[l8, l8, l8, l8],
                         [l9, l1, l9, l1],
                         [l9, l6, 0.0, 0.0],          # row padded to 4 with mask 0
                         [l8, l8, l8, l8]])
    ans = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    p = answer_prob(logp, ans)
    assert torch.allclose(p, torch.tensor([0.8, 0.9, math.sqrt(0.54), 0.0]), atol=1e-6)
    # threshold 0.05 lets the 0.1 tokens in: geometric mean of 0.9 and 0.1 = 0.3
    assert answer_prob(logp[1:2], ans[1:2], threshold=0.05).item() == pytest.approx(0.3, abs=1e-6)
    conf = torch.tensor([[0, 1, 0, 0]])               # another row's confident set, not this row's
    assert answer_prob(logp[1:2], ans[1:2], conf_mask=conf).item() == pytest.approx(0.1, abs=1e-6)
    neg_inf = torch.tensor([[-math.inf, l8]])
    assert answer_prob(neg_inf, torch.ones(1, 2)).item() == pytest.approx(0.8)
    assert answer_prob(neg_inf, torch.ones(1, 2), conf_mask=torch.ones(1, 2)).item() == 0.0


# ---------------------------------------------------------------- one-pass log-probs
def _naive_logprobs(model, context, answer):
    ids = torch.tensor([context + answer])
    logp = model(input_ids=ids).logits[0].float().log_softmax(-1)              # (L, V)
    pos = torch.arange(len(context) - 1, len(context) + len(answer) - 1)
    return logp[pos, torch.tensor(answer)]


def test_answer_logprobs_match_per_row_forwards(tok):
    model = data.build_tiny_model(tok, seed=3)
    rng = random.Random(0)
    vocab = list(range(2, len(tok)))
    contexts = [[rng.choice(vocab) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    answers = [[rng.choice(vocab) for _ in range(rng.randint(1, 8))] for _ in range(6)]
    calls = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    got = answer_logprobs(model, contexts, answers, tok.pad_token_id)
    assert len(calls) == 1
    with torch.no_grad():
        for c, a, g in zip(contexts, answers, got):
            assert g.dtype == torch.float32 and g.shape == (len(a),)
            assert torch.allclose(g, _naive_logprobs(model, c, a), atol=1e-5)
    # the 2N call of memory_rewards equals two N calls
    halves = (answer_logprobs(model, contexts[:3], answers[:3], tok.pad_token_id)
              + answer_logprobs(model, contexts[3:], answers[3:], tok.pad_token_id))
    for g, h in zip(got, halves):
        assert torch.allclose(g, h, atol=1e-5)
    # a small token budget forces micro-batches; same numbers, input order kept
    calls.clear()
    small = answer_logprobs(model, contexts, answers, tok.pad_token_id, token_budget=60)
    assert len(calls) >= 3
    for g, s in zip(got, small):
        assert torch.allclose(g, s, atol=1e-5)
    hook.remove()


# ---------------------------------------------------------------- memory reward
PROMPT = "<|user|> 1 : friend ? <|end|> <|assistant|>"
ROUND1 = "<think> search </think> <search> friend </search>"
FILL = data.RELATIONS + [str(k) for k in range(1, 10)] + [":"]
FULL_NOISE = 0.25     # tool results are noisy evidence: p(X | X in a tool result) ~ 0.77


def _full_ctx(body: str) -> str:
    return f"{PROMPT} {ROUND1} <|end|> <|user|> <information> {body} </information> <|end|> <|assistant|>"


def _answer(x: str) -> str:
    return f" <think> answer </think> <answer> {x} </answer>"


def _copy_sample(rng: random.Random) -> tuple[str, str]:
    """(context, answer entity): copy the one name in context; memory is clean, a tool result noisy."""
    x = rng.choice(NAMES)
    words = [rng.choice(FILL) for _ in range(rng.randint(1, 3))]
    kind = rng.randrange(3)
    if kind < 2:
        words.insert(rng.randint(0, len(words)), x)
    if kind == 0:
        return _full_ctx(" ".join(words)), x if rng.random() > FULL_NOISE else rng.choice(NAMES)
    return f"{PROMPT} <mem> {' '.join(words)} </mem>", x if kind == 1 else rng.choice(NAMES)


@pytest.fixture(scope="module")
def copy_model(tok):
    """Hidden 64, 2 layers, 4 heads; 600 AdamW steps, loss on the answer entity only (~10 s)."""
    model = data.build_tiny_model(tok, hidden=64, layers=2, heads=4, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    for _ in range(600):
        rows = []
        for ctx, x in (_copy_sample(rng) for _ in range(32)):
            c, a = (tok.encode(s, add_special_tokens=False) for s in (ctx, _answer(x)))
            rows.append((c + a, len(c) + 4))         # answer token 4 is the entity
        L = max(len(s) for s, _ in rows)
        ids = torch.zeros(len(rows), L, dtype=torch.long)             # right padded
        attn = torch.zeros(len(rows), L, dtype=torch.long)
        labels = torch.full((len(rows), L), -100)
        for b, (s, j) in enumerate(rows):
            ids[b, :len(s)], attn[b, :len(s)] = torch.tensor(s), 1
            labels[b, j] = s[j]
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _trajectory(tok, x: str, mems: list[str | None]) -> Trajectory:
    """Round 1 searches; rounds 2.. see the tool result holding x and write <mem> body (None = no mem)."""
    rounds = [_round(tok, PROMPT, ROUND1, "search")]
    for k, body in enumerate(mems):
        last = k == len(mems) - 1
        action = f"<answer> {x} </answer>" if last else "<search> friend </search>"
        mem = "" if body is None else f"<mem> {body} </mem> "
        text = f"{mem}<think> {'answer' if last else 'search'} </think> {action}"
        rounds.append(_round(tok, _full_ctx(f"2 {x} friend"), text, "answer" if last else "search"))
    return Trajectory("1 : friend ?", [[x]], 0, tok.encode(PROMPT, add_special_tokens=False), [],
                      rounds, x, True)


def test_memory_reward_sign(tok, copy_model):
    x = NAMES[5]
    lost, kept = _trajectory(tok, x, ["1 : friend"]), _trajectory(tok, x, [f"1 : friend {x}"])
    out = memory_rewards(copy_model, tok, [lost, kept])
    r_lost, r_kept = out["reward"]
    assert out["scored"] == [(0, 1), (1, 1)] and out["n"] == 2
    assert out["p_full"][0] == pytest.approx(out["p_full"][1], abs=1e-5) and out["p_full"][0] > 0.5
    assert out["p_mem"][0] == 0.0 and out["mask_mem"] == [0, 1] and out["mask_full"] == [1, 1]
    assert out["empty_frac"] == 0.5 and out["no_signal_frac"] == 0.0   # a dropped answer is a signal, not silence
    assert r_lost < -0.5                    # the memory dropped the entity the full context had
    unseen = _trajectory(tok, x, [f"1 : friend {x}"])
    unseen.golds = [[NAMES[6]]]             # an answer neither context holds: no confident word on either side
    three = memory_rewards(copy_model, tok, [lost, kept, unseen])
    assert three["mask_full"][2] == three["mask_mem"][2] == 0 and three["reward"][2] == 0.0
    assert three["no_signal_frac"] == pytest.approx(1 / 3) and three["empty_frac"] == pytest.approx(2 / 3)
    assert r_kept > 0.05 and r_kept > r_lost + 0.5
    # plumbing: P_mem is exactly p(x | prompt + "<mem> ... </mem>") from a direct call
    ids, _ = answer_template(tok, [[x]])
    mem_ctx = tok.encode(f"{PROMPT} <mem> 1 : friend {x} </mem>", add_special_tokens=False)
    direct = answer_logprobs(copy_model, [mem_ctx], [ids], tok.pad_token_id)[0][4].exp().item()
    assert out["p_mem"][1] == pytest.approx(direct, abs=1e-5)

    full = memory_rewards(copy_model, tok, [lost, kept], mask_mode="full")
    assert full["mask_mem"] == full["mask_full"] == [1, 1] and full["empty_frac"] == 0.0
    assert 0.0 < full["p_mem"][0] < 0.3     # penalised on the full context's tokens, not dropped
    assert -1.0 < full["reward"][0] < -0.4
    assert full["reward"][1] == pytest.approx(r_kept, abs=1e-6)
    for o in (out, full):
        values = o["p_mem"] + o["p_full"] + o["reward"]
        assert not any(math.isnan(v) for v in values)


def test_memory_reward_rounds_and_nothing_to_score(tok):
    class NoForward(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise AssertionError("no forward pass expected")
    x = NAMES[2]
    skip = _trajectory(tok, x, [None])                 # round 1 has no <mem>: nothing to score
    out = memory_rewards(NoForward(), tok, [skip, _trajectory(tok, x, [])])
    logps = {k: out.pop(k) for k in ("word_logp_full", "word_logp_mem")}
    assert out == {"reward": [], "scored": [], "p_mem": [], "p_full": [],
                   "mask_mem": [], "mask_full": [], "empty_frac": 0.0, "no_signal_frac": 0.0, "n": 0}
    assert all(lp.shape == (0, 0) for lp in logps.values())          # the same keys as when rounds are scored
    assert memory_rewards(NoForward(), tok, [])["reward"] == []
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
    mixed = _trajectory(tok, x, ["1", None, "2 friend", f"1 : friend {x}"])
    mixed.rounds[0] = _round(tok, PROMPT, f"<mem> 1 </mem> {ROUND1}", "search")   # round 0: never scored
    assert mixed.rounds[0].mem_end == 3
    out = memory_rewards(model, tok, [skip, mixed], threshold=0.0, token_budget=50)    # every gold word counts
    assert out["scored"] == [(1, 1), (1, 3), (1, 4)] and out["n"] == 3 and len(out["reward"]) == 3
    # by hand, round by round: P = p(x | context + "<think> probe </think> <answer>"), x one token
    ids, mask = answer_template(tok, mixed.golds)
    at_x = [j for j, w in enumerate(mask) if w]
    assert len(at_x) == 1
    p = lambda ctx: _naive_logprobs(model, ctx, ids)[at_x[0]].exp().item()
    with torch.no_grad():
        want = [p(mixed.prompt_ids + r.round_ids[:r.mem_end]) - p(r.context_ids)
                for r in (mixed.rounds[k] for k in (1, 3, 4))]
    assert out["reward"] == pytest.approx(want, rel=0, abs=1e-8)     # rewards ~3e-5 on an untrained model
    assert min(abs(a - b) for a, b in zip(want, want[1:] + want[:1])) > 1e-7     # each round its own memory


def test_answer_logprobs_buckets_two_length_profiles_with_the_same_numbers(tok):
    model = data.build_tiny_model(tok, seed=4)
    rng = random.Random(1)
    vocab = list(range(2, len(tok)))
    lens = [rng.randint(5, 8) for _ in range(4)] + [rng.randint(60, 70) for _ in range(4)]   # short mem, long full
    contexts = [[rng.choice(vocab) for _ in range(n)] for n in lens]
    answers = [[rng.choice(vocab) for _ in range(3)] for _ in lens]
    calls = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    got = answer_logprobs(model, contexts, answers, tok.pad_token_id, token_budget=65536, pad_limit=100)
    assert len(calls) == 2          # one bucket per length profile; without the limit: one batch padded to 73
    calls.clear()
    one = answer_logprobs(model, contexts, answers, tok.pad_token_id, token_budget=65536, pad_limit=10**9)
    assert len(calls) == 1
    hook.remove()
    with torch.no_grad():
        for c, a, g, o in zip(contexts, answers, got, one):
            assert torch.allclose(g, _naive_logprobs(model, c, a), atol=1e-5) and torch.allclose(g, o, atol=1e-5)


def test_answer_logprobs_caps_cpu_micro_batches_at_cpu_tokens_whatever_the_budget(tok):
    from reward import CPU_TOKENS
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=5)
    rng = random.Random(2)
    vocab = list(range(2, len(tok)))
    contexts = [[rng.choice(vocab) for _ in range(rng.randint(55, 60))] for _ in range(48)]   # ~2900 tokens
    answers = [[rng.choice(vocab) for _ in range(3)] for _ in contexts]
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: shapes.append(kw["input_ids"].shape), with_kwargs=True)
    got = answer_logprobs(model, contexts, answers, tok.pad_token_id, token_budget=65536)
    hook.remove()
    assert len(shapes) == 2 and all(b * L <= CPU_TOKENS for b, L in shapes) and sum(b for b, _ in shapes) == 48
    with torch.no_grad():
        for c, a, g in zip(contexts[:6], answers, got):
            assert torch.allclose(g, _naive_logprobs(model, c, a), atol=1e-5)
