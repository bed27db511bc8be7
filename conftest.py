"""One shared fixture: a tiny SFT checkpoint, trained once per test session (the only way to get a
real model that writes valid multi-round trajectories without a model hub)."""
import pytest

import train

SFT_ARGS = train.SMALL_SFT_ARGS


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory):
    """Folder of a finished SFT-only run: ``final/`` holds model + tokenizer, ``metrics.jsonl`` the curve."""
    run = tmp_path_factory.mktemp("sft")
    train.main(["--run", str(run)] + SFT_ARGS)
    return run
