"""Every flag of every entry point refuses a value it cannot run with at start: one line on stderr,
``error: --flag VALUE: why``, exit status 2, no run folder. The walk reads what each flag declares it accepts
(flags.Accepts on a Config field or as an argparse type) and fails on a numeric or K-range flag that declares
nothing, so a new flag without bounds is caught here (``unbounded=True`` says a seed has none on purpose)."""
import argparse
import os
import re
import subprocess
import sys
from dataclasses import fields

import pytest

import bench
import checkpoint
import data
import diagnostics
import eval as ev
import flags
import search
import sft
import train
from recipes import memalpha, memalpha_eval, memtrain, memtrain_eval

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = [train.Config, memalpha.MemAlphaConfig, memtrain.MemTrainConfig]
RANGE = re.compile(r"^\d+(-\d+|(,\d+)+)$")          # a K range default: "1-4", "1,2"


def bad_values(rule) -> list[str]:
    """Values ``rule`` (a flags.Accepts: a Config field's, or a script flag's argparse type) must refuse."""
    get = lambda name: getattr(rule, name, None)
    if get("choices"):
        return ["nope"]
    if get("int_range"):
        return ["3-1", "0-2", "2,1", "x"]
    if get("ranges"):
        return ["3-1", "0-2", "1-3,5-4", "1-3,", "x"]
    out = []
    if get("min") is not None:
        out += [get("min") - 1] + ([-1] if get("min") - 1 != -1 else [])
    if get("above") is not None:
        out += [get("above")] + ([get("above") - 1] if get("off") != get("above") - 1 else [])
    if get("max") is not None:
        out += [get("max") + 1]
    return [f"{v:g}" for v in out] + ["x"] if out or get("unbounded") else []     # "x": not a number


def declared(rule, default) -> bool:
    """Does a flag of this default declare what it accepts? Numbers and K ranges must; other strings need not."""
    if any(getattr(rule, name, None) is not None for name in ("min", "max", "above")) or \
            any(getattr(rule, name, None) for name in ("choices", "int_range", "ranges", "unbounded")):
        return True
    return not (isinstance(default, (int, float)) or isinstance(default, str) and RANGE.match(default)
                or rule in (int, float))


