"""MemTrain: the proxy-task builder (world and real-format corpus), the IMR builder, the rewards, the
memory agent, one training step that changes weights, and the eval metrics."""
import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import data
import sft
import train
from eval import load
from grpo import collate, filter_groups, grouped_advantage, target_row
from recipes import memtrain, memtrain_eval, memtrain_tasks
from recipes.memtrain import (MemAgentConfig, memory_rollout, memory_step_context, memtrain_reward,
                              reconstruction_reward, written_memory)
from recipes.memtrain_eval import evaluate_memtrain, memtrain_heldout, memtrain_summary
from sft import sft_loss

NAMES = frozenset(data.name_pool())


def fact_of(passage: str):
    """``kalo friend mira`` / ``mira is friend of kalo`` -> ``("kalo", "friend", "mira")``."""
    w = passage.split()
    if len(w) == 3:
        return tuple(w)
    if len(w) == 5 and w[1] == "is" and w[3] == "of":
        return (w[4], w[2], w[0])
    raise AssertionError(passage)


@pytest.mark.parametrize("world_seed", [0, 1, 2])
def test_world_tasks_mask_every_pivot_occurrence_and_are_recoverable(world_seed):
    world = data.make_world(world_seed)
    docs = {d["id"]: d["contents"] for d in memtrain_tasks.world_memtrain_docs(world)}
    tasks = memtrain_tasks.world_memtrain_tasks(world_seed, 60, seed=world_seed, max_chunks=8)
    assert len(tasks) == 60
    for t in tasks:
        text = " | ".join(t.chunks)
        passages = text.split(" | ")
        assert len(passages) == len(t.passage_ids) == 8 and len(t.chunks) == 8
        pivot = passages[t.passage_ids.index(t.pivot_id)]
        assert pivot == memtrain_tasks.replace_entity(docs[t.pivot_id], t.answer, memtrain_tasks.MASK)
        assert t.answer not in pivot.split() and memtrain_tasks.MASK in pivot.split()
        # every occurrence, nowhere else
        assert text.count(memtrain_tasks.MASK) == docs[t.pivot_id].split().count(t.answer)
        # recoverable: another passage states the pivot's fact with the answer in the masked slot
        s, r, o = fact_of(docs[t.pivot_id])
        others = [fact_of(p) for i, p in zip(t.passage_ids, passages) if i != t.pivot_id]
        assert (s, r, o) in others
        # and no other passage states a different value for the same slot (facts are functions)
        masked_subject = s == t.answer
        if masked_subject:
            assert not any(f[1] == r and f[2] == o and f[0] != s for f in others)
        else:
            assert not any(f[0] == s and f[1] == r and f[2] != o for f in others)


def test_world_tasks_are_deterministic_under_seed():
    a = memtrain_tasks.world_memtrain_tasks(4, 10, seed=7)
    assert a == memtrain_tasks.world_memtrain_tasks(4, 10, seed=7)
    assert a != memtrain_tasks.world_memtrain_tasks(4, 10, seed=8)


def test_chunks_are_whole_passages_at_most_max_chunks():
    assert memtrain_tasks.split_chunks(list("abcde"), 2) == ["a | b | c", "d | e"]
    assert memtrain_tasks.split_chunks(list("ab"), 8) == ["a", "b"]
    t = memtrain_tasks.world_memtrain_tasks(0, 5, seed=0, max_chunks=3)
    assert all(len(x.chunks) == 3 for x in t)
    assert [len(c.split(" | ")) for c in t[0].chunks] == [3, 3, 2]


def test_entity_heuristic_on_real_text():
    text = "The Eiffel Tower was built in Paris by Gustave Eiffel in 1889. It opened on March 31, 1889."
    assert memtrain_tasks.entity_spans(text) == ["Eiffel Tower", "Paris", "Gustave Eiffel", "1889", "March 31, 1889"]
    assert memtrain_tasks.entity_spans("In 4 May 1970 the Bank of England paid 3.5 pounds.") == \
        ["4 May 1970", "Bank of England", "3.5"]
    a, b = data.name_pool()[:2]
    assert memtrain_tasks.entity_spans(f"{a} friend {b} | {b} is boss of {a}", NAMES) == [a, b]


