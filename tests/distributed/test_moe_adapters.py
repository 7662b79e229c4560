"""LoRA on mixture-of-experts models trains the experts (`chattune.model.peft.adapter_targets`): on Qwen3-MoE,
gpt-oss, Mixtral, DeepSeek-V3 and Qwen3.5-MoE shapes, `all-linear` reaches every stacked expert weight; the
experts' adapter gradients, sharded over two ranks and packed, equal a plain peft model's run on each document
alone; the merged export equals peft's own merge; the adapter directory loads in peft over the base with the same
targets and the same forward; the router trains only when asked; linears that peft's transformers-4 conversion
would move on loading are left out with the reason logged, or refused when named."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from omegaconf import OmegaConf

from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed
from chattune.distributed import exit_process, shutdown_distributed
from chattune.errors import UserError
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.io.export import export_adapter, plan_tensors
from chattune.model.peft.adapter_targets import expert_stacks, routers, trainable_by_group
from chattune.model.peft.adapters import add_adapters
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.parallel.fsdp import shard_model
from chattune.train.step import accumulate_gradients
from conftest import (
    demo_documents,
    demo_tokenizer,
    free_port,
    init_worker_process_group,
    mesh_dims,
    plain_mean_token_loss,
    relative_error,
    spawn,
    tiny_model,
)

NUM_DOCS = 6
LORA = OmegaConf.create(
    {
        "type": "lora",
        "rank": 4,
        "alpha": 8,
        "dropout": 0.0,
        "target_modules": "all-linear",
        "train_router": False,
        "use_dora": False,
        "modules_to_save": None,
        "quantize_base": None,
    }
)
# Tiny shapes of the families users fine-tune with adapters. Qwen3-MoE has a dense first layer
# (mlp_only_layers) and DeepSeek-V3 a dense first layer and shared experts: the linears peft's conversion
# would move to the experts on loading.
FAMILIES = {
    "qwen3_moe": dict(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
        mlp_only_layers=[0],
    ),
    "gpt_oss": dict(
        model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(
        model_type="deepseek_v3", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1, num_key_value_heads=4,
    ),
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, head_dim=16, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    ),
}  # fmt: skip
# The linears `all-linear` leaves out where the installed peft would move them to the experts when loading the
# adapter (huggingface/peft#3711, up to peft 0.21; `peft_moves_linears`).
LEFT_OUT = {
    "qwen3_moe": {"model.layers.0.mlp." + p for p in ("gate_proj", "up_proj", "down_proj")},
    "deepseek_v3": {
        f"model.layers.{i}.mlp.{part}{p}"
        for i, part in ((0, ""), (1, "shared_experts."))
        for p in ("gate_proj", "up_proj", "down_proj")
    },
}
# One sharded run per family; Qwen3-MoE's with its router trained and activation checkpointing.
SETTINGS = {name: LORA for name in FAMILIES} | {"qwen3_moe": OmegaConf.merge(LORA, {"train_router": True})}


def peft_moves_linears() -> bool:
    """Whether the installed peft's conversion of transformers-4 MoE adapters moves a linear named like an expert
    projection (a dense layer's `down_proj`) to the stacked experts: asked of peft itself, on Qwen3-MoE."""
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import (
        convert_peft_config_for_transformers,
        get_model_conversion_mapping,
    )

    model = tiny_model(seed=0, **FAMILIES["qwen3_moe"])
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"])
    convert_peft_config_for_transformers(config, model=model, conversions=get_model_conversion_mapping(model))
    return "down_proj" not in set(config.target_modules or [])


def left_out(name: str) -> set[str]:
    return LEFT_OUT.get(name, set()) if peft_moves_linears() else set()


def moe_lora_model(name: str, settings=None):
    """A tiny family model with adapters whose B is not zero (at peft's init B = 0, and A's gradient with it)."""
    model = tiny_model(seed=0, **FAMILIES[name])
    peft_model = add_adapters(model, settings if settings is not None else SETTINGS[name])
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter_name, p in model.named_parameters():
            if "lora_B" in parameter_name:
                p.normal_(0, 0.05)
    return model, peft_model


def adapted_parameters(model) -> dict[str, set[str]]:
    """Each module holding an adapted parameter -> the names of its parameters peft wraps (read from peft)."""
    from peft.tuners.lora import ParamWrapper

    found: dict[str, set[str]] = {}
    for path, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            found.setdefault(path.replace(".base_layer", ""), set()).add(module.parameter_name)
    return found


@pytest.mark.parametrize("name", FAMILIES)
def test_all_linear_adapts_every_expert_stack_and_the_log_says_so(name, caplog):
    from peft.tuners.lora import LoraLayer, ParamWrapper

    plain = tiny_model(seed=0, **FAMILIES[name])
    stacks = expert_stacks(plain)
    linears = {p for p, m in plain.named_modules() if isinstance(m, torch.nn.Linear) and p != "lm_head"}
    router_paths = set(routers(plain))
    assert stacks and router_paths
    with caplog.at_level(logging.INFO, logger="chattune.model.peft.adapters"):
        model, _ = moe_lora_model(name, LORA)
    # Every expert stack has its adapter (gate_up_proj and down_proj of every MoE layer).
    wrapped = adapted_parameters(model)
    assert {f"{path}.{p}" for path, names in wrapped.items() for p in names} == set(stacks)
    # Every other linear but the router has one, except what peft would move on loading.
    adapted = {
        p.replace(".base_layer", "")
        for p, m in model.named_modules()
        if isinstance(m, LoraLayer) and not isinstance(m, ParamWrapper)
    }
    assert adapted == linears - router_paths - left_out(name)
    # The router is frozen: no adapter and no gradient.
    assert not any(
        p.requires_grad
        for n, p in model.named_parameters()
        if n.replace(".base_layer", "").startswith(tuple(router_paths))
    )
    counts = trainable_by_group(model)
    assert counts["experts"] > 0 and counts["attention"] > 0 and counts["router"] == 0
    assert f"experts {counts['experts']:,}" in caplog.text and "router 0" in caplog.text
    if left_out(name):
        assert (
            f"left out of all-linear: {len(LEFT_OUT[name])} linear layers named down_proj, gate_proj, up_proj"
            in caplog.text
        )
        assert "huggingface/peft#3711" in caplog.text
    else:
        assert "left out of all-linear" not in caplog.text


def test_the_router_trains_when_asked():
    model, _ = moe_lora_model("gpt_oss", OmegaConf.merge(LORA, {"train_router": True}))
    assert {path: names for path, names in adapted_parameters(model).items() if "router" in path} == {
        f"model.layers.{i}.mlp.router": {"weight"} for i in range(2)
    }
    assert trainable_by_group(model)["router"] > 0


def test_named_targets_reach_expert_stacks_and_a_name_peft_would_move_is_refused():
    model, _ = moe_lora_model("gpt_oss", OmegaConf.merge(LORA, {"target_modules": ["q_proj", "down_proj"]}))
    assert {f"{path}.{p}" for path, names in adapted_parameters(model).items() for p in names} == {
        f"model.layers.{i}.mlp.experts.down_proj" for i in range(2)
    }
    model, _ = moe_lora_model("mixtral", OmegaConf.merge(LORA, {"target_modules": ["experts"]}))
    assert {f"{path}.{p}" for path, names in adapted_parameters(model).items() for p in names} == set(
        expert_stacks(model)
    )
    assert trainable_by_group(model)["attention"] == 0
    # Qwen3-MoE's dense layer has a down_proj, which peft up to 0.21 re-targets to the experts when loading: refused
    # there; peft 0.22 keeps it, and the name reaches the dense layer's module and the experts' stacks.
    named = OmegaConf.merge(LORA, {"target_modules": ["down_proj"]})
    if peft_moves_linears():
        with pytest.raises(UserError, match=r"peft.target_modules: down_proj on Qwen3MoeForCausalLM: .*peft#3711"):
            add_adapters(tiny_model(**FAMILIES["qwen3_moe"]), named)
    else:
        model, _ = moe_lora_model("qwen3_moe", named)
        stacks = {s for s in expert_stacks(model) if s.endswith("down_proj")}
        assert {f"{path}.{p}" for path, names in adapted_parameters(model).items() for p in names} == stacks
        assert "model.layers.0.mlp.down_proj.lora_A.default.weight" in dict(model.named_parameters())


def _worker(rank: int, world_size: int, port: int, name: str, splits, out_path: str, checkpointing: bool) -> None:
    init_worker_process_group(rank, world_size, port)
    docs = demo_documents(NUM_DOCS)
    hf_model, _ = moe_lora_model(name)
    model = PackedCausalLM(hf_model, loss_chunk_size=16)
    placement = shard_model(model, mesh_dims(), activation_checkpointing=checkpointing)
    model.train()
    microbatches = [collate_packed([docs[i] for i in mb]) for mb in splits[rank]]
    accumulate_gradients(model, TokenCrossEntropy(), StepBatches(microbatches), placement)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad), "the base must stay frozen"
    grads = {
        n.removeprefix("hf_model."): p.grad.full_tensor().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    if rank == 0:
        torch.save(grads, out_path)
    shutdown_distributed()
    exit_process()


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.launch
def test_expert_adapter_gradients_equal_a_plain_peft_model_on_each_document(tmp_path, name):
    model, _ = moe_lora_model(name)
    model.set_attn_implementation("eager")
    plain_mean_token_loss(model, NUM_DOCS).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    split = [[[0, 1], [2]], [[3], [4, 5]]]
    out = tmp_path / "grads.pt"
    checkpointing = name == "qwen3_moe"
    spawn(_worker, args=(2, free_port(), name, split, str(out), checkpointing), nprocs=2)
    got = torch.load(out)
    assert sorted(got) == sorted(want)
    experts = [n for n in want if ".experts." in n and ".lora_" in n]
    assert experts and all(want[n].abs().sum() > 0 for n in experts), "the experts' adapters get gradients"
    assert relative_error(got, want) < 1e-5
    if name == "qwen3_moe":  # its router's adapter trains too
        assert any(".mlp.gate.lora_" in n and want[n].abs().sum() > 0 for n in want)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_merged_export_and_the_adapter_directory_equal_peft_over_the_base(tmp_path, name):
    from peft import PeftModel

    model, peft_model = moe_lora_model(name)
    packed = PackedCausalLM(model, loss_chunk_size=16)
    # The merged export (each tensor as the file gets it) equals peft's own merge.
    planned = plan_tensors(packed, torch.float32)
    merged = {t.name: t.merge(t.source.detach().float(), 0) if t.merge else t.source.detach() for t in planned}
    want = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert set(merged) <= set(want) and set(want) - set(merged) <= {"lm_head.weight"}
    assert all(torch.allclose(merged[k], want[k], rtol=0, atol=1e-6) for k in merged), name
    assert any(
        not torch.equal(merged[k], tiny_model(**FAMILIES[name]).state_dict()[k]) for k in merged if ".experts." in k
    )
    # The adapter directory loads in peft over the same base, with the same adapters and the same forward.
    export_adapter(packed, peft_model, demo_tokenizer(), tmp_path / "adapter", True, None)
    loaded = PeftModel.from_pretrained(tiny_model(seed=0, **FAMILIES[name]), tmp_path / "adapter")
    ours = {n.removeprefix("base_model.model."): p for n, p in peft_model.named_parameters() if ".lora_" in n}
    theirs = {n.removeprefix("base_model.model."): p for n, p in loaded.named_parameters() if ".lora_" in n}
    assert sorted(theirs) == sorted(ours) and all(torch.equal(theirs[n], ours[n]) for n in ours)
    ids = torch.tensor([demo_documents(1)[0].input_ids.tolist()])
    loaded.eval(), model.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_qlora_quantizes_the_linears_and_says_the_expert_stacks_stay_in_the_compute_dtype():
    pytest.importorskip("bitsandbytes")
    from chattune.hf_layout import decoder_layers
    from chattune.model.peft.adapter_targets import quantized_experts_note
    from chattune.model.quantization.quantize import is_quantized, quantize_linears

    model, _ = moe_lora_model("qwen3_moe", OmegaConf.merge(LORA, {"quantize_base": "nf4"}))
    quantized = quantize_linears(decoder_layers(model), "nf4", torch.float32, torch.device("cpu"))
    assert quantized and all(is_quantized(m.weight) for m in quantized)
    stacks = dict(model.named_parameters())
    assert all(not is_quantized(p) for n, p in stacks.items() if n.endswith(("gate_up_proj", "down_proj")))
    assert quantized_experts_note(model, "bfloat16") == (
        "QLoRA: the 2 stacked expert weights stay in bfloat16 (bitsandbytes quantizes linear layers only); their "
        "adapters train as with LoRA"
    )