def refused(capsys, call, argv: list[str], flag: str, value: str) -> None:
    with pytest.raises(SystemExit) as stop:
        call(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2, (argv, err)
    assert err.count("\n") == 1 and err.startswith("error: ") and f"{flag} {value}: " in err, (argv, err)


# --------------------------------------------------------------------------- the Configs

@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_every_config_field_declares_and_refuses(config, tmp_path, capsys):
    run = tmp_path / "run"
    assert vars(train.parse_args([], config)) == vars(config())           # the defaults pass, unchanged
    for f in fields(config):
        rule = f.metadata.get("accepts")
        if isinstance(f.default, bool):
            continue
        assert rule is not None and declared(rule, f.default), f"--{f.name}: declares no bound (or unbounded=True)"
        checked = rule.kind is not str or rule.choices or rule.int_range or rule.ranges
        assert not checked or rule.rejects(f.default) is None
        flag = "--" + f.name.replace("_", "-")
        for value in bad_values(rule):
            refused(capsys, lambda a: train.parse_args(a, config), ["--run", str(run), flag, value], flag, value)
    assert not run.exists()


@pytest.mark.parametrize("argv, flag", [
    (["--group", "1", "--algo", "grpo"], "--group 1"),      # a group of one: every outcome advantage 0
    (["--hidden", "100"], "--hidden 100"),                   # not a multiple of --heads 8
    (["--dual-clip", "0.5"], "--dual-clip 0.5"),             # 0 = off, else > 1
    (["--threshold", "1"], "--threshold 1"),                 # no token's probability passes it: every P is 0
])
def test_settings_that_cannot_learn_stop(argv, flag, capsys):
    with pytest.raises(SystemExit) as stop:
        train.parse_args(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: {flag}: ")


def test_memtrain_group_of_one_stops_and_a_memory_only_or_unused_flag_warns(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--group", "1"], memtrain.MemTrainConfig)
    assert capsys.readouterr().err.startswith("error: --group 1: ")
    assert train.parse_args(["--group", "1"]).group == 1              # MemPO: the memory advantage still trains
    assert capsys.readouterr().err.startswith("warning: --group 1: ")
    train.parse_args(["--algo", "grpo", "--mem-weight", "2"])
    assert capsys.readouterr().err == "warning: --mem-weight 2.0: unused with --algo grpo (no memory reward)\n"
    train.parse_args(["--dual-clip", "0"])
    train.parse_args(["--group", "1"], memalpha.MemAlphaConfig)     # one group = every chunk step of an instance
    assert capsys.readouterr().err == ""


def test_help_groups_the_flags_by_config_section_and_a_recipe_s_own_last(capsys):
    """--help's first group holds the flags a user of the recipe sets first (at most 25: model, data, search, the RL
    budget, the memory reward, LoRA, logging); the PPO knobs, the run's details, the variants and the embedded
    world's SFT follow in groups of their own, and a recipe's own flags come last."""
    titles = [f.metadata["section"] for f in fields(train.Config) if f.metadata["section"]]
    sections = [f.metadata["section"] for f in fields(train.Config)]
    first = [f.name for f in fields(train.Config)][:sections.index(titles[1])]          # the fields before group 2
    assert len(titles) == 5 and len(first) <= 25
    assert {"model", "data", "corpus", "search_url", "rl_steps", "lr", "mem_weight", "lora_rank",
            "report_to"} <= set(first)
    assert not {"sft_steps", "forget_p", "hidden", "mem_adv_norm", "clip_low"} & set(first)
    for config in CONFIGS:
        with pytest.raises(SystemExit):
            train.parse_args(["--help"], config)
        out = capsys.readouterr().out
        at = [out.index(f"\n{t}:\n") for t in titles]
        assert at == sorted(at) and at[0] < out.index("\n  --lr ") < at[1] < out.index("\n  --clip-low ") < at[2]
        own = [f.name for f in fields(config) if f.name not in train.Config.__dataclass_fields__]
        if own:          # a recipe's own flags: a group of their own, after Config's
            group = out.index("\n" + config.__doc__.split("\n")[0].rstrip(".") + ":\n")
            assert group > at[-1] and all(out.index("\n  --" + n.replace("_", "-") + " ") > group for n in own)
    assert config is not train.Config and own


# --------------------------------------------------------------------------- the scripts' argparse flags

class Built(Exception):
    pass


def parser_of(main, argv: list[str], monkeypatch) -> argparse.ArgumentParser:
    """The parser ``main(argv)`` builds, caught at its parse_args before anything runs."""
    built = []

    def catch(self, *args, **kwargs):
        built.append(self)
        raise Built

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", catch)
        with pytest.raises(Built):
            main(argv)
    return built[0]


def flags_of(p: argparse.ArgumentParser) -> list[tuple[list[str], argparse.Action]]:
    """(the sub-command words that lead to it, action) of every flag, sub-commands included."""
    out = []
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            out += [([name] + words, b) for name, sub in a.choices.items() for words, b in flags_of(sub)]
        elif a.option_strings and (a.type is not None or a.choices is not None):
            out.append(([], a))
    return out


SCRIPTS = {      # name: (main, the arguments it needs to reach its flag checks)
    "eval": (ev.parse_args, ["--checkpoint", "."]),
    "diagnostics": (diagnostics.parse_args, ["--checkpoint", ".", "--memory"]),
    "bench": (bench.parse_args, []),
    "sft": (sft.main, ["--export", "NOWHERE"]),
    "search": (search.main, ["--index", "NOWHERE"]),
    "memalpha_eval": (memalpha_eval.main, ["--checkpoint", "."]),
    "memtrain_eval": (memtrain_eval.main, ["--checkpoint", "."]),
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_flag_declares_and_refuses(script, monkeypatch, capsys):
    main, need = SCRIPTS[script]
    checked = 0
    for words, a in flags_of(parser_of(main, [], monkeypatch)):
        flag = a.option_strings[0]
        assert a.choices is None, f"{script} {flag}: choices belong to its type (one error form)"
        assert declared(a.type, a.default), f"{script} {flag}: declares no bound (or unbounded=True)"
        for value in bad_values(a.type):
            refused(capsys, main, words + need + [flag, value], flag, value)
            checked += 1
    assert checked and not os.path.exists("NOWHERE")


def test_one_checker_for_every_flag(monkeypatch):
    """Every script flag with a type checks it with flags.Accepts, whose K range parse is data.int_range's."""
    for script, (main, _) in SCRIPTS.items():
        for _, a in flags_of(parser_of(main, [], monkeypatch)):
            assert isinstance(a.type, flags.Accepts), f"{script} {a.option_strings[0]}: not a flags.Accepts"
    for text in ("1-4", "3", "2,4,6", "3-1", "0-2", "2,1", "x", "1-2-3", "-1", ""):
        assert parsed(flags.k_range, text) == parsed(data.int_range, text), text


def parsed(parse, text: str):
    try:
        return parse(text)
    except ValueError:
        return "ValueError"


# --------------------------------------------------------------------------- end to end

def test_bad_flags_end_to_end_print_one_line_and_leave_no_run(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = tmp_path / "run"
    for cmd, line in ((["train.py", "--run", str(run), "--sft-steps", "0", "--rl-steps", "1", "--lr", "-1"],
                       "error: --lr -1: must be > 0\n"),
                      (["eval.py", "--checkpoint", str(tmp_path), "--max-turns", "0"],
                       "error: --max-turns 0: must be >= 1\n")):
        r = subprocess.run([sys.executable] + cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=120)
        assert (r.returncode, r.stderr, r.stdout) == (2, line, "")
    assert not run.exists()


# --------------------------------------------------------------------------- a missing or broken input

def entry_points() -> list[str]:
    """Every script of the repository with a ``__main__`` block (the tests aside)."""
    paths = [os.path.join(HERE, n) for n in os.listdir(HERE)] + [os.path.join(HERE, "recipes", n)
                                                                  for n in os.listdir(os.path.join(HERE, "recipes"))]
    return sorted(os.path.relpath(p, HERE) for p in paths if p.endswith(".py") and not
                  os.path.basename(p).startswith(("test_", "conftest")) and '__name__ == "__main__"' in open(p).read())


def test_every_entry_point_runs_its_main_under_the_bad_input_guard():
    scripts = entry_points()
    assert {"train.py", "eval.py", "sft.py", "search.py", "diagnostics.py", "viz.py", "bench.py",
            "recipes/memalpha.py", "recipes/memalpha_eval.py", "recipes/memtrain.py",
            "recipes/memtrain_eval.py"} <= set(scripts)
    for name in scripts:
        guard = open(os.path.join(HERE, name)).read().split('if __name__ == "__main__":')[1]
        assert guard.split() == ["data.exit_on_bad_input(main)"] + guard.split()[1:] \
            or guard.split()[0] == "exit_on_bad_input(main)", f"{name}: main() runs unguarded"


def test_a_missing_or_broken_input_is_one_line_naming_it_and_exit_status_2(tmp_path, capsys, monkeypatch):
    """Each script's own reading of each kind of input: a data file missing or not JSON, an index folder cut
    short, a system prompt file that is not there."""
    missing, bad = tmp_path / "MISSING.jsonl", tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "kalo friend mira"}\n{not json\n')
    index = tmp_path / "index"
    search.build_index([{"id": "1", "contents": "kalo friend mira"}, {"id": "2", "contents": "mira boss tebo"}],
                       str(index))
    (index / "postings_doc.npy").write_bytes((index / "postings_doc.npy").read_bytes()[:70])
    monkeypatch.setattr(search, "make_server", lambda *a: pytest.fail("serving a damaged index"))
    tok = data.build_tokenizer()
    model = tmp_path / "model"
    checkpoint.save_model(str(model), data.build_tiny_model(tok, hidden=32, layers=1, heads=2, ffn=64), tok,
                          data.SYSTEM_PROMPT)
    prompt = tmp_path / "MISSING.txt"
    no_prompt = f"error: [Errno 2] No such file or directory: '{prompt}'"
    cases = [
        (search.main, ["index", "--corpus", str(missing), "--index", str(tmp_path / "ix")],
         f"error: {missing}: file not found"),
        (search.main, ["index", "--corpus", str(bad), "--index", str(tmp_path / "ix")],
         f"error: {bad}:2: not valid JSON"),
        (search.main, ["serve", "--index", str(index)], f"error: {index}: a damaged index ("),
        (train.main, ["--run", str(tmp_path / "run"), "--system-prompt", str(prompt), "--sft-steps", "0",
                      "--rl-steps", "0", "--hidden", "32", "--heads", "2"], no_prompt),
        (memtrain.main, ["--run", str(tmp_path / "run2"), "--corpus", str(missing)],
         f"error: {missing}: file not found"),
        (ev.main, ["--checkpoint", str(model), "--system-prompt", str(prompt)], no_prompt),
        (diagnostics.main, ["--checkpoint", str(model), "--memory", "--system-prompt", str(prompt)], no_prompt),
    ]
    capsys.readouterr()
    for main, argv, line in cases:
        with pytest.raises(SystemExit) as stop:
            data.exit_on_bad_input(lambda: main(argv))
        err = capsys.readouterr().err              # a model's loading bar may come first
        assert stop.value.code == 2 and err.endswith("\n") and err.splitlines()[-1].startswith(line), (argv, err)
        assert "Traceback" not in err and sum(ln.startswith("error") for ln in err.splitlines()) == 1, (argv, err)
    assert not (tmp_path / "ix" / "meta.json").exists()


def test_search_index_of_a_missing_corpus_end_to_end_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "search.py", "index", "--corpus", "MISSING.jsonl", "--index", str(tmp_path)],
                       cwd=HERE, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr, r.stdout) == (2, "error: MISSING.jsonl: file not found\n", "")
