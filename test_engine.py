"""The engine against a naive reference (``model.generate``, token for token), stop handling, sampling and the
prefix cache."""
import random

import pytest
import torch

import data
from engine import PrefixCache, generate, left_pad, sample_next, stop_strings
from rollout import STOP_STRINGS


@pytest.fixture(scope="module")
def tiny():
    tok = data.build_tokenizer()
    return tok, data.build_tiny_model(tok, seed=1).eval()


def random_prompts(tok, n=12, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, len(tok)) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def test_greedy_equals_model_generate_token_for_token(tiny):
    tok, model = tiny
    prompts = random_prompts(tok)
    ours = generate(model, prompts, 24, pad_id=tok.pad_token_id, temperature=0.0)
    ids, attn = left_pad(prompts, tok.pad_token_id, model.device)
    ref = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=24, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=None)[:, ids.shape[1]:].tolist()
    assert ours == ref


def test_stop_sequence_ends_row_and_others_are_unchanged(tiny):
    tok, model = tiny
    prompts = random_prompts(tok, n=6, seed=1)
    free = generate(model, prompts, 16, pad_id=tok.pad_token_id, temperature=0.0)
    stop = free[0][4]
    first = free[0].index(stop)
    out = generate(model, prompts, 16, pad_id=tok.pad_token_id, temperature=0.0, stop_seqs=[[stop]])
    assert out[0] == free[0][: first + 1]              # the stop token is kept, nothing after it
    for a, b in zip(out, free):                        # rows leaving the batch do not disturb the rest
        cut = b.index(stop) + 1 if stop in b else len(b)
        assert a == b[:cut]
    # a two-token stop sequence only fires on the full sequence
    two = [free[1][5], free[1][6]]
    out2 = generate(model, prompts[1:2], 16, pad_id=tok.pad_token_id, temperature=0.0, stop_seqs=[two])
    i = next(j for j in range(1, len(free[1])) if free[1][j - 1:j + 1] == two)
    assert out2[0] == free[1][: i + 1]


def test_eos_ends_row(tiny):
    tok, model = tiny
    prompts = random_prompts(tok, n=4, seed=2)
    free = generate(model, prompts, 12, pad_id=tok.pad_token_id, temperature=0.0)
    eos = free[2][3]
    out = generate(model, prompts, 12, pad_id=tok.pad_token_id, eos_id=eos, temperature=0.0)
    assert out[2][-1] == eos and len(out[2]) == free[2].index(eos) + 1


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(tiny):
    tok, model = tiny
    prompts = random_prompts(tok, n=5, seed=3)
    a = generate(model, prompts, 10, pad_id=0, generator=torch.Generator().manual_seed(7))
    b = generate(model, prompts, 10, pad_id=0, generator=torch.Generator().manual_seed(7))
    c = generate(model, prompts, 10, pad_id=0, generator=torch.Generator().manual_seed(8))
    assert a == b and a != c
    greedy = generate(model, prompts, 10, pad_id=0, temperature=0.0)
    assert generate(model, prompts, 10, pad_id=0, top_p=1e-6, generator=torch.Generator().manual_seed(1)) == greedy
    logits = torch.tensor([[0.0, 10.0, 0.0]])
    assert sample_next(logits, 0.0, 1.0, None).item() == 1


def test_stop_candidates_of_world_tokenizer_are_the_tokens_holding_a_closing_bracket():
    tok = data.build_tokenizer()
    cands = {tok.convert_ids_to_tokens(i) for i in stop_strings(tok, STOP_STRINGS).candidates}
    assert {"</search>", "</access>", "</answer>"} <= cands
    assert all(">" in c for c in cands) and "kalo" not in cands and "friend" not in cands


# ---------------------------------------------------------------- sampling distribution
def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs > 0
    return float((((counts - n * probs) ** 2)[keep] / (n * probs[keep])).sum())


def test_sampled_frequencies_match_softmax_over_temperature_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    N, T = 40000, 0.7
    gen = torch.Generator().manual_seed(0)
    draws = sample_next(logits.repeat(N, 1), T, 1.0, gen)
    counts = torch.bincount(draws, minlength=6).double()
    probs = torch.softmax(logits.double() / T, -1)
    # chi-square with 5 degrees of freedom: 99.99% quantile ~25.7; the untempered softmax is far off
    assert _chi2(counts, probs) < 25.7
    assert _chi2(counts, torch.softmax(logits.double(), -1)) > 500
    # top-p 0.8 at T = 0.7: probs 0.672, 0.161, 0.078, ... -> the nucleus is the tokens before the mass reaches 0.8
    nucleus = probs * ((probs.cumsum(-1) - probs) < 0.8)
    assert (nucleus > 0).sum() == 2
    draws = sample_next(logits.repeat(N, 1), T, 0.8, gen)
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[2:].sum() == 0
    assert _chi2(counts, nucleus / nucleus.sum()) < 16.0                  # 1 dof: 99.99% quantile ~15.1


# ---------------------------------------------------------------- the prefix cache
def test_engine_prefix_cache_rows_of_mixed_prefixes_equal_plain_prefill(tiny):
    """Direct engine check: three stored prefixes of different lengths, suffixes of different lengths, a row
    with no stored prefix, and a row that IS a stored prefix (nothing left to prefill: it gets a shorter one)."""
    tok, model = tiny
    rng = random.Random(4)
    draw = lambda n: [rng.randrange(5, len(tok)) for _ in range(n)]
    prefixes = [draw(n) for n in (3, 17, 30)]
    prompts = [p + draw(rng.randint(1, 12)) for p in prefixes for _ in range(3)] + [draw(9), prefixes[1]]
    prompts.append(prefixes[0] + prompts[0][3:])                 # a duplicate prompt: prefilled once
    cache = PrefixCache()
    cache.add(model, prefixes + [prefixes[1][:5]], tok.pad_token_id)
    assert cache.match(prefixes[1]) == tuple(prefixes[1][:5]) and cache.match(draw(40)) in ((),)
    plain = generate(model, prompts, 16, pad_id=tok.pad_token_id, temperature=0.0)
    cached = generate(model, prompts, 16, pad_id=tok.pad_token_id, temperature=0.0, prefix_cache=cache)
    assert cached == plain
