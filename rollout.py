"""Rollouts: a batched KV-cache sampling engine and the MemPO agent loop (its search / access tools: search.py).

Engine (``generate``): token ids in, sampled ids out; it knows nothing of tags. Prompts are left
padded and prefilled in one forward; identical prompts (the G rollouts of a question in round 1)
are prefilled once and their cache rows repeated. Position ids come from the attention mask so
padding does not shift them. Decoding writes into a preallocated ``StaticCache`` (no per-step
concat of the cache), passes a preallocated 4D mask straight to attention (no per-step mask
building), keeps outputs in one tensor (no per-step Python over rows) and samples by inverse CDF
(one uniform per row). A row that hits EOS, a stop token sequence or a stop STRING is finished (stop
strings: ``StopStrings``, the tag however the tokenizer splits it; only rows whose newest token holds
a tag's last character decode their tail); finished rows leave the batch (their cache rows dropped)
once they are a quarter of it, since each drop copies the cache. Under bf16 autocast over fp32 weights
the cache stores keys and values in the autocast dtype.
Greedy output equals ``model.generate`` token for token (``test_rollout.py``); ``bench.py`` times it.
Prefix cache (``PrefixCache``, ``AgentConfig.prefix_cache``, on by default): the agent loop prefills each
question's system prompt + question once per ``rollout`` call and every round of every rollout copies
those keys / values and prefills only what follows (design, layout and memory cost in its docstring);
greedy and seeded sampled outputs equal the plain path's. Off, the engine is the plain path above.

Agent loop (``rollout``): per round, for every live trajectory,

    messages = memory.prepare_prompt(records)      # snail: question + last round; full: everything
    context  = chat_template(messages) + forced "<mem>" prefix (rounds >= 2, option)
    output   = generate(context)                   # stops at </search>, </access>, </answer>, EOS
    tool     = BM25 search (top-k docs) | access (one whole document) | answer -> done

and records everything the memory reward and the update need: the exact context ids the model saw
(``full_traj``), the forced prefix, the sampled ids, and how many leading tokens form the
``<mem>...</mem>`` span. Every round is one training sample ``context + prefix + output`` with
loss mask 1 on ``output`` only: in ``full`` mode this equals the original's one growing sequence
(same tokens, same conditioning), computed per round for simplicity.

Choices: a round that does not end in an action tag (EOS, max tokens) ends its trajectory, which
the format check then scores 0; a round's TEXT ends at its first closing action tag (what a BPE token
carries past it, ``>.`` or ``>\n``, is dropped from the text, the next context and the format check),
while its ids stay exactly as sampled (the update trains on them); the next round's prompt is the chat
template of the records' text, which is what the policy then sees and what that round's row holds (every
message as written: a template that rewrites earlier assistant turns, as Qwen3's cuts them at ``</think>`` and
with them the previous ``<mem>``, renders place holders that are then replaced, ``needs_verbatim``);
tool output is a whole chunk of the next prompt, never fed token by token. A model from elsewhere gets
``PROTOCOL_PROMPT``; a checkpoint of this project carries its own prompt (``system_prompt.txt``,
``checkpoint_prompt``). Loading a model (folder, ``.gguf``, SmolLM2) and the forward's precision: models.py.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, StaticCache

from memory import Record, mem_token_end, prepare_prompt, tool_record
from search import Retriever

PROTOCOL_PROMPT = """You are a research agent that answers questions by searching a document collection. \
You work in rounds. Each round you write, in this order and nothing else:
1. <mem> ... </mem>: your memory. Write everything worth keeping so far: what each question asks, \
what you have found (names, dates, numbers, document ids) and what is still missing. Rewrite it in full \
every round: after this round you will no longer see older rounds or older search results, only your \
newest memory, so anything you leave out is gone.
2. <think> ... </think>: brief reasoning about what to do next.
3. Exactly one action, then stop writing:
   <search> query </search> searches the collection; the top results come back inside <information> ... </information>.
   <access> document id </access> returns the beginning of one document inside <information> ... </information>.
   <answer> a1 ; a2 ; ... </answer> ends the task: one short answer per question, in the order the \
