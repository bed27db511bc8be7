"""The Hugging Face path with a real checkpoint folder built offline: a tiny random Qwen2 (GQA) and a
byte-level BPE tokenizer shaped like Qwen2.5's (tags several tokens, ChatML), saved with
``save_pretrained`` and loaded back with ``AutoModelForCausalLM`` / ``AutoTokenizer``.

Covers: stop strings however the tokens split them (a scripted real module forcing the tokens), ids
in = ids out on BPE, the answer template and ``<mem>`` span on BPE, fp32 master weights under bf16
autocast, train / eval / resume / SFT-from-file on the folder, data-file errors, MEM1 composition and
the exported world files."""
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

import data
import eval as ev
import grpo
import sft
import train
from engine import generate, left_pad, stop_strings
from memory import mem_token_end
from reward import answer_template
from rollout import AgentConfig, PROTOCOL_PROMPT, STOP_STRINGS, checkpoint_prompt, parse_action, rollout, run_episodes
from search import SearchTool

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return data.save_random_checkpoint(str(tmp_path_factory.mktemp("qwen") / "model"))


@pytest.fixture(scope="module")
def real(folder):
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A QA file and a corpus file in the real formats (the embedded world's test set, K=2)."""
    d = tmp_path_factory.mktemp("files")
    world, tasks = data.held_out_tasks(2, 8)
    with open(d / "qa.jsonl", "w") as f:
        for t in tasks:
            f.write(json.dumps({"question": t.question, "golden_answers": t.golds}) + "\n")
    data.save_corpus(world.docs, str(d / "corpus.jsonl"))
    return d / "qa.jsonl", d / "corpus.jsonl"


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_folder_loads_the_way_a_qwen_download_does(real, folder):
    model, tok = real
    assert type(model) is Qwen2ForCausalLM and type(tok).__name__ == "Qwen2Tokenizer"
    assert model.config.model_type == "qwen2" and model.config.num_key_value_heads < model.config.num_attention_heads
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert len(ids(tok, "</search>")) >= 3                        # tags are NOT special tokens
    assert tok.convert_tokens_to_ids("<|im_start|>") in tok.all_special_ids
    text = tok.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    assert checkpoint_prompt(folder) == PROTOCOL_PROMPT            # a model from elsewhere gets the protocol


def test_greedy_engine_equals_model_generate_on_the_bpe_folder(real):
    model, tok = real
    prompts = [ids(tok, t) for t in ("<mem> 1 = kalo friend", "hello", "<search> mira rival _ </search>\n <")]
    ours = generate(model, prompts, 20, pad_id=tok.pad_token_id, temperature=0.0)
    x, attn = left_pad(prompts, tok.pad_token_id, model.device)
    ref = model.generate(input_ids=x, attention_mask=attn, max_new_tokens=20, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=None)[:, x.shape[1]:].tolist()
    assert ours == ref


def test_engine_runs_under_bf16_autocast_over_fp32_weights(real):
    """models.autocast's forward: fp32 master weights, bf16 compute; the KV cache must take both dtypes."""
    model, tok = real
    prompts = [ids(tok, "<mem> 1 = kalo friend"), ids(tok, "hello there")]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(model, prompts, 12, pad_id=tok.pad_token_id, temperature=0.0)
    assert [len(o) for o in out] == [12, 12] and next(model.parameters()).dtype == torch.float32


class Scripted(torch.nn.Module):
    """A real Qwen2 whose logits are pushed towards a script: the n-th new token of the row whose prompt has
    ``prompt_lens[r]`` tokens is ``scripts[r][n]``. Rows are told apart by position (prompt lengths differ by
    more than the new tokens), so rows may leave the batch in any order."""

    def __init__(self, inner, prompt_lens, scripts):
        super().__init__()
        self.inner, self.config, self.prompt_lens, self.scripts = inner, inner.config, prompt_lens, scripts

    @property
    def device(self):
        return self.inner.device

    def forward(self, input_ids, position_ids, **kw):
        out = self.inner(input_ids=input_ids, position_ids=position_ids, **kw)
        pos = position_ids[:, -out.logits.shape[1]:]               # (b, k): position of each kept logit
        for b, j in torch.cartesian_prod(torch.arange(pos.shape[0]), torch.arange(pos.shape[1])).tolist():
            for L, script in zip(self.prompt_lens, self.scripts):
                n = int(pos[b, j]) + 1 - L
                if 0 <= n < len(script) and n < 64:
                    out.logits[b, j, script[n]] += 1e4
        return out


def scripted_generate(model, tok, prompts, scripts):
    assert all(abs(len(a) - len(b)) > 64 for i, a in enumerate(prompts) for b in prompts[i + 1:])
    m = Scripted(model, [len(p) for p in prompts], scripts)
    return generate(m, prompts, 40, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                    stops=stop_strings(tok, STOP_STRINGS), temperature=0.0)


def token(tok, t):
    """The id of one token given as text (byte-level: a space is "Ġ", a newline "Ċ")."""
    return tok.backend_tokenizer.token_to_id(t.replace(" ", "Ġ").replace("\n", "Ċ"))


SPLITS = {   # how </search> arrives, as token strings; "X" = what a BPE token carries past the tag
    "canonical": [" </", "search", ">"],
    "three": ["<", "/", "search", ">"],
    "newline in the last token": [" </", "search", ">\n"],
    "dot in the last token": ["<", "/", "search", ">."],
}


@pytest.mark.parametrize("split", list(SPLITS))
def test_each_split_of_the_closing_tag_ends_the_round_at_the_tag(real, split):
    model, tok = real
    head = ids(tok, "<mem> 1 = kalo friend _ </mem> <think> search </think> <search> kalo friend")
    tail = [token(tok, t) for t in SPLITS[split]]
    assert None not in tail, SPLITS[split]
    junk = ids(tok, " and more text after the tag")
    prompt = ids(tok, "<|im_start|>assistant\n")
    out = scripted_generate(model, tok, [prompt], [head + tail + junk])[0]
    assert out == head + tail                                      # ends exactly at the token completing the tag
    text = tok.decode(out)
    assert parse_action(text) == ("search", "kalo friend")


def test_rows_stop_independently_and_only_on_the_whole_tag(real):
    model, tok = real
    a = ids(tok, "<think> search </think> <search> kalo </search>")
    b = ids(tok, "<think> x </think> <search> a </ search> and < /search> but not closed " + "word " * 30)
    c = ids(tok, "<think> x </think> <search> a </sea") + ids(tok, "rch>")   # a split no tokenizer would make
    prompt = ids(tok, "<|im_start|>assistant\n")
    pad = ids(tok, " ".join(["word"] * 80))
    out = scripted_generate(model, tok, [prompt, pad + prompt, pad + pad + prompt],
                            [a + ids(tok, " junk"), b, c + ids(tok, " junk")])
    assert out[0] == a and out[2] == c
    assert len(b) >= 40 and out[1] == b[:40]                       # never closed: runs to max_new_tokens


def test_rollout_rows_hold_exactly_the_sampled_ids_on_bpe(real):
    """Token ids in, token ids out: the update's row = context ids + forced prefix + the sampled ids."""
    model, tok = real
    world, tasks = data.held_out_tasks(1, 2)
    cfg = AgentConfig(system_prompt=PROTOCOL_PROMPT, max_turns=3, max_new_tokens=24, temperature=1.0)
    trajs = rollout(model, tok, tasks, 2, SearchTool(world.docs), cfg, torch.Generator().manual_seed(0))
    samples = train.build_samples(trajs, torch.ones(len(trajs)), {})
    rounds = [r for t in trajs for r in t.rounds if r.output_ids]
    assert len(samples) == len(rounds) > 0
    for s, r in zip(samples, rounds):
        assert s.ids == r.context_ids + r.prefix_ids + r.output_ids
        assert s.ids[s.n_prompt:] == r.output_ids                  # loss mask 1 on exactly the sampled tokens


def test_answer_template_is_the_tokenizers_own_encoding_and_masks_exactly_the_gold(real):
    _, tok = real
    for golds in ([["1,234"], ["U.S."]], [["東京タワー"]], [["kalo"], ["bobi gonu"]], [["New York City"]]):
        t_ids, mask = answer_template(tok, golds)
        text = tok.decode(t_ids)
        assert ids(tok, text) == t_ids
        runs, cur = [], []                                         # contiguous runs of gold tokens
        for i, m in zip(t_ids + [None], mask + [0]):
            if m:
                cur.append(i)
            elif cur:
                runs, cur = runs + [tok.decode(cur).strip()], []
        words = [w for g in golds for w in g[0].split()]
        assert " ".join(runs).split() == words                     # each gold exactly, nothing else
        # word numbers: every gold word's pieces share one number, words numbered 1, 2, ... in order
        assert sorted(set(mask) - {0}) == list(range(1, len(words) + 1))
        for w, word in enumerate(words, 1):
            assert tok.decode([i for i, m in zip(t_ids, mask) if m == w]).strip() == word


def test_probe_confidence_is_per_word_on_bpe(real):
    """A name in several BPE pieces counts as confident only when the whole name is (sum of its pieces)."""
    from reward import answer_prob, word_logprobs
    _, tok = real
    t_ids, mask = answer_template(tok, [["kalovu"], ["bobi"]])
    pieces = [j for j, m in enumerate(mask) if m == 1]
    assert len(pieces) >= 2                                        # the fixture's BPE splits this name
    logp = torch.full((1, len(t_ids)), -5.0)
    logp[0, pieces[0]] = -2.0                                      # first piece unlikely (p 0.14) ...
    for j in pieces[1:]:
        logp[0, j] = -0.01                                         # ... continuation pieces near certain
    for j in (j for j, m in enumerate(mask) if m == 2):
        logp[0, j] = -0.1 / sum(m == 2 for m in mask)              # "bobi": p 0.905 as a whole word
    wl, present = word_logprobs(logp, torch.tensor([mask]))
    assert wl.shape == (1, 2) and present.tolist() == [[True, True]]
    assert wl[0, 0].item() == pytest.approx(-2.0 - 0.01 * (len(pieces) - 1), abs=1e-5)
    assert wl[0, 1].item() == pytest.approx(-0.1, abs=1e-5)
    assert answer_prob(wl, present).item() == pytest.approx(0.905, abs=1e-3)   # only "bobi" is confident
    token_level = answer_prob(logp, torch.tensor([mask]) > 0)                    # the old per-token rule
    assert token_level.item() > 0.95                                             # counts kalovu's tail pieces


def test_mem_span_and_forced_prefix_on_bpe(real):
    _, tok = real
    prefix = ids(tok, "<mem>")
    out = ids(tok, " 1 = kalo friend mira </mem> <think> search </think> <search> mira boss </search>")
    n = mem_token_end(tok, prefix + out)
    assert tok.decode((prefix + out)[:n]).endswith("</mem>")
    assert not tok.decode((prefix + out)[:n - 1]).endswith("</mem>")
    assert mem_token_end(tok, out) == 0                           # no leading <mem>: no span


def test_fp32_master_weights_move_at_lr_1e6_under_bf16_autocast():
    tok = data.build_tokenizer()
    moved = {}
    for weights in ("fp32 master", "bf16"):
        model = data.build_tiny_model(tok, hidden=64, layers=1, heads=2, seed=0)
        if weights == "bf16":
            model = model.to(torch.bfloat16)
        cfg = train.parse_args(["--precision", "bf16", "--lr", "1e-6"])
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        samples = [grpo.target_row(list(range(5, 13)), list(range(13, 25)), adv_t=1.0),
                   grpo.target_row(list(range(30, 36)), list(range(36, 44)), adv_t=-1.0)]
        before = [p.detach().clone() for p in model.parameters()]
        m = train.update(model, None, opt, samples, cfg, tok.pad_token_id)
        assert "skipped" not in m
        changed = sum((a != p.detach()).sum().item() for a, p in zip(before, model.parameters()))
        moved[weights] = changed / sum(p.numel() for p in model.parameters())
        assert all(p.dtype == (torch.float32 if weights != "bf16" else torch.bfloat16) for p in model.parameters())
    assert moved["fp32 master"] > 0.5 > 0.05 > moved["bf16"], moved   # bf16 weights round the step away


def cli(script, *args):
    return subprocess.run([sys.executable, script, *map(str, args)], cwd=HERE, capture_output=True, text=True)


def test_train_eval_resume_on_the_folder(folder, files, tmp_path):
    qa, corpus = files
    run = tmp_path / "run"
    common = ["--model", folder, "--data", qa, "--corpus", corpus, "--questions", 2, "--group", 2,
              "--max-turns", 2, "--max-new-tokens", 16, "--save-every", 1, "--eval-every", 0]
    p = cli("train.py", "--run", run, "--rl-steps", 2, *common)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1] and all(r["stage"] == "rl" for r in rows)
    assert (run / "final" / "model.safetensors").exists()
    assert open(run / "final" / "system_prompt.txt").read() == PROTOCOL_PROMPT
    p = cli("train.py", "--run", run, "--rl-steps", 3, "--resume", *common)
    assert p.returncode == 0 and "resuming rl at step 2" in p.stdout, p.stderr[-2000:]
    assert [json.loads(x)["step"] for x in open(run / "metrics.jsonl")] == [0, 1, 2]
    p = cli("eval.py", "--checkpoint", run, "--data", qa, "--corpus", corpus, "--max-turns", 2,
            "--max-new-tokens", 16, "--compose", 1, 2)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])["results"]
    assert res["1"]["n"] == 8 and res["2"]["n"] == 4 and p.stderr.count("eval:") <= 3   # one bar, not one per K


