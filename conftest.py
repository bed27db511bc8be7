"""Shared fixtures.

* ``sft_run``: a tiny SFT checkpoint trained once per pytest run, for the tests whose point is that SFT
  learns (the loss falls, the policy writes valid rounds, RL updates it). How well a short SFT trains
  depends on float summation order (CPU kernels, BLAS, thread count), so the fixture trains with a margin
  and checks the criterion those tests need (``policy_criterion``); short of it, it trains again for
  longer, and then fails naming the criterion.
* ``expert_rollout``: multi-round trajectories BY CONSTRUCTION, for the tests whose point is the agent
  loop (contexts, forced prefix, records): the real ``rollout`` over a real tiny model whose logits follow
  the world's expert (``ExpertTape``), whatever any training would have produced.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StaticCache

import config
import data
import train
from reward import _check_round, outcome_reward
from rollout import AgentConfig, rollout
from search import SearchTool

SFT_ARGS = config.SMALL_SFT_ARGS
# 400 SFT steps (SMALL_SFT_ARGS) are at the edge: with some CPU kernels (AVX2, 1 or 2 threads) the policy writes
# 0 valid trajectories of 16 where others write enough; at 800 it writes 16 of 16. A second, longer run is the
# fallback before the fixture gives up.
SFT_STEPS = (800, 1600)


def policy_criterion(model, tok) -> tuple[bool, str]:
    """What the ``sft_run`` tests need of the fixture policy (greedy, 16 K=2 questions of 1-2 hops, 6 turns):
    at least 36 rounds before the answer, 90% of them format-valid, 4 valid trajectories, 24 rounds on
    the exported test files' questions (every threshold above the strictest test's: a margin)."""
    world, tasks = data.make_tasks(3, 16, [2], (1, 2))
    agent = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=6, max_new_tokens=60, temperature=0.0)
    trajs = rollout(model, tok, tasks, 1, SearchTool(world.docs), agent)
    rounds = [(t, r.text) for tr in trajs for t, r in enumerate(tr.rounds[:-1])]
    ok = sum(_check_round(text, t, False, 2) is None for t, text in rounds)
    valid = sum(outcome_reward(tr)["valid"] for tr in trajs)
    world, tasks = data.held_out_tasks(2, 16, split="test")
    agent = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=12, max_new_tokens=128, temperature=0.0)
    test_rounds = sum(len(t.rounds) for t in rollout(model, tok, tasks, 1, SearchTool(world.docs), agent))
    met = len(rounds) >= 36 and ok >= 0.9 * len(rounds) and valid >= 4 and test_rounds >= 24
    return met, (f"{len(rounds)} rounds before the answer (want >= 36), {ok} format-valid (want >= 90%), "
                 f"{valid} valid trajectories (want >= 4), {test_rounds} rounds on 16 test questions (want >= 24)")


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory):
    """Folder of a finished SFT-only run: ``final/`` holds model + tokenizer, ``metrics.jsonl`` the curve."""
    for steps in SFT_STEPS:
        run = tmp_path_factory.mktemp(f"sft{steps}")
        train.main(["--run", str(run)] + SFT_ARGS + ["--sft-steps", str(steps)])
        model = AutoModelForCausalLM.from_pretrained(run / "final").eval()
        met, figures = policy_criterion(model, AutoTokenizer.from_pretrained(run / "final"))
        if met:
            return run
    pytest.fail(f"the SFT fixture policy did not learn the protocol in {steps} SFT steps: {figures}")


def expert_tape(tok, task, mem_prefix: bool = True) -> tuple[list[str], list[int]]:
    """The expert's rounds of ``task`` and their ids in order, less the "<mem>" the loop forces from round 1 on."""
    rounds = [text for text, _ in data.expert_episode(task)]
    mem = tok.encode("<mem>", add_special_tokens=False)
    tape = []
    for t, text in enumerate(rounds):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids[:1] == mem
        tape += ids[1:] if t > 0 and mem_prefix else ids
    return rounds, tape


class ExpertTape(torch.nn.Module):
    """A real tiny model whose logits follow a tape: the expert's rounds of ONE trajectory, in order, less the
    "<mem>" the loop forces from round 1 on. Every forward of ``generate`` (its prefill, then one per decode step)
    reads the next tape token; the prefix cache's own prefill (a ``DynamicCache``) reads none. One row, or with
    ``every_row`` every row of the batch writes the same tape."""

    def __init__(self, inner, tape: list[int], every_row: bool = False):
        super().__init__()
        self.inner, self.config, self.tape, self.n, self.every_row = inner, inner.config, tape, 0, every_row

    @property
    def device(self):
        return self.inner.device

    def forward(self, input_ids, **kw):
        out = self.inner(input_ids=input_ids, **kw)
        if isinstance(kw.get("past_key_values"), StaticCache):
            assert (self.every_row or input_ids.shape[0] == 1) and self.n < len(self.tape), "one row, within the tape"
            out.logits[:, -1, self.tape[self.n]] += 1e4
            self.n += 1
        return out


@pytest.fixture(scope="session")
def expert_rollout():
    """``run(tasks, tool, cfg) -> trajectories``: the real agent loop, one rollout per task, over a policy that
    writes the expert's rounds (checked: each trajectory's round texts are the expert's)."""
    tok = data.build_tokenizer()
    inner = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64, seed=0).eval()

    def run(tasks, tool, cfg: AgentConfig):
        trajs = []
        for task in tasks:
            rounds, tape = expert_tape(tok, task, cfg.mem_prefix)
            traj, = rollout(ExpertTape(inner, tape), tok, [task], 1, tool, cfg)
            assert [r.text for r in traj.rounds] == rounds[:len(traj.rounds)]
            trajs.append(traj)
        return trajs, tok
    return run
