"""A multi-node launch, as README gives it: two "nodes" of one process each, rendezvous through c10d on
loopback, train exactly as one node with two processes (the same losses, step for step)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_sft_recipe import read_metrics

from conftest import SMALL_MODEL, exported_weights, free_port, launch, relative_error, torchrun

pytestmark = pytest.mark.launch  # every test here starts processes

ARGS = [
    "recipes/sft.py",
    *SMALL_MODEL,
    "max_steps=6",
    "log_every=1",
    "eval_every=0",
    "save_every=3",
    "grad_accum_steps=2",
    "data.max_tokens_per_microbatch=512",
    "data.report_records=0",
]


def test_two_nodes_train_as_one_node_with_two_processes(tmp_path):
    single = tmp_path / "single"
    launch(
        torchrun(
            *ARGS,
            f"output_dir={single}",
            nproc=2,
        )
    )

    nodes = tmp_path / "nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    launches = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(rank),
                "--nproc_per_node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "chattune-test",
                *ARGS,
                f"output_dir={nodes}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [launch.communicate(timeout=600)[0] for launch in launches]
    assert [launch.returncode for launch in launches] == [0, 0], "\n".join(o[-3000:] for o in outputs)

    def steps(directory):
        return [(m["step"], m["num_tokens"]) for m in read_metrics(directory)]

    assert steps(nodes) == steps(single) and len(steps(single)) == 6
    # The same training, not bit for bit: a rank's CPU threads are the cores over its node's ranks
    # (chattune.distributed), 2 per rank on one-process nodes and 1 on the two-process node, and on an AVX-512 CPU
    # the matmuls round differently with the thread count (5e-8 of a loss after 3 steps; bit for bit on the CPUs
    # before it). Same data, same steps, losses and weights within float32 rounding.
    for got, want in zip(read_metrics(nodes), read_metrics(single)):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert relative_error(exported_weights(nodes / "hf"), exported_weights(single / "hf")) <= 1e-6
    # Both nodes' ranks wrote their shards of every checkpoint into the shared output directory.
    assert {p.name for p in (nodes / "checkpoints" / "step_6").glob("train_state_rank*.pt")} == {
        "train_state_rank0.pt",
        "train_state_rank1.pt",
    }
