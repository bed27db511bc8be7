"""P_full and P_mem of a model on expert trajectories (a ``--sft-data`` file), under each probe marker.

    python results/probe_markers.py --model smollm2 runs/smollm2_sft/final --data heldout/sft_trajectories.jsonl

Every round after the first with a ``<mem>`` is scored as the memory reward scores a rollout's round
(``reward.memory_rewards``: its snail context, the prompt + its ``<mem>``), and split by whether that context (or
memory) holds the gold answers (``sft.held_answers`` on its text: all of them, or none). ``auto`` is the marker a
run from the model resolves ``--probe-think auto`` to (``checkpoint.trained_probe_think``).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import data  # noqa: E402
import sft  # noqa: E402
from checkpoint import trained_probe_think  # noqa: E402
from memory import Record, extract_mem, mem_token_end, prepare_prompt  # noqa: E402
from models import load_pretrained  # noqa: E402
from reward import memory_rewards  # noqa: E402
from rollout import Round, Trajectory, checkpoint_prompt, encode_chat, parse_action  # noqa: E402


def expert_trajectories(tok, prompt: str, rows: list[dict]):
    """The file's episodes as the agent loop would have recorded them, and per round what its context shows."""
    trajs, seen = [], []
    mem = tok.encode("<mem>", add_special_tokens=False)
    for gid, tr in enumerate(rows):
        prompt_ids = encode_chat(tok, prepare_prompt([Record("prompt", tr["question"])], prompt))
        traj = Trajectory(tr["question"], tr["golds"], gid, prompt_ids, [])
        shown = []
        for t, text, records in sft.episode_records(tr["question"], tr["rounds"]):
            messages = prepare_prompt(records, prompt)
            shown.append(" ".join(m["content"] for m in messages[2:]))
            pre = mem if t > 0 and text.startswith("<mem>") else []
            out = tok.encode(text[len("<mem>"):] if pre else text, add_special_tokens=False)
            traj.rounds.append(Round(encode_chat(tok, messages), pre, out, text, mem_token_end(tok, pre + out),
                                     parse_action(text)[0]))
        trajs.append(traj)
        seen.append(shown)
    return trajs, seen


def holds(golds, text) -> str:
    known = [a != data.UNKNOWN for a in sft.held_answers(golds, text)]
    return "all" if all(known) else "none" if not any(known) else "some"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", nargs="+", required=True, help="models: smollm2, checkpoint folders")
    p.add_argument("--data", required=True, help="a --sft-data file of expert episodes (sft.py --export)")
    a = p.parse_args()
    rows = data.load_trajectories(a.data)
    print("| model | marker | rounds | P_full, context holds the golds | P_full, holds none | P_mem, memory holds "
          "them | P_mem, holds none | reward P_mem - P_full |")
    print("|---|---|---|---|---|---|---|---|")
    for path in a.model:
        model, tok = load_pretrained(path, torch.device("cpu"))
        model.eval()
        prompt = checkpoint_prompt(path)
        trajs, seen = expert_trajectories(tok, prompt, rows)
        auto = trained_probe_think(path)
        for marker in dict.fromkeys([auto, "probe", "answer"]):
            r = memory_rewards(model, tok, trajs, think=marker)
            groups: dict = {}
            for n, (i, t) in enumerate(r["scored"]):
                groups.setdefault(("full", holds(trajs[i].golds, seen[i][t])), []).append(r["p_full"][n])
                groups.setdefault(("mem", holds(trajs[i].golds, extract_mem(trajs[i].rounds[t].text))),
                                  []).append(r["p_mem"][n])
            cell = lambda k: (f"{sum(groups[k]) / len(groups[k]):.3f} ({len(groups[k])})" if groups.get(k) else "-")
            reward = sum(r["reward"]) / max(r["n"], 1)
            print(f"| {path} | {marker}{' (auto)' if marker == auto else ''} | {r['n']} | {cell(('full', 'all'))} | "
                  f"{cell(('full', 'none'))} | {cell(('mem', 'all'))} | {cell(('mem', 'none'))} | {reward:+.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
