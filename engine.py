"""The batched KV-cache generation engine: token ids in, sampled ids out; it knows nothing of tags.

A file of its own, as nanochat keeps its engine: the agent loops above it (rollout.py, recipes/) pass token
ids, stop strings and sampling settings down, and a reader of the algorithm may skip it. Prompts are left padded
and prefilled in one forward; identical prompts (the G rollouts of a question in round 0) are prefilled once and
their cache rows repeated. Position ids come from the attention mask so padding does not shift them. Decoding
writes into a preallocated ``StaticCache`` (no per-step concat of the cache), passes a preallocated 4D mask
straight to attention (no per-step mask building), keeps outputs in one tensor (no per-step Python over rows) and
samples by inverse CDF (one uniform per row). A row that hits EOS, a stop token sequence or a stop string is
finished (``StopStrings``: the string however the tokenizer splits it); finished rows leave the batch (their
cache rows dropped) once they are a quarter of it, since each drop copies the cache. Under bf16 autocast over
fp32 weights the cache stores keys and values in the autocast dtype.

Prefix cache (``PrefixCache``): prompts that start with a stored prefix (the agent loop's system prompt +
question) copy its keys / values and prefill only what follows (design, layout and memory cost in its
docstring); greedy and seeded sampled outputs equal the plain path's. Without one, the engine is the plain path.
Greedy output equals ``model.generate`` token for token (``test_engine.py``); ``bench.py`` times it.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache

# --------------------------------------------------------------------------- padding, sampling, stopping

def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> ``(ids, attention_mask)``, both (B, L)."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, L - len(s):] = 1
    return ids.to(device), mask.to(device)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids; temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)     # (B, V)
    order = None
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        probs = probs * (probs.cumsum(-1) - probs < top_p)           # always keeps the top token
    # inverse-CDF sampling: one uniform per row (torch.multinomial draws one exponential per entry: 10x slower on CPU)
    cdf = probs.cumsum(-1)                                             # (B, V)
    u = torch.rand((len(cdf), 1), device=cdf.device, generator=generator) * cdf[:, -1:]
    tok = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)   # (B, 1)
    return (tok if order is None else order.gather(-1, tok)).squeeze(-1)


def select_rows(cache, rows: torch.Tensor) -> None:
    """Keep (or repeat) batch ``rows`` of every layer of a ``StaticCache``, in place."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[rows], layer.values[rows]


class StopStrings:
    """Ends a row when its decoded text contains a stop string, however the tokenizer split it.

    ``</search>`` may arrive as one token, as ``</`` ``search`` ``>``, as ``</search`` ``>\n`` (a BPE token
    carrying what follows the tag) or as any other split a sampled model emits. The string completes
    exactly when the token holding its LAST character is added, so only rows whose newest token
    contains such a character (``candidates``, found once per tokenizer by decoding every id) decode
    their tail: the last ``window`` tokens, enough since every token is at least one byte.
    """

    def __init__(self, tokenizer, strings):
        self.tokenizer, self.strings = tokenizer, tuple(strings)
        self.window = max(len(s.encode()) for s in self.strings)
        lasts = {s[-1] for s in self.strings}
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        self.candidates = [i for i, t in enumerate(texts) if any(c in t for c in lasts)]

    def ended(self, tail: list[int]) -> bool:
        """Does the text of ``tail`` (a row's newest tokens) contain a stop string?"""
        text = self.tokenizer.decode(tail[-self.window:])
        return any(s in text for s in self.strings)


_STOPS: dict[tuple, StopStrings] = {}


def stop_strings(tokenizer, strings: tuple[str, ...]) -> StopStrings:
    """The (cached) ``StopStrings`` of this tokenizer and ``strings`` (the caller's tags: the engine knows none):
    the candidate scan decodes the whole vocabulary once."""
    key = (id(tokenizer), len(tokenizer), tuple(strings))
    if key not in _STOPS:
        _STOPS[key] = StopStrings(tokenizer, strings)
    return _STOPS[key]


def store_in_autocast_dtype(cache, device: torch.device) -> None:
    """Under autocast, make ``cache`` store keys and values in the autocast dtype (a no-op otherwise).

    Under bf16 autocast over fp32 weights, RoPE leaves keys in fp32 while values are bf16; a cache holds one
    dtype, so both are stored in the autocast dtype (attention runs in it anyway)."""
    if torch.is_autocast_enabled(device.type):
        dtype, update = torch.get_autocast_dtype(device.type), cache.update
        cache.update = lambda k, v, *args, **kw: update(k.to(dtype), v.to(dtype), *args, **kw)


# --------------------------------------------------------------------------- the prefix cache

