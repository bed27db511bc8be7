"""Checkpoints, the run folder and its metrics: what a run writes, and how ``--resume`` reads it back.

A run folder holds ``config.json`` (the run's Config), ``metrics.jsonl`` (one JSON row per logged step),
``ckpt/`` (the newest checkpoint), ``sft/`` (the model when SFT ended), ``ref/`` (the KL reference,
``--kl-coef`` > 0 or ``--log-kl``) and ``final/``. Every model folder is ``save_pretrained`` + the tokenizer +
the system prompt it was trained with (``system_prompt.txt``, read back by ``rollout.checkpoint_prompt``) + the
memory reward's probe marker (``probe_think.txt``, ``trained_probe_think``), so a run from it probes as its SFT taught.

* A checkpoint (model + ``trainer.pt``: optimizer, stage + step, torch RNG) is written to ``PATH.tmp`` and
  renamed into place, so a kill leaves either the old or the new one. Data order depends only on
  ``(seed, step)``, so ``--resume`` continues a killed run with the same batches.
* ``resume`` (every recipe's one resume path) loads ``trainer.pt`` and drops the metrics rows a killed
  run logged after its checkpoint: they are logged again, so a resumed run's metrics.jsonl holds each
  step once.
* The KL reference is the policy RL started from, saved once as ``RUN/ref`` when RL starts and loaded
  from there by every run, fresh or resumed: a resumed run pulls towards the same policy as an
  uninterrupted one (a copy of the current model would be the step-s checkpoint).
* Under torchrun every rank calls the savers (FSDP2 gathers the full state, ``dist.full_state``) and
  rank 0 writes; a checkpoint is in the single-process format, so a run resumes with any world size.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from transformers import AutoModelForCausalLM

import dist

def save_checkpoint(path: str, model, tokenizer, optimizer, state: dict, system_prompt: str,
                    probe_think: str = "") -> None:
    """Atomic checkpoint: write to ``path.tmp`` then rename over ``path``. Torchrun: every rank calls it
    (FSDP2 gathers the full state), rank 0 writes."""
    model_sd, optimizer_sd = dist.full_state(model, optimizer)
    if dist.DIST.rank != 0:
        return
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, model, tokenizer, system_prompt, model_sd, probe_think)
    torch.save({"optimizer": optimizer_sd, "state": state,
                "torch_rng": torch.get_rng_state()}, os.path.join(tmp, "trainer.pt"))
    old = path + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def save_model(path: str, model, tokenizer, system_prompt: str, state_dict: dict | None = None,
               probe_think: str = "") -> None:
    """``save_pretrained`` of the (full) model and the tokenizer, plus the system prompt the model was trained
    with (``system_prompt.txt``, read back by ``rollout.checkpoint_prompt``) and the memory reward's probe marker
    (``probe_think.txt``, read back by ``trained_probe_think``; none when ``probe_think`` is empty); rank 0 only."""
    model.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "system_prompt.txt"), "w", encoding="utf-8") as f:
        f.write(system_prompt)
    if probe_think:
        with open(os.path.join(path, PROBE_FILE), "w", encoding="utf-8") as f:
            f.write(probe_think)
    if dist.DIST.fsdp:   # FSDP2 renames the class (FSDPLlamaForCausalLM); the config must name the HF class
        cfg_path = os.path.join(path, "config.json")
        conf = json.load(open(cfg_path))
        conf["architectures"] = [a.removeprefix("FSDP") for a in conf.get("architectures", [])]
        json.dump(conf, open(cfg_path, "w"), indent=2)


PROBE_FILE = "probe_think.txt"


def run_config(checkpoint: str) -> dict:
    """The RUN/config.json of the run that wrote ``checkpoint`` (a run folder or a folder inside one: ``final``,
    ``ckpt``, ``sft``); {} for a checkpoint without one (e.g. a hub model)."""
    for folder in (checkpoint, os.path.dirname(os.path.normpath(checkpoint))):
        path = os.path.join(folder, "config.json")
        if os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
            if "mem_mask" in cfg:                     # RUN/config.json, not a model's config.json
                return cfg
    return {}


def trained_probe_think(checkpoint: str) -> str:
    """The think word the model at ``checkpoint`` learnt to answer after, for the memory reward's probes: its
    ``probe_think.txt``, else the ``probe_think`` of the run that wrote it (a run from before the marker scored
    ``answer``), else ``answer``: a model from elsewhere knows no marker and answers after the expert's own
    ``<think> answer </think>``."""
    path = os.path.join(checkpoint, PROBE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    return run_config(checkpoint).get("probe_think", "answer")


def log_jsonl(path: str, row: dict) -> None:
    if dist.DIST.rank != 0:       # torchrun: rank 0 writes the (already reduced) metrics
        return
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


STAGE_ORDER = {"sft": 0, "memtrain_warmup": 1, "rl": 2, "memtrain": 2}    # a row's stage -> when it is logged


def truncate_metrics(path: str, state: dict) -> None:
    """Drop the metrics rows a killed run logged after its checkpoint ``state`` (they are logged again)."""
    if dist.DIST.rank != 0 or not os.path.exists(path):
        return
    order = lambda stage: STAGE_ORDER.get(stage, 2)
    keep = lambda row: (order(row["stage"]), row["step"]) < (order(state["stage"]), state["step"])
    rows = [ln for ln in open(path) if ln.strip() and keep(json.loads(ln))]
    with open(path, "w") as f:
        f.writelines(rows)


def resume(run: str) -> dict | None:
    """The trainer state of ``RUN/ckpt`` (``optimizer``, ``state`` = stage + step, ``torch_rng``), with the
    metrics rows logged after it dropped; None when there is no checkpoint (the run starts afresh)."""
    path = os.path.join(run, "ckpt", "trainer.pt")
    if not os.path.exists(path):
        return None
    trainer = torch.load(path, weights_only=False)
    truncate_metrics(os.path.join(run, "metrics.jsonl"), trainer["state"])
    return trainer


def check_run(run: str, resuming: bool) -> str:
    """Create the run folder; returns its metrics path. A folder that already holds a run is refused unless
    ``resuming``: two runs' metrics never mix and no checkpoint is overwritten."""
    os.makedirs(run, exist_ok=True)
    metrics_path = os.path.join(run, "metrics.jsonl")
    if not resuming and os.path.exists(metrics_path):
        raise SystemExit(f"{run} already holds a run ({metrics_path}); pass --resume to continue it, "
                         f"or choose another --run")
    return metrics_path


def write_config(run: str, config: dict) -> None:
    """``RUN/config.json``: the run's Config (rank 0); eval.py reads the memory reward's settings from it."""
    if dist.DIST.rank == 0:
        with open(os.path.join(run, "config.json"), "w") as f:
            json.dump(config, f, indent=1)


def reference_model(model, run: str, start: int):
    """The KL reference = the policy RL started from: saved as ``RUN/ref`` at RL step 0, always loaded from there.

    On ``--resume`` (start > 0) ``model`` is the step-s checkpoint, so the reference must come from disk.
    It is loaded in the policy's dtype, so at step 0 the KL is exactly 0.
    """
    path = os.path.join(run, "ref")
    if start == 0:                      # RL starts (or restarts before its first checkpoint): this is the reference
        if dist.DIST.rank == 0:         # torchrun: one writer, the others wait for it (all_sum is the barrier)
            tmp = path + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
        dist.all_sum([0.0])
    elif not os.path.isdir(path):
        raise SystemExit(f"--kl-coef > 0 on --resume needs the KL reference {path}, saved when RL started")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=model.dtype,
                                               attn_implementation=model.config._attn_implementation)
    return ref.to(model.device).eval().requires_grad_(False)
