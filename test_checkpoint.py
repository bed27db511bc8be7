"""Checkpoints a kill cannot lose: a run killed between the save's two renames resumes from the complete copy it
left and finishes as the uninterrupted run; a damaged file is one line naming it, and ``--resume`` falls back to an
intact older copy where one exists, saying so. Real tiny SFT runs, real files truncated on disk."""
import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

import checkpoint
import train

# SFT alone, checkpoints at steps 5 and 10 of 12: seconds on a CPU
TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--ffn", "64", "--sft-batch", "8", "--sft-steps", "12",
        "--sft-copy-steps", "4", "--sft-save-every", "5", "--rl-steps", "0", "--eval-every", "0",
        "--sft-objectives", "1-2", "--hops", "1-2"]


def weights(run):
    return AutoModelForCausalLM.from_pretrained(run / "final").state_dict()


def saved_step(folder):
    return torch.load(folder / "trainer.pt", weights_only=False)["state"]["step"]


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
