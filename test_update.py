"""The update (train.update: REINFORCE by default, ppo.ppo_update for PPO's knobs) on hand-built samples: it
changes weights, its gradient equals a naive per-trajectory loss with or without micro-batches, the default path
and PPO's at its first step give the same weights, it moves log-probabilities the way the advantages point, and a
non-finite batch is skipped with the weights untouched."""
import copy
import inspect

import pytest
import torch

import data
import grpo
import ppo
import sft
import train


def hand_built_samples(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L, P = int(torch.randint(8, 20, (1,), generator=g)), 5
        ids = torch.randint(5, 200, (L,), generator=g).tolist()
        mem = [(P - 1, P + 2, 0.5 * (-1.0) ** (i // 2))]            # the forced prefix + 2 sampled tokens
        out.append(grpo.Sample(ids, [(P, L)], mem, adv_t=(-1.0) ** i))
    return out


def test_the_default_update_changes_weights_and_reports_the_reinforce_loss_and_padding_by_hand():
    """The default update's loss is -(sum over the policy tokens of A * log p) / their count: each row's A_T on its
    L - 5 policy tokens plus its A_M on the 2 of them inside its <mem> span, times the log-probabilities before the
    step (computed here apart, row by row). The padding waste is grpo.padding_waste of the same micro-batches."""
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
    cfg = train.parse_args(["--lr", "1e-2", "--micro-tokens", "40"])      # forces several micro-batches
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    samples = hand_built_samples()
    before = [p.detach().clone() for p in model.parameters()]
    weighted = 0.0
    with torch.no_grad():
        for s in samples:
            logp = grpo.token_logprobs(model, torch.tensor([s.ids]), torch.ones(1, len(s.ids)), cfg.temperature)[0]
            adv = torch.full((len(s.ids),), s.adv_t)
            adv[s.mem[0][0]:s.mem[0][1]] += s.mem[0][2]
            weighted += (adv * logp)[5:].sum().item()                   # the policy tokens: from position 5 on
    m = train.update(model, None, opt, samples, cfg, tok.pad_token_id)
    assert "skipped" not in m
    assert m["loss"] == pytest.approx(-weighted / sum(len(s.ids) - 5 for s in samples), abs=1e-5)
    batches = grpo.micro_batches(samples, 40)
    assert len(batches) >= 3 and m["padding_waste"] == pytest.approx(grpo.padding_waste(batches), abs=1e-12)
    assert m["padding_waste"] > 0                                       # rows of unequal length share a batch
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_default_reinforce_step_and_ppos_first_step_give_the_same_weights_bit_for_bit():
    """At one epoch and one mini-batch every PPO ratio is exactly 1 and the clip never acts, so ppo.ppo_update's
    clipped loss has -(A * d log p) as its gradient, float for float: the default path is that step, written
    plainly. Several micro-batches, A_T and A_M, AdamW: the same weights after, bit for bit."""
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
    twin = copy.deepcopy(model)
    cfg = train.parse_args(["--lr", "1e-2", "--micro-tokens", "40"])
    train.reinforce_update(model, torch.optim.AdamW(model.parameters(), lr=cfg.lr), hand_built_samples(), cfg,
                           tok.pad_token_id)
    ppo.ppo_update(twin, None, torch.optim.AdamW(twin.parameters(), lr=cfg.lr), hand_built_samples(), cfg,
                   tok.pad_token_id)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    start = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), start.parameters()))


def test_ppo_with_two_epochs_and_kl_reference_is_finite():
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
    ref = copy.deepcopy(model)
    cfg = train.parse_args(["--lr", "1e-2", "--ppo-epochs", "2", "--kl-coef", "0.1", "--agg", "seq-mean-token-mean"])
    m = train.update(model, ref, torch.optim.AdamW(model.parameters(), lr=cfg.lr), hand_built_samples(seed=1),
                         cfg, tok.pad_token_id)
    assert "skipped" not in m and m["clip_frac"] > 0      # epoch 2 moved off-policy
    assert m["kl"] > 1e-6                                  # ... and away from the reference
    # one epoch against a reference equal to the policy: k3 is exactly 0 on every token
    model2 = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
    cfg1 = train.parse_args(["--kl-coef", "0.1", "--agg", "seq-mean-token-mean"])
    m1 = train.update(model2, copy.deepcopy(model2), torch.optim.AdamW(model2.parameters()),
                          hand_built_samples(seed=1), cfg1, tok.pad_token_id)
    assert m1["kl"] == 0.0


def _sgd_step(samples, cfg_args, seed=0):
    """Weights after one ``train.update`` (``reinforce_update`` at token-mean, ``ppo.ppo_update`` for a seq-mean
    ``--agg``) with plain SGD at lr 1 and no clipping: old - new = the gradient."""
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, seed=seed)
    cfg = train.parse_args(cfg_args + ["--grad-clip", "1e9", "--temperature", "1"])   # the naive loss has no T
    before = [p.detach().clone() for p in model.parameters()]
    m = train.update(model, None, torch.optim.SGD(model.parameters(), lr=1.0), samples, cfg, tok.pad_token_id)
    assert "skipped" not in m
    return [b - p.detach() for b, p in zip(before, model.parameters())], m


