"""SFT trajectories from a QA file and a retriever: the chat ``messages`` JSONL that ``--sft-data`` reads.

A teacher plays each question against the real search tool (``--corpus`` / ``--search-url``) in the round protocol;
an episode is written only when the format rules pass and ``reward.outcome_reward`` scores 1 (rejection sampling,
``--samples`` tries). Teachers: ``gold``, a script, no model: it searches the question, then each objective still
open, writes into ``<mem>`` the retrieved words around a gold alias (EM's normalisation) and answers those aliases;
a question no result answers is dropped, and a round the rules reject is a bug that stops the run. A model folder:
``rollout.rollout`` over the engine with the folder's prompt. ``http(s)://host:port/v1``: an OpenAI-compatible
``/chat/completions`` (vLLM, SGLang, ``transformers serve``) prompted with ``PROTOCOL_PROMPT`` and two gold episodes;
its loop, ``play_endpoint``, is its own because ``rollout`` runs token ids through the engine where an endpoint
takes messages and returns text, and it puts back the closing tag a server cuts as a stop string. A failed call
stops the run in one line naming the URL, no retries: the file resumes. Rows keep every tool result in full (the
SFT renders snail or full from them), ``golden_answers`` (its probe rows), ``index`` (resuming), ``teacher`` and
``context``. The same command appends after the last question written (a torn last line is dropped); sampling is
seeded per question, or per ``--batch`` for a model, which a rerun replays, so it writes what one run writes.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

import data
from checkpoint import writing
from flags import Accepts, FlagParser
from memory import Record, prepare_prompt, tool_record
from reward import TAG_RE, normalize_answer, outcome_reward
from rollout import PROTOCOL_PROMPT, STOP_STRINGS, AgentConfig, Round, Trajectory, cut_at_stop, parse_action, rollout
from search import SEARCH_FAILED, Retriever, SearchError, SearchTool, describe, information, open_search

COMPOSED = "Answer the following questions: "          # data.compose_tasks's prefix
SENTENCE_END = (".", "!", "?")


class TeacherError(Exception):
    """The teacher endpoint gave no valid answer; the message names the URL. Not an OSError or RuntimeError, so
    ``checkpoint.writing`` (a full disk) does not take it for a failed write."""


# --------------------------------------------------------------------------- episodes and rows

def episode(task: data.Task, records: list[Record], answer: str | None) -> Trajectory:
    """A played episode as ``rollout`` returns one, its rounds read off ``records`` (no ids: text is what is kept)."""
    rounds = [Round([], [], [], r.text, 0, parse_action(r.text)[0]) for r in records if r.type == "llm_gen"]
    return Trajectory(task.question, task.golds, 0, [], records, rounds, answer, True)


def right(traj: Trajectory) -> bool:
    """Format rules pass, every objective answered right, and no search failed on the way."""
    scores = outcome_reward(traj)
    return scores["valid"] and scores["score"] == 1.0 and all(r.text != SEARCH_FAILED for r in traj.records)


def row(traj: Trajectory, index: int, system_prompt: str, teacher: str, context: str) -> dict:
    """One line of the file: the episode as chat messages, tool results in full."""
    roles = {"prompt": "user", "llm_gen": "assistant", "search_results": "tool", "webpage": "tool"}
    messages = [{"role": "system", "content": system_prompt}]
    messages += [{"role": roles[r.type], "content": r.text} for r in traj.records]
    return {"messages": messages, "golden_answers": traj.golds, "index": index, "teacher": teacher,
            "context": context}


# --------------------------------------------------------------------------- the gold-guided teacher

def clean(text: str) -> str:
    """``text`` without protocol tags and on one line, so a passage or a question quoted in a round breaks no rule."""
    return " ".join(TAG_RE.sub(" ", text).split())


def objective_queries(question: str, k: int) -> list[str]:
    """One search query per objective: a composed question's parts, the embedded world's numbered parts, else
    the question itself."""
    if question.startswith(COMPOSED):
        parts = question[len(COMPOSED):].split(" ; ")
    else:
        parts = re.findall(r"\d+ : (.*?) \?", question)
    parts = [clean(p) for p in parts]
    return parts if len(parts) == k and all(parts) else [clean(question)] * k


def find_alias(aliases: list[str], text: str, window: int) -> tuple[str, str] | None:
    """(alias, snippet): the first usable alias whose normalised words occur in ``text``'s, and the words around
    them to a sentence end, at most ``window`` a side; None when ``text`` holds none."""
    for line in text.split("\n"):            # a corpus line is a title or a paragraph: no snippet spans two
        words = clean(line).split()
        kept = [(i, n) for i, n in enumerate(normalize_answer(w) for w in words) if n]
        norm = [n for _, n in kept]
        for alias in aliases:
            a = normalize_answer(alias).split()
            if not a or ";" in alias or TAG_RE.search(alias):     # ";" splits objectives in an answer
                continue
            at = next((i for i in range(len(norm) - len(a) + 1) if norm[i:i + len(a)] == a), None)
            if at is None:
                continue
            start, end = kept[at][0], kept[at + len(a) - 1][0] + 1
            lo = start
            while lo > max(0, start - window) and not words[lo - 1].endswith(SENTENCE_END):
                lo -= 1
            hi = end
            while hi < min(len(words), end + window) and not words[hi - 1].endswith(SENTENCE_END):
                hi += 1
            return " ".join(alias.split()), " ".join(words[lo:hi])
    return None


def gold_memory(queries: list[str], found: dict[int, tuple[str, str, str]]) -> str:
    """The ``<mem>`` of a gold episode: each objective, and what was found for it (the words, the document id)."""
    return " | ".join(f"{k + 1}. {q}: " + (f"{found[k][1]} (document {found[k][2]})" if k in found else "not found yet")
                      for k, q in enumerate(queries))


def gold_episode(task: data.Task, tool: Retriever, window: int = 30) -> Trajectory | None:
    """The gold-guided teacher's episode, or None when a search failed or no result holds an objective's answer."""
    queries = objective_queries(task.question, len(task.golds))
    records, found, searched = [Record("prompt", task.question)], {}, []
    while len(found) < len(task.golds):
        open_k = [k for k in range(len(task.golds)) if k not in found and queries[k] not in searched]
        query = clean(task.question.removeprefix(COMPOSED)) if not searched else queries[open_k[0]] if open_k else None
        if query is None:
            return None
        why = "search the question" if not searched else f"search question {open_k[0] + 1}"
        text = f"<mem> {gold_memory(queries, found)} </mem> <think> {why} </think> <search> {query} </search>"
        searched.append(query)
        try:
            docs = [d for d, _ in tool.retrieve([query], tool.top_k)[0]]
        except SearchError as e:
            tool.failures += 1
            print(f"search: {e}", file=sys.stderr)
            return None
        records += [Record("llm_gen", text), tool_record("search_results", information(docs))]
        for k in range(len(task.golds)):
            for d in docs if k not in found else []:
                hit = find_alias(task.golds[k], d["contents"], window)
                if hit is not None:
                    found[k] = (*hit, clean(str(d["id"])))
                    break
    answer = " ; ".join(found[k][0] for k in range(len(task.golds)))
    records.append(Record("llm_gen", f"<mem> {gold_memory(queries, found)} </mem> <think> my memory holds every "
                                     f"answer </think> <answer> {answer} </answer>"))
    traj = episode(task, records, answer)
    scores = outcome_reward(traj)
    if not (scores["valid"] and scores["score"] == 1.0):     # the script writes the protocol: this is a bug
        raise AssertionError(f"the gold teacher wrote an episode it may not keep ({scores['reason']}, score "
                             f"{scores['score']}): {task.question!r}")
    return traj


# --------------------------------------------------------------------------- the endpoint teacher

EXAMPLE_DOCS = [{"id": "12", "contents": "Hamlet\nHamlet is a tragedy written by William Shakespeare around 1600."},
                {"id": "40", "contents": "Eiffel Tower\nThe Eiffel Tower is a wrought-iron tower in Paris, France."},
                {"id": "7", "contents": "Paris\nParis is the capital and largest city of France."},
                {"id": "3", "contents": "Macbeth\nMacbeth is a tragedy by William Shakespeare set in Scotland."}]
EXAMPLE_TASKS = [data.Task("who wrote Hamlet?", [["William Shakespeare", "Shakespeare"]]),
                 data.Task(COMPOSED + "in which city is the Eiffel Tower? ; where is Macbeth set?",
                           [["Paris"], ["Scotland"]])]


def endpoint_prompt() -> str:
    """``PROTOCOL_PROMPT`` and two gold episodes on a four-document collection, as examples of the rounds."""
    tool, shots = SearchTool(EXAMPLE_DOCS), []
    for task in EXAMPLE_TASKS:
        traj = gold_episode(task, tool)
        shots.append("\n".join(("Question: " if r.type == "prompt" else "You: " if r.type == "llm_gen" else "Result: ")
                               + r.text for r in traj.records))
    return PROTOCOL_PROMPT + "\n\nTwo examples:\n\n" + "\n\n".join(shots)


def close_action(text: str) -> str:
    """``text`` with the closing tag of its last opened action put back, where a server cut it as a stop string."""
    opened = list(re.finditer(r"<(search|access|answer)>", text))
    if opened and f"</{opened[-1].group(1)}>" not in text[opened[-1].end():]:
        return text.rstrip() + f" </{opened[-1].group(1)}>"
    return text


class ChatEndpoint:
    """An OpenAI-compatible server: ``GET /models`` names its model, ``POST /chat/completions`` writes a round."""

    def __init__(self, url: str, model: str = "", timeout: float = 300.0):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.model = model or self.call("/models", None, lambda r: str(r["data"][0]["id"]))

    def call(self, path: str, body: dict | None, read):
        """One request -> ``read(its JSON)``; any failure (``read``'s too) is a ``TeacherError`` naming the URL."""
        req = urllib.request.Request(self.url + path, None if body is None else json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return read(json.loads(r.read()))
        except urllib.error.HTTPError as e:
            why = f"HTTP {e.code} ({' '.join(e.read().decode('utf-8', 'replace').split())[:160]})"
        except (OSError, http.client.HTTPException) as e:
            why = describe(e)
        except (ValueError, KeyError, IndexError, TypeError) as e:
            why = f"not an OpenAI-compatible reply ({type(e).__name__}: {e})"
        raise TeacherError(f"teacher {self.url + path}: {why}")

    def complete(self, messages: list[dict], agent: AgentConfig, seed: int) -> str:
        """The server's round for ``messages``, cut at the first closing action tag."""
        text = self.call("/chat/completions", {
            "model": self.model, "messages": messages, "max_tokens": agent.max_new_tokens, "seed": seed,
            "temperature": agent.temperature, "top_p": agent.top_p, "stop": list(STOP_STRINGS)},
            lambda r: str(r["choices"][0]["message"]["content"] or ""))
        return cut_at_stop(close_action(text.strip()))


def play_endpoint(client: ChatEndpoint, task: data.Task, tool: Retriever, agent: AgentConfig, seed: int) -> Trajectory:
    """One episode of ``task`` with the endpoint writing every round: rollout's loop, on messages."""
    keep = None if agent.context == "full" else agent.keep_rounds
    records, answer = [Record("prompt", task.question)], None
    for turn in range(agent.max_turns):
        text = client.complete(prepare_prompt(records, agent.system_prompt, keep), agent, seed + turn)
        kind, body = parse_action(text)
        records.append(Record("llm_gen", text))
        if kind == "search":
            records.append(tool_record("search_results", tool.search(body), agent.webpage_chars))
        elif kind == "access":
            records.append(tool_record("webpage", tool.access(body), agent.webpage_chars))
        else:
            answer = body if kind == "answer" else None
            break
    return episode(task, records, answer)


# --------------------------------------------------------------------------- the run

def teacher_of(args, tool: Retriever):
    """(system prompt, ``teach(chunk of (index, task))`` -> one kept episode or None per question in order, whether
    a resumed run must replay the whole ``--batch`` it stopped in: a model teacher's samples depend on it)."""
    agent = AgentConfig(system_prompt=PROTOCOL_PROMPT, context=args.context, max_turns=args.max_turns,
                        max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    if args.teacher == "gold":
        return PROTOCOL_PROMPT, lambda chunk: (gold_episode(task, tool, args.snippet_words) for _, task in chunk), False
    if re.match(r"https?://", args.teacher):
        client = ChatEndpoint(args.teacher, args.teacher_model, args.timeout)
        agent.system_prompt = endpoint_prompt()

        def play(item: tuple[int, data.Task]) -> Trajectory | None:
            i, task = item
            tries = (play_endpoint(client, task, tool, agent, (args.seed * 1_000_003 + i) * 1000 + 100 * s)
                     for s in range(args.samples))
            return next((t for t in tries if right(t)), None)

        def teach(chunk):                 # the chunk's questions in parallel: a server batches what it is sent
            with ThreadPoolExecutor(len(chunk)) as pool:
                try:
                    yield from pool.map(play, chunk)
                except BaseException:
                    pool.shutdown(cancel_futures=True)
                    raise
        return agent.system_prompt, teach, False
    import eval as evaluate                   # loading a model: only this teacher needs it
    from models import pick_device
    model, tokenizer, agent.system_prompt = evaluate.load(args.teacher, pick_device(args.device))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    def teach(chunk):
        gen = torch.Generator(model.device).manual_seed(args.seed * 1_000_003 + chunk[0][0])
        with torch.no_grad():
            trajs = rollout(model, tokenizer, [t for _, t in chunk], args.samples, tool, agent, gen)
        for q in range(len(chunk)):
            yield next((t for t in trajs[q * args.samples:(q + 1) * args.samples] if right(t)), None)
    return agent.system_prompt, teach, True


def resume(path: str, tasks: list[data.Task]) -> tuple[int, int]:
    """(next question, episodes kept) of an earlier run's ``path``; a torn last line (a kill) is cut off first."""
    if not os.path.exists(path):
        return 0, 0
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw.split(b"\n")
    if lines[-1]:                                              # no newline at the end: torn by a kill
        with open(path, "r+b") as f:
            f.truncate(len(raw) - len(lines[-1]))
    rows = []
    for n, line in enumerate(lines[:-1], 1):
        try:
            r = json.loads(line) if line.strip() else None
        except ValueError:
            r = {}
        if r is None:
            continue
        i = r.get("index") if isinstance(r, dict) else None
        if not isinstance(i, int) or not 0 <= i < len(tasks) or r["messages"][1]["content"] != tasks[i].question:
            raise data.DataError(f"{path}:{n}: not an episode of this QA file's question {i}; give another --out")
        rows.append(r)
    return (rows[-1]["index"] + 1 if rows else 0), len(rows)


def parse_args(argv=None):
    p = FlagParser(description="Write SFT trajectories (chat messages JSONL for --sft-data) from a QA file.")
    p.add_argument("--data", required=True, help="QA file, JSONL or parquet: question, golden_answers")
    p.add_argument("--corpus", default="", help="corpus JSONL (id, contents) or an index folder (search.py index)")
    p.add_argument("--search-url", default="", help="a Search-R1 /retrieve server instead of --corpus")
    p.add_argument("--out", required=True, help="output JSONL; an existing one is continued")
    p.add_argument("--teacher", default="gold", help="gold | a model or run folder | http://host:port/v1 endpoint")
    p.add_argument("--teacher-model", default="", help="the endpoint's model name (default: its first /models)")
    p.add_argument("--context", type=Accepts(str, choices=("snail", "full")), default="snail",
                   help="what a model teacher sees each round (the gold teacher's rounds are the same)")
    p.add_argument("--samples", type=Accepts(int, min=1), default=4, help="tries per question for a model teacher")
    p.add_argument("--compose", type=Accepts(int, min=1), default=1, help="join K questions into one (MEM1)")
    p.add_argument("--max-turns", type=Accepts(int, min=1), default=16, help="rounds per episode")
    p.add_argument("--max-new-tokens", type=Accepts(int, min=1), default=512, help="tokens per round")
    p.add_argument("--temperature", type=Accepts(float, min=0), default=0.7, help="a model teacher's sampling")
    p.add_argument("--top-k", type=Accepts(int, min=1), default=3, help="documents per search")
    p.add_argument("--snippet-words", type=Accepts(int, min=1), default=30,
                   help="gold teacher: words kept either side of the answer in <mem>, to a sentence end")
    p.add_argument("--batch", type=Accepts(int, min=1), default=16, help="questions per engine call / in flight")
    p.add_argument("--timeout", type=Accepts(float, above=0), default=300.0, help="seconds per endpoint call")
    p.add_argument("--device", default="auto", help="a model teacher's device")
    p.add_argument("--seed", type=Accepts(int, unbounded=True), default=0, help="sampling and --compose seed")
    args = p.parse_args(argv)
    if bool(args.corpus) == bool(args.search_url):
        p.error("give one of --corpus and --search-url")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    tasks = data.load_qa(args.data)
    if args.compose > 1:
        tasks = data.compose_tasks(tasks, args.compose, args.seed)
    tool = open_search(args.corpus, args.search_url, args.top_k)
    start, kept = resume(args.out, tasks)
    numbered, bar = list(enumerate(tasks)), None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    try:
        system_prompt, teach, whole_batches = teacher_of(args, tool)
        bar = tqdm(total=len(tasks), initial=start, desc="trajectories", unit="question")
        with writing(args.out), open(args.out, "a", encoding="utf-8") as f:
            first = start - start % args.batch        # a model teacher replays the batch it was in: same samples
            for b in range(first, len(tasks), args.batch):
                chunk = numbered[b if whole_batches else max(b, start):b + args.batch]
                for (i, _), traj in zip(chunk, teach(chunk)):
                    if i < start:
                        continue
                    if traj is not None:
                        f.write(json.dumps(row(traj, i, system_prompt, args.teacher, args.context)) + "\n")
                        f.flush()
                        kept += 1
                    bar.update(1)
                    bar.set_postfix(kept=f"{kept / (i + 1):.2f}")
    except TeacherError as e:
        if bar is not None:
            bar.close()
        print(f"error: {e} (kept so far: {kept} in {args.out}; the same command continues)", file=sys.stderr)
        sys.exit(2)
    bar.close()
    if tool.failures:
        print(f"search: {tool.failures} searches failed; their episodes are not kept", file=sys.stderr)
    print(f"kept {kept} of {len(tasks)} ({kept / len(tasks):.0%})")


if __name__ == "__main__":
    data.exit_on_bad_input(main)         # a missing or broken input: one line, exit status 2
