"""See what RL does: one RL step (or a set of evaluation episodes) as one HTML page, one episode as text.

Three plain functions, fed what a step already holds (nothing here imports ``train.py`` or ``eval.py``):

    record = step_record(trajs, tokenizer, adv_t, mem, adv_m, mem_weight, metrics=m)   # JSON-able dict
    write_page("RUN/viz/step_0040.html", record)     # one self-contained HTML file
    print(format_episode(record["questions"][0], record["questions"][0]["rollouts"][0]))   # 100 columns

The page shows, per question, its G rollouts side by side (one column each, one row per round). Each
round: the context exactly as the policy saw it (``context_ids`` decoded, collapsible), every sampled
token with its background coloured by the advantage it was trained with, the tool result, and the
memory reward's two probes. The advantage is the update's own: per round, the masks ``grpo.collate``
builds (loss mask 1 on the sampled output, the ``<mem>`` span on the round's first ``mem_end`` tokens,
forced prefix included) through ``grpo.token_advantages``, so a token shows

    A_T[i]                   sampled, outside <mem>          A_T = the rollout's outcome advantage
    A_T[i] + w * A_M[i, t]   sampled, inside round t's <mem> A_M = 0 for a round without a memory reward
    not trained              the forced "<mem>" prefix (loss mask 0), a round with no sampled token

Choices of this page:
* Colour: a diverging scale, red < 0 < blue, white at 0, saturated at the page's largest |advantage|
  rounded up to a multiple of 0.5 (``write_page(vmax=...)`` fixes it, e.g. to compare steps); the legend
  prints the scale. A round holds at most a few distinct advantages (A_T, and A_T + w * A_M on its
  ``<mem>``), so a token is ``<span class=cK>`` and the round's element carries colour K and its exact
  value (``--cK``, ``data-cK``): ~30 bytes per token. 8 questions x 8 rollouts sampled from a 1500-step SFT
  policy at K = 1-4: 0.70 MB; every round of every rollout at the limits (16 rounds x 96 tokens): 4.1 MB
  snail, 3.9 MB full context. Hovering a token shows its exact value (the page's only script).
* A context that starts with the previous round's context (full context; snail's round 1) names that part
  (``[round t's context: N characters]``) and shows the rest, so a full-context page grows linearly.
* The ``<mem>`` span is boxed with a dashed line; tokens with loss mask 0 are grey.
* Tokens are decoded one by one in context (a short window before each), so a word-level tokenizer's
  spaces and a BPE's multi-byte characters come out as in the round's text.
* The tool result is the full text (what full context shows); snail context later shows a webpage cut to
  its first ``webpage_chars`` characters, which the next round's context then holds.
* The format verdict is ``outcome_reward``'s (``validate_format``): the rule that failed and the round it
  failed in, whose cell gets a red edge. Per question: mean score, valid count, and the mean / std of its
  memory rewards (the ``std`` pool that A_M normalises by, under ``--mem-adv-norm std``).
* No advantages given (``adv_t=None``, evaluation episodes): tokens are shown uncoloured.
* Under torchrun a rank holds only its own questions' trajectories: the page of rank 0 shows those.
"""
from __future__ import annotations

import argparse
import html
import json
import math
import os
import random
import re
import textwrap

import torch

import data
from grpo import grouped_advantage, memory_advantage, token_advantages
from memory import extract_mem
from reward import memory_rewards, outcome_reward
from models import load_pretrained, pick_device
from rollout import AgentConfig, checkpoint_prompt, parse_action, rollout
from search import SearchTool

THINK_RE = re.compile(r"<think>(.*?)</think>", re.S)
RULE_RE = re.compile(r"^(rule \d+)")
ROUND_RE = re.compile(r"\(round (\d+)\)$")
TOOL_TYPES = ("search_results", "webpage")


# --------------------------------------------------------------------------- the record (plain data)

