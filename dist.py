"""torchrun: the process group, the DDP / FSDP2 wrappers, and the few collectives the trainer needs.

Plumbing, kept out of the algorithm. One RL step (``train.rl_step``) meets the other ranks at three named points:
``my_share`` (this rank's questions, rolled out and scored alone), ``metrics.rl_metrics`` (``gather_metrics``) and
``train.update``, which sends a torchrun step to ``ppo.ppo_update``: every collective of the update (global
denominators, ``backward``, ``grad_sync``, ``even_micro_batches``, ``any_rank``) is there, and the default
single-process update (``train.reinforce_update``) has none. Around the step: ``train.run_rl`` (the slowest rank's
seconds, rank 0's evaluation), ``sft.run_sft`` (``update_module`` / ``grad_sync`` / ``all_sum``) and
``checkpoint.py`` (``full_state``; rank 0 writes).

  torchrun --standalone --nproc_per_node 8 train.py --run-dir runs/x ...       (one node, 8 GPUs)

``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK; ``setup_distributed`` then opens a process group
(nccl on CUDA, gloo on CPU) and binds GPU LOCAL_RANK. Without them (plain ``python train.py``) the
functions below are identities: no process group, no wrapper, no communication.

* Rollouts are split by question: rank r takes questions [r*B/W, (r+1)*B/W) of the step (the same
  ``rl_tasks`` list on every rank) and all G rollouts of each, so a group never spans ranks and the
  outcome advantage, the memory reward and its pool need no communication.
* Seeding (a choice): rank r samples its share with one generator seeded from (seed, step, its first
  question's index), one batched rollout per rank; rank 0 of 1 uses exactly the single-process seed. A W-rank
  run therefore draws different (equally distributed) rollouts from a 1-rank run.
* The update is the single-process update: every loss denominator is the GLOBAL batch's
  (``denominators``: one all_reduce), each rank back-propagates loss * W (DDP and FSDP2 average
  gradients over ranks; the sum over ranks of the per-rank losses is the global loss), gradients
  are synchronised once per optimizer step (no_sync / ``set_requires_gradient_sync`` on all other
  micro-batches), and every rank runs the same number of micro-batches (short ranks add an empty
  one: loss 0) because FSDP2 all-gathers in every forward. Grad-norm clipping sees the global
  gradient (DDP: identical on every rank; FSDP2: ``clip_grad_norm_`` reduces the DTensor norm).
* Default DDP (weights replicated); ``--fsdp``: FSDP2 ``fully_shard`` on each decoder layer, then the
  root. Generation and the memory-reward pass under FSDP2 run inside ``full_weights``: every layer is
  unsharded once (one all-gather per layer) and kept unsharded until the rollout is scored, so the
  ranks' different numbers of decode steps need no communication; memory during the rollout is then
  the full model (bf16 weights of one replica) on every GPU, as with DDP, plus the sharded gradients
  and optimizer state; it is freed (resharded) before the update.
* Errors: the collective-free phase of a step (rollout, rewards) runs under ``all_ranks_or_none``:
  a status flag is all-reduced after it, and if one rank raised, every rank stops with an error
  naming it (the failing rank raises its own exception). A step skipped for zero advantages or a
  non-finite loss / gradient is decided on global numbers, so every rank skips it. A collective that
  waits longer than ``--dist-timeout`` seconds fails instead of hanging, and torchrun ends the other
  workers when one exits with an error.
* Metrics are computed from every rank's per-trajectory values (gathered) with the single-process
  formulas; seconds are the slowest rank's; rank 0 writes metrics.jsonl, config.json and every
  checkpoint. A checkpoint is a full ``save_pretrained`` model (FSDP2 gathers it to rank 0) and a
  full optimizer state in the single-process format, so a run resumes with any world size, and
  every rank reads it (multi-node: the run folder must be on a shared filesystem).
* Evaluation (periodic evals here, and eval.py) runs on rank 0 only.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from grpo import Sample
from models import pick_device

@dataclass
class Dist:
    """This process's place in the run; the defaults are plain ``python train.py``."""
    active: bool = False          # a process group is open (torchrun, any world size)
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    fsdp: bool = False
    comm_device: str = "cpu"      # where the small tensors of all_reduce live (cuda for nccl)
    ddp: object = None            # the DDP wrapper used for the update (the raw model does everything else)