class PrefixCache:
    """Keys and values of shared prompt prefixes, prefilled once and copied into every batch that starts with one.

    Every round of every rollout of a question starts with the same system prompt + question (the agent loop's
    ``question_prefix``; with a real model's natural-language protocol prompt that is hundreds of tokens, most
    of a snail round's prompt). ``add`` prefills those prefixes once, in one left-padded forward over a
    ``DynamicCache``, and keeps each prefix's keys / values, per layer (kv_heads, P, head_dim). ``generate``
    then asks ``match`` for the longest stored prefix of each prompt and prefills only the rest (the suffix).

    Layout of a batch: rows hold prefixes of different lengths (one per question) and suffixes of different
    lengths, so each row is ``[pad | prefix | pad | suffix]``: prefixes right-aligned in columns [0, P) (P the
    longest), suffixes left-padded in [P, P + S), pads masked out. The keys carry their rotary position (RoPE
    is applied before caching), so a column's place in the buffer does not matter; position ids still come
    from the mask's cumulative sum, so a row's positions are 0..len-1 as without the cache, and its attention
    sees exactly the same keys. Greedy and seeded sampled outputs equal the uncached engine's (``test_engine.py``;
    through the agent loop, word-level and byte-level BPE, multi-round: ``test_rollout.py``) up to float summation
    order (batch shapes differ), which moved no token in the tests. flash-attention-2 reads the same 2D mask
    (keys gathered by mask, queries = the last S columns, causal from the bottom right), untested here (no GPU).

    Memory: the store holds 2 x layers x kv_heads x head_dim x P values per question, e.g. 12 KiB per token for
    Qwen2.5-0.5B in bf16 (24 layers, 2 kv heads, 64) and 56 KiB for Qwen2.5-7B (28, 4, 128): a 500-token prefix
    costs 6 / 28 MiB per question, for the length of one ``rollout`` call (the weights change after it, so the
    store must not outlive it). A batch's static cache is as large as before plus the gap between a short
    prefix and the longest one. Compute: the prefix's projections and MLP run once per question instead of once
    per round and rollout; attention over the prefix keys is still paid per round.

    Models whose layers are not all full attention (sliding windows) get no prefixes stored (the plain path).
    """

    def __init__(self):
        self.kv: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}   # prefix -> [(K, V) per layer]
        self.lengths: list[int] = []                                                     # stored lengths, longest first

    @torch.inference_mode()
    def add(self, model, prefixes: list[list[int]], pad_id: int) -> None:
        """Prefill the ``prefixes`` not stored yet (one forward over all of them) and keep their keys / values."""
        if any(t != "full_attention" for t in getattr(model.config, "layer_types", None) or ()):
            return
        new = list(dict.fromkeys(tuple(p) for p in prefixes if p and tuple(p) not in self.kv))
        if not new:
            return
        device = model.device
        ids, attn = left_pad([list(p) for p in new], pad_id, device)                   # (n, L)
        cache = DynamicCache(config=model.config)
        store_in_autocast_dtype(cache, device)
        model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
              past_key_values=cache, use_cache=True, logits_to_keep=1)
        L = ids.shape[1]
        for i, p in enumerate(new):                # clones: the batch's padded tensors are freed
            self.kv[p] = [(layer.keys[i, :, L - len(p):].clone(), layer.values[i, :, L - len(p):].clone())
                          for layer in cache.layers]
        self.lengths = sorted({len(p) for p in self.kv}, reverse=True)

    def match(self, prompt) -> tuple[int, ...]:
        """The longest stored prefix of ``prompt`` that leaves at least one token to prefill; () when none."""
        for n in self.lengths:
            if n < len(prompt) and tuple(prompt[:n]) in self.kv:
                return tuple(prompt[:n])
        return ()

    def fill(self, cache, shared: list[tuple[int, ...]], width: int) -> None:
        """Write row r's prefix ``shared[r]`` into columns [width - len, width) of every layer of a fresh
        ``StaticCache`` and start its writing at column ``width``."""
        rows: dict[tuple, list[int]] = {}
        for r, s in enumerate(shared):
            if s:
                rows.setdefault(s, []).append(r)
        some = self.kv[next(iter(rows))]
        for i, layer in enumerate(cache.layers):
            k, v = some[i]                                                              # (h, P, d)
            layer.lazy_initialization(k.new_zeros(len(shared), k.shape[0], 1, k.shape[-1]),
                                      v.new_zeros(len(shared), v.shape[0], 1, v.shape[-1]))
            for s, r in rows.items():
                idx = torch.tensor(r, device=k.device)
                layer.keys[idx, :, width - len(s):width] = self.kv[s][i][0]             # broadcast over the rows
                layer.values[idx, :, width - len(s):width] = self.kv[s][i][1]
            layer.cumulative_length.fill_(width)


def prefix_mask(shared: list[tuple[int, ...]], device) -> torch.Tensor:
    """(U, P) attention mask of right-aligned prefixes, P the longest: 1 on each row's last len(prefix) columns."""
    P = max(len(s) for s in shared)
    lens = torch.tensor([len(s) for s in shared], device=device)
    return (torch.arange(P, device=device) >= P - lens[:, None]).long()


# --------------------------------------------------------------------------- prefill and decode

