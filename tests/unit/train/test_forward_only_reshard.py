"""Forward-only passes leave no gathered parameters behind (issue 26, item 1).

FSDP2 reshards the root unit only after a backward. A held-out evaluation at the last step (with no
checkpoint after it) used to leave the root's embeddings, tied head and final norm gathered in bf16, and
the export then wrote those bf16 copies instead of the fp32 masters; a live DPO reference kept its root
gathered for the whole run. The masters here are read from the optimizer (the sharded parameters it
updates), the export from its safetensors files: neither through `named_parameters()`."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.io.export import export_adapter, export_hf
from chattune.model.peft.adapters import BaseModelView, add_adapters
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.objectives.dpo import LiveReference
from chattune.parallel.fsdp import Placement, shard_model
from chattune.train.evaluation import evaluate
from chattune.train.step import UpdateRule, train_step
from conftest import demo_documents, demo_tokenizer, exported_weights, mesh_dims, tiny_model

CPU = torch.device("cpu")
LORA_WITH_EMBEDDINGS = OmegaConf.create(
    {
        "type": "lora",
        "rank": 4,
        "alpha": 8,
        "dropout": 0.0,
        "target_modules": "all-linear",
        "use_dora": False,
        "modules_to_save": ["embed_tokens"],
        "quantize_base": None,
    }
)


def _bf16_model(hf_model) -> tuple[PackedCausalLM, Placement]:
    model = PackedCausalLM(hf_model, loss_chunk_size=64)
    return model, shard_model(model, mesh_dims(), param_dtype="bfloat16")


def _train_then_evaluate(model: PackedCausalLM, placement: Placement, steps: int = 2) -> dict[str, torch.Tensor]:
    """A few bf16-compute updates (so the fp32 masters are no longer bf16 values), then an evaluation.
    Returns the masters: the optimizer's parameters (fp32 shards; one rank: whole), by their names in the
    HF model, named before any forward (a gathered unit registers other tensors under those names)."""
    names = {id(p): name.removeprefix("hf_model.") for name, p in model.named_parameters()}
    documents = demo_documents(8)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    model.train()
    for step in range(steps):
        train_step(
            model,
            TokenCrossEntropy(),
            StepBatches([collate_packed(documents[4 * (step % 2) : 4 * (step % 2) + 4])]),
            UpdateRule(optimizer, scheduler, 1.0),
            placement,
        )
    evaluate(model, TokenCrossEntropy(), [collate_packed(demo_documents(3, start=20))], placement.dims, pad_token_id=0)
    return {names[id(p)]: p.detach().full_tensor() for group in optimizer.param_groups for p in group["params"]}


def _not_bf16_values(tensor: torch.Tensor) -> float:
    """The share of values a bf16 copy would change: 0 for a tensor of bf16 values."""
    return float((tensor.to(torch.bfloat16).float() != tensor).float().mean())


def test_an_export_after_an_evaluation_writes_the_fp32_masters(tmp_path, one_rank_group):
    model, placement = _bf16_model(tiny_model(seed=0))
    masters = _train_then_evaluate(model, placement)
    export_hf(model, demo_tokenizer(), tmp_path / "hf", is_main=True, dtype=torch.float32)
    exported = exported_weights(tmp_path / "hf")
    for name in ("model.embed_tokens.weight", "model.norm.weight"):  # the root unit's parameters
        assert _not_bf16_values(masters[name]) > 0.5, f"{name}: the test needs masters that are not bf16 values"
        assert torch.equal(exported[name], masters[name]), f"{name}: the export is not the fp32 master"
    assert all(torch.equal(exported[name], value) for name, value in masters.items())


def test_an_adapter_export_after_an_evaluation_writes_the_fp32_embeddings(tmp_path, one_rank_group):
    hf_model = tiny_model(seed=0)
    peft_model = add_adapters(hf_model, LORA_WITH_EMBEDDINGS)
    model, placement = _bf16_model(hf_model)
    masters = _train_then_evaluate(model, placement)
    export_adapter(model, peft_model, demo_tokenizer(), tmp_path / "adapter", is_main=True, base_path=None)
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    embedding = next(
        value for name, value in masters.items() if name.endswith("embed_tokens.modules_to_save.default.weight")
    )
    stored = next(value for name, value in saved.items() if name.endswith("embed_tokens.weight"))
    assert _not_bf16_values(embedding) > 0.5
    assert torch.equal(stored, embedding)


def test_a_live_reference_leaves_its_parameters_sharded(one_rank_group):
    reference_model, _ = _bf16_model(tiny_model(seed=0))
    reference = LiveReference(reference_model)
    batch = collate_packed(demo_documents(4))
    batch.doc_ids = batch.doc_ids[:2]  # two "pairs": the logps are not what is checked here
    reference(batch)
    gathered = [name for name, p in reference_model.named_parameters() if not isinstance(p, DTensor)]
    assert not gathered, f"gathered after the reference's forward: {gathered}"

    # A view of the policy's base (LoRA) shares the policy's root: left for the policy's backward.
    hf_model = tiny_model(seed=1)
    peft_model = add_adapters(hf_model, LORA_WITH_EMBEDDINGS)
    policy, _ = _bf16_model(hf_model)
    LiveReference(BaseModelView(policy, peft_model))(batch)
    assert any(not isinstance(p, DTensor) for p in policy.parameters())