def test_sft_from_a_chat_format_trajectory_file_lowers_the_loss(folder, tmp_path):
    paths = sft.export(str(tmp_path / "export"), ks=(1,), n=4, episodes=24)
    traj = [p for p in paths if p.endswith("sft_trajectories.jsonl")][0]
    run, prompt = tmp_path / "sft", tmp_path / "prompt.txt"
    prompt.write_text("answer all . keep findings in mem\n")          # --system-prompt: short rows, a fast test
    p = cli("train.py", "--run", run, "--model", folder, "--sft-data", traj, "--sft-steps", 60, "--sft-batch", 8,
            "--sft-lr", "1e-2", "--rl-steps", 0, "--eval-every", 0, "--system-prompt", prompt)
    assert p.returncode == 0, p.stderr[-2000:]
    losses = [json.loads(x)["loss"] for x in open(run / "metrics.jsonl")]
    assert losses[-1] < 0.7 * losses[0], losses
    assert open(run / "final" / "system_prompt.txt").read() == "answer all . keep findings in mem"


def test_trajectory_rows_match_the_expert_rows(tmp_path):
    """A trajectory file renders the same rows as the in-memory expert (same prompt, same snail context)."""
    import random
    tok = data.build_tokenizer()
    rng = random.Random(3)
    world = data.make_world(3)
    tool = SearchTool(world.docs)
    task = data.make_task(world, rng, 2, (1, 2))
    msgs = [{"role": "user", "content": task.question}]
    for text, q in data.expert_episode(task, forget=True):
        msgs.append({"role": "assistant", "content": text})
        if q is not None:
            msgs.append({"role": "tool", "content": tool.search(" ".join(q))})
    (tmp_path / "t.jsonl").write_text(json.dumps({"messages": msgs}) + "\n")
    tr = data.load_trajectories(str(tmp_path / "t.jsonl"))[0]
    got = sft.episode_samples(tok, tr["question"], tr["rounds"], data.SYSTEM_PROMPT)
    want = sft.expert_samples(tok, task, tool, forget=True)
    assert [(s.ids, s.n_prompt) for s in got] == [(s.ids, s.n_prompt) for s in want]


