"""LoRA RL (``--lora-rank``): the base stays bit-identical while the adapters move, the optimizer holds the
adapters alone, a checkpoint is the adapters (put back on ``RUN/base`` by ``--resume``, which continues as the
uninterrupted run), ``RUN/final`` is the merged plain model that eval.py and ``from_pretrained`` load, the KL
reference is the base (the same module, adapters off), and SmolLM2 trains under rank 16 the same way."""
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import checkpoint
import eval as ev
import grpo
import models
import train
from rollout import checkpoint_prompt

CPU = torch.device("cpu")
# the fixture policy, sampled hot with threshold 0 (test_train.py's settings): every step has memory-reward signal
RL_ARGS = ["--questions", "2", "--group", "3", "--max-turns", "5", "--rl-objectives", "2", "--rl-hops", "1-2",
           "--eval-every", "0", "--save-every", "1", "--lr", "1e-2", "--max-new-tokens", "40", "--temperature", "0.5",
           "--threshold", "0", "--lora-rank", "4", "--lora-alpha", "8", "--log-kl"]   # with LoRA the KL costs no copy


def rl_rows(run) -> list[dict]:
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if not k.startswith("sec")} for r in rows if r["stage"] == "rl"]


def base_weights(model) -> dict:
    """The frozen weights of a LoRA policy under their plain model names (what ``RUN/base`` holds)."""
    return {n.removeprefix("base_model.model.").replace(".base_layer", ""): p.detach().clone()
            for n, p in model.named_parameters() if "lora_" not in n}


@pytest.fixture(scope="module")
def lora_run(sft_run, tmp_path_factory):
    """Three LoRA RL steps from the SFT fixture, a checkpoint after each."""
    run = tmp_path_factory.mktemp("lora") / "run"
    train.main(["--run", str(run), "--model", str(sft_run / "final"), "--rl-steps", "3"] + RL_ARGS)
    return run


def test_rl_moves_the_adapters_and_leaves_the_base_bit_identical(sft_run, lora_run):
    rows = rl_rows(lora_run)
    assert len(rows) == 3 and sum("skipped" not in r for r in rows) >= 2, rows
    start = AutoModelForCausalLM.from_pretrained(sft_run / "final").state_dict()
    policy, _ = checkpoint.load_checkpoint(str(lora_run), CPU)
    base = base_weights(policy)
    assert base.keys() <= start.keys() and all(torch.equal(base[k], start[k]) for k in base)
    lora_b = [p for n, p in policy.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.requires_grad for p in lora_b) and any(p.abs().sum() > 0 for p in lora_b)  # B starts at 0
    # the checkpoint: adapters (no full model) and an AdamW state over exactly the trainable tensors
    assert not (lora_run / "ckpt" / "model.safetensors").exists()
    trainer = torch.load(lora_run / "ckpt" / "trainer.pt", weights_only=True)
    n_trainable = sum(p.requires_grad for p in policy.parameters())
    assert len(trainer["optimizer"]["param_groups"][0]["params"]) == n_trainable == len(trainer["optimizer"]["state"])


