"""The one torchrun command builder (chattune.launch.torchrun) the tests, the benchmarks and the GPU check use."""

import sys

from chattune.launch.torchrun import torchrun_command


def test_a_launch_on_a_port_and_a_standalone_one():
    assert torchrun_command("recipes/sft.py", "max_steps=2", nproc=2, port=29555) == [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29555",
        "recipes/sft.py", "max_steps=2",
    ]  # fmt: skip
    assert torchrun_command("recipes/dpo.py")[3:] == ["--nproc_per_node", "1", "--standalone", "recipes/dpo.py"]
