"""Checkpoints a kill cannot lose: a run killed between the save's two renames resumes from the complete copy it
left and finishes as the uninterrupted run; a damaged file is one line naming it, and ``--resume`` falls back to an
intact older copy where one exists, saying so. Real tiny SFT runs, real files truncated on disk."""
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

import checkpoint
import sft
import train

# SFT alone, checkpoints at steps 5 and 10 of 12: seconds on a CPU
TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--ffn", "64", "--sft-batch", "8", "--sft-steps", "12",
        "--sft-copy-steps", "4", "--sft-save-every", "5", "--rl-steps", "0", "--eval-every", "0",
        "--sft-objectives", "1-2", "--hops", "1-2"]


def weights(run):
    return AutoModelForCausalLM.from_pretrained(run / "final").state_dict()


def saved_step(folder):
    return torch.load(folder / "trainer.pt", weights_only=True)["state"]["step"]


@pytest.fixture(scope="module")
def between_renames(tmp_path_factory):
    """(the uninterrupted run, a run killed inside its step-10 save after ``ckpt`` -> ``ckpt.old`` and before
    ``ckpt.tmp`` -> ``ckpt``): the real save code, stopped at that instant."""
    root = tmp_path_factory.mktemp("ckpt")
    train.main(["--run", str(root / "full")] + TINY)
    real = os.replace

    def die_before_the_second_rename(src, dst):
        marker = os.path.join(src, checkpoint.COMPLETE)
        if src.endswith("ckpt.tmp") and json.load(open(marker))["state"]["step"] == 10:
            raise KeyboardInterrupt
        return real(src, dst)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "replace", die_before_the_second_rename)
        with pytest.raises(KeyboardInterrupt):
            train.main(["--run", str(root / "killed")] + TINY)
    killed = root / "killed"
    assert not (killed / "ckpt").exists() and not (killed / "final").exists()
    assert saved_step(killed / "ckpt.old") == 5 and saved_step(killed / "ckpt.tmp") == 10
    return root / "full", killed


