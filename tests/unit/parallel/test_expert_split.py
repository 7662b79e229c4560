"""Expert parallelism's refusals at start-up (`chattune.parallel.fsdp.shard_model` under `parallel.expert`), on a
one-rank group with the ep mesh kept at degree 1 (`ParallelDims.build(keep={"ep"})`): a model without
mixture-of-experts layers, and one whose experts module holds weights that are not stacked by expert, are refused
with `UnsupportedModel` naming the reason and the remedy, the model left whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from chattune.distributed import ParallelDims
from chattune.errors import UnsupportedModel
from chattune.model.causal_lm import PackedCausalLM
from chattune.parallel.expert_parallel import ExpertParallelExperts
from chattune.parallel.fsdp import shard_model
from conftest import tiny_model

MOE = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)


def test_a_model_without_stacked_experts_is_refused_with_the_reason(one_rank_group):
    dims = ParallelDims.build(torch.device("cpu"), keep=frozenset({"ep"}))
    with pytest.raises(UnsupportedModel, match=r"has no mixture-of-experts layers with stacked experts .* set "
                       r"parallel.expert=1"):  # fmt: skip
        shard_model(PackedCausalLM(tiny_model(seed=0)), dims)
    moe = tiny_model(seed=0, **MOE)
    moe.model.layers[1].mlp.experts.extra = nn.Linear(4, 4)  # a weight not stacked by expert, inside a module
    with pytest.raises(UnsupportedModel, match=r"Qwen3MoeExperts holds .*weights in modules \(extra.weight, "
                       r"extra.bias\): its experts cannot be split over ranks; set parallel.expert=1"):  # fmt: skip
        shard_model(PackedCausalLM(moe), dims)
    assert not any(isinstance(m, ExpertParallelExperts) for m in moe.modules())  # (layer 0's too: left whole)
