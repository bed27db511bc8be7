"""Rewards: the outcome score of a trajectory and MemPO's memory reward for each ``<mem>``.

**Outcome reward.** A trajectory that breaks any format rule (``validate_format``) scores 0; otherwise its
``<answer>`` is compared with the gold after SQuAD normalisation. A K-objective answer ``a1 ; ... ; aK`` is
split on ``;``, part k against objective k's aliases:

    score = (# objectives matched exactly) / K      em = 1 iff all K match      f1 = mean word F1

**Memory reward** (the paper's extra forward pass). For trajectory i and every round t >= 1 (rounds count from 0:
every round after the first) whose ``<mem>`` closed:

    round_context[i,t] = the exact context the model saw before round t (no forced prefix): the paper's
                         full_traj, the whole trajectory so far where rollouts see it (--train-context full),
                         the snail shell where they see that (the default)
    mem_traj[i,t]      = system + question + round t cut right after </mem>      (memory.mem_traj)
    answer             = "<think> probe </think> <answer> g1 ; ... ; gK </answer>", ans_mask = the gold words
    P                  = exp(mean(logp_word over ans_mask & (logp_word > log threshold)))
    mem_reward[i,t]    = P_mem - P_full

All 2N (context, answer) pairs go through one no-grad pass, in micro-batches; grpo.py normalises the rewards.
The math works on token ids (``p_mem_minus_p_full``); ``memory_rewards`` picks the rounds and builds their two
contexts from trajectories, read by attribute. The file imports only memory.py of the project, so the two copy
out together (torch; a tokenizer and a model are passed in). Choices:

1. The think word is a marker, ``probe``, that the policy never writes; SFT's probe rows teach the policy to
   answer after it, after a round's context and after prompt + ``<mem>`` (sft.py), so both probes sit where a
   small policy can answer. A policy that never learnt the marker is probed after ``answer``.
2. Confidence is judged per gold word (log p summed over its tokens), not per token: on a BPE tokenizer a name's
   later pieces are predictable from its first, so per-token masks would keep names the probe could not write.
3. The answer template is encoded once and ``ans_mask`` comes from character offsets, so any tokenizer gets its
   own ids. An empty mask gives P = 0, never NaN. ``mask_mode="full"`` (not the paper's) averages both P over the
   words the full context is confident on.
4. K objectives: a missing part is "", extra parts are ignored, K = 0 scores 0. Format rules are checked in order
   and the first broken one is reported, with its round.
5. Micro-batches: rows sorted by length and split by ``token_budget`` and ``pad_limit`` (at most ``CPU_TOKENS`` on
   CPU, where bigger forwards cost more per token); only the answer positions are projected to logits.
"""
from __future__ import annotations

import math
import re
import string
from collections import Counter

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from memory import mem_traj

PUNCT = set(string.punctuation)
TAG_RE = re.compile(r"<(/?)(mem|think|search|access|answer|information)>")
ACTIONS = ("search", "access", "answer")


# the memory reward's defaults (train.Config's, and eval.py's for a checkpoint without a run config); PROBE_THINK is
# the marker SFT's probe rows teach (a policy that never learnt it is probed after "answer": train.resolve_probe_think)
THRESHOLD, MEM_MASK, PROBE_THINK = 0.5, "separate", "probe"


# --------------------------------------------------------------------------- answer matching

def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation and articles, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def em_score(pred: str, golds: list[str]) -> float:
    """1.0 if the normalised prediction equals any normalised alias, else 0.0."""
    p = normalize_answer(pred)
    return float(any(p == normalize_answer(g) for g in golds))