def copy_of(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def test_a_kill_between_the_renames_resumes_from_the_newer_complete_copy_and_finishes(between_renames, tmp_path,
                                                                                      capsys):
    full, killed = between_renames
    run = copy_of(killed, tmp_path)
    train.main(["--run", str(run), "--resume"] + TINY)
    out, err = capsys.readouterr()
    assert f"{run / 'ckpt'} missing (a kill between the save's renames): resuming from {run / 'ckpt.tmp'}" in err
    assert "resuming sft at step 10 from" in out          # the step-10 copy, not the step-5 one beside it
    assert weights(full).keys() == weights(run).keys()
    assert all(torch.equal(a, b) for a, b in zip(weights(full).values(), weights(run).values()))
    assert saved_step(run / "sft") == 12 and not (run / "ckpt.tmp").exists()


def test_a_cut_short_tmp_beside_the_old_copy_resumes_from_the_old_one(between_renames, tmp_path, capsys):
    """ckpt.tmp without its marker (the save died while writing it): never read, the step-5 copy is."""
    full, killed = between_renames
    run = copy_of(killed, tmp_path)
    (run / "ckpt.tmp" / checkpoint.COMPLETE).unlink()
    train.main(["--run", str(run), "--resume"] + TINY)
    out, err = capsys.readouterr()
    assert f"resuming from {run / 'ckpt.old'}" in err and "resuming sft at step 5 from" in out
    assert all(torch.equal(a, b) for a, b in zip(weights(full).values(), weights(run).values()))


@pytest.mark.parametrize("damaged", ["model.safetensors", "trainer.pt"])
def test_a_truncated_file_falls_back_to_the_intact_older_copy_saying_so(between_renames, tmp_path, capsys, damaged):
    full, killed = between_renames
    run = copy_of(killed, tmp_path)
    os.replace(run / "ckpt.tmp", run / "ckpt")           # the step-10 save finished; the step-5 copy still beside it
    truncate(run / "ckpt" / damaged)
    train.main(["--run", str(run), "--resume"] + TINY)
    out, err = capsys.readouterr()
    line, = [ln for ln in err.splitlines() if "resuming from" in ln]
    assert line.startswith(f"warning: {run / 'ckpt' / damaged}: damaged (")
    assert f"resuming from the intact {run / 'ckpt.old'}" in line and "resuming sft at step 5 from" in out
    assert all(torch.equal(a, b) for a, b in zip(weights(full).values(), weights(run).values()))
    assert (run / "ckpt.damaged" / damaged).exists()       # kept for a look, out of the way of the next save


@pytest.mark.parametrize("damaged", ["model.safetensors", "trainer.pt"])
@pytest.mark.parametrize("marker", [True, False], ids=["marked", "unmarked"])
def test_a_truncated_file_without_an_older_copy_stops_in_one_line_naming_it(between_renames, tmp_path, damaged,
                                                                              marker):
    """Unmarked: a checkpoint saved before the marker existed is still read, its weights' header and
    trainer.pt's zip directory checked."""
    _, killed = between_renames
    run = copy_of(killed, tmp_path)
    shutil.rmtree(run / "ckpt.old")
    os.replace(run / "ckpt.tmp", run / "ckpt")
    if not marker:
        (run / "ckpt" / checkpoint.COMPLETE).unlink()
    truncate(run / "ckpt" / damaged)
    with pytest.raises(SystemExit) as stop:
        train.main(["--run", str(run), "--resume"] + TINY)
    msg = str(stop.value.code)
    assert "\n" not in msg and msg.startswith(f"error: --resume {run}: no intact checkpoint: {run / 'ckpt' / damaged}")
    assert (run / "ckpt" / damaged).exists() and not (run / "final").exists()


def test_the_marker_lists_every_file_with_its_size_and_any_changed_file_is_damage(between_renames, tmp_path):
    _, killed = between_renames
    folder = killed / "ckpt.old"
    listed = json.load(open(folder / checkpoint.COMPLETE))
    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != checkpoint.COMPLETE}
    assert listed == {"state": {"stage": "sft", "step": 5, "precision": "auto"}, "files": files}
    assert {"model.safetensors", "trainer.pt", "config.json", "system_prompt.txt"} <= set(files)
    assert checkpoint.checkpoint_damage(str(folder)) is None
    copy = copy_of(folder, tmp_path)
    (copy / "config.json").write_text("{}")                # any file, not only the weights
    assert checkpoint.checkpoint_damage(str(copy)) == f"{copy / 'config.json'}: damaged (2 bytes of the " \
                                                          f"{files['config.json']} saved)"


def test_a_trainer_file_whose_zip_is_whole_but_not_torchs_stops_in_one_line(between_renames, tmp_path):
    """What neither the sizes (an unmarked checkpoint) nor the zip directory show: torch.load's own error."""
    import zipfile
    _, killed = between_renames
    run = copy_of(killed, tmp_path)
    shutil.rmtree(run / "ckpt.old")
    os.replace(run / "ckpt.tmp", run / "ckpt")
    (run / "ckpt" / checkpoint.COMPLETE).unlink()
    (run / "ckpt" / "trainer.pt").unlink()
    with zipfile.ZipFile(run / "ckpt" / "trainer.pt", "w") as z:
        z.writestr("notes.txt", "not a torch.save file")
    with pytest.raises(SystemExit) as stop:
        train.main(["--run", str(run), "--resume"] + TINY)
    msg = str(stop.value.code)
    assert "\n" not in msg and msg.startswith(f"error: --resume {run}: {run / 'ckpt' / 'trainer.pt'}: damaged (")


# --------------------------------------------------------------------------- a checkpoint is data

def plant(folder, payload):
    """Replace ``folder``'s trainer.pt with a torch.save file holding ``payload`` as its state, and rewrite
    complete.json's sizes to match: the completeness check passes, only the load can refuse it."""
    trainer = torch.load(folder / "trainer.pt", weights_only=True)
    trainer["state"] = payload
    torch.save(trainer, folder / "trainer.pt")
    marker = json.load(open(folder / checkpoint.COMPLETE))
    marker["files"]["trainer.pt"] = (folder / "trainer.pt").stat().st_size
    json.dump(marker, open(folder / checkpoint.COMPLETE, "w"))
    assert checkpoint.checkpoint_damage(str(folder)) is None


