"""One shared fixture: a tiny SFT checkpoint, trained once per test session (the only way to get a
real model that writes valid multi-round trajectories without a model hub)."""
import pytest

import train

SFT_ARGS = ["--sft-copy-steps", "200", "--sft-steps", "400", "--sft-batch", "32", "--rl-steps", "0",
            "--forget-p", "0.5", "--sft-objectives", "1-2", "--hops", "1-2", "--eval-every", "0"]


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory):
    """Folder of a finished SFT-only run: ``final/`` holds model + tokenizer, ``metrics.jsonl`` the curve."""
    run = tmp_path_factory.mktemp("sft")
    train.main(["--run", str(run)] + SFT_ARGS)
    return run