@pytest.mark.parametrize("content,expect", [
    (b'{"question": "q", "golden_answers": ["a"]}\n{"question": 3}\n',
     r"qa.jsonl:2: missing or empty field 'question'"),
    (b'{"question": "q", "golden_answers": ["a"]}\n\xff\xfe bad bytes\n', r"qa.jsonl:2: not UTF-8 text"),
    (b'{"question": "q", "golden_answers": ["a"]}\n{not json\n', r"qa.jsonl:2: not valid JSON"),
])
def test_a_bad_data_file_stops_with_one_line_naming_file_and_line(tmp_path, content, expect, files):
    bad = tmp_path / "qa.jsonl"
    bad.write_bytes(content)
    p = cli("train.py", "--run", tmp_path / "r", "--model", "unused", "--data", bad, "--corpus", files[1])
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: ") and expect in p.stderr, p.stderr


def test_duplicate_corpus_ids_name_both_lines(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"id": "a", "contents": "x"}\n{"id": "b", "contents": "y"}\n{"id": "a", "contents": "z"}\n')
    with pytest.raises(data.DataError, match=r"c\.jsonl:3: duplicate id 'a' \(first on line 1\)"):
        data.load_corpus(str(f))


def test_compose_joins_k_questions_mem1_style():
    tasks = [data.Task(f"q{i}", [[f"a{i}", f"alias{i}"]]) for i in range(7)]
    out = data.compose_tasks(tasks, 3, seed=1)
    assert len(out) == 2
    for t in out:
        qs = t.question.removeprefix("Answer the following questions: ").split(" ; ")
        assert len(qs) == 3 and [g[0] for g in t.golds] == [q.replace("q", "a") for q in qs]
    used = [q for t in out for q in t.question.split(": ")[1].split(" ; ")]
    assert len(set(used)) == 6                                     # each question used once
    with pytest.raises(data.DataError):
        data.compose_tasks(tasks, 8)


def test_exported_files_score_the_same_as_the_in_memory_eval(sft_run, tmp_path):
    paths = sft.export(str(tmp_path), ks=(2,), n=16, episodes=2)
    model, tok, prompt = ev.load(str(sft_run), torch.device("cpu"))
    assert prompt == data.SYSTEM_PROMPT                            # the checkpoint carries its prompt
    agent = ev.greedy_agent("snail", 12, system_prompt=prompt)
    tasks, tool = ev.embedded_tasks(2, 16, split="test")
    in_memory = run_episodes(model, tok, tasks, tool, agent)
    files = run_episodes(model, tok, data.load_qa(paths[0]), SearchTool(data.load_corpus(paths[1])), agent)
    assert [[r.round_ids for r in t.rounds] for t in files] == [[r.round_ids for r in t.rounds] for t in in_memory]
    assert ev.summarize(files) == ev.summarize(in_memory)
    # every round saw the same tool results from the exported corpus as from the world's documents (the fixture's
    # criterion, >= 24 rounds on these very questions, makes the policy search)
    assert [[r.context_ids for r in t.rounds] for t in files] == [[r.context_ids for r in t.rounds] for t in in_memory]