DIST = Dist()          # one object, updated in place: ``from dist import DIST`` sees the process group


def setup_distributed(cfg) -> torch.device:
    """Under torchrun: open the process group, bind a GPU, check B % W; always returns this rank's device.

    ``cfg``: the trainer's Config (``device``, ``fsdp``, ``questions``, ``dist_timeout``)."""
    if "WORLD_SIZE" not in os.environ:
        if cfg.fsdp:
            raise SystemExit("--fsdp needs torchrun (e.g. torchrun --standalone --nproc_per_node 2 train.py ...)")
        return pick_device(cfg.device)
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if cfg.questions % world:
        raise SystemExit(f"--questions {cfg.questions} is not divisible by the {world} ranks: each rank takes "
                         f"questions / ranks questions of a step")
    tdist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                             timeout=datetime.timedelta(seconds=cfg.dist_timeout))
    DIST.__init__(True, rank, world, local_rank, cfg.fsdp, str(device) if device.type == "cuda" else "cpu")
    return device


def close() -> None:
    """End the process group (torchrun), once every rank is done; nothing otherwise."""
    if DIST.active:
        all_sum([0.0])
        # DDP's reducer holds the group: freed at interpreter exit instead, gloo's threads can abort the process
        DIST.ddp = None
        gc.collect()
        tdist.destroy_process_group()


def is_dist() -> bool:
    return DIST.active


def all_sum(values: list[float]) -> list[float]:
    """Sum of each value over ranks (float64, one all_reduce)."""
    if not is_dist():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=DIST.comm_device)
    tdist.all_reduce(t)
    return t.tolist()


def any_rank(flag: bool) -> bool:
    """True when ``flag`` holds on any rank (every rank gets the same answer)."""
    return bool(all_sum([float(flag)])[0])


def backward(loss: torch.Tensor) -> None:
    """Back-propagate this rank's part of the global loss: DDP and FSDP2 average gradients over ranks, and the
    global loss is the sum of the ranks' losses, so each rank back-propagates loss * W (plain: the loss)."""
    (loss * DIST.world).backward()


def all_max(values: list[float]) -> list[float]:
    """Max of each value over ranks."""
    if not is_dist():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=DIST.comm_device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t.tolist()


def gather(xs: list) -> list:
    """Concatenation of every rank's list, in rank order (= question order); plain: ``xs`` itself."""
    if not is_dist():
        return xs
    parts = [None] * DIST.world
    tdist.all_gather_object(parts, xs)
    return [x for p in parts for x in p]


def my_questions(n: int) -> range:
    """Indices of this rank's share of a step's ``n`` questions."""
    if n % DIST.world:
        raise ValueError(f"{n} questions cannot be split evenly over {DIST.world} ranks")
    k = n // DIST.world
    return range(DIST.rank * k, (DIST.rank + 1) * k)


def seq_key(s: Sample) -> tuple:
    """The sequence a row belongs to for ``seq-mean-*``: its trajectory (a row without one is its own)."""
    return ("traj", s.traj) if s.traj is not None else ("row", id(s))


def denominators(samples: list[Sample]) -> dict:
    """Every loss denominator of ``ppo.ppo_update`` for the WHOLE batch (micro-batches split trajectories) and, under
    torchrun, the GLOBAL one: policy tokens and sequences summed over ranks in one all_reduce; per sequence
    (= trajectory) its policy tokens, local, since a trajectory's rows never leave its rank."""
    seq_tokens: dict = {}
    for s in samples:
        seq_tokens[seq_key(s)] = seq_tokens.get(seq_key(s), 0.0) + s.n_policy
    local = [float(sum(seq_tokens.values())), float(sum(1 for n in seq_tokens.values() if n > 0))]
    n_tokens, n_seqs = all_sum(local)
    return {"n_tokens": n_tokens, "n_seqs": n_seqs, "seq_tokens": seq_tokens}


def even_micro_batches(batches: list[list[Sample]], pad_id: int) -> list[list[Sample]]:
    """Append empty micro-batches (one row of padding, loss mask 0) until every rank has as many."""
    n = int(all_max([len(batches)])[0])
    return batches + [[Sample(ids=[pad_id, pad_id], policy=[])] for _ in range(n - len(batches))]


def update_module(model):
    """The module to run forward + backward of the update through: the DDP wrapper, else the model."""
    return DIST.ddp if DIST.ddp is not None else model


