"""The tests' one launch helper (`conftest.launch`): a test that starts a process without the `launch` marker
fails (so `pytest -m "not launch"` never starts one), and ranks forked from the preloaded server
(`warm_ranks`) train exactly as real torchrun's workers do."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import pytest
from test_sft_recipe import read_metrics

from conftest import SMALL_MODEL, launch, torchrun


def test_an_unmarked_test_cannot_start_a_process():
    with pytest.raises(AssertionError, match="mark it"):
        subprocess.run([sys.executable, "-c", "pass"])
    with pytest.raises(AssertionError, match="mark it"):
        multiprocessing.get_context("fork").Process(target=print).start()


@pytest.mark.launch
def test_forked_ranks_train_as_torchruns_workers(tmp_path):
    """The same 2-rank run with 2 loader workers, launched by real torchrun and by the forked ranks: the same
    losses and gradient norms, bit for bit, and both say what they trained."""
    runs = {}
    for real in (True, False):
        out = tmp_path / ("torchrun" if real else "forked")
        command = torchrun(
            "sft",
            *SMALL_MODEL,
            f"output_dir={out}",
            "max_steps=4",
            "log_every=1",
            "eval_every=0",
            "save_every=0",
            "data.eval=[]",
            "data.num_workers=2",
            "data.report_records=0",
            nproc=2,
        )
        result = launch(command, real_torchrun=real)
        assert "step 4 |" in result.stdout + result.stderr
        runs[real] = [(m["loss"], m["grad_norm"]) for m in read_metrics(out)]
    assert len(runs[True]) == 4 and runs[True] == runs[False]