def prefill(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, prefix_cache: PrefixCache | None):
    """One forward over the left-padded ``prompts`` into a fresh ``StaticCache`` with room for ``max_new_tokens``
    -> (last logits (B, V), attention mask (B, L), position ids (B, L), cache). Identical prompts (the G rollouts
    of one question) are prefilled once and their cache rows repeated; a stored prefix is copied, not computed."""
    device, B = model.device, len(prompts)
    first: dict[tuple, int] = {}
    copy_of = [first.setdefault(tuple(p), len(first)) for p in prompts]          # prompt -> unique prompt
    shared = [prefix_cache.match(p) if prefix_cache is not None else () for p in first]   # () = no prefix
    ids, attn = left_pad([list(p[len(s):]) for p, s in zip(first, shared)], pad_id, device)   # (U, S)
    if any(shared):      # columns [0, P) hold the stored prefix keys, right-aligned: [pad | prefix | pad | suffix]
        attn = torch.cat([prefix_mask(shared, device), attn], dim=1)              # (U, P + S)
    L = attn.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=L + max_new_tokens)   # written in place: no per-step concat
    store_in_autocast_dtype(cache, device)
    if any(shared):
        prefix_cache.fill(cache, shared, L - ids.shape[1])
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                                      # (U, L)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos[:, L - ids.shape[1]:], past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]   # (U, V)
    if len(first) < B:
        rep = torch.tensor(copy_of, device=device)
        select_rows(cache, rep)
        logits, attn, pos = logits[rep], attn[rep], pos[rep]         # (B, ...)
    return logits, attn, pos, cache


@torch.inference_mode()
def generate(model, prompts: list[list[int]], max_new_tokens: int, *, pad_id: int,
             eos_id: int | None = None, stop_seqs: list[list[int]] = (), stops: StopStrings | None = None,
             temperature: float = 1.0, top_p: float = 1.0, generator: torch.Generator | None = None,
             prefix_cache: PrefixCache | None = None) -> list[list[int]]:
    """Sample continuations of ``prompts`` with a KV cache; each output ends at EOS, a stop token
    sequence (``stop_seqs``) or a stop string (``stops``), the ending token kept. A prompt that starts with
    a prefix stored in ``prefix_cache`` prefills only the rest (see ``PrefixCache``)."""
    device, B, T = model.device, len(prompts), max_new_tokens
    logits, attn, pos, cache = prefill(model, prompts, T, pad_id, prefix_cache)    # (B, V), (B, L), (B, L)
    L = attn.shape[1]
    # keys each row may see; step t opens column L + t. SDPA takes its (b, 1, 1, L+T) view as is (no
    # per-step mask building); other attention kernels get the 2D mask and build their own.
    mask = torch.zeros(B, L + T, dtype=torch.bool, device=device)                # (b, L+T)
    mask[:, :L] = attn.bool()
    as_4d = model.config._attn_implementation == "sdpa"
    pos = pos[:, -1:].clone()                                                     # (b, 1)
    ends = {s[-1] for s in stop_seqs if s} | ({eos_id} if eos_id is not None else set())
    ends |= set(stops.candidates) if stops is not None else set()
    ends = torch.tensor(sorted(ends), dtype=torch.long, device=device)
    seqs = [torch.tensor(s, device=device) for s in stop_seqs if s]
    out = torch.full((B, T), pad_id, dtype=torch.long, device=device)            # (B, T)
    n_out = torch.full((B,), T, dtype=torch.long, device=device)                  # (B,) output lengths
    rows = torch.arange(B, device=device)                                         # (b,) live row -> prompt
    done = torch.zeros(B, dtype=torch.bool, device=device)                        # (b,) finished, still in batch
    for t in range(T):
        tok = sample_next(logits, temperature, top_p, generator)                  # (b,)
        out[rows, t] = tok
        hit = torch.isin(tok, ends) & ~done          # could have ended: only then look at whole sequences
        if hit.any():
            ended = tok == eos_id if eos_id is not None else torch.zeros_like(hit)
            for s in seqs:
                if t + 1 >= len(s):
                    ended |= (out[rows, t + 1 - len(s):t + 1] == s).all(-1)
            if stops is not None:                    # decode only the candidate rows' tails
                for b in (hit & ~ended).nonzero().flatten().tolist():
                    if stops.ended(out[rows[b], max(0, t + 1 - stops.window):t + 1].tolist()):
                        ended[b] = True
            ended &= hit
            n_out[rows[ended]] = t + 1
            done |= ended
            n_done = int(done.sum())
            if n_done == len(rows):
                break
            if 4 * n_done >= len(rows):              # drop finished rows once a quarter of the batch is done
                keep = (~done).nonzero().squeeze(1)
                select_rows(cache, keep)
                rows, mask, pos, tok, done = rows[keep], mask[keep], pos[keep], tok[keep], done[keep]
        mask[:, L + t] = True
        pos += 1
        logits = model(input_ids=tok[:, None], attention_mask=mask[:, None, None] if as_4d else mask,
                       position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]   # (b, V)
    return [row[:n] for row, n in zip(out.tolist(), n_out.tolist())]