questions were asked, separated by " ; ", with no explanation.
Never write <information> yourself. Answer as soon as your memory holds every answer."""
ACTION_RE = re.compile(r"<(search|access|answer)>(.*?)</\1>\s*$", re.S)
STOP_STRINGS = ("</search>", "</access>", "</answer>")


# --------------------------------------------------------------------------- the system prompt a checkpoint carries

def checkpoint_prompt(path: str) -> str:
    """The system prompt a checkpoint was trained with (``system_prompt.txt``, written by train.py), else
    ``PROTOCOL_PROMPT`` (a model from elsewhere learns the protocol from the prompt)."""
    f = os.path.join(path, "system_prompt.txt")
    if os.path.exists(f):
        with open(f, encoding="utf-8") as fh:
            return fh.read()
    return PROTOCOL_PROMPT


# --------------------------------------------------------------------------- the engine

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


def stop_strings(tokenizer, strings=STOP_STRINGS) -> StopStrings:
    """The (cached) ``StopStrings`` of this tokenizer: the candidate scan decodes the whole vocabulary once."""
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
    sees exactly the same keys. Greedy and seeded sampled outputs equal the uncached engine's (``test_rollout.py``:
    word-level and byte-level BPE, multi-round) up to float summation order (batch shapes differ), which moved
    no token in the tests. flash-attention-2 reads the same 2D mask (keys gathered by mask, queries = the last
    S columns, causal from the bottom right), untested here (no GPU).

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


# --------------------------------------------------------------------------- the agent loop

@dataclass
class Round:
    """One LLM generation: what it saw (``context_ids`` = full_traj), the forced prefix, what it sampled."""
    context_ids: list[int]
    prefix_ids: list[int]
    output_ids: list[int]
    text: str                 # the round as written: prefix + decoded output
    mem_end: int              # leading tokens of prefix_ids + output_ids up to </mem>; 0 = no span
    action: str | None        # "search" | "access" | "answer" | None (malformed)

    @property
    def round_ids(self) -> list[int]:
        return self.prefix_ids + self.output_ids

    @property
    def n_tokens(self) -> int:
        return len(self.context_ids) + len(self.prefix_ids) + len(self.output_ids)


@dataclass
class Trajectory:
    """One rollout of one question."""
    question: str
    golds: list[list[str]]
    group_id: int
    prompt_ids: list[int]                 # system + question + generation prompt (for mem_traj)
    records: list[Record]
    rounds: list[Round] = field(default_factory=list)
    answer: str | None = None             # body of <answer>, None if it never answered
    done: bool = False


@dataclass
class AgentConfig:
    system_prompt: str
    context: str = "snail"       # "snail" | "full"
    keep_rounds: int = 1
    max_turns: int = 8
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    mem_prefix: bool = True      # force "<mem>" at the start of rounds >= 2
    webpage_chars: int = 100
    prefix_cache: bool = True    # prefill system + question once per question (PrefixCache); False: every round in full


# a conversation whose every message a faithful template renders as written; each assistant turn holds a
# </think>, the mark a reasoning model's template cuts earlier turns at
PROBE_CHAT = [{"role": "system", "content": "probe system"}, {"role": "user", "content": "probe question"},
              {"role": "assistant", "content": "<mem> probe memory 1 </mem> <think> probe 1 </think> <search> q1 </search>"},
              {"role": "user", "content": "<information> probe result 1 </information>"},
              {"role": "assistant", "content": "<mem> probe memory 2 </mem> <think> probe 2 </think> <search> q2 </search>"},
              {"role": "user", "content": "<information> probe result 2 </information>"}]
SLOT_RE = re.compile(r"\x00slot(\d+)\x00")
_VERBATIM: dict[str, bool] = {}         # chat template -> does it need the verbatim rendering


def rewrites_messages(tokenizer) -> bool:
    """Does the tokenizer's chat template drop or change the text of a message (``PROBE_CHAT``)?

    Qwen3's template keeps, of every assistant turn before the last user message, only what follows
    ``</think>``: the previous round's ``<mem>`` would vanish from the next round's context unseen.
    """
    text = tokenizer.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, tokenize=False)
    return not all(m["content"] in text for m in PROBE_CHAT)


def needs_verbatim(tokenizer) -> bool:
    """``rewrites_messages``, judged once per chat template; the first time it is true, one line says so."""
    key = tokenizer.chat_template or ""
    if key not in _VERBATIM:
        _VERBATIM[key] = rewrites_messages(tokenizer)
        if _VERBATIM[key]:
            slots = render_verbatim(tokenizer, PROBE_CHAT)
            if not all(m["content"] in slots for m in PROBE_CHAT):
                raise SystemExit(f"the chat template of {tokenizer.name_or_path or 'the tokenizer'} drops messages "
                                 f"even in place holders: give the tokenizer a template that keeps every message")
            print(f"chat template of {tokenizer.name_or_path or 'the tokenizer'}: it rewrites earlier assistant "
                  f"turns, so every message goes in as written, in the template's own turn markers")
    return _VERBATIM[key]


def render_verbatim(tokenizer, messages: list[dict]) -> str:
    """The chat template's text of ``messages`` with each message's content exactly as written: the template
    renders a place holder per message (no ``</think>`` to cut at) and each is replaced by its content."""
    slots = [{"role": m["role"], "content": f"\x00slot{i}\x00"} for i, m in enumerate(messages)]
    text = tokenizer.apply_chat_template(slots, add_generation_prompt=True, tokenize=False)
    return SLOT_RE.sub(lambda s: messages[int(s.group(1))]["content"], text)


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages -> ids with the assistant turn opened, every message's content as written (a template
    that rewrites earlier turns is rendered around it: ``needs_verbatim``)."""
    if needs_verbatim(tokenizer):
        text = render_verbatim(tokenizer, messages)
    else:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def question_prefix(tokenizer, system_prompt: str, question: str) -> list[int]:
    """Ids every round's context of ``question`` starts with (system prompt + question as the chat template
    renders them): the common start of round 1's prompt and a later round's, less round 1's last token."""
    first = encode_chat(tokenizer, prepare_prompt([Record("prompt", question)], system_prompt))
    later = encode_chat(tokenizer, prepare_prompt([Record("prompt", question), Record("llm_gen", "<mem>"),
                                                   tool_record("search_results", "<information>")], system_prompt))
    n = next((i for i, (a, b) in enumerate(zip(first, later)) if a != b), min(len(first), len(later)))
    return first[:min(n, len(first) - 1)]