@contextlib.contextmanager
def grad_sync(model, sync: bool):
    """Synchronise gradients in this backward only when ``sync`` (the optimizer step's last micro-batch)."""
    if DIST.ddp is not None and not sync:
        with DIST.ddp.no_sync():
            yield
        return
    if DIST.fsdp:
        model.set_requires_gradient_sync(sync)
    yield


def wrap_for_training(model, device: torch.device):
    """DDP (default) or FSDP2 (``--fsdp``) under torchrun; returns the model (FSDP2 wraps it in place)."""
    if not is_dist():
        return model
    if DIST.fsdp:
        for t in model.state_dict().values():      # identical weights on every rank before sharding
            tdist.broadcast(t, 0)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    # no buffer sync: rotary buffers are constants, and a broadcast per forward would be a collective in every
    # forward (DDP broadcasts the parameters from rank 0 once, here). torch 2.13 names it forward_sync_buffers
    # (broadcast_buffers is deprecated there); older torch has only broadcast_buffers.
    no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else "broadcast_buffers")
    DIST.ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       **{no_sync: False})
    return model


@contextlib.contextmanager
def full_weights(model):
    """FSDP2: unshard every layer for generation / scoring (ranks may then run different numbers of
    forwards with no communication), reshard after. Other modes: nothing to do."""
    if not DIST.fsdp:
        yield
        return
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.unshard()
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
        model.set_reshard_after_forward(True)


@contextlib.contextmanager
def all_ranks_or_none(what: str):
    """Run a collective-free block on every rank; if it raised on any rank, raise on every rank."""
    failed = True
    try:
        yield
        failed = False
    finally:
        if is_dist():
            n_failed = all_sum([float(failed)])[0]
            if n_failed and not failed:
                raise RuntimeError(f"{what}: {int(n_failed)} other rank(s) failed; stopping this rank too")


def grad_norm_value(gn: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_``'s total norm as a plain tensor (FSDP2 returns a DTensor)."""
    return gn.full_tensor() if hasattr(gn, "full_tensor") else gn


def full_state(model, optimizer) -> tuple[dict | None, dict | None]:
    """(model state dict or None = the model's own, optimizer state dict in single-process format);
    under FSDP2 both are gathered (every rank must call this) and only rank 0 gets them."""
    if not DIST.fsdp:
        return None, optimizer.state_dict() if optimizer else None
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(model, options=opts)
    osd = None
    if optimizer is not None:
        full = get_optimizer_state_dict(model, optimizer, options=opts)
        names = [n for g in full.get("param_groups", []) for n in g["params"]]
        index = {n: i for i, n in enumerate(names)}      # parameter name -> position, as optimizer.state_dict()
        osd = {"state": {index[n]: s for n, s in full.get("state", {}).items()},
               "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in full.get("param_groups", [])]}
    return sd, osd


def load_optimizer(model, optimizer, osd: dict) -> None:
    """Load a single-process-format optimizer state (as ``save_checkpoint`` writes it) into any mode."""
    if not DIST.fsdp:
        optimizer.load_state_dict(osd)
        return
    model.zero_grad(set_to_none=True)     # torch initialises an empty optimizer state only when no grads exist
    names = [n for n, p in model.named_parameters()]      # the order the optimizer was built in
    full = {"state": {names[i]: s for i, s in osd["state"].items()},
            "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in osd["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))


# --------------------------------------------------------------------------- where rl_step meets the other ranks

@contextlib.contextmanager
def my_share(model, tasks: list, what: str):
    """This rank's share of a step's questions -> ``(tasks, q0)``, q0 the global index of its first one.

    The block is the step's collective-free phase (rollout, rewards): under FSDP2 it runs on unsharded
    weights (``full_weights``), and if it raises on one rank every rank stops (``all_ranks_or_none``)."""
    share = my_questions(len(tasks))
    with full_weights(model), all_ranks_or_none(what):
        yield tasks[share.start:share.stop], share.start


def gather_metrics(lists: dict[str, list]) -> dict[str, list]:
    """Every rank's per-trajectory (or per-round) values, concatenated in rank order; plain: unchanged."""
    return {k: gather(v) for k, v in lists.items()}


def slowest(m: dict, keys: tuple[str, ...]) -> dict:
    """The slowest rank's value of each of ``keys`` (seconds)."""
    return dict(zip(keys, all_max([m[k] for k in keys])))
