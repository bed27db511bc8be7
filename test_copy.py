"""grpo.py, memory.py and reward.py copy out alone (reward.py with the memory.py it reads ``mem_traj`` from): copied
into an empty folder, each file imports in a fresh Python that cannot see this repository and computes its core on
small inputs known by hand."""
import os
import shutil
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.abspath(__file__))

# run first in every subprocess: the repository is on no import path, and no module of it can be found
ALONE = """
import importlib.util, math, os, sys
REPO = {repo!r}
assert not any(os.path.realpath(p or os.getcwd()) == REPO for p in sys.path), sys.path
assert importlib.util.find_spec("rollout") is None and importlib.util.find_spec("train") is None
import {module}
assert os.path.dirname(os.path.abspath({module}.__file__)) == os.getcwd()
assert not {{"rollout", "data", "search", "train"}} & set(sys.modules)
"""


def run_alone(tmp_path, filename: str, script: str, brings: tuple[str, ...] = ()) -> None:
    """Copy ``filename`` (and the files it ``brings``) alone into an empty folder and run ``script`` there in a fresh
    interpreter."""
    folder = tmp_path / filename.removesuffix(".py")
    folder.mkdir()
    for f in (filename, *brings):
        shutil.copy(os.path.join(REPO, f), folder)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ALONE.format(repo=REPO, module=filename.removesuffix(".py")) + textwrap.dedent(script) + "\nprint('ok')\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_grpo_copies_alone(tmp_path):
    run_alone(tmp_path, "grpo.py", """
        import torch
        from grpo import grouped_advantage, memory_advantage, policy_loss
        # group 7: scores [1,0,1,1,0], mean 0.6, unbiased std sqrt(0.3); group 3 holds one rollout -> 0
        adv = grouped_advantage(torch.tensor([1., 0, 1, 1, 0, 0.5]), torch.tensor([7, 7, 7, 7, 7, 3]))
        up, down = 0.4 / (0.3 ** 0.5 + 1e-6), -0.6 / (0.3 ** 0.5 + 1e-6)
        assert torch.allclose(adv, torch.tensor([up, down, up, up, down, 0.0])), adv
        assert round(up, 4) == 0.7303 and round(down, 4) == -1.0954
        # ratio 1.5 on both tokens: A = +1 is clipped to 1.2 (loss -1.2), A = -1 keeps 1.5 (loss +1.5)
        logp = torch.tensor([[math.log(1.5), math.log(1.5)]])
        loss, m = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
        assert abs(loss.item() - (-1.2 + 1.5) / 2) < 1e-6 and m["clip_frac"] == 0.5
        # the paper's pool: question 4's three rounds {0.1, 0.3, 0.5} (two trajectories), mean 0.3, std 0.2
        a = memory_advantage(torch.tensor([0.1, 0.3, 0.5, 2.0]), torch.tensor([4, 4, 4, 9]))
        assert torch.allclose(a, torch.tensor([-1.0, 0.0, 1.0, 0.0]), atol=1e-5), a
    """)


def test_memory_copies_alone(tmp_path):
    run_alone(tmp_path, "memory.py", """
        from memory import Record, extract_mem, mem_traj, prepare_prompt, tool_record
        records = [Record("prompt", "Q"), Record("llm_gen", "g1"), tool_record("search_results", "r1"),
                   Record("llm_gen", "g2"), tool_record("webpage", "p" * 150, webpage_chars=10)]
        # snail: the cut is at the 2nd tool result from the end, so g1 and r1 are gone; a webpage shows 10 chars
        assert prepare_prompt(records, "S") == [
            {"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "g2"}, {"role": "user", "content": "p" * 10}]
        full = prepare_prompt(records, "S", keep_rounds=None)
        assert [m["content"] for m in full] == ["S", "Q", "g1", "r1", "g2", "p" * 150]
        assert extract_mem(" <mem> 1 = a b </mem> <think> x </think>") == "1 = a b"
        assert extract_mem("<think> x </think> <mem> a </mem>") is None
        assert mem_traj([1, 2], [3, 4, 5], 2) == [1, 2, 3, 4]
    """)