class Payload:
    """What a planted checkpoint carries: unpickling it would create ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def planted_run(between_renames, tmp_path):
    _, killed = between_renames
    run = copy_of(killed, tmp_path)
    shutil.rmtree(run / "ckpt.old")
    os.replace(run / "ckpt.tmp", run / "ckpt")
    pwned = tmp_path / "pwned"
    plant(run / "ckpt", Payload(pwned))
    return run, pwned


def test_a_planted_pickle_in_trainer_pt_never_runs_on_resume_in_train_py(between_renames, tmp_path):
    """The real command, in its own process: the payload's file stays absent, one line names the file, exit 2."""
    run, pwned = planted_run(between_renames, tmp_path)
    done = subprocess.run([sys.executable, "train.py", "--run", str(run), "--resume"] + TINY, cwd=HERE,
                          capture_output=True, text=True, timeout=300)
    assert not pwned.exists()
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line, = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith(f"error: --resume {run}: {run / 'ckpt' / 'trainer.pt'}: refused: it holds posix.system")
    assert not (run / "final").exists()


@pytest.mark.parametrize("entry", ["memalpha", "memtrain"])
def test_a_planted_pickle_never_runs_on_resume_in_the_recipes(between_renames, tmp_path, capsys, entry):
    """Every recipe resumes through ``checkpoint.resume``: the same refusal before any model loads."""
    import importlib
    run, pwned = planted_run(between_renames, tmp_path)
    main = importlib.import_module(f"recipes.{entry}").main
    with pytest.raises(SystemExit) as stop:
        main(["--run", str(run), "--resume"])
    assert stop.value.code == 2 and not pwned.exists()
    assert f"{run / 'ckpt' / 'trainer.pt'}: refused: it holds posix.system" in capsys.readouterr().err


def test_a_foreign_object_in_trainer_pt_is_one_line_naming_it(between_renames, tmp_path, capsys):
    from fractions import Fraction
    _, killed = between_renames
    run = copy_of(killed, tmp_path)
    plant(run / "ckpt.old", {"stage": "sft", "step": Fraction(5)})
    with pytest.raises(SystemExit) as stop:
        checkpoint.load_trainer(str(run / "ckpt.old" / "trainer.pt"), str(run))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert "trainer.pt: refused: it holds fractions.Fraction, which is not data" in err


def test_the_trainer_state_is_data_and_loads_without_unpickling_objects(between_renames):
    """What save_checkpoint writes (the format every earlier checkpoint has) loads as data: resuming it needs no
    conversion."""
    _, killed = between_renames
    trainer = checkpoint.load_trainer(str(killed / "ckpt.old" / "trainer.pt"), str(killed))
    assert set(trainer) == {"optimizer", "state", "torch_rng"}
    assert trainer["state"] == {"stage": "sft", "step": 5, "precision": "auto"}
    assert trainer["torch_rng"].dtype == torch.uint8 and trainer["optimizer"]["state"]


