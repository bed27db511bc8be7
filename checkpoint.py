"""Checkpoints, the run folder and its metrics: what a run writes, and how ``--resume`` reads it back.

A run folder holds ``config.json`` (the run's Config), ``metrics.jsonl`` (one JSON row per logged step),
``ckpt/`` (the newest checkpoint), ``saved.json`` (its stage and step), ``sft/`` (the model when SFT ended),
``ref/`` (the KL reference, ``--kl-coef`` > 0 or ``--log-kl``), ``base/`` (what LoRA adapters sit on) and
``final/``. Every model folder is ``save_pretrained`` + the tokenizer + the system prompt it was trained with
(``system_prompt.txt``, read back by ``rollout.checkpoint_prompt``) + the memory reward's probe marker
(``probe_think.txt``, ``trained_probe_think``), so a run from it probes as its SFT taught.

* A checkpoint (model + ``trainer.pt``: optimizer, stage + step, torch RNG) is written whole to ``PATH.tmp``,
  flushed to disk, marked complete by ``complete.json`` written last (its files and their sizes), then
  ``PATH`` -> ``PATH.old`` and ``PATH.tmp`` -> ``PATH``: a kill at any instant leaves a complete ``PATH``,
  ``PATH.tmp`` or ``PATH.old``. Data order depends only on ``(seed, step)``, so ``--resume`` continues a
  killed run with the same batches.
* ``resume`` (every recipe's one resume path) puts the first intact one of ``RUN/ckpt``, ``ckpt.tmp``,
  ``ckpt.old`` in place as ``RUN/ckpt`` (a damaged file is one line naming it), loads ``trainer.pt`` as data
  (``weights_only``: a pickled object that could run code is refused in one line) and drops the metrics rows a
  killed run logged after its checkpoint: they are logged again, so a resumed run's metrics.jsonl holds each
  step once. A run with no checkpoint yet starts from step 0, so the same ``--resume`` command can be repeated
  by a scheduler from the first instant on. A folder with finished work and no checkpoint (``final/``, ``sft/``,
  ``saved.json``: the checkpoint deleted, or a mistyped folder) is refused in one line: never trained over.
* Every write of a run (checkpoint, ``final/``, ``ref/``, metrics, config, a viz page, an exported file) goes
  through ``writing``: a failed write (``write_error``) is one line naming the file, the cause (a full disk said
  only when it is one) and the newest intact checkpoint; any other error keeps its traceback. What a write
  replaces (a checkpoint, ``final/``, ``config.json``, a kept ``step_NNNN/``) is written whole beside it first
  (``.tmp``, then renamed), so nothing complete is lost; a metrics row is appended and cut back if it fails
  half way; a viz page or an exported file is written in place (a failed one is written again by a rerun).
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

import contextlib
import errno
import json
import os
import pickle
import re
import shutil
import sys
import zipfile

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import dist
from models import AdaptersOff, attach_lora, is_lora, load_lora, load_pretrained

def save_checkpoint(path: str, model, tokenizer, optimizer, state: dict, system_prompt: str,
                    probe_think: str = "") -> None:
    """A checkpoint no kill loses: written whole to ``path.tmp``, every file flushed to disk, ``complete.json``
    written last (``mark_complete``), then ``path`` -> ``path.old``, ``path.tmp`` -> ``path`` and ``path.old``
    removed; ``resume`` finds whichever complete one a kill left. A write that fails (a full disk) removes the
    partial ``path.tmp`` and stops the run in one line naming the intact ``path`` (``writing``). The trainer
    state is tensors, numbers and strings only, so ``resume`` reads it as data (``load_trainer``). Torchrun:
    every rank calls it (FSDP2 gathers the full state), rank 0 writes."""
    model_sd, optimizer_sd = dist.full_state(model, optimizer)
    if dist.DIST.rank != 0:
        return
    tmp, old = path + ".tmp", path + ".old"
    discard(tmp)
    with writing(tmp, os.path.dirname(path), cleanup=lambda: discard(tmp)):    # a full disk: the last copy stays
        save_model(tmp, model, tokenizer, system_prompt, model_sd, probe_think)
        torch.save({"optimizer": optimizer_sd, "state": state,
                    "torch_rng": torch.get_rng_state()}, os.path.join(tmp, "trainer.pt"))
        mark_complete(tmp, state)
    discard(old)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_folder(os.path.dirname(os.path.abspath(path)))     # the renames on disk before the old copy goes
    discard(old)
    # the run's record that it got this far: with the checkpoint deleted, --resume still knows not to start over
    replace_file(os.path.join(os.path.dirname(path), SAVED), json.dumps(state), os.path.dirname(path))


SAVED = "saved.json"    # RUN/saved.json: the stage and step of the newest checkpoint the run wrote


COMPLETE = "complete.json"      # a checkpoint's marker, written last: a folder without it is a save cut short


def fsync_folder(path: str) -> None:
    """Flush a folder's entries (files created or renamed in it) to disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:             # a platform that cannot open a folder (Windows): its renames are its own
        return
    try:
        os.fsync(fd)
    except OSError:             # a filesystem that cannot fsync a folder (some network mounts)
        pass
    finally:
        os.close(fd)