def _naive_gradient(samples, agg, seed=0):
    """Each row run alone; on-policy ratio exp(logp - logp.detach()); loss per trajectory, then the mean."""
    from grpo import token_logprobs
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, seed=seed)
    per_traj: dict = {}
    for s in samples:
        ids = torch.tensor([s.ids])
        logp = token_logprobs(model, ids, torch.ones_like(ids))[0, s.n_prompt:]          # policy tokens
        a_m = torch.zeros(len(s.ids))
        for a, b, x in s.mem:
            a_m[a:b] = x
        adv = s.adv_t + a_m[s.n_prompt:]
        per_traj.setdefault(s.traj, []).append(-adv * torch.exp(logp - logp.detach()))
    toks = {k: torch.cat(v) for k, v in per_traj.items()}
    if agg == "token-mean":
        loss = sum(t.sum() for t in toks.values()) / sum(len(t) for t in toks.values())
    else:
        loss = sum(t.mean() for t in toks.values()) / len(toks)
    loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_the_update_gradient_equals_naive_per_trajectory_loss_with_or_without_micro_batches(agg):
    samples = hand_built_samples(n=8, seed=2)
    for i, s in enumerate(samples):
        s.traj = [0, 0, 0, 1, 1, 2, 3, 3][i]        # rows of one trajectory differ in length: sorting splits them
    small, m = _sgd_step(samples, ["--agg", agg, "--micro-tokens", "40"])
    one, _ = _sgd_step(samples, ["--agg", agg, "--micro-tokens", "100000"])
    batches = grpo.micro_batches(samples, 40)
    assert len(batches) >= 3
    split = [t for t in range(4) if len({bi for bi, b in enumerate(batches) for s in b if s.traj == t}) > 1]
    assert split, "no trajectory was split across micro-batches"
    naive = _naive_gradient(samples, agg)
    for a, b, g in zip(small, one, naive):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
        assert torch.allclose(a, g, atol=1e-6), (a - g).abs().max()


def test_update_raises_logprob_of_positive_and_lowers_negative_advantage_tokens():
    from grpo import token_logprobs
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
    up = tok.encode("<mem> 1 = bobi friend </mem> <think> search </think>", add_special_tokens=False)
    down = tok.encode("<think> answer </think> <answer> gonu </answer>", add_special_tokens=False)
    up = grpo.target_row(up[:3], up[3:], adv_t=1.0, traj=0)
    down = grpo.target_row(down[:3], down[3:], adv_t=-1.0, traj=1)

    def policy_logp(s):
        ids = torch.tensor([s.ids])
        with torch.no_grad():
            return token_logprobs(model, ids, torch.ones_like(ids))[0, s.n_prompt:].sum().item()
    before = policy_logp(up), policy_logp(down)
    cfg = train.parse_args(["--lr", "1e-3"])
    train.update(model, None, torch.optim.SGD(model.parameters(), lr=cfg.lr), [up, down], cfg, tok.pad_token_id)
    after = policy_logp(up), policy_logp(down)
    assert after[0] > before[0] and after[1] < before[1]