def token_pieces(tokenizer, ids: list[int], window: int = 4) -> list[str]:
    """The text each token adds, decoded after up to ``window`` tokens before it: ``"".join`` = decode(ids).

    A byte-level BPE splits a character of several bytes over tokens; the part decodes to U+FFFD, so a token
    that leaves a character unfinished adds "" and the token that finishes it adds the character."""
    pieces, start = [], 0               # start: the first token whose text is not out yet
    for k in range(len(ids)):
        a = max(0, start - window)
        now = tokenizer.decode(ids[a:k + 1])
        if now.endswith("\ufffd") and k + 1 < len(ids):
            pieces.append("")
            continue
        before = tokenizer.decode(ids[a:start]) if start > a else ""
        pieces.append(now[len(before):] if now.startswith(before) else tokenizer.decode(ids[start:k + 1]))
        start = k + 1
    return pieces


def round_advantages(adv_t: float | None, adv_m: float, n_prefix: int, mem_end: int, n_out: int,
                     mem_weight: float) -> list[float | None]:
    """Per token of ``prefix + output``: the advantage the update trains it with, None where it trains none."""
    n = n_prefix + n_out
    if adv_t is None or n_out == 0:          # evaluation episodes; a round with no sampled token is no row
        return [None] * n
    loss_mask, mem_adv = torch.zeros(1, n), torch.zeros(1, n)        # (1, T), as grpo.collate lays them out
    loss_mask[0, n_prefix:] = 1
    mem_adv[0, :mem_end] = adv_m
    adv = token_advantages(torch.tensor([adv_t]), mem_adv, loss_mask, mem_weight)[0]
    return [None] * n_prefix + adv[n_prefix:].tolist()


def failed_rule(reason: str) -> str | None:
    """``validate_format``'s reason -> the rule's name (``"rule 6"``), None when it names none."""
    m = RULE_RE.match(reason)
    return m.group(1) if m else None


def tool_results(records) -> list[str | None]:
    """The tool result that followed each round (None after an answer or a malformed round)."""
    out = []
    for r in records[1:]:
        if r.type == "llm_gen":
            out.append(None)
        elif r.type in TOOL_TYPES and out:
            out[-1] = r.text
    return out


def _round_record(tokenizer, rnd, tool: str | None, adv_t: float | None, probe: dict, mem_weight: float) -> dict:
    kind, body = parse_action(rnd.text)
    think = THINK_RE.search(rnd.text)
    ids = rnd.round_ids
    return {"context": tokenizer.decode(rnd.context_ids), "n_context": len(rnd.context_ids),
            "tokens": token_pieces(tokenizer, ids),
            "adv": round_advantages(adv_t, probe.get("adv_m") or 0.0, len(rnd.prefix_ids), rnd.mem_end,
                                    len(rnd.output_ids), mem_weight),
            "n_prefix": len(rnd.prefix_ids), "mem_end": rnd.mem_end, "text": rnd.text,
            "mem": extract_mem(rnd.text), "think": think.group(1).strip() if think else None,
            "action": kind, "action_body": body, "tool": tool,
            **{k: probe.get(k) for k in ("p_full", "p_mem", "mem_reward", "adv_m", "mask_full", "mask_mem")}}


