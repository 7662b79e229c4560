"""`chattune.model.tensor_parallel.tensor_parallel_problem`: which models split over T ranks, and the reason for
those that do not (what `shard_model` raises as UnsupportedModel at start-up). The split itself is checked on
real processes in test_device_mesh (gradients against stock transformers) and test_mesh_layouts (recipe runs)."""

from __future__ import annotations

from chattune.model.tensor_parallel import tensor_parallel_problem
from conftest import tiny_config


def test_the_families_of_the_plan_split_and_others_are_refused_with_the_reason():
    assert tensor_parallel_problem(tiny_config("llama"), 2) is None
    assert tensor_parallel_problem(tiny_config("qwen3"), 1) is None
    assert tensor_parallel_problem(tiny_config("gpt2"), 2) == (
        "gpt2 has no tensor-parallel plan in chattune (families: llama, mistral, qwen2, qwen3, gemma3_text); train "
        "it with parallel.tensor=1"
    )
    # tiny_config: 4 query heads, 2 key-value heads, MLP width 128
    assert tensor_parallel_problem(tiny_config("qwen2"), 4) == (
        "4 does not divide the model's 2 key-value heads: each rank holds 1/4 of them"
    )
    assert tensor_parallel_problem(tiny_config("mistral", intermediate_size=129), 2) == (
        "2 does not divide the model's 129 MLP width: each rank holds 1/2 of them"
    )