def _f1(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def f1_score(pred: str, golds: list[str]) -> float:
    """Word-level F1 of the prediction, max over aliases (0.0 with no aliases)."""
    return max((_f1(pred, g) for g in golds), default=0.0)


def score_answer(pred: str | None, golds: list[list[str]]) -> dict:
    """K-objective answer ``a1 ; ... ; aK`` vs golds[k] (aliases) -> {"score", "em", "f1"}."""
    if pred is None or not golds:
        return {"score": 0.0, "em": 0.0, "f1": 0.0}
    parts = [p.strip() for p in pred.split(";")]
    parts += [""] * (len(golds) - len(parts))
    ems = [em_score(p, g) for p, g in zip(parts, golds)]
    f1s = [f1_score(p, g) for p, g in zip(parts, golds)]
    return {"score": sum(ems) / len(golds), "em": float(all(ems)), "f1": sum(f1s) / len(golds)}


# --------------------------------------------------------------------------- format

def _check_round(text: str, t: int, last: bool, mem_from: int) -> str | None:
    """The first broken rule of round t as "rule N: why", or None."""
    spans: list[tuple[str, str]] = []      # (tag, body) in order of appearance
    outside: list[str] = []
    open_tag, open_end, pos = None, 0, 0
    for m in TAG_RE.finditer(text):
        closing, name = m.group(1) == "/", m.group(2)
        if open_tag is None:
            if closing:
                return f"rule 1: </{name}> closes nothing"
            outside.append(text[pos:m.start()])
            open_tag, open_end = name, m.end()
        elif not closing:
            return f"rule 1: <{name}> opened inside <{open_tag}>"
        elif name != open_tag:
            return f"rule 1: </{name}> closes <{open_tag}>"
        else:
            spans.append((name, text[open_end:m.start()]))
            open_tag, pos = None, m.end()
    if open_tag is not None:
        return f"rule 1: <{open_tag}> is never closed"
    outside.append(text[pos:])

    kinds = [k for k, _ in spans if k != "information"]
    actions = [k for k in kinds if k in ACTIONS]
    if kinds.count("mem") > 1 or kinds.count("think") != 1 or len(actions) != 1:
        return (f"rule 2: {kinds.count('mem')} <mem>, {kinds.count('think')} <think>, "
                f"{len(actions)} actions")
    expected = (["mem"] if "mem" in kinds else []) + ["think", actions[0]]
    if kinds != expected:
        return f"rule 3: order {kinds}, expected {expected}"
    if any(k == "information" for k, _ in spans):
        return "rule 4: <information> written by the model"
    stray = [s.strip() for s in outside if s.strip()]
    if stray:
        return f"rule 5: text outside tags: {stray[0][:40]!r}"
    if last and actions[0] != "answer":
        return f"rule 6: the last round ends with <{actions[0]}>, not <answer>"
    if not last and actions[0] == "answer":
        return "rule 6: answers before the last round"
    if not next(body for k, body in spans if k == actions[0]).strip():
        return f"rule 7: empty <{actions[0]}>"
    if t >= mem_from and "mem" not in kinds:
        return "rule 8: no <mem>"
    return None


def validate_format(rounds: list[str], mem_from: int = 1) -> tuple[bool, str]:
    """(True, "ok") or (False, "rule N: why (round t)") for the first broken rule; ``rounds[t]`` = round t's text,
    and every round from ``mem_from`` on must write ``<mem>`` (rule 8: all but the first)."""
    if not rounds:
        return False, "rule 6: no rounds, so no <answer>"
    for t, text in enumerate(rounds):
        why = _check_round(str(text), t, t == len(rounds) - 1, mem_from)
        if why is not None:
            return False, f"{why} (round {t})"
    return True, "ok"


def outcome_reward(traj) -> dict:
    """Format check + answer score of a trajectory (``.rounds[t].text``, ``.answer``, ``.golds``) -> {"score", "em",
    "f1", "valid", "reason"}; invalid scores 0."""
    valid, reason = validate_format([r.text for r in traj.rounds])
    scores = score_answer(traj.answer if valid else None, traj.golds)
    return {**scores, "valid": valid, "reason": reason}


# --------------------------------------------------------------------------- memory reward

def answer_template(tokenizer, golds: list[list[str]], think: str = PROBE_THINK) -> tuple[list[int], list[int]]:
    """`` <think> {think} </think> <answer> g1 ; g2 </answer>`` -> (ids, ans_mask); ans_mask[j] = w > 0 on gold word w.

    The text is encoded ONCE, so the ids are exactly the tokenizer's own encoding of it (per-piece
    encoding differs from it on BPE wherever a gold holds punctuation, digits or CJK), and a token is
    gold when its characters overlap a gold answer's (offset mapping). ``ans_mask`` numbers the gold
    WORDS (1, 2, ... in order, whitespace-split, objective by objective; ``template_objectives`` maps
    them back) so that a word split into several BPE pieces is judged as one word; as a boolean it is
    the usual gold mask. The leading space makes the template start a new word after any context.
    ``think`` = ``probe`` (``PROBE_THINK``): the probes' own marker, which the policy learns to answer after
    (SFT probe rows) and never writes itself; ``answer`` is what the expert writes.
    """
    text, spans = f" <think> {think} </think> <answer>", []
    for k, aliases in enumerate(golds):
        text += " ;" if k else ""
        for word in (aliases[0] if aliases else "").split():
            spans.append((len(text) + 1, len(text) + 1 + len(word)))
            text += " " + word
    text += " </answer>"
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [next((w + 1 for w, (s, e) in enumerate(spans) if a < e and s < b), 0) for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def template_objectives(golds: list[list[str]]) -> list[int]:
    """Objective index of each gold word of ``answer_template`` (word w + 1 of its mask -> entry w)."""
    return [k for k, aliases in enumerate(golds) for _ in (aliases[0] if aliases else "").split()]


def word_logprobs(logp: Tensor, word_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Token log-probs (B, A) + word numbers (B, A) -> word log-probs (B, W) and the words present (B, W).

    A word's log-prob is the sum over its tokens (log p of the whole word), so on a BPE tokenizer a
    name's predictable continuation pieces cannot make it look confident on their own; with one
    token a word (the word-level world) this is the token's own log-prob.
    """
    W = int(word_mask.max()) if word_mask.numel() else 0
    onehot = torch.nn.functional.one_hot(word_mask.long(), W + 1)[..., 1:].to(logp.dtype)   # (B, A, W)
    return torch.einsum("ba,baw->bw", logp, onehot), onehot.sum(1) > 0


PAD_LIMIT = 1024    # padding tokens a scoring micro-batch may carry before a new one starts (see bench.py)
CPU_TOKENS = 2048   # token cap of a scoring micro-batch on CPU: past ~2k tokens a forward's per-token cost grows


@torch.no_grad()
def answer_logprobs(model, contexts: list[list[int]], answers: list[list[int]], pad_id: int,
                    token_budget: int = 8192, pad_limit: int = PAD_LIMIT) -> list[Tensor]:
    """log p(answer[i][j] | context[i] + answer[i][:j]) -> one (len(answers[i]),) float32 tensor per row."""
    if any(not c for c in contexts):
        raise ValueError("every context needs at least one token")
    seqs = [list(c) + list(a) for c, a in zip(contexts, answers)]
    out: list[Tensor] = [torch.zeros(len(a)) for a in answers]
    device = next(model.parameters()).device
    if device.type == "cpu":      # the budget is a memory ceiling; on CPU smaller forwards are faster per token
        token_budget = min(token_budget, CPU_TOKENS)
    # shortest first; a new micro-batch when the budget would be exceeded, or when the batch's padding
    # would pass pad_limit tokens (length buckets: 2N rows of two length profiles pad no more than N + N)
    batches: list[list[int]] = [[]]
    real = 0
    for i in sorted(range(len(seqs)), key=lambda i: len(seqs[i])):
        rows, L = len(batches[-1]) + 1, len(seqs[i])
        if batches[-1] and (rows * L > token_budget or rows * L - real - L > pad_limit):
            batches.append([])
            real = 0
        batches[-1].append(i)
        real += L
    for rows in batches:
        lens = [len(answers[i]) for i in rows]
        A = max(lens, default=0)
        if A == 0:
            continue
        # left padding, so every row's answer ends at the last column; positions count real tokens only
        ids = pad_sequence([torch.tensor(seqs[i], dtype=torch.long) for i in rows], batch_first=True,
                           padding_value=pad_id, padding_side="left").to(device)   # (b, L)
        attn = pad_sequence([torch.ones(len(seqs[i]), dtype=torch.long) for i in rows], batch_first=True,
                            padding_side="left").to(device)                          # (b, L)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False,
                       logits_to_keep=A + 1).logits[:, :A].float()                 # (b, A, V)
        # answers right-aligned: column j predicts token j of a row whose answer has A tokens
        target = torch.zeros((len(rows), A), dtype=torch.long)
        for b, i in enumerate(rows):
            target[b, A - lens[b]:] = torch.tensor(answers[i], dtype=torch.long)
        # log p = logit - logsumexp: no second (b, A, V) tensor (log_softmax's), which a 152k vocabulary makes large
        logp = (logits.gather(-1, target.to(device)[..., None]).squeeze(-1) - logits.logsumexp(-1)).cpu()
        for b, i in enumerate(rows):
            out[i] = logp[b, A - lens[b]:]
    return out


def answer_prob(logp: Tensor, ans_mask: Tensor, threshold: float = 0.5,
                conf_mask: Tensor | None = None) -> Tensor:
    """P = exp(mean logp over ans_mask & confident) per row; logp, masks (N, W) -> (N,); empty -> 0. ``logp`` may
    be per token (W = answer tokens) or, as memory_rewards passes it, per gold word (W = words)."""
    if conf_mask is None:
        conf_mask = logp > (math.log(threshold) if threshold > 0 else -math.inf)
    mask = ans_mask.bool() & conf_mask.bool()                                      # (N, W)
    n = mask.sum(-1)
    mean = torch.where(mask, logp, torch.zeros_like(logp)).sum(-1) / n.clamp(min=1)
    return torch.where(n > 0, mean.exp(), torch.zeros_like(mean))


def p_mem_minus_p_full(model, round_context: list[list[int]], mem_traj: list[list[int]], answers: list[list[int]],
                       ans_masks: list[list[int]], pad_id: int, threshold: float = THRESHOLD,
                       mask_mode: str = MEM_MASK, token_budget: int = 8192) -> dict[str, Tensor]:
    """MemPO's memory reward of N rounds given as token ids, all 2N (context, answer) pairs in one no-grad pass.

    ``round_context[n]`` / ``mem_traj[n]``: round n's two contexts; ``answers[n]`` / ``ans_masks[n]``: its gold
    answer template and gold word numbers (``answer_template``). ``mask_mode="full"`` judges both P on the
    words the full context is confident on. Returns (N,) tensors ``mem_reward`` = ``p_mem`` - ``p_full`` and
    ``n_mem`` / ``n_full`` (confident gold words), and (N, W) ``word_logp_mem`` / ``word_logp_full``.
    """
    if mask_mode not in ("separate", "full"):
        raise ValueError(f"unknown mask_mode {mask_mode!r}")
    N = len(answers)
    # one no-grad pass in micro-batches: log p of every answer token, round_context rows then mem_traj rows, zero-padded
    logps = answer_logprobs(model, round_context + mem_traj, answers + answers, pad_id, token_budget) if N else []
    A = max((len(a) for a in answers), default=0)
    logp = torch.zeros(2 * N, A)                                                   # (2N, A)
    words = torch.zeros(N, A, dtype=torch.long)                                    # (N, A) gold word numbers
    for r, lp in enumerate(logps):
        logp[r, :len(lp)] = lp
    for r, mask in enumerate(ans_masks):
        words[r, :len(mask)] = torch.tensor(mask, dtype=torch.long)

    # per gold WORD (sum of its tokens' log-probs), so confidence means "the whole name"; P per side
    logp_full, ans_mask = word_logprobs(logp[:N], words)                           # (N, W)
    logp_mem, _ = word_logprobs(logp[N:], words)
    log_thr = math.log(threshold) if threshold > 0 else -math.inf
    conf_full = logp_full > log_thr
    conf_mem = conf_full if mask_mode == "full" else logp_mem > log_thr
    p_full = answer_prob(logp_full, ans_mask, conf_mask=conf_full)                 # (N,)
    p_mem = answer_prob(logp_mem, ans_mask, conf_mask=conf_mem)
    return {"mem_reward": p_mem - p_full, "p_mem": p_mem, "p_full": p_full,
            "n_mem": (ans_mask & conf_mem).sum(-1), "n_full": (ans_mask & conf_full).sum(-1),
            "word_logp_mem": logp_mem, "word_logp_full": logp_full}


def memory_rewards(model, tokenizer, trajs: list, threshold: float = THRESHOLD, mask_mode: str = MEM_MASK,
                   think: str = PROBE_THINK, token_budget: int = 8192) -> dict:
    """``p_mem_minus_p_full`` of every round t >= 1 of ``trajs`` whose ``<mem>`` closed (rollout.Trajectory's fields).

    Reads ``tr.golds``, ``tr.prompt_ids`` (system + question + generation prompt) and, per round,
    ``context_ids`` (round_context), ``round_ids`` and ``mem_end`` (its leading ``<mem>...</mem>`` tokens, 0 = none).
    Returns one dict of per-round values, all in the order of ``scored``, the N (trajectory i, round t) pairs:
    ``reward`` (P_mem - P_full), ``p_mem`` / ``p_full`` and ``mask_mem`` / ``mask_full`` (P and its count of
    confident gold words), ``word_logp_mem`` / ``word_logp_full`` (N, W); and ``n`` = N, ``empty_frac`` /
    ``no_signal_frac`` (the share of rounds with a probe, or both, confident on no gold word).
    """
    scored = [(i, t) for i, tr in enumerate(trajs) for t, r in enumerate(tr.rounds) if t >= 1 and r.mem_end > 0]
    N = len(scored)
    templates = {i: answer_template(tokenizer, trajs[i].golds, think) for i, _ in scored}
    rounds = [trajs[i].rounds[t] for i, t in scored]
    round_context = [r.context_ids for r in rounds]
    mem_trajs = [mem_traj(trajs[i].prompt_ids, r.round_ids, r.mem_end) for (i, _), r in zip(scored, rounds)]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = p_mem_minus_p_full(model, round_context, mem_trajs, [templates[i][0] for i, _ in scored],
                             [templates[i][1] for i, _ in scored], pad_id, threshold, mask_mode, token_budget)
    # empty_frac: a probe with no confident answer word on either side; with separate masks that includes a
    # dropped answer (P_full confident, P_mem empty: a strong negative reward). no_signal_frac: NEITHER probe
    # is confident, the only rounds whose reward is 0 by construction
    n_full, n_mem = out["n_full"], out["n_mem"]
    share = lambda flags: float(flags.float().mean()) if N else 0.0
    return {"scored": scored, "reward": out["mem_reward"].tolist(), "n": N,
            "p_mem": out["p_mem"].tolist(), "p_full": out["p_full"].tolist(), "mask_mem": n_mem.tolist(),
            "mask_full": n_full.tolist(), "word_logp_full": out["word_logp_full"],
            "word_logp_mem": out["word_logp_mem"],
            "empty_frac": share((n_full == 0) | (n_mem == 0)), "no_signal_frac": share((n_full == 0) & (n_mem == 0))}