# --------------------------------------------------------------------------- --resume a scheduler can repeat

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def test_resume_with_no_checkpoint_yet_starts_from_step_0_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"stage": "sft", "step": 0, "loss": 9.0}\n{"stage": "sft", "st')
    (run / "ckpt.tmp").mkdir()                            # a first save cut short: no marker
    (run / "ckpt.tmp" / "trainer.pt").write_bytes(b"half")
    assert checkpoint.resume(str(run)) is None
    err = capsys.readouterr().err
    assert err == f"--resume {run}: no checkpoint yet (stopped before its first save): starting from step 0\n"
    assert (run / "metrics.jsonl").read_text() == "" and not (run / "ckpt.tmp").exists()


@pytest.mark.parametrize("cut", ["before", "inside"])
def test_a_run_stopped_before_or_inside_its_first_save_is_rerun_by_the_same_resume_command(between_renames,
                                                                                           tmp_path, capsys, cut):
    """Stopped at the first save's start (config and metrics rows written, no checkpoint) or inside it (the
    step-5 ckpt.tmp without its marker): ``--resume`` starts from step 0, saying so, and ends with the
    uninterrupted run's weights and metrics."""
    full, _ = between_renames
    run = tmp_path / "run"
    target = (sft, "save_checkpoint") if cut == "before" else (checkpoint, "mark_complete")

    def stop(*args, **kwargs):
        raise KeyboardInterrupt
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(*target, stop)
        with pytest.raises(KeyboardInterrupt):
            train.main(["--run", str(run)] + TINY)
    assert (run / "metrics.jsonl").stat().st_size > 0 and not (run / "ckpt").exists()
    assert (run / "ckpt.tmp").exists() == (cut == "inside")
    capsys.readouterr()
    train.main(["--run", str(run), "--resume"] + TINY)
    assert "no checkpoint yet (stopped before its first save): starting from step 0" in capsys.readouterr().err
    assert all(torch.equal(a, b) for a, b in zip(weights(full).values(), weights(run).values()))
    assert open(run / "metrics.jsonl").read().count("\n") == open(full / "metrics.jsonl").read().count("\n")


# 240 steps, a checkpoint every 50: a few seconds of steps to kill in (TINY's 12 take under one)
LONGER = TINY[:TINY.index("--sft-steps")] + ["--sft-steps", "240", "--sft-save-every", "50"] + \
    TINY[TINY.index("--sft-copy-steps"):TINY.index("--sft-save-every")] + TINY[TINY.index("--rl-steps"):]


def test_the_same_resume_command_repeated_after_sigkills_at_random_instants_finishes_as_uninterrupted(tmp_path):
    """A scheduler's loop: the same ``train.py --resume`` from the first instant on (no run folder yet), SIGKILLed
    in its first steps (before any checkpoint), then at random instants of its steps, then left to finish: the
    uninterrupted run's weights, each metrics row once."""
    full, run = tmp_path / "full", tmp_path / "run"
    inode = lambda path: path.stat().st_ino if path.exists() else None
    p = subprocess.Popen([sys.executable, "train.py", "--run", str(full)] + LONGER, cwd=HERE, env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while p.poll() is None and not (full / "config.json").exists():
        time.sleep(0.005)
    t0 = time.time()
    assert p.wait(timeout=300) == 0
    steps_sec = time.time() - t0             # the reference's 240 steps, start-up left out
    cmd = [sys.executable, "train.py", "--run", str(run), "--resume"] + LONGER
    rng = random.Random(0)
    for kill in range(3):
        # the steps this attempt has left: from the checkpoint it resumes, or all of them
        marker = run / "ckpt" / checkpoint.COMPLETE
        done = json.loads(marker.read_text())["state"]["step"] if marker.exists() else 0
        before = run / "config.json"
        config_inode = inode(before)
        p = subprocess.Popen(cmd, cwd=HERE, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while p.poll() is None and time.time() < deadline and (
                inode(before) in (None, config_inode) or kill == 0 and not (run / "metrics.jsonl").exists()):
            time.sleep(0.005)
        # a random instant within the first half of the steps left, at the reference's pace
        time.sleep(0.0 if kill == 0 else rng.uniform(0.0, 0.5 * steps_sec * (240 - done) / 240))
        assert p.poll() is None, f"attempt {kill} ended before its kill: the kill tested nothing"
        p.send_signal(signal.SIGKILL)
        p.wait()
        if kill == 0:
            assert not any((run / c).exists() for c in checkpoint.CANDIDATES), "the first save came before the kill"
    subprocess.run(cmd, cwd=HERE, env=ENV, capture_output=True, timeout=300, check=True)
    assert all(torch.equal(a, b) for a, b in zip(weights(full).values(), weights(run).values()))
    key = lambda path: [(r["stage"], r["step"]) for r in map(json.loads, open(path))]
    assert key(run / "metrics.jsonl") == key(full / "metrics.jsonl")


# --------------------------------------------------------------------------- a full disk

def disk_size(folder) -> int:
    """Bytes ``folder``'s files take on a tmpfs (whole 4 KiB pages)."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a real tmpfs of ``size`` bytes; remount(size) grows it (space freed); unmounted after."""
    disk = tmp_path / "disk"
    disk.mkdir()
    sh = lambda *a: subprocess.run(a, check=True, capture_output=True)

    def mount(size):
        try:
            sh("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk))
        except (subprocess.CalledProcessError, FileNotFoundError) as e:     # not root, or a sandbox without mount
            pytest.skip(f"cannot mount a tmpfs here: {getattr(e, 'stderr', b'').decode().strip() or e}")
        return disk
    yield mount, lambda size: sh("mount", "-o", f"remount,size={size}", str(disk))
    subprocess.run(["umount", "--lazy", str(disk)], capture_output=True)     # detached even if a file is open


def test_a_disk_that_fills_at_the_second_checkpoint_stops_in_one_line_and_resumes_once_space_is_back(
        between_renames, small_disk):
    """A real small tmpfs: it holds the run and one checkpoint, not two. The step-10 save fails: one line, exit
    != 0, the step-5 checkpoint intact (never removed before its replacement is whole), the half-written copy
    gone; grown again, the same ``--resume`` finishes with the uninterrupted run's weights."""
    _, killed = between_renames
    mount, remount = small_disk
    one = disk_size(killed / "ckpt.old")                   # one checkpoint's pages
    disk = mount(one * 3 // 2 + 64 * 1024)
    run, full = disk / "run", disk.parent / "full"        # the reference in its own process, as the resumed run
    subprocess.run([sys.executable, "train.py", "--run", str(full)] + TINY, cwd=HERE, env=ENV, capture_output=True,
                   timeout=300, check=True)
    cmd = [sys.executable, "train.py", "--run", str(run)] + TINY
    done = subprocess.run(cmd, cwd=HERE, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    line, = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]     # tqdm may draw after it
    assert line == (f"error: could not write {run / 'ckpt.tmp'}: no space left on device; the newest intact "
                    f"checkpoint is {run / 'ckpt'} (sft step 5): free space, then rerun with --resume")
    assert checkpoint.checkpoint_damage(str(run / "ckpt")) is None and saved_step(run / "ckpt") == 5
    assert not (run / "ckpt.tmp").exists() and not (run / "final").exists()
    remount("64m")
    subprocess.run(cmd + ["--resume"], cwd=HERE, env=ENV, capture_output=True, timeout=300, check=True)
    assert all(torch.equal(a, b) for a, b in zip(weights(full).values(), weights(run).values()))


class FullDisk:
    """``open`` for a module, where a write to a file whose path ends with ``suffix`` writes half its text and
    fails as a full disk does (ENOSPC): an injected failure at one write of a real run."""

    def __init__(self, suffix, after=0):
        self.suffix, self.left = suffix, after

    def __call__(self, path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if str(path).endswith(self.suffix) and ("w" in mode or "a" in mode):
            if self.left == 0:
                real = f.write

                def write(text):
                    real(text[:len(text) // 2])
                    f.flush()
                    raise OSError(errno.ENOSPC, "No space left on device", str(path))
                f.write = write
            self.left -= 1
        return f


def test_a_metrics_row_that_fills_a_real_disk_is_one_line_and_leaves_the_file_as_it_was(small_disk):
    """A real tmpfs with every page taken but the few free bytes in metrics.jsonl's last one: the next row goes
    down only in part before the disk says ENOSPC. One line naming the file; the file holds its whole rows and not
    a byte more (a buffered file would fail again inside truncate() and leave the part)."""
    mount, _ = small_disk
    disk = mount(256 * 1024)
    path = disk / "metrics.jsonl"
    for step in range(3):           # rows to within ~100 bytes of the end of the file's first page
        checkpoint.log_jsonl(str(path), {"stage": "sft", "step": step, "note": "n" * (1300 - 3 * step)})
    before = path.read_bytes()
    assert 3900 < len(before) < 4096
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    with pytest.raises(SystemExit) as stop:
        checkpoint.log_jsonl(str(path), {"stage": "sft", "step": 3, "note": "y" * 600})   # a row a buffer holds
    assert str(stop.value.code).startswith(f"error: could not write {path}: no space left on device; ")
    assert path.read_bytes() == before


def test_a_full_disk_at_a_run_s_metrics_row_names_the_intact_checkpoint_and_resume_finishes(between_renames,
                                                                                            tmp_path):
    """The step-11 row of a real run fails after half of it is written (the disk's short write, then ENOSPC, at
    the write call itself): one line naming metrics.jsonl and the step-10 checkpoint; whole rows only; the same
    command with --resume finishes as the uninterrupted run."""
    full, _ = between_renames
    run = tmp_path / "run"
    real, rows = os.write, []

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            rows.append(fd)
            if len(rows) == 2:                   # the second row: step 11 (rows at steps 0 and 11)
                real(fd, data[:len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "write", write)
        with pytest.raises(SystemExit) as stop:
            train.main(["--run", str(run)] + TINY)
    assert str(stop.value.code) == (f"error: could not write {run / 'metrics.jsonl'}: no space left on device; "
                                    f"the newest intact checkpoint is {run / 'ckpt'} (sft step 10): free space, "
                                    f"then rerun with --resume")
    assert [json.loads(ln)["step"] for ln in open(run / "metrics.jsonl")] == [0]
    train.main(["--run", str(run), "--resume"] + TINY)
    assert all(torch.equal(a, b) for a, b in zip(weights(full).values(), weights(run).values()))
    key = lambda path: [(r["stage"], r["step"]) for r in map(json.loads, open(path))]
    assert key(run / "metrics.jsonl") == key(full / "metrics.jsonl")


def test_a_full_disk_at_the_final_model_is_one_line_and_no_partial_final(between_renames, tmp_path):
    """safetensors' own error ("I/O error: No space left on device") while RUN/final is written: one line, no
    folder named final (it is written as final.tmp and renamed whole), and --resume writes it."""
    from safetensors import SafetensorError
    full, _ = between_renames
    run = tmp_path / "run"
    real = checkpoint.save_model

    def fails_at_final(path, *args, **kwargs):
        if path.endswith("final.tmp"):
            real(path, *args, **kwargs)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(path, *args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint, "save_model", fails_at_final)
        with pytest.raises(SystemExit) as stop:
            train.main(["--run", str(run)] + TINY)
    assert str(stop.value.code).startswith(f"error: could not write {run / 'final'}: no space left on device; the "
                                           f"newest intact checkpoint is {run / 'ckpt'} (sft step 10)")
    assert not (run / "final").exists() and not (run / "final.tmp").exists()
    train.main(["--run", str(run), "--resume"] + TINY)
    assert all(torch.equal(a, b) for a, b in zip(weights(full).values(), weights(run).values()))


def test_a_full_disk_at_the_config_or_an_exported_file_is_one_line_naming_it(tmp_path):
    run = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint, "open", FullDisk("config.json.tmp"), raising=False)
        with pytest.raises(SystemExit) as stop:
            train.main(["--run", str(run)] + TINY)
    assert str(stop.value.code) == (f"error: could not write {run / 'config.json'}: no space left on device; {run} "
                                    f"has no intact checkpoint yet: rerun with --resume to start it again from "
                                    f"step 0")
    assert not (run / "config.json.tmp").exists()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sft, "open", FullDisk("test_k2.jsonl"), raising=False)
        with pytest.raises(SystemExit) as stop:
            sft.main(["--export", str(tmp_path / "exported"), "--objectives", "1", "2", "--tasks", "4",
                      "--episodes", "4"])
    assert str(stop.value.code) == f"error: could not write {tmp_path / 'exported' / 'test_k2.jsonl'}: no space " \
                                   f"left on device"


# --------------------------------------------------------------------------- finished work; errors by their name

@pytest.mark.parametrize("left", ["final", "saved.json"])
def test_resume_never_trains_over_finished_work_whose_checkpoint_is_gone(between_renames, tmp_path, left):
    """A finished run whose ``ckpt`` was deleted (as people delete optimizer states), or a run whose only trace of
    its checkpoints is ``saved.json``: ``--resume`` is one line and exit 2, and touches nothing (no retraining
    from step 0 over its metrics and models)."""
    full, _ = between_renames
    run = tmp_path / "run"
    shutil.copytree(full, run)
    shutil.rmtree(run / "ckpt")
    if left == "saved.json":
        shutil.rmtree(run / "final")
        shutil.rmtree(run / "sft")
    files = lambda: {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    before = files()
    done = subprocess.run([sys.executable, "train.py", "--run", str(run), "--resume"] + TINY, cwd=HERE, env=ENV,
                          capture_output=True, text=True, timeout=300)
    held = run / "final" if left == "final" else "a checkpoint was saved at sft step 12"   # RUN/sft, the last
    assert (done.returncode, done.stderr) == (2, f"error: --resume {run}: no checkpoint, but it holds finished work "
                                                 f"({held}): nothing touched; choose another --run to train again\n")
    assert files() == before


def test_an_error_that_is_not_a_write_error_keeps_its_traceback_and_a_full_disk_is_said_only_when_it_is(
        tmp_path, monkeypatch):
    """Inside ``writing``: a CUDA or HF error (RuntimeError) is raised as it is, never "could not write"; on a disk
    with under 1 MiB free, a permission error is named as one, with no advice to free space; torch.save's errno-less
    "unexpected pos" there is a full disk."""
    run, path = str(tmp_path), str(tmp_path / "ckpt.tmp")
    with pytest.raises(RuntimeError, match="CUDA error"):
        with checkpoint.writing(path, run):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(checkpoint, "free_bytes", lambda p: 1000)          # a nearly full disk
    with pytest.raises(SystemExit) as stop:
        with checkpoint.writing(path, run):
            raise PermissionError(errno.EACCES, "Permission denied", path)
    assert str(stop.value.code) == (f"error: could not write {path}: [Errno 13] Permission denied: '{path}'; {run} "
                                    f"has no intact checkpoint yet: rerun with --resume to start it again from step 0")
    assert isinstance(stop.value.__cause__, PermissionError)
    with pytest.raises(SystemExit) as stop:
        with checkpoint.writing(path):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 128")
    assert str(stop.value.code) == f"error: could not write {path}: no space left on device"


def test_intact_checkpoint_advises_freeing_space_only_for_a_full_disk(between_renames, tmp_path):
    _, killed = between_renames
    run = copy_of(killed, tmp_path)
    ckpt = os.path.join(run, "ckpt.tmp")
    assert checkpoint.intact_checkpoint(run, full=False) == \
        f"the newest intact checkpoint is {ckpt} (sft step 10): rerun with --resume"
    assert checkpoint.intact_checkpoint(run).endswith(": free space, then rerun with --resume")


KEEP = ["--sft-steps", "0", "--questions", "2", "--group", "2", "--max-turns", "2", "--max-new-tokens", "8",
        "--eval-every", "0", "--hidden", "32", "--layers", "1", "--heads", "2", "--ffn", "64", "--rl-steps", "3",
        "--save-every", "1", "--lr", "1e-2", "--keep-checkpoints"]


def test_a_full_disk_at_a_kept_model_leaves_no_partial_copy_and_resume_writes_it(tmp_path):
    """``--keep-checkpoints``: the copy of step 2 fails half way (a full disk): one line, no ``step_0002`` or its
    ``.tmp``; ``--resume`` from the step-2 checkpoint writes the copy it lacks, and every kept folder is a model
    folder (no trainer.pt, no checkpoint marker listing one) equal to the uninterrupted run's."""
    full, run = tmp_path / "full", tmp_path / "run"
    train.main(["--run", str(full)] + KEEP)
    real = shutil.copyfile

    def copy(src, dst, *a, **kw):
        if "step_0002" in str(dst) and os.fspath(src).endswith(".safetensors"):
            with open(dst, "wb") as f:
                f.write(b"half")
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real(src, dst, *a, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shutil, "copyfile", copy)
        with pytest.raises(SystemExit) as stop:
            train.main(["--run", str(run)] + KEEP)
    assert str(stop.value.code).startswith(f"error: could not write {run / 'step_0002'}: no space left on device; "
                                           f"the newest intact checkpoint is {run / 'ckpt'} (rl step 2)")
    assert sorted(p.name for p in run.glob("step_*")) == ["step_0001"]
    train.main(["--run", str(run), "--resume"] + KEEP)
    kept = sorted(p.name for p in run.glob("step_*"))
    assert kept == ["step_0001", "step_0002", "step_0003"] == sorted(p.name for p in full.glob("step_*"))
    for name in kept:
        assert sorted(p.name for p in (run / name).iterdir()) == sorted(p.name for p in (full / name).iterdir())
        assert not {"trainer.pt", checkpoint.COMPLETE} & {p.name for p in (run / name).iterdir()}
        assert (run / name / "model.safetensors").read_bytes() == (full / name / "model.safetensors").read_bytes()