CORPUS = [
    {"id": "w1", "contents": "Gustave Eiffel designed the Eiffel Tower in Paris for the 1889 World's Fair."},
    {"id": "w2", "contents": "The Statue of Liberty was designed by Gustave Eiffel and Frederic Bartholdi."},
    {"id": "w3", "contents": "Paris hosted the 1889 World's Fair, which drew 32 million visitors."},
    {"id": "w4", "contents": "London is the capital of England and lies on the Thames."},
    {"id": "w5", "contents": "The Thames flows through Oxford before it reaches London."},
    {"id": "w6", "contents": "Frederic Bartholdi was born in Colmar in 1834."},
    {"id": "w7", "contents": "Colmar is a town in Alsace near the Rhine."},
    {"id": "w8", "contents": "The Rhine flows from the Alps to the North Sea."},
]


def test_real_format_corpus_file(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in CORPUS))
    docs = data.load_corpus(str(path))
    tasks = memtrain_tasks.masked_reconstruction_tasks(docs, 20, seed=3, max_chunks=4, n_neighbours=2, n_random=2)
    assert tasks == memtrain_tasks.masked_reconstruction_tasks(docs, 20, seed=3, max_chunks=4, n_neighbours=2,
                                                               n_random=2)
    by_id = {d["id"]: d["contents"] for d in docs}
    for t in tasks:
        assert 1 <= len(t.chunks) <= 4
        passages = " | ".join(t.chunks).split(" | ")
        pivot = passages[t.passage_ids.index(t.pivot_id)]
        assert pivot == by_id[t.pivot_id].replace(t.answer, memtrain_tasks.MASK) and t.answer not in pivot
        assert t.evidence_ids and all(t.answer in by_id[i] and i != t.pivot_id for i in t.evidence_ids)
        assert set(t.evidence_ids) <= set(t.passage_ids)


def test_imr_task_masks_an_earlier_chunk():
    chunks = ["kalo friend mira | mira boss kalo", "[MASK] is friend of tebo", "lapu rival tebo"]
    names = NAMES | {"kalo", "mira", "tebo", "lapu"}
    seen = set()
    for s in range(40):
        t = memtrain_tasks.imr_task(chunks, 3, random.Random(s), names)
        assert t.chunk_step < t.k < 3
        assert t.chunk == memtrain_tasks.replace_entity(chunks[t.chunk_step], t.target, memtrain_tasks.TARGET)
        assert t.target not in t.chunk.split() and memtrain_tasks.MASK != t.target
        seen.add((t.k, t.chunk_step, t.target))
    assert {(1, 0, "kalo"), (1, 0, "mira"), (2, 1, "tebo")} <= seen
    assert memtrain_tasks.imr_task(chunks, 1, random.Random(0), names) is None    # one memory: no earlier chunk


def test_add_words_extends_a_world_tokenizer_and_model():
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=16, layers=1, heads=2, ffn=32)
    added = memtrain_tasks.add_words(tok, model, memtrain_tasks.MEMTRAIN_WORDS)
    assert memtrain_tasks.MASK in added and "friend" not in added
    text = f"{data.name_pool()[0]} friend [MASK] ? which entity is [TARGET] , this"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:-1] == tok.convert_tokens_to_ids(text.split()[:-1]) and tok.unk_token_id not in ids[:-1]
    assert ids[-1] == tok.unk_token_id                   # "this" is not "is": added words match whole words only
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    assert memtrain_tasks.add_words(tok, model, memtrain_tasks.MEMTRAIN_WORDS) == []


# --------------------------------------------------------------------------- rewards