def step_record(trajs: list, tokenizer, adv_t=None, mem: dict | None = None,
                adv_m: dict | None = None, mem_weight: float = 1.0, outcomes: list[dict] | None = None,
                metrics: dict | None = None, title: str = "") -> dict:
    """What one RL step computed, as JSON-able data grouped by question (``group_id``).

    ``trajs``: the step's ``Trajectory`` list; ``adv_t``: A_T per trajectory (N,) or None (evaluation);
    ``mem``: ``reward.memory_rewards``' dict (None: GRPO, or no probes); ``adv_m``: A_M by (trajectory, round)
    (``train.memory_advantages``); ``outcomes``: ``outcome_reward`` per trajectory (computed
    here when None); ``metrics``: the step's metrics row.
    """
    outcomes = outcomes if outcomes is not None else [outcome_reward(t) for t in trajs]
    if len(outcomes) != len(trajs) or (adv_t is not None and len(adv_t) != len(trajs)):
        raise ValueError(f"{len(trajs)} trajectories, {len(outcomes)} outcomes, "
                         f"{'no' if adv_t is None else len(adv_t)} outcome advantages")
    probes: dict[tuple[int, int], dict] = {}           # (trajectory, round) -> its memory reward's numbers
    if mem is not None:
        for r, (i, t) in enumerate(mem["scored"]):
            probes[(i, t)] = {"p_full": float(mem["p_full"][r]), "p_mem": float(mem["p_mem"][r]),
                              "mask_full": int(mem["mask_full"][r]), "mask_mem": int(mem["mask_mem"][r]),
                              "mem_reward": float(mem["reward"][r]),
                              "adv_m": float(adv_m[(i, t)]) if adv_m is not None else None}
    questions: dict[int, dict] = {}
    for i, (traj, out) in enumerate(zip(trajs, outcomes)):
        q = questions.setdefault(traj.group_id, {"group_id": traj.group_id, "question": traj.question,
                                                 "golds": traj.golds, "rollouts": []})
        a_t = float(adv_t[i]) if adv_t is not None else None
        tools = tool_results(traj.records) if traj.records else [None] * len(traj.rounds)
        tools += [None] * (len(traj.rounds) - len(tools))
        reason = out.get("reason", "ok")
        fail_round = ROUND_RE.search(reason)
        q["rollouts"].append({
            "index": i, "answer": traj.answer, "score": float(out["score"]), "em": float(out["em"]),
            "f1": float(out["f1"]), "valid": bool(out["valid"]), "reason": reason,
            "rule": failed_rule(reason) if not out["valid"] else None,
            "fail_round": int(fail_round.group(1)) if fail_round else None, "adv_t": a_t,
            "rounds": [_round_record(tokenizer, rnd, tools[t], a_t, probes.get((i, t), {}), mem_weight)
                       for t, rnd in enumerate(traj.rounds)]})
    return {"title": title, "metrics": dict(metrics or {}), "mem_weight": mem_weight,
            "has_adv": adv_t is not None, "has_mem": mem is not None,
            "questions": [questions[g] for g in sorted(questions)]}


# --------------------------------------------------------------------------- the page

CSS = """body{font:13px/1.4 system-ui,sans-serif;margin:12px;color:#111;background:#fafafa}
h1{font-size:18px;margin:0 0 6px}h2{font-size:15px;margin:18px 0 4px}
.mt{font:12px monospace;max-width:1100px}.mt span{display:inline-block;margin:0 16px 2px 0}
.lg{margin:8px 0;font-size:12px}.bar{display:inline-block;width:300px;height:12px;vertical-align:middle;
border:1px solid #999;background:linear-gradient(90deg,rgb(222,45,38),#fff,rgb(49,130,189))}
.tk{display:inline-flex;justify-content:space-between;width:300px;font:11px monospace}
.sc{overflow-x:auto}table.g{border-collapse:collapse}table.g td,table.g th{vertical-align:top;
border:1px solid #ccc;padding:4px;width:330px;min-width:330px;max-width:330px;background:#fff}
table.g th{font-weight:normal;text-align:left;background:#f0f0f0}.ok{color:#161}.bad{color:#b00}
td.fail{border-left:3px solid #b00}.rh{font-weight:bold;font-size:12px}
summary{cursor:pointer;color:#555;font-size:11px}pre{white-space:pre-wrap;overflow-wrap:anywhere;
font:11px monospace;margin:2px 0;background:#f4f4f4;max-height:300px;overflow:auto}
.t{white-space:pre-wrap;overflow-wrap:anywhere;font:12px monospace;margin:3px 0}
.t span{border-right:1px solid rgba(0,0,0,.12)}.n{color:#999}.m{outline:1px dashed #333;outline-offset:1px}
.c0{background:var(--c0)}.c1{background:var(--c1)}.c2{background:var(--c2)}.c3{background:var(--c3)}
.tl{font:11px monospace;color:#335;background:#eef2f8;white-space:pre-wrap;overflow-wrap:anywhere;
margin:2px 0;max-height:120px;overflow:auto}.pr{font:11px monospace;color:#333}
#hv{position:fixed;right:8px;bottom:8px;background:#ffe;border:1px solid #aa8;padding:3px 8px;font:12px monospace}
"""
# hovering a token shows its exact advantage (the page's only script)
JS = """document.addEventListener('mouseover',e=>{const s=e.target,r=s.closest('.t'),
k=(s.className.match(/c\\d/)||[])[0];if(r&&s!==r&&s.className!='m')document.getElementById('hv').textContent=
JSON.stringify(s.textContent)+(k?' advantage '+r.dataset[k]:' not trained');});"""
NEG, POS = (222, 45, 38), (49, 130, 189)