def test_non_finite_update_is_skipped_and_weights_untouched():
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
    samples = hand_built_samples()
    samples[0].adv_t = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    m = train.update(model, None, torch.optim.AdamW(model.parameters()), samples, train.parse_args([]),
                         tok.pad_token_id)
    assert m["skipped"].startswith("non-finite")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class CountingSGD(torch.optim.SGD):
    """SGD that keeps the gradient it stepped with, each step."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.grads = []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_each_minibatch_is_one_optimizer_step_over_its_own_token_counts(agg):
    """Two mini-batches: two optimizer steps, the first one's gradient that of the naive loss over the first
    mini-batch ALONE (its own token / trajectory counts as denominators); one mini-batch is the whole-batch step."""
    samples = hand_built_samples(n=8, seed=2)
    for i, s in enumerate(samples):
        s.traj = [0, 0, 0, 1, 1, 2, 3, 3][i]
    parts = ppo.minibatch_split(samples, 2)
    assert [sorted({s.traj for s in p}) for p in parts] == [[0, 1], [2, 3]]      # whole trajectories, in order
    assert ppo.minibatch_split(samples, 1) == [samples]
    tok = data.build_tokenizer()
    for n, first in ((1, samples), (2, parts[0])):
        model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, seed=0)
        cfg = train.parse_args(["--agg", agg, "--micro-tokens", "40", "--grad-clip", "1e9", "--temperature", "1",
                                "--ppo-minibatches", str(n)])
        opt = CountingSGD(model.parameters(), lr=1.0)
        m = train.update(model, None, opt, samples, cfg, tok.pad_token_id)
        assert "skipped" not in m and len(opt.grads) == n
        for a, g in zip(opt.grads[0], _naive_gradient(first, agg)):
            assert torch.allclose(a, g, atol=1e-6), (a - g).abs().max()


def test_the_clip_acts_from_the_second_minibatch_on():
    tok = data.build_tokenizer()
    samples = hand_built_samples(n=8, seed=1)
    for i, s in enumerate(samples):
        s.traj = i
    ratios = {}
    for n in (1, 2):
        model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
        cfg = train.parse_args(["--lr", "3e-2", "--ppo-minibatches", str(n)])
        ratios[n] = train.update(model, None, torch.optim.AdamW(model.parameters(), lr=cfg.lr), samples, cfg,
                                     tok.pad_token_id)
    assert "clip_frac" not in ratios[1] and ratios[2]["clip_frac"] > 0      # one step: REINFORCE, nothing to clip


def _growing_trajectory():
    """Three full-context rounds: each round's context is the one before + that round + its tool result."""
    from rollout import Round, Trajectory
    ctx0 = [1, 2, 3]
    ctx1 = ctx0 + [10, 11, 12] + [4, 5]
    ctx2 = ctx1 + [20, 21, 22, 23, 24] + [6, 7]
    rounds = [Round(ctx0, [], [10, 11, 12], "", 0, "search"), Round(ctx1, [20], [21, 22, 23, 24], "", 3, "search"),
              Round(ctx2, [20], [31, 32], "", 2, "answer")]
    return Trajectory("q", [["a"]], 0, ctx0, [], rounds)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_a_full_context_trajectory_is_one_row_with_every_rounds_spans_and_the_same_gradient(agg):
    """--train-context full: a trajectory whose contexts grow is ONE row (its last round's context + output), each
    round's policy tokens and <mem> span (forced prefix included) at their positions in it; its update gradient is
    the one of the same rounds as separate rows."""
    trajs = [_growing_trajectory(), _growing_trajectory()]
    trajs[1].rounds[2] = type(trajs[1].rounds[2])([9] + trajs[1].rounds[2].context_ids[1:], [20], [33], "", 2,
                                                  "answer")      # round 3 does not extend round 2: rows per round
    adv_m = {(0, 1): 0.75, (0, 2): -2.0, (1, 1): 1.5}
    one = train.build_samples(trajs, torch.tensor([1.0, -0.5]), adv_m, one_row=True)
    per_round = train.build_samples(trajs, torch.tensor([1.0, -0.5]), adv_m)
    assert len(per_round) == 6 and len(one) == 4
    row = one[0]
    assert row.ids == [1, 2, 3, 10, 11, 12, 4, 5, 20, 21, 22, 23, 24, 6, 7, 20, 31, 32]
    assert row.policy == [(3, 6), (9, 13), (16, 18)] and row.mem == [(8, 11, 0.75), (15, 17, -2.0)]
    assert [s.ids for s in one[1:]] == [s.ids for s in per_round[3:]]
    for a, b in zip(_sgd_step(one, ["--agg", agg])[0], _sgd_step(per_round, ["--agg", agg])[0]):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()


def test_asymmetric_clip_bounds_and_the_dual_clip_reach_policy_loss(monkeypatch):
    """--clip-low 0.1 --clip-high 0.3 --dual-clip 3 over two mini-batches (the clip acts from the second): every
    policy_loss call gets each bound in its own place (swapped or symmetric bounds fail here)."""
    seen = []
    real = ppo.policy_loss

    def spy(*a, **kw):
        args = inspect.signature(real).bind(*a, **kw)
        args.apply_defaults()
        seen.append((args.arguments["clip_low"], args.arguments["clip_high"], args.arguments["dual_clip"]))
        return real(*a, **kw)
    monkeypatch.setattr(ppo, "policy_loss", spy)
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
    cfg = train.parse_args(["--clip-low", "0.1", "--clip-high", "0.3", "--dual-clip", "3", "--ppo-minibatches", "2",
                            "--lr", "3e-2"])
    m = train.update(model, None, torch.optim.AdamW(model.parameters(), lr=cfg.lr), hand_built_samples(n=8, seed=1),
                         cfg, tok.pad_token_id)
    assert "skipped" not in m and m["clip_frac"] > 0
    assert len(seen) >= 2 and set(seen) == {(0.1, 0.3, 3.0)}


