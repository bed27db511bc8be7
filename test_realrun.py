"""README's "A real run", run as written: each command of its bash block, in order, on tiny real-format files.

The block is read from README.md, not copied here, so a command that drifts from the code fails this test. Each
command runs as the user would: a subprocess in a folder holding ``qa.jsonl``, ``test.jsonl`` and ``wiki.jsonl`` (the
embedded world written by ``sft.export``, as ``python sft.py --export`` does); the first command writes
``trajectories.jsonl`` from them. What
changes: the model placeholders become a tiny random Qwen2 folder with a byte-level BPE tokenizer
(``data.save_random_checkpoint``), ``$URL`` the address ``search.py serve`` prints, the LoRA line's ``...`` the RL
line's data flags, and small sizes are APPENDED (argparse keeps the last value), so the README's words are all
there. The server listens on a free port (``--port 0``, appended too).
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import data
import sft

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("/path/to/Qwen2.5-0.5B-Instruct", "M")           # the block's placeholders for a model
# Small sizes appended to each command, by the script and its first word: a few steps, questions and tokens.
SMALL = {
    "trajectories": [],
    "index": [],
    "serve": ["--port", "0"],
    "train": ["--sft-steps", "2", "--sft-batch", "4", "--rl-steps", "1", "--questions", "2", "--group", "2",
              "--max-turns", "2", "--max-new-tokens", "8", "--eval-every", "0", "--device", "cpu"],
    "eval": ["--max-turns", "2", "--max-new-tokens", "8", "--device", "cpu"],
}
# The LoRA line's "...": the rest of an RL command, as the line above it gives.
LORA_REST = ["--data", "qa.jsonl", "--search-url", "$URL"]


def readme_commands() -> list[str]:
    """The bash block of README's "## A real run", one command a line (continuations joined)."""
    text = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    section = text.split("\n## A real run\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def argv(words: list[str], url: str, model: str) -> list[str]:
    """One README command's words made runnable here: this Python, the script's path, the placeholders filled."""
    assert words[0] == "python", words
    script = os.path.join(HERE, words[1])
    rest = [model if w in MODELS else url if w == "$URL" else w for w in words[2:]]
    if "..." in rest:
        i = rest.index("...")
        rest[i:i + 1] = [url if w == "$URL" else w for w in LORA_REST]
    stage = words[2] if words[1] == "search.py" else words[1][:-3]
    return [sys.executable, script] + rest + SMALL[stage]


def run(cmd: list[str], cwd: str, env: dict) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{shlex.join(cmd)}\nexit {out.returncode}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The user's folder: the exported world as the README's file names, and a tiny model folder."""
    d = tmp_path_factory.mktemp("realrun")
    qa, corpus, _ = sft.export(str(d / "export"), ks=(1,), n=8, episodes=1)     # 8: the gold teacher keeps 2
    for src, name in ((qa, "qa.jsonl"), (qa, "test.jsonl"), (corpus, "wiki.jsonl")):
        shutil.copy(src, d / name)
    model = data.save_random_checkpoint(str(d / "tiny-qwen2"))
    return d, model


def test_every_readme_command_of_a_real_run_runs(workdir):
    d, model = workdir
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    lines = readme_commands()
    assert lines[0].startswith("python trajectories.py"), "the first line writes the SFT trajectories"
    assert lines[1].split("#")[0].rstrip().endswith("&"), "the second line serves the index in the background"
    server, url = None, ""          # the first line needs no server
    try:
        seen = []
        for line in lines:
            words = shlex.split(line, comments=True)
            if words[0] == "torchrun":       # test_dist.py runs train.py under torchrun
                continue
            if "&&" in words:                # index && serve &: build the index, then serve it in the background
                i = words.index("&&")
                index, serve = words[:i], [w for w in words[i + 1:] if w != "&"]
                run(argv(index, "", model), d, env)
                assert os.path.exists(d / "I" / "meta.json")
                server = subprocess.Popen(argv(serve, "", model), cwd=d, env=env, stderr=subprocess.PIPE, text=True)
                first = server.stderr.readline()
                url = re.search(r"http://\S+/retrieve", first)
                assert url, first
                url = url.group(0)
                seen.append("serve")
                continue
            out = run(argv(words, url, model), d, env)
            seen.append(" ".join(words[1:3]))
            if words[1] == "trajectories.py":
                assert out.stdout.strip() == "kept 2 of 8 (25%)"
                assert len(data.load_trajectories(str(d / "trajectories.jsonl"))) == 2     # what the SFT line reads
            elif words[1] == "eval.py":
                result = json.loads(out.stdout.strip().splitlines()[-1])
                assert result["search_failures"] == 0 and set(result["results"]) == {"1", "2", "4"}
                assert result["context"] == "snail"
            elif "--lora-rank" in words:
                run_dir = d / "runs" / "default"
                final = run_dir / "final"
                assert (final / "config.json").exists() and not (final / "adapter_config.json").exists()  # merged
                assert any(f.startswith("events.out.tfevents") for f in os.listdir(run_dir / "tb"))
            elif "--sft-data" in words:
                assert (d / "runs" / "sft" / "final" / "config.json").exists()
            else:
                assert (d / "runs" / "rl" / "final" / "config.json").exists()
                rows = [json.loads(x) for x in open(d / "runs" / "rl" / "metrics.jsonl")]
                assert [r["search_failures"] for r in rows if r.get("stage") == "rl"] == [0]   # none failed
        assert seen == ["trajectories.py --data", "serve", "train.py --run-dir", "train.py --run-dir",
                        "eval.py --checkpoint", "train.py --model"], seen
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