def test_final_is_the_merged_plain_model_that_eval_scores(lora_run, capsys):
    final = AutoModelForCausalLM.from_pretrained(lora_run / "final")
    assert type(final).__name__ == "LlamaForCausalLM" and not (lora_run / "final" / "adapter_config.json").exists()
    policy, tok = checkpoint.load_checkpoint(str(lora_run), CPU)
    ids = torch.tensor([list(range(5, 40))])
    with torch.no_grad():
        merged, adapted = final(input_ids=ids).logits, policy(input_ids=ids).logits
        base = models.AdaptersOff(policy)(input_ids=ids).logits
    assert torch.allclose(merged, adapted, atol=1e-4) and not torch.allclose(merged, base, atol=1e-4)
    ev.main(["--checkpoint", str(lora_run / "final"), "--objectives", "1", "--tasks", "2", "--max-turns", "4"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]["1"]
    # the same episodes as the adapted policy plays them (the same tokens: tt), so the same scores
    prompt = checkpoint_prompt(str(lora_run / "final"))
    played = ev.evaluate_embedded(policy.eval(), tok, [1], 2, split="test", max_turns=4, system_prompt=prompt)[1]
    keys = ("f1", "em", "valid", "tt", "turns")
    assert {k: out[k] for k in keys} == pytest.approx({k: played[k] for k in keys}) and out["tt"] > 0


def test_kl_reference_is_the_base_with_adapters_off(sft_run, lora_run):
    """The reference the RL loop builds for a LoRA policy: no RUN/ref copy, the base's exact log-probs."""
    policy, _ = checkpoint.load_checkpoint(str(lora_run), CPU)
    ref = checkpoint.reference_model(policy, str(lora_run), 3)
    assert not (lora_run / "ref").exists()
    start = AutoModelForCausalLM.from_pretrained(sft_run / "final")
    ids = torch.tensor([list(range(5, 30)), list(range(30, 55))])
    attn = torch.ones_like(ids)
    with torch.no_grad():
        got, want = grpo.token_logprobs(ref, ids, attn, 0.7), grpo.token_logprobs(start, ids, attn, 0.7)
        moved = grpo.token_logprobs(policy, ids, attn, 0.7)
    assert torch.equal(got, want) and not torch.equal(moved, want)
    rows = rl_rows(lora_run)
    assert rows[0]["kl"] == 0.0                                  # logged from step 0, where policy = reference
    updated = [r for r in rows if "skipped" not in r]
    assert len(updated) >= 2 and updated[1]["kl"] > 1e-6         # after an update, the adapters moved off the base


def test_resume_continues_as_the_uninterrupted_run(sft_run, lora_run, tmp_path):
    """Two steps, a stop (RUN/final written), then --resume to three: the rows and the weights of the run above."""
    run = tmp_path / "run"
    args = ["--run", str(run), "--model", str(sft_run / "final")] + RL_ARGS
    train.main(args + ["--rl-steps", "2"])
    train.main(args + ["--rl-steps", "3", "--resume"])
    assert rl_rows(run) == rl_rows(lora_run)
    a = AutoModelForCausalLM.from_pretrained(run / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(lora_run / "final").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_with_fsdp_is_refused_in_one_line():
    with pytest.raises(SystemExit):
        train.parse_args(["--lora-rank", "8", "--fsdp"])


def test_smollm2_under_rank_16_trains_the_adapters_alone():
    """SmolLM2-135M (``--model smollm2``) under ``--lora-rank 16``: an update (``train.update``, the default
    ``reinforce_update``) on an optimizer over the trainable parameters leaves every base weight bit-identical and
    moves the adapters; the KL reference (adapters off) still gives the base's log-probs."""
    model, tok = models.load_pretrained("smollm2", CPU)
    cfg = train.parse_args(["--model", "smollm2", "--lora-rank", "16", "--lr", "1e-3", "--temperature", "1"])
    ids = tok.encode("<mem> Paris is the capital of France </mem> <think> answer </think> <answer> Paris </answer>")
    samples = [grpo.target_row(ids[:4], ids[4:], adv_t=1.0, traj=0),
               grpo.target_row(ids[:4], ids[4:-3], adv_t=-1.0, traj=1)]
    x = grpo.collate(samples, tok.pad_token_id, CPU)
    with torch.no_grad():
        before = grpo.token_logprobs(model, x["ids"], x["attn"])
    start = {k: v.clone() for k, v in model.state_dict().items()}
    policy = models.attach_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.seed)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert 0 < sum(p.numel() for p in trainable) < 0.05 * sum(p.numel() for p in policy.parameters())
    m = train.update(policy, None, torch.optim.AdamW(trainable, lr=cfg.lr), samples, cfg, tok.pad_token_id)
    assert "skipped" not in m
    base = base_weights(policy)
    assert all(torch.equal(base[k], start[k]) for k in base) and len(base) >= len(start) - 1   # tied head: one name
    assert any(p.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        ref = grpo.token_logprobs(models.AdaptersOff(policy), x["ids"], x["attn"])
        after = grpo.token_logprobs(policy, x["ids"], x["attn"])
    assert torch.equal(ref, before) and not torch.equal(after, before)
