"""Checkpoints, the run folder and its metrics: what a run writes, and how ``--resume`` reads it back.

A run folder holds ``config.json`` (the run's Config), ``metrics.jsonl`` (one JSON row per logged step),
``ckpt/`` (the newest checkpoint), ``sft/`` (the model when SFT ended), ``ref/`` (the KL reference,
``--kl-coef`` > 0 or ``--log-kl``), ``base/`` (what LoRA adapters sit on) and ``final/``. Every model folder is
``save_pretrained`` + the tokenizer + the system prompt it was trained with (``system_prompt.txt``, read back by
``rollout.checkpoint_prompt``) + the memory reward's probe marker (``probe_think.txt``, ``trained_probe_think``), so
a run from it probes as its SFT taught.

* A checkpoint (model + ``trainer.pt``: optimizer, stage + step, torch RNG) is written to ``PATH.tmp`` and
  renamed into place, so a kill leaves either the old or the new one. Data order depends only on
  ``(seed, step)``, so ``--resume`` continues a killed run with the same batches.
* ``resume`` (every recipe's one resume path) loads ``trainer.pt`` and drops the metrics rows a killed
  run logged after its checkpoint: they are logged again, so a resumed run's metrics.jsonl holds each
  step once.
* The KL reference is the policy RL started from, saved once as ``RUN/ref`` when RL starts and loaded
  from there by every run, fresh or resumed: a resumed run pulls towards the same policy as an
  uninterrupted one (a copy of the current model would be the step-s checkpoint).
* LoRA (``--lora-rank``): RL trains adapters over the policy it starts from, saved once as ``RUN/base``; a
  checkpoint holds the adapters and the optimizer over them (``load_checkpoint`` puts them back on RUN/base),
  the KL reference is RUN/base itself (the adapters switched off: no second copy, no ``RUN/ref``), and
  ``final/`` is the merged plain model.
* ``--report-to tensorboard,wandb``: every metrics row's numbers also go there as ``stage/key`` scalars at the
  row's step (``open_reporters``; tensorboard in ``RUN/tb``, wandb offline unless ``WANDB_MODE`` says otherwise).
* Under torchrun every rank calls the savers (FSDP2 gathers the full state, ``dist.full_state``) and
  rank 0 writes; a checkpoint is in the single-process format, so a run resumes with any world size.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import dist
from models import AdaptersOff, attach_lora, is_lora, load_lora, load_pretrained

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
    """Append ``row`` to the metrics file (rank 0), and its numbers to every ``--report-to`` logger."""
    if dist.DIST.rank != 0:       # torchrun: rank 0 writes the (already reduced) metrics
        return
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    for log, _ in REPORTERS:
        log(row)


REPORTERS: list = []     # (log(row), close()) of each --report-to backend (open_reporters)


def row_scalars(row: dict) -> dict[str, float]:
    """Every number of a metrics row, named ``stage/key`` (a stage counts its own steps; the step is the x axis)."""
    return {f"{row['stage']}/{k}": float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


def open_reporters(run: str, report_to: str, config: dict) -> None:
    """The ``--report-to`` loggers (comma-separated: ``tensorboard``, ``wandb``; ``none``) of this run, each
    given the run's name and config, in place of any open ones; each package is imported only when asked for."""
    for _, close in REPORTERS:
        close()
    REPORTERS.clear()
    name = os.path.basename(os.path.normpath(run))
    for backend in report_to.split(","):
        if backend == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise SystemExit("--report-to tensorboard needs the tensorboard package: pip install tensorboard") \
                    from None
            tb = SummaryWriter(os.path.join(run, "tb"))
            tb.add_text("config", f"run {name}\n\n    " + json.dumps(config, indent=1).replace("\n", "\n    "))

            def log(row, tb=tb):
                for tag, value in row_scalars(row).items():
                    tb.add_scalar(tag, value, row["step"])
                tb.flush()          # a killed run keeps every row it logged
            REPORTERS.append((log, tb.close))
        elif backend == "wandb":
            try:
                import wandb
            except ImportError:
                raise SystemExit("--report-to wandb needs the wandb package: pip install wandb") from None
            os.environ.setdefault("WANDB_MODE", "offline")      # no network unless the user asks for it
            wb = wandb.init(project=os.environ.get("WANDB_PROJECT", "mempo"), name=name, dir=run, config=config)

            def log(row, wb=wb, stages=set()):
                if row["stage"] not in stages:   # each stage on its own step axis (SFT steps, then RL from 0)
                    stages.add(row["stage"])
                    wb.define_metric(f"{row['stage']}/*", step_metric=f"{row['stage']}/step")
                wb.log(row_scalars(row) | {f"{row['stage']}/step": row["step"]})
            REPORTERS.append((log, wb.finish))


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
    metrics rows logged after it dropped; None when there is no checkpoint (``check_run`` refuses that first)."""
    path = os.path.join(run, "ckpt", "trainer.pt")
    if not os.path.exists(path):
        return None
    trainer = torch.load(path, weights_only=False)
    truncate_metrics(os.path.join(run, "metrics.jsonl"), trainer["state"])
    return trainer


def check_run(run: str, resuming: bool) -> str:
    """Create the run folder; returns its metrics path. A folder that already holds a run is refused unless
    ``resuming``: two runs' metrics never mix and no checkpoint is overwritten. ``resuming`` a folder without
    a checkpoint stops with one line and exit status 2 (a flag error): a fresh start there would be silent."""
    if resuming and not os.path.exists(os.path.join(run, "ckpt", "trainer.pt")):
        print(f"error: --resume {run}: nothing to resume (no checkpoint {os.path.join(run, 'ckpt')})",
              file=sys.stderr)
        raise SystemExit(2)
    os.makedirs(run, exist_ok=True)
    metrics_path = os.path.join(run, "metrics.jsonl")
    if not resuming and os.path.exists(metrics_path):
        raise SystemExit(f"{run} already holds a run ({metrics_path}); pass --resume to continue it, "
                         f"or choose another --run")
    return metrics_path


def write_config(run: str, config: dict) -> None:
    """``RUN/config.json``: the run's Config (rank 0); eval.py reads the memory reward's settings from it. Every
    script calls it once at its start, so it also opens the ``--report-to`` loggers."""
    if dist.DIST.rank == 0:
        with open(os.path.join(run, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        open_reporters(run, config.get("report_to", "none"), config)


def close_reporters() -> None:
    """Flush and close the ``--report-to`` loggers (the end of a run)."""
    open_reporters("", "none", {})


# --------------------------------------------------------------------------- LoRA

def save_folder(path: str, model) -> None:
    """``model.save_pretrained(path)`` atomically (``path.tmp``, then renamed) by rank 0; every rank waits for it."""
    if dist.DIST.rank == 0:         # torchrun: one writer, the others wait for it (all_sum is the barrier)
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    dist.all_sum([0.0])


def lora_policy(model, run: str, rank: int, alpha: int, targets: str, seed: int):
    """The policy RL trains under ``--lora-rank``: ``model`` saved as ``RUN/base`` (what a resumed run puts the
    checkpoint's adapters back on), then under fresh adapters."""
    save_folder(os.path.join(run, "base"), model)
    return attach_lora(model, rank, alpha, targets, seed)


def load_checkpoint(run: str, device: torch.device):
    """(model, tokenizer) of ``RUN/ckpt``: a full model, or LoRA adapters put back on ``RUN/base``."""
    path = os.path.join(run, "ckpt")
    if os.path.exists(os.path.join(path, "adapter_config.json")):
        return load_lora(os.path.join(run, "base"), path, device), AutoTokenizer.from_pretrained(path)
    return load_pretrained(path, device)


def reference_model(model, run: str, start: int):
    """The KL reference = the policy RL started from: saved as ``RUN/ref`` at RL step 0, always loaded from there.

    On ``--resume`` (start > 0) ``model`` is the step-s checkpoint, so the reference must come from disk.
    It is loaded in the policy's dtype, so at step 0 the KL is exactly 0. A LoRA policy's reference is its own
    frozen base (``RUN/base``, the policy RL started from), the same module with the adapters off.
    """
    if is_lora(model):
        return AdaptersOff(model)
    path = os.path.join(run, "ref")
    if start == 0:                      # RL starts (or restarts before its first checkpoint): this is the reference
        save_folder(path, model)
    elif not os.path.isdir(path):
        raise SystemExit(f"--kl-coef > 0 on --resume needs the KL reference {path}, saved when RL started")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=model.dtype,
                                               attn_implementation=model.config._attn_implementation)
    return ref.to(model.device).eval().requires_grad_(False)