def cut_at_stop(text: str, strings=STOP_STRINGS) -> str:
    """The text up to the end of its first stop string; unchanged when it holds none.

    The engine stops at the token that completes a closing tag, and a BPE token may carry characters
    past it (``>.``, ``>\n``): those belong to no tag and are dropped from the round's text.
    """
    ends = [text.find(s) + len(s) for s in strings if s in text]
    return text[:min(ends)] if ends else text


def parse_action(text: str) -> tuple[str | None, str]:
    """The action that ends a round's text -> ``(kind, body)``; ``(None, "")`` when it ends in none.

    Whatever follows the first closing action tag (the rest of the token that completed it) is ignored.
    """
    m = ACTION_RE.search(cut_at_stop(text))
    return (m.group(1), m.group(2).strip()) if m else (None, "")


def rollout(model, tokenizer, tasks: list, group_size: int, tool: Retriever, cfg: AgentConfig,
            generator: torch.Generator | None = None) -> list[Trajectory]:
    """Run ``group_size`` trajectories per task through the multi-turn loop; returns them in task order."""
    keep_rounds = None if cfg.context == "full" else cfg.keep_rounds
    forced_mem = tokenizer.encode("<mem>", add_special_tokens=False) if cfg.mem_prefix else []
    stops = stop_strings(tokenizer)
    trajs = []
    for gid, task in enumerate(tasks):
        records = [Record("prompt", task.question)]
        prompt_ids = encode_chat(tokenizer, prepare_prompt(records, cfg.system_prompt, keep_rounds))
        for _ in range(group_size):
            trajs.append(Trajectory(task.question, task.golds, gid, prompt_ids, list(records)))
    question_cache = None
    if cfg.prefix_cache:         # lives for this call only: the weights change after it
        question_cache = PrefixCache()
        question_cache.add(model, [question_prefix(tokenizer, cfg.system_prompt, t.question) for t in tasks],
                  tokenizer.pad_token_id)
    for turn in range(cfg.max_turns):
        live = [t for t in trajs if not t.done]
        if not live:
            break
        contexts, forced = [], []
        for t in live:
            ctx = encode_chat(tokenizer, prepare_prompt(t.records, cfg.system_prompt, keep_rounds))
            contexts.append(ctx)
            forced.append(forced_mem if turn > 0 else [])
        outs = generate(model, [c + p for c, p in zip(contexts, forced)], cfg.max_new_tokens,
                        pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, stops=stops,
                        temperature=cfg.temperature, top_p=cfg.top_p, generator=generator, prefix_cache=question_cache)
        searching, queries = [], []
        for t, ctx, pre, out in zip(live, contexts, forced, outs):
            text = cut_at_stop(tokenizer.decode(pre + out))     # ids stay exactly as sampled
            kind, body = parse_action(text)
            t.rounds.append(Round(ctx, pre, out, text, mem_token_end(tokenizer, pre + out), kind))
            t.records.append(Record("llm_gen", text))
            if kind == "search":
                searching.append(t)
                queries.append(body)
            elif kind == "access":
                t.records.append(tool_record("webpage", tool.access(body), cfg.webpage_chars))
            else:
                t.answer = body if kind == "answer" else None
                t.done = True
        for t, obs in zip(searching, tool.search_batch(queries)):     # the round's searches: one batch
            t.records.append(tool_record("search_results", obs, cfg.webpage_chars))
    return trajs


def run_episodes(model, tokenizer, tasks: list, tool: Retriever, agent: AgentConfig, batch: int = 64,
                 bar=None) -> list[Trajectory]:
    """One rollout per task (greedy when ``agent.temperature == 0``), ``batch`` tasks a call, in task order."""
    trajs = []
    for i in range(0, len(tasks), batch):
        part = rollout(model, tokenizer, tasks[i:i + batch], 1, tool, agent)
        if bar is not None:
            bar.update(len(part))
        for t in part:
            t.group_id += i                      # index into ``tasks``
        trajs += part
    return trajs