def test_log_kl_leaves_the_default_update_as_it_is_and_logs_ppos_kl():
    """``--log-kl`` at ``--kl-coef`` 0 only logs: the same weights as without it, bit for bit, the same metrics
    keys plus ``kl``, and that ``kl`` is the one ppo.py logs against the same reference on the same rows."""
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
    ref = data.build_tiny_model(tok, hidden=32, layers=1, heads=2, seed=1).eval()   # another policy: kl > 0
    plain, twin = copy.deepcopy(model), copy.deepcopy(model)
    cfg = train.parse_args(["--lr", "1e-2", "--micro-tokens", "40", "--log-kl"])
    opt = lambda m: torch.optim.AdamW(m.parameters(), lr=cfg.lr)
    logged = train.update(model, ref, opt(model), hand_built_samples(), cfg, tok.pad_token_id)
    base = train.update(plain, None, opt(plain), hand_built_samples(), cfg, tok.pad_token_id)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    assert set(logged) == set(base) | {"kl"} and logged["loss"] == base["loss"]
    via_ppo = ppo.ppo_update(twin, ref, opt(twin), hand_built_samples(), cfg, tok.pad_token_id)
    assert logged["kl"] > 0 and logged["kl"] == pytest.approx(via_ppo["kl"], rel=1e-5)


def test_gradient_checkpointing_recomputes_each_layer_in_the_backward_and_gives_the_same_gradients(tmp_path):
    """--gradient-checkpointing (train.load_policy): the policy's decoder layers run again in the backward pass (a
    layer's MLP runs twice per SFT or RL loss, once without the flag), the gradients of both losses
    are those without it, and generation (eval mode, no grad) writes the same rollouts."""
    import sft
    from rollout import AgentConfig, rollout
    from search import SearchTool
    tiny = ["--hidden", "32", "--layers", "2", "--heads", "2", "--ffn", "64", "--run", str(tmp_path)]
    models = {}
    for on in (False, True):
        cfg = train.parse_args(tiny + (["--gradient-checkpointing"] if on else []))
        models[on] = train.load_policy(cfg, torch.device("cpu"))[0]
        assert models[on].is_activation_checkpointing == on
    tok = data.build_tokenizer()
    batch = grpo.collate(hand_built_samples(), tok.pad_token_id, torch.device("cpu"))
    losses = {"sft": lambda m: sft.sft_loss(m, batch, 40.0),
              "rl": lambda m: -(grpo.token_logprobs(m, batch["ids"], batch["attn"], 0.7) * batch["loss_mask"]).sum()}
    for name, loss in losses.items():
        grads, calls = {}, {}
        for on, model in models.items():
            model.train().zero_grad()
            calls[on] = 0
            mlp = model.model.layers[0].mlp
            mlp.forward = lambda x, mlp=mlp, on=on: calls.__setitem__(on, calls[on] + 1) or type(mlp).forward(mlp, x)
            loss(model).backward()
            del mlp.forward
            grads[on] = [p.grad.clone() for p in model.parameters()]
        assert calls == {False: 1, True: 2}, name
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[False], grads[True])), name
    world, tasks = data.make_tasks(3, 4, [2], (1, 2))
    agent = AgentConfig(system_prompt=data.SYSTEM_PROMPT, max_turns=2, max_new_tokens=12, temperature=0.0)
    texts = {on: [[r.text for r in t.rounds] for t in rollout(m.eval(), tok, tasks, 2, SearchTool(world.docs), agent)]
             for on, m in models.items()}
    assert texts[True] == texts[False]


@pytest.mark.parametrize("extra", [[], ["--ppo-epochs", "2"]])
def test_no_gradient_is_held_after_an_update_step(extra):
    """The gradients are freed at the optimizer step, not at the next update's start: the rollout between them
    (its KV cache, on a card of weights + AdamW state) does not carry a copy of the weights' size."""
    tok = data.build_tokenizer()
    model = data.build_tiny_model(tok, hidden=32, layers=1, heads=2)
    cfg = train.parse_args(extra)
    before = [p.detach().clone() for p in model.parameters()]
    m = train.update(model, None, torch.optim.AdamW(model.parameters(), lr=1e-3), hand_built_samples(), cfg,
                     tok.pad_token_id)
    assert "skipped" not in m and any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sft.run_sft(model, opt, lambda step: hand_built_samples(), range(1), lambda step: 1e-3, cfg, tok.pad_token_id,
                lambda *a: None)
    assert all(p.grad is None for p in model.parameters()) and opt.state