def colour(v: float, vmax: float) -> str:
    """Diverging colour of advantage ``v``: white at 0, red at -vmax, blue at +vmax (clipped)."""
    t = max(-1.0, min(1.0, v / vmax))
    end = POS if t > 0 else NEG
    return "#" + "".join(f"{round(255 + (c - 255) * abs(t)):02x}" for c in end)


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _num(x, fmt: str = "+.3f") -> str:
    return "–" if x is None else format(x, fmt)


def signed(x: float) -> str:
    """A signed number that stays readable near 0 (a memory reward of -2e-07 is not "-0.000")."""
    return f"{x:+.3f}" if x == 0 or abs(x) >= 0.001 else f"{x:+.1e}"


def page_scale(record: dict) -> float:
    """The colour scale: the largest |advantage| on the page rounded up to a multiple of 0.5 (at least 0.5)."""
    top = max((abs(a) for q in record["questions"] for ro in q["rollouts"] for rd in ro["rounds"]
               for a in rd["adv"] if a is not None), default=0.0)
    return max(0.5, math.ceil(top * 2) / 2)


def _tokens_html(rd: dict, vmax: float, has_adv: bool) -> str:
    """One round's tokens: ``<span class=cK>`` each (K = the round's K-th distinct advantage), <mem> boxed;
    an untrained token is grey, and plain on a page without advantages (evaluation)."""
    values = sorted({a for a in rd["adv"] if a is not None})
    if len(values) > 4:
        raise ValueError(f"a round with {len(values)} distinct advantages (the CSS defines 4 colours)")
    key = {a: f"c{k}" for k, a in enumerate(values)}
    attrs = "".join(f' data-c{k}="{a!r}"' for k, a in enumerate(values))
    style = ";".join(f"--c{k}:{colour(a, vmax)}" for k, a in enumerate(values))
    spans = []
    for j, (piece, a) in enumerate(zip(rd["tokens"], rd["adv"])):
        cls = f" class={key[a]}" if a is not None else " class=n" if has_adv else ""
        span = f"<span{cls}>{_e(piece)}</span>"
        if j == 0 and rd["mem_end"] > 0:
            span = "<span class=m>" + span
        if j == rd["mem_end"] - 1:
            span += "</span>"
        spans.append(span)
    return f'<div class=t{attrs} style="{style}">{"".join(spans)}</div>'


def _context_html(context: str, prev: str | None, t: int) -> str:
    """The round's context; the part that repeats the previous round's context (full context, and snail's
    round 1) is named, not repeated: without that a full-context page of long episodes passes 5 MB."""
    if prev and context.startswith(prev):
        return f"<span class=n>[round {t - 1}'s context: {len(prev)} characters]</span>{_e(context[len(prev):])}"
    return _e(context)


def _probe_html(rd: dict, t: int, has_mem: bool) -> str:
    """The round's memory reward: P_full, P_mem, r_mem = P_mem - P_full (gated), A_M; or why it has none."""
    if rd.get("p_full") is None:
        why = "the first round" if t == 0 else "no &lt;/mem&gt;" if has_mem else "GRPO"
        return f"<div class='pr n'>no memory reward ({why})</div>"
    return (f'<div class=pr data-p-full="{rd["p_full"]!r}" data-p-mem="{rd["p_mem"]!r}" '
            f'data-mem-reward="{rd["mem_reward"]!r}" data-adv-m="{rd["adv_m"]!r}">'
            f'P_full {rd["p_full"]:.3f} · P_mem {rd["p_mem"]:.3f} · r_mem <b>{signed(rd["mem_reward"])}</b><br>'
            f'A_M <b>{_num(rd["adv_m"])}</b> <span class=n>· confident gold words {rd["mask_full"]} / {rd["mask_mem"]}'
            f'</span></div>')