def mark_complete(folder: str, state: dict) -> None:
    """Flush every file of ``folder`` to disk, then write ``complete.json`` (``state`` and each file's size, what
    ``checkpoint_damage`` checks) and flush it and the folder: the marker exists only once everything else does."""
    sizes = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            p = os.path.join(root, name)
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            sizes[os.path.relpath(p, folder)] = os.path.getsize(p)
    with open(os.path.join(folder, COMPLETE), "w") as f:
        json.dump({"state": state, "files": sizes}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_folder(folder)


def discard(folder: str) -> None:
    """Remove a checkpoint folder, its marker first: one half removed never reads as complete."""
    try:
        os.remove(os.path.join(folder, COMPLETE))
        fsync_folder(folder)
    except FileNotFoundError:
        pass
    shutil.rmtree(folder, ignore_errors=True)


# what torch.save and safetensors say where open() / write() would raise OSError: their I/O failures carry no errno
IO_MESSAGES = ("unexpected pos", "file write failed", "I/O error", "IoError", "No space left", "StorageFull")
FULL = (errno.ENOSPC, errno.EDQUOT)


def write_error(e: BaseException) -> bool:
    """Is ``e`` a failed write (open() / write()'s OSError, torch.save's or safetensors' I/O error) rather than a
    bug or a device error raised while writing (a CUDA error, HF's shared-tensor check), which keeps its traceback?"""
    return isinstance(e, OSError) or isinstance(e, (RuntimeError, SafetensorError)) \
        and any(m in str(e) for m in IO_MESSAGES)


def disk_full(e: BaseException, path: str) -> bool:
    """Did ``e`` fail for want of space? Its errno (ENOSPC, EDQUOT) or message says so; an I/O error without an
    errno (torch.save: "unexpected pos") on a disk with under 1 MiB free is taken as one."""
    errno_ = getattr(e, "errno", None)
    return errno_ in FULL or "No space left" in str(e) or "StorageFull" in str(e) \
        or errno_ is None and free_bytes(path) < 2**20


@contextlib.contextmanager
def writing(path: str, run: str = "", cleanup=None):
    """Write ``path`` (a file or a folder) inside this block: a write that fails (``write_error``: a full disk, a
    quota, an I/O error) ends the run with one line naming ``path``, what failed and, for a ``run``, its newest
    intact checkpoint, never a traceback; ``cleanup()`` first removes what was half written. Any other error
    raised inside (a bug, a CUDA error) is not a write error and goes on as it is."""
    try:
        yield
    except Exception as e:
        if not write_error(e):
            raise
        full = disk_full(e, path)
        line = f"error: could not write {path}: {'no space left on device' if full else _first_line(e)}"
        if cleanup is not None:
            cleanup()
        raise SystemExit(line + (f"; {intact_checkpoint(run, full)}" if run else "")) from e


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def intact_checkpoint(run: str, full: bool = True) -> str:
    """Where ``run`` stands for ``--resume``, in words: its newest intact checkpoint and step, or none yet; ``full``:
    the write failed for want of space, so the advice is to free some first."""
    ckpt = os.path.join(run, "ckpt")
    for folder in (os.path.join(run, c) for c in CANDIDATES):
        if os.path.isdir(folder) and checkpoint_damage(folder, need_marker=folder != ckpt) is None:
            try:
                with open(os.path.join(folder, COMPLETE)) as f:
                    state = json.load(f)["state"]
                at = f" ({state['stage']} step {state['step']})"
            except (OSError, ValueError, KeyError, TypeError):
                at = ""
            advice = "free space, then rerun" if full else "rerun"
            return f"the newest intact checkpoint is {folder}{at}: {advice} with --resume"
    return f"{run} has no intact checkpoint yet: rerun with --resume to start it again from step 0"


def _first_line(e: Exception) -> str:
    """An error's first line (its type for an empty message): what a one-line report quotes of it."""
    return (str(e).splitlines() or [type(e).__name__])[0]


def checkpoint_damage(folder: str, need_marker: bool = True) -> str | None:
    """Why ``folder`` is no checkpoint to resume from, one line naming the file; None when it is intact.

    Every file ``complete.json`` lists must have the size it was saved with (a truncated copy, a disk that
    filled), the weights must open (each ``*.safetensors`` header covers its file) and ``trainer.pt`` must be
    a whole ``torch.save`` file (its zip directory sits at the end). A checkpoint from before the marker
    existed (``need_marker=False``) gets the last two checks alone."""
    marker = os.path.join(folder, COMPLETE)
    if os.path.isfile(marker):
        try:
            with open(marker) as f:
                sizes = json.load(f)["files"]
        except (ValueError, KeyError, TypeError) as e:
            return f"{marker}: unreadable ({e})"
        for name, size in sizes.items():
            p = os.path.join(folder, name)
            if not os.path.isfile(p):
                return f"{p}: missing"
            if os.path.getsize(p) != size:
                return f"{p}: damaged ({os.path.getsize(p)} bytes of the {size} saved)"
    elif need_marker:
        return f"{folder}: incomplete (no {COMPLETE}: its save was cut short)"
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            p = os.path.join(folder, name)
            try:
                with safe_open(p, framework="pt"):
                    pass
            except Exception as e:      # SafetensorError: a header that does not cover the file
                return f"{p}: damaged ({_first_line(e)})"
    trainer = os.path.join(folder, "trainer.pt")
    if not zipfile.is_zipfile(trainer):
        return f"{trainer}: {'damaged (not a whole torch.save file)' if os.path.exists(trainer) else 'missing'}"
    return None


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


def save_final(run: str, model, tokenizer, system_prompt: str, state_dict: dict | None = None,
               probe_think: str = "") -> str:
    """``RUN/final`` (``save_model``), written whole to ``final.tmp`` and then renamed: a folder named ``final``
    is always complete; a full disk is one line (``writing``). Rank 0 only; returns the path."""
    path = os.path.join(run, "final")
    write_folder(path, lambda tmp: save_model(tmp, model, tokenizer, system_prompt, state_dict, probe_think), run)
    return path


def write_folder(path: str, write, run: str = "") -> None:
    """A folder written whole: ``write(path.tmp)``, then renamed over ``path``, so a folder by that name is always
    complete; a failed write (a full disk) removes the half-written ``.tmp`` and is one line (``writing``)."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(path, run, cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True)):
        write(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)


def keep_step(run: str, step: int) -> None:
    """``RUN/step_NNNN`` (``--keep-checkpoints``): the model of ``RUN/ckpt`` at ``step``, without its optimizer or
    marker (a model folder for eval.py, not a checkpoint), written whole (``write_folder``); rank 0. One already
    there is kept, so a run resumed after a failed copy writes the copy it lacks."""
    kept = os.path.join(run, f"step_{step:04d}")
    if dist.DIST.rank == 0 and not os.path.isdir(kept):
        skip = shutil.ignore_patterns("trainer.pt", COMPLETE)
        write_folder(kept, lambda tmp: shutil.copytree(os.path.join(run, "ckpt"), tmp, ignore=skip), run)


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
    """Append ``row`` to the metrics file (rank 0), and its numbers to every ``--report-to`` logger. The row goes
    down in unbuffered ``os.write`` calls and a failed one cuts the file back to its size before (``os.ftruncate``):
    a full disk leaves whole rows only. (A buffered file would flush the rest of the row again inside
    ``truncate()``, fail again, and leave the half row.)"""
    if dist.DIST.rank != 0:       # torchrun: rank 0 writes the (already reduced) metrics
        return
    line = memoryview((json.dumps(row) + "\n").encode())
    with writing(path, os.path.dirname(path)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                while line:
                    line = line[os.write(fd, line):]
            except OSError:
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)
    for log, _ in REPORTERS:
        log(row)


def write_page(path: str, text: str, run: str) -> None:
    """Write an HTML page of the run (``--viz-every``), rank 0; a full disk is one line (``writing``)."""
    if dist.DIST.rank != 0:       # torchrun: every rank built the page of its own questions, rank 0 writes its
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with writing(path, run), open(path, "w", encoding="utf-8") as f:
        f.write(text)


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
    rows = [ln for ln in open(path) if whole_row(ln) and keep(json.loads(ln))]
    replace_file(path, "".join(rows), os.path.dirname(path))


def whole_row(line: str) -> bool:
    """A metrics line that is a whole JSON row (a kill in the middle of an append leaves a torn last line)."""
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def replace_file(path: str, text: str, run: str = "") -> None:
    """Write ``text`` to ``path.tmp``, then rename it over ``path``: a full disk leaves the old file whole."""
    tmp = path + ".tmp"
    with writing(path, run, cleanup=lambda: os.path.exists(tmp) and os.remove(tmp)):
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


CANDIDATES = ("ckpt", "ckpt.tmp", "ckpt.old")   # where a kill may have left a run's newest checkpoint, in order


def resume(run: str) -> dict | None:
    """The trainer state (``optimizer``, ``state`` = stage + step, ``torch_rng``) of the run's newest intact
    checkpoint, with the metrics rows logged after it dropped; None, saying so in one line, when the run has no
    checkpoint yet: it starts again from step 0, so a scheduler can repeat the same ``--resume`` command from the
    first instant of a run on (verl's ``resume_mode=auto``, Lightning's ``ckpt_path="last"``).

    That checkpoint is the first intact one (``checkpoint_damage``) of ``RUN/ckpt``; ``ckpt.tmp``, complete when a
    kill came between the save's renames; ``ckpt.old``, the one before it. One that is not ``RUN/ckpt`` is renamed
    into place (a damaged ``RUN/ckpt`` kept as ``ckpt.damaged``), so every loader reads ``RUN/ckpt``, saying so in
    one line. A save cut short (no marker) is no checkpoint; a damaged one stops the run with one line naming each
    damaged file, since starting again would throw its steps away."""
    ckpt = os.path.join(run, "ckpt")
    found, passed = None, []
    for folder in (os.path.join(run, c) for c in CANDIDATES):
        if os.path.isdir(folder):
            why = checkpoint_damage(folder, need_marker=folder != ckpt)
            if why is None:
                found = folder
                break
            if folder == ckpt or os.path.isfile(os.path.join(folder, COMPLETE)):
                passed.append(why)
    if found is None and passed:
        raise SystemExit(f"error: --resume {run}: no intact checkpoint: {'; '.join(passed)}")
    if found is None:
        done = finished_work(run)
        if done:            # a checkpoint deleted, or a mistyped folder: starting from 0 would train over it
            print(f"error: --resume {run}: no checkpoint, but it holds finished work ({done}): nothing touched; "
                  f"choose another --run to train again", file=sys.stderr)
            raise SystemExit(2)
        if dist.DIST.rank == 0:
            print(f"--resume {run}: no checkpoint yet (stopped before its first save): starting from step 0",
                  file=sys.stderr)
            for folder in CANDIDATES[1:]:
                discard(os.path.join(run, folder))
        truncate_metrics(os.path.join(run, "metrics.jsonl"), {"stage": "sft", "step": 0})   # every row
        return None
    if found != ckpt:
        said = (f"warning: {passed[0]}; resuming from the intact {found} (the damaged copy kept as {ckpt}.damaged)"
                if os.path.isdir(ckpt) else
                f"{ckpt} missing (a kill between the save's renames): resuming from {found}")
        dist.all_sum([0.0])     # torchrun: every rank has looked before rank 0 renames
        if dist.DIST.rank == 0:
            print(said, file=sys.stderr)
            put_in_place(found, ckpt)
        dist.all_sum([0.0])
    trainer = load_trainer(os.path.join(ckpt, "trainer.pt"), run)
    truncate_metrics(os.path.join(run, "metrics.jsonl"), trainer["state"])
    return trainer


def finished_work(run: str) -> str:
    """What in ``run`` only a run past its first checkpoint leaves, in words ("" for none): a finished stage's model
    (``final/``, ``sft/``, a kept ``step_NNNN/``) or ``saved.json``, the record every checkpoint writes beside
    itself. A run stopped before its first save leaves none of them, and only such a run starts again from 0."""
    kept = sorted(n for n in os.listdir(run) if re.fullmatch(r"step_\d+", n)) if os.path.isdir(run) else []
    for name in ["final", "sft"] + kept:
        if os.path.isdir(os.path.join(run, name)):
            return os.path.join(run, name)
    try:
        with open(os.path.join(run, SAVED)) as f:
            state = json.load(f)
        return f"a checkpoint was saved at {state['stage']} step {state['step']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def load_trainer(path: str, run: str) -> dict:
    """``trainer.pt`` read as data: ``torch.load(weights_only=True)`` unpickles tensors, numbers, strings and
    containers and refuses anything else, so a checkpoint from elsewhere cannot run code on ``--resume``. A
    refused file is one line naming it and the object it holds (exit status 2); it is never loaded."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = found.group(1) if found else _first_line(e)
        print(f"error: --resume {run}: {path}: refused: it holds {what}, which is not data (tensors, numbers, "
              f"strings, lists, dicts), and loading it could run code", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as e:      # damaged in a way its size and zip directory do not show
        raise SystemExit(f"error: --resume {run}: {path}: damaged ({_first_line(e)})") from None


def put_in_place(found: str, ckpt: str) -> None:
    """Rename the checkpoint ``found`` to ``ckpt``, a ``ckpt`` already there to ``ckpt.damaged``; a kill between the
    two renames leaves ``found`` for the next ``resume``."""
    if os.path.isdir(ckpt):
        shutil.rmtree(ckpt + ".damaged", ignore_errors=True)
        os.replace(ckpt, ckpt + ".damaged")
    os.replace(found, ckpt)
    fsync_folder(os.path.dirname(ckpt))


def check_run(run: str, resuming: bool) -> str:
    """Create the run folder; returns its metrics path. A folder that already holds a run is refused unless
    ``resuming``: two runs' metrics never mix and no checkpoint is overwritten. ``resuming`` a folder without
    a checkpoint starts it from step 0 (``resume`` says so)."""
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
        replace_file(os.path.join(run, "config.json"), json.dumps(config, indent=1), run)
        open_reporters(run, config.get("report_to", "none"), config)


def close_reporters() -> None:
    """Flush and close the ``--report-to`` loggers (the end of a run)."""
    open_reporters("", "none", {})


# --------------------------------------------------------------------------- LoRA

def save_folder(path: str, model, tokenizer=None) -> None:
    """``model.save_pretrained(path)`` (and the tokenizer's) atomically (``path.tmp``, then renamed; a full disk is
    one line) by rank 0; every rank waits for it."""
    def write(tmp: str) -> None:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    if dist.DIST.rank == 0:         # torchrun: one writer, the others wait for it (all_sum is the barrier)
        write_folder(path, write, os.path.dirname(path))
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
