"""``bench.py``'s figure 9 holds SFT and the RL step's phases against the machine's floor: its token counts must be
the tokens the model computed. Each is checked against the model's own forward calls, counted at the forward."""
from collections import defaultdict

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import bench_update
import sft
import train


def test_the_floor_counts_the_tokens_each_phase_computes(sft_run, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(sft_run / "final").eval()
    tok = AutoTokenizer.from_pretrained(sft_run / "final")
    phase, calls = ["rollout"], defaultdict(list)     # (positions, real tokens) of each forward, by phase
    real_forward, real_advantages, real_run_sft = type(model).forward, train.memory_advantages, sft.run_sft

    def forward(self, *a, input_ids=None, attention_mask=None, **k):
        if torch.is_grad_enabled() or phase[0] == "reward":     # the rollout's forwards are not counted
            calls[phase[0]].append((input_ids.numel(), int(attention_mask.sum())))
        return real_forward(self, *a, input_ids=input_ids, attention_mask=attention_mask, **k)

    def in_phase(name, fn, after):
        def run(*a, **k):
            phase[0] = name(k)
            try:
                return fn(*a, **k)
            finally:
                phase[0] = after
        return run
    monkeypatch.setattr(type(model), "forward", forward)       # the figures' copies of the model count too
    monkeypatch.setattr(train, "memory_advantages", in_phase(lambda k: "reward", real_advantages, "update"))
    monkeypatch.setattr(sft, "run_sft", in_phase(lambda k: k["desc"], real_run_sft, "done"))

    st = bench_update.bench_train_step(model, tok, torch.device("cpu"), 1)
    assert calls["reward"] and calls["update"]     # every update skipped (scores tied): the forced one is counted
    assert st["update_padded"] == pytest.approx(sum(n for n, _ in calls["update"]))
    assert st["update_tokens"] == sum(r for _, r in calls["update"]) < st["update_padded"]
    assert st["reward_tokens"] == sum(r for _, r in calls["reward"])

    sf = bench_update.bench_sft(model, tok, torch.device("cpu"), 2, bench_update.matmul_peak(torch.device("cpu"), 256))
    assert sf["stages"] == ["copy", "expert"]                # the default SFT has a copy warm-up
    for stage in sf["stages"]:
        done = calls[f"bench sft ({stage})"]
        assert len(done) > 2                              # more than one micro-batch a step: each one counted
        assert sf[stage]["padded_tokens"] * 2 == sum(p for p, _ in done)
        assert sf[stage]["real_tokens"] * 2 == sum(r for _, r in done) < sum(p for p, _ in done)