def test_reconstruction_reward_is_normalised_exact_match():
    assert reconstruction_reward("Gustave Eiffel.", "gustave eiffel") == 1.0
    assert reconstruction_reward("The Thames", "Thames") == 1.0           # articles dropped
    assert reconstruction_reward("Gustave", "Gustave Eiffel") == 0.0      # no partial credit
    assert reconstruction_reward(None, "mira") == 0.0


def test_memtrain_reward_hand_computed():
    e2e = torch.tensor([1.0, 0.0, 1.0])
    imr = torch.tensor([[1.0, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    # 1 + 0.5/4*2 = 1.25 ; 0 + 0.5/4*4 = 0.5 ; 1 + 0 = 1.0
    assert torch.allclose(memtrain_reward(e2e, imr), torch.tensor([1.25, 0.5, 1.0]))
    assert torch.allclose(memtrain_reward(e2e, imr, lam=0.0), e2e)        # the IMR ablation
    assert torch.allclose(memtrain_reward(e2e, imr, lam=1.0), torch.tensor([1.5, 1.0, 1.0]))
    with pytest.raises(ValueError):
        memtrain_reward(e2e, imr[:2])


def test_dr_grpo_and_dapo_filter_on_memtrain_rewards():
    # two tasks x G1 = 2: task 0 rewards [1.25, 0.5] (kept), task 1 [1.0, 1.0] (all equal: dropped)
    r = memtrain_reward(torch.tensor([1.0, 0, 1, 1]), torch.tensor([[1.0, 1], [1, 1], [0, 0], [0, 0]]))
    gids = torch.tensor([0, 0, 1, 1])
    assert torch.allclose(r, torch.tensor([1.5, 0.5, 1.0, 1.0]))
    assert filter_groups(r, gids).tolist() == [True, True, False, False]
    assert torch.allclose(grouped_advantage(r, gids, norm_by_std=False), torch.tensor([0.5, -0.5, 0.0, 0.0]))


# --------------------------------------------------------------------------- the memory agent

@pytest.fixture(scope="module")
def tiny():
    tok = data.build_tokenizer(data.world_vocab() + memtrain_tasks.MEMTRAIN_WORDS)
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval()
    return model, tok


def test_step_context_is_a_mempo_round_with_the_chunk_as_tool_result(tiny):
    _, tok = tiny
    a, b, c = data.name_pool()[:3]
    ids = memory_step_context(tok, data.SYSTEM_PROMPT, "which entity is [MASK] ?", f"{a} friend {b}", f"{b} boss {c}")
    assert tok.decode(ids) == (f"<|system|> {data.SYSTEM_PROMPT} <|end|> <|user|> which entity is [MASK] ? <|end|> "
                               f"<|assistant|> <mem> {a} friend {b} </mem> <|end|> "
                               f"<|user|> <information> {b} boss {c} </information> <|end|> <|assistant|>")
    first = tok.decode(memory_step_context(tok, data.SYSTEM_PROMPT, "which entity is [MASK] ?", None, a))
    assert "<mem>" not in first and first.endswith(f"<|user|> <information> {a} </information> <|end|> <|assistant|>")


def test_written_memory_is_the_body_capped_at_the_budget(tiny):
    _, tok = tiny
    a, b, c = data.name_pool()[:3]
    assert written_memory(tok, f"<mem> {a} friend {b} </mem> <think> answer </think>", 8) == f"{a} friend {b}"
    assert written_memory(tok, f"<mem> {a} friend {b} boss {c}", 3) == f"{a} friend {b}"     # never closed: cut


def test_memory_rollout_carries_each_memory_into_the_next_step(tiny):
    model, tok = tiny
    tasks = memtrain_tasks.world_memtrain_tasks(0, 2, seed=0, max_chunks=3)
    cfg = MemAgentConfig(data.SYSTEM_PROMPT, mem_tokens=6, answer_tokens=4)
    trajs = memory_rollout(model, tok, tasks, 3, cfg, torch.Generator().manual_seed(0))
    assert [x.group_id for x in trajs] == [0, 0, 0, 1, 1, 1]
    for x in trajs:
        assert len(x.rounds) == len(x.memories) == 3
        for t, r in enumerate(x.rounds):
            ctx = tok.decode(r.context_ids)
            assert f"<information> {x.chunks[t]} </information>" in ctx
            if t:
                assert f"<mem> {x.memories[t - 1]} </mem>" in ctx
            assert tok.decode(r.prefix_ids) == "<mem>"
            assert len(tok.encode(x.memories[t], add_special_tokens=False)) <= 6
            assert len(r.output_ids) <= 6 + 1 + (4 if t == 2 else 0)
    again = memory_rollout(model, tok, tasks, 3, cfg, torch.Generator().manual_seed(0))
    assert [x.memories for x in again] == [x.memories for x in trajs]


# --------------------------------------------------------------------------- one MemTrain step

def format_warm_start(model, tok, steps: int = 150, seed: int = 0):
    """A few SFT steps on scripted memory-agent rounds (memory = the newest chunks, last step answers the
    gold) so the tiny model writes the step format and the rewards of a group can differ."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for s in range(steps):
        rows = []
        for task in memtrain_tasks.world_memtrain_tasks(rng.randrange(10**6), 4, seed=s, max_chunks=2):
            mem = None
            for t, chunk in enumerate(task.chunks):
                ctx = memory_step_context(tok, data.SYSTEM_PROMPT, task.problem, mem, chunk)
                new = " ".join(((mem or "") + " " + chunk).split()[-6:])
                text = f"<mem> {new} </mem>"
                if t == len(task.chunks) - 1:
                    text += f" <think> answer </think> <answer> {task.answer} </answer>"
                rows.append(target_row(ctx, tok.encode(text, add_special_tokens=False)))
                mem = new
        batch = collate(rows, tok.pad_token_id, "cpu")
        n = float(sum(r.n_policy for r in rows))
        opt.zero_grad()
        loss = sft_loss(model, batch, n)
        loss.backward()
        opt.step()
    print('warm-start loss', loss.item())
    return model.eval()


def test_one_memtrain_step_changes_weights_and_logs_dropped_groups():
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=64, layers=1, heads=4, ffn=128, seed=0)
    assert memtrain_tasks.add_words(tok, model, memtrain_tasks.MEMTRAIN_WORDS)
    format_warm_start(model, tok)
    # 8 questions: the DAPO filter kept 1 / 2 / 1 of 4 groups (at 1 thread / the ATen default / 2 threads),
    # one tie away from a skipped step; twice the groups keep the check off that edge
    cfg = train.parse_args(["--algo", "memtrain", "--questions", "8", "--group", "8", "--imr-group", "2",
                            "--mem-tokens", "8", "--max-chunks", "2", "--lr", "1e-3"], memtrain.MemTrainConfig)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    m = memtrain.memtrain_step(model, None, tok, opt, cfg, 0)
    assert m["answered"] > 0.5 and m["mem_closed"] > 0.5          # the warm start taught the format
    assert m["kept_groups"] + m["dropped_groups"] == 8 and m["kept_groups"] >= 1
    assert "skipped" not in m and all(torch.isfinite(torch.tensor(m[k])) for k in ("loss", "grad_norm", "score"))
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


# --------------------------------------------------------------------------- eval

def test_memtrain_summary_hand_computed():
    s = memtrain_summary(["mira", "Gustave Eiffel", "1889"], ["Mira", None, "1890"], ["kalo", "tebo"], ["kalo", None])
    assert s == {"reconstruction": 1 / 3, "imr": 0.5, "answered": 2 / 3, "n": 3, "imr_n": 2}


def test_heldout_tasks_are_deterministic_and_split_apart():
    a, names = memtrain_heldout(6, "test")
    assert names == NAMES and a == memtrain_heldout(6, "test")[0]
    assert {t.pivot_id + t.answer for t in a} != {t.pivot_id + t.answer for t in memtrain_heldout(6, "valid")[0]}


def test_eval_cli_on_world_and_real_format_corpus(tmp_path, capsys):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in CORPUS))
    tok = data.build_bpe_tokenizer(data.world_texts(1) + [d["contents"] for d in CORPUS]
                                   + memtrain_tasks.MEMTRAIN_WORDS)
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64)
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    memtrain_eval.main(["--checkpoint", str(tmp_path / "ckpt"), "--corpus", str(path), "--tasks", "5",
                        "--mem-tokens", "6", "--max-chunks", "3", "--device", "cpu"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memtrain"]
    assert set(out) == {"world", "corpus"} and out["world"]["n"] == out["corpus"]["n"] == 5
    # every task has 3 chunks and every step writes a memory, so IMR is built where an earlier chunk has an entity
    corpus_tasks, _ = memtrain_heldout(5, "test", 0, 3, data.load_corpus(str(path)))
    expected = sum(any(memtrain_tasks.entity_spans(c) for c in t.chunks[:2]) for t in corpus_tasks)
    assert out["corpus"]["imr_n"] == expected
    again = evaluate_memtrain(*load(str(tmp_path / "ckpt"), torch.device("cpu"))[:2], corpus_tasks, None, 6)
    assert again == out["corpus"]                                              # greedy: reproducible


def test_memtrain_expert_keeps_the_masked_passage_and_answers():
    task = memtrain_tasks.MemTrainTask(memtrain_tasks.problem_text(), "mira",
                                       ["a b c | d e f", "x [MASK] y | mira q", "g h i"], "p", [], [])
    rounds = memtrain_tasks.memtrain_expert_rounds(task, mem_words=7)
    assert rounds == ["<mem> a b c | d e f </mem>",
                      "<mem> x [MASK] y | mira q </mem>",                      # 10 words > 7: a b c, d e f dropped
                      "<mem> x [MASK] y | mira q </mem> <think> answer </think> <answer> mira </answer>"]


def test_memtrain_as_pretraining_sees_no_expert_row_and_the_scarce_sft_runs_on_its_checkpoint(tmp_path, monkeypatch):
    """The study's order (recipes/memtrain.py, where MemTrain goes): MemTrain from a random init with --sft-steps 0
    trains on the corpus' masked-reconstruction rows only (no call makes a row of the search agent's expert: no
    question, no expert episode); train.py --model MT/final --stage sft --sft-episodes 2 then trains the agent on the
    2 fixed episodes, its format last."""
    called = []
    for name in ("cold_start", "sft_batch", "copy_batch", "fill_batch", "fixed_episodes", "probe_samples"):
        real = getattr(sft, name)
        monkeypatch.setattr(sft, name, lambda *a, _n=name, _r=real, **k: called.append(_n) or _r(*a, **k))
    monkeypatch.setattr(train, "cold_start", sft.cold_start)          # train.py holds its own name for it
    tiny = ["--hidden", "32", "--layers", "1", "--heads", "2", "--ffn", "64", "--sft-batch", "4", "--eval-every", "0"]
    mt = tmp_path / "mt"
    memtrain.main(["--run", str(mt), "--sft-steps", "0", "--memtrain-warmup", "2", "--rl-steps", "0",
                   "--max-chunks", "2"] + tiny)
    stages = [json.loads(line)["stage"] for line in open(mt / "metrics.jsonl")]
    assert called == [] and set(stages) == {"memtrain_warmup"}
    train.main(["--run", str(tmp_path / "agent"), "--model", str(mt / "final"), "--stage", "sft", "--sft-episodes", "2",
                "--sft-steps", "3", "--sft-copy-steps", "1", "--rl-steps", "0", "--sft-objectives", "1-2", "--hops",
                "1-2"] + tiny)
    assert called.count("cold_start") == called.count("fixed_episodes") == 1 and "sft_batch" in called
    a = AutoModelForCausalLM.from_pretrained(mt / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "agent" / "final").state_dict()
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
    tok = AutoTokenizer.from_pretrained(tmp_path / "agent" / "final")
    assert tok.unk_token_id not in tok.encode("[MASK] [TARGET]", add_special_tokens=False)   # MemTrain's words kept