def _round_html(rd: dict, prev: str | None, i: int, t: int, fail: bool, vmax: float, has: dict) -> str:
    """One round's cell: action, context (collapsed), coloured tokens, tool result, memory reward."""
    head = f'round {t} · {_e(rd["action"] or "no action")}' + (" <span class=bad>✗ format fails here</span>"
                                                                    if fail else "")
    tool = f'<div class=tl>{_e(rd["tool"])}</div>' if rd["tool"] else ""
    return (f'<td class="r{" fail" if fail else ""}" data-traj={i} data-round={t}><div class=rh>{head}</div>'
            f'<details><summary>context · {rd["n_context"]} tokens</summary>'
            f'<pre>{_context_html(rd["context"], prev, t)}</pre></details>'
            f'{_tokens_html(rd, vmax, has["adv"])}{tool}{_probe_html(rd, t, has["mem"])}</td>')


def _rollout_head(ro: dict, g: int) -> str:
    verdict = ('<span class=ok>✓ format ok</span>' if ro["valid"] else
               f'<span class=bad>✗ {_e(ro["reason"])}</span>')
    return (f'<th data-score="{ro["score"]!r}" data-adv-t="{ro["adv_t"]!r}" data-valid="{int(ro["valid"])}" '
            f'data-rule="{_e(ro["rule"] or "")}"><b>rollout {g + 1}</b> '
            f'<span class=n>(trajectory {ro["index"]})</span><br>score <b>{ro["score"]:.3f}</b> · em {ro["em"]:.0f} · '
            f'f1 {ro["f1"]:.3f} · A_T <b>{_num(ro["adv_t"])}</b><br>'
            f'answer: {_e(ro["answer"]) if ro["answer"] is not None else "<i>none</i>"}<br>{verdict}</th>')


def _question_html(q: dict, n: int, vmax: float, has: dict) -> str:
    """One question: its rollouts side by side (a column each), a row per round."""
    ros = q["rollouts"]
    rewards = [rd["mem_reward"] for ro in ros for rd in ro["rounds"] if rd.get("mem_reward") is not None]
    pool = ""
    if rewards:
        mean = sum(rewards) / len(rewards)
        std = (sum((x - mean) ** 2 for x in rewards) / (len(rewards) - 1)) ** 0.5 if len(rewards) > 1 else 0.0
        pool = f" · {len(rewards)} memory rewards, mean {signed(mean)}, std {signed(std)[1:]}"
    golds = " ; ".join(" | ".join(g) for g in q["golds"])
    rows = ["<tr>" + "".join(_rollout_head(ro, g) for g, ro in enumerate(ros)) + "</tr>"]
    for t in range(max((len(ro["rounds"]) for ro in ros), default=0)):
        cells = [_round_html(ro["rounds"][t], ro["rounds"][t - 1]["context"] if t else None, ro["index"], t,
                             ro["fail_round"] == t, vmax, has) if t < len(ro["rounds"]) else "<td></td>"
                 for ro in ros]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    mean_score = sum(ro["score"] for ro in ros) / len(ros)
    return (f'<section id=q{n}><h2>question {n + 1} <span class=n>(group {q["group_id"]})</span>: '
            f'{_e(q["question"])}</h2>'
            f'<div>gold: <b>{_e(golds)}</b> · mean score {mean_score:.3f} · '
            f'format ok {sum(ro["valid"] for ro in ros)} / {len(ros)}{pool}</div>'
            f'<div class=sc><table class=g>{"".join(rows)}</table></div></section>')