def test_reward_copies_alone(tmp_path):
    run_alone(tmp_path, "reward.py", """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from reward import em_score, f1_score, p_mem_minus_p_full, score_answer, validate_format

        assert score_answer("Mira ; lena ; bobo", [["mira"], ["lena"], ["kalo"]]) == {
            "score": 2 / 3, "em": 0.0, "f1": 2 / 3}
        assert em_score("the Cat.", ["dog", "cat"]) == 1.0 and em_score("cats", ["cat"]) == 0.0
        assert abs(f1_score("the big red dog", ["red dog"]) - 0.8) < 1e-9      # P 2/3, R 1
        r1 = "<think> s </think> <search> q </search>"
        r2 = "<mem> m </mem> <think> a </think> <answer> x </answer>"
        assert validate_format([r1, r2]) == (True, "ok")
        assert validate_format([r1])[1].startswith("rule 6:")
        assert validate_format([r1, r2.replace("<mem> m </mem> ", "")])[1].startswith("rule 8:")

        # P_mem - P_full on a tiny random Llama, against a forward per sequence
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, initializer_range=0.5,
                                             max_position_embeddings=64)).eval()
        full = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15], [16, 17, 18, 19, 20]]
        mem = [[3, 4, 21], [10, 22, 23, 24], [16, 25]]
        answers = [[26, 27, 28, 29], [26, 30, 29], [26, 27, 30, 31, 29]]
        masks = [[0, 1, 2, 0], [0, 1, 0], [0, 1, 2, 3, 0]]        # gold words, one token each; 0 = template

        def naive_logp(ctx, ans):
            with torch.no_grad():
                lp = model(input_ids=torch.tensor([ctx + ans])).logits[0].float().log_softmax(-1)
            return [lp[len(ctx) - 1 + j, a].item() for j, a in enumerate(ans)]
        logp_full = [naive_logp(c, a) for c, a in zip(full, answers)]
        logp_mem = [naive_logp(c, a) for c, a in zip(mem, answers)]
        # a threshold halfway between two gold log-probs, so that some tokens are confident and some are not
        gold = sorted(x for lps, m in zip(logp_full + logp_mem, masks + masks) for x, w in zip(lps, m) if w)
        mid = len(gold) // 2
        threshold = math.exp((gold[mid - 1] + gold[mid]) / 2)
        assert gold[mid] - gold[mid - 1] > 1e-3

        def naive_p(lps, mask, conf):
            kept = [x for x, w, c in zip(lps, mask, conf) if w and c]
            return math.exp(sum(kept) / len(kept)) if kept else 0.0
        for mask_mode in ("separate", "full"):      # full: both P on the words the full context is confident on
            out = p_mem_minus_p_full(model, full, mem, answers, masks, pad_id=0, threshold=threshold,
                                     mask_mode=mask_mode)
            for n in range(3):
                conf_full = [x > math.log(threshold) for x in logp_full[n]]
                conf_mem = conf_full if mask_mode == "full" else [x > math.log(threshold) for x in logp_mem[n]]
                p_full, p_mem = naive_p(logp_full[n], masks[n], conf_full), naive_p(logp_mem[n], masks[n], conf_mem)
                assert abs(out["p_full"][n].item() - p_full) < 1e-5 and abs(out["p_mem"][n].item() - p_mem) < 1e-5
                assert abs(out["mem_reward"][n].item() - (p_mem - p_full)) < 1e-5
            n_full, n_mem = out["n_full"].tolist(), out["n_mem"].tolist()
            assert n_mem == n_full if mask_mode == "full" else sum(n_full) + sum(n_mem) == len(gold) - mid
            assert any(out["mem_reward"].tolist())
    """, brings=("memory.py",))