def _metric(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else _e(v)


def page_html(record: dict, vmax: float | None = None) -> str:
    """The whole page as one string (``write_page`` writes it)."""
    vmax = vmax or page_scale(record)
    metrics = "".join(f"<span>{_e(k)} <b>{_metric(v)}</b></span>" for k, v in record["metrics"].items())
    w = record["mem_weight"]
    legend = (f'<div class=lg>token background = the advantage it was trained with: A_T, and A_T + w·A_M '
              f'(w = {w:g}) inside the <span class=m>dashed &lt;mem&gt; span</span>; '
              f'<span class=n>grey = not trained</span> (forced prefix). Hover a token for its value.<br>'
              f'<span class=bar></span><br><span class=tk>' +
              "".join(f"<span>{x:+.2f}</span>" for x in (-vmax, -vmax / 2, 0.0, vmax / 2, vmax)) + "</span></div>"
              if record["has_adv"] else '<div class=lg>no advantages: evaluation episodes, shown uncoloured.</div>')
    has = {"adv": record["has_adv"], "mem": record["has_mem"]}
    body = "".join(_question_html(q, n, vmax, has) for n, q in enumerate(record["questions"]))
    title = record["title"] or "MemPO step"
    return (f'<!doctype html><html><head><meta charset=utf-8><title>{_e(title)}</title><style>{CSS}</style></head>'
            f'<body><h1>{_e(title)}</h1><div class=mt>{metrics}</div>{legend}{body}'
            f'<div id=hv>hover a token</div><script>{JS}</script></body></html>')


def write_page(path: str, record: dict, vmax: float | None = None) -> str:
    """Write ``record`` as one self-contained HTML file (inline CSS, one tiny script, no URL); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page_html(record, vmax))
    return path


# --------------------------------------------------------------------------- one episode as text

def format_episode(question: dict, rollout: dict, width: int = 100) -> str:
    """One rollout of ``step_record``'s ``question`` as plain text, round by round, within ``width`` columns."""
    lines: list[str] = []

    def put(label: str, text) -> None:
        head = f"  {label:<7}: "
        lines.extend(textwrap.wrap(str(text), width, initial_indent=head, subsequent_indent=" " * len(head),
                                   drop_whitespace=True) or [head.rstrip()])

    golds = " ; ".join(" | ".join(g) for g in question["golds"])
    lines.append(f"== trajectory {rollout['index']} (question group {question['group_id']}) ".ljust(width, "="))
    lines += textwrap.wrap(f"question: {question['question']}", width, subsequent_indent="  ")
    lines += textwrap.wrap(f"gold: {golds or '(none given)'}   answer: {rollout['answer']}", width,
                           subsequent_indent="  ")
    verdict = "format ok" if rollout["valid"] else f"format FAILS {rollout['reason']}"
    score = (f"score {rollout['score']:.3f}  em {rollout['em']:.0f}  f1 {rollout['f1']:.3f}  " if golds else
             "no gold to score against  ")
    lines += textwrap.wrap(f"outcome: {score}{verdict}", width, subsequent_indent="  ")
    for t, rd in enumerate(rollout["rounds"]):
        lines.append(f"-- round {t} " + "-" * (width - 10 - len(str(t))))
        put("memory", rd["mem"] if rd["mem"] is not None else "(no <mem>)")
        put("think", rd["think"] if rd["think"] is not None else "(no <think>)")
        if rd["action"]:
            put("action", f"<{rd['action']}> {rd['action_body']} </{rd['action']}>")
        else:
            wrote = rd["text"].split("</think>", 1)[-1].strip() if rd["think"] is not None else rd["text"]
            put("action", f"(none: the round ends without an action tag) it wrote: {wrote}")
        if rd["tool"]:
            put("result", rd["tool"])
        if rd.get("p_full") is not None:
            put("probe", f"P_full {rd['p_full']:.3f}  P_mem {rd['p_mem']:.3f}  "
                         f"memory reward {signed(rd['mem_reward'])}")
        else:
            put("probe", "none (the first round)" if t == 0 else "none (no </mem>, or no probes computed)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- demo: one step's page, no update

def demo_step(model, tokenizer, system_prompt: str, questions: int = 8, group: int = 8, seed: int = 0,
              objectives: tuple[int, ...] = (1, 2, 3, 4), max_turns: int = 16, max_new_tokens: int = 96) -> dict:
    """What ``train.rl_step`` computes before its update (default settings), on a fresh embedded world."""
    rng = random.Random(seed)
    world = data.make_world(rng.randrange(10**9))
    tasks = [data.make_task(world, rng, rng.choice(objectives), (1, 3)) for _ in range(questions)]
    agent = AgentConfig(system_prompt=system_prompt, max_turns=max_turns, max_new_tokens=max_new_tokens,
                        temperature=1.0)
    trajs = rollout(model, tokenizer, tasks, group, SearchTool(world.docs), agent,
                    torch.Generator(device=model.device).manual_seed(seed))
    outs = [outcome_reward(t) for t in trajs]
    gids = torch.tensor([t.group_id for t in trajs])
    adv_t = grouped_advantage(torch.tensor([o["score"] for o in outs]), gids)
    mem = memory_rewards(model, tokenizer, trajs)
    question = torch.tensor([trajs[i].group_id for i, _ in mem["scored"]])
    adv = memory_advantage(torch.tensor(mem["reward"], dtype=torch.float64), question)
    adv_m = dict(zip(mem["scored"], adv.tolist()))
    flat = mem["reward"]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
    metrics = {"score": mean([o["score"] for o in outs]), "f1": mean([o["f1"] for o in outs]),
               "valid": mean([float(o["valid"]) for o in outs]), "turns": mean([len(t.rounds) for t in trajs]),
               "mem_reward": mean(flat), "p_full": mean(mem["p_full"]), "p_mem": mean(mem["p_mem"]),
               "mem_rounds": len(flat), "empty_frac": mem["empty_frac"]}
    return step_record(trajs, tokenizer, adv_t, mem, adv_m, 1.0, outs, metrics)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="one RL step's rollouts, rewards and advantages as an HTML page "
                                            "(no update): the page train.py --viz-every writes")
    p.add_argument("--checkpoint", default="",
                   help="checkpoint folder (e.g. RUN/sft); default: an untrained tiny model")
    p.add_argument("--out", default="viz_demo.html", help="HTML file to write")
    p.add_argument("--questions", type=int, default=8, help="questions (B)")
    p.add_argument("--group", type=int, default=8, help="rollouts per question (G)")
    p.add_argument("--seed", type=int, default=0, help="seed of the world, the questions and the sampling")
    p.add_argument("--objectives", type=int, nargs="+", default=[1, 2, 3, 4], help="objective counts K to draw from")
    p.add_argument("--json", default="", help="also write the record as JSON here")
    p.add_argument("--show", type=int, default=0, help="print this many episodes as text (format_episode)")
    args = p.parse_args(argv)
    if args.checkpoint:
        model, tokenizer = load_pretrained(args.checkpoint, pick_device("auto"))
        model, prompt = model.eval(), checkpoint_prompt(args.checkpoint)
    else:
        tokenizer, prompt = data.build_tokenizer(), data.SYSTEM_PROMPT
        model = data.build_tiny_model(tokenizer).eval()
    record = demo_step(model, tokenizer, prompt, args.questions, args.group, args.seed, tuple(args.objectives))
    record["title"] = f"one RL step, no update: {args.checkpoint or 'an untrained tiny model'} (seed {args.seed})"
    write_page(args.out, record)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f)
    for q in record["questions"][:args.show]:
        print(format_episode(q, q["rollouts"][0]), end="\n\n")
    n = sum(len(q["rollouts"]) for q in record["questions"])
    print(json.dumps({"page": args.out, "bytes": os.path.getsize(args.out), "questions": len(record["questions"]),
                      "rollouts": n}))


if __name__ == "__main__":
    data.exit_on_bad_input(main)         # a missing or broken input: one line, exit status 2
