"""QLoRA (peft.quantize_base): a base whose decoder linears are 4-bit (bitsandbytes), loaded on two gloo ranks
from a model directory, with LoRA (and DoRA) adapters on it. Checked against an independent computation:
the same base quantized and dequantized with bitsandbytes' functions, run as a plain peft model one chat at a
time. The adapter gradients, the merged export and the adapter directory all match it. The recipes refuse
a 4-bit base on the CPU; these tests drive the library on bitsandbytes' CPU kernels."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import distribute_tensor
from transformers import AutoModelForCausalLM

import conftest
from chattune.checkpoint.checkpoint import load_checkpoint, save_checkpoint
from chattune.checkpoint.run_state import model_and_optimizer
from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed
from chattune.distributed import exit_process, init_distributed, shutdown_distributed
from chattune.hf_layout import decoder_layers
from chattune.model.build import ModelSections, ModelSource, build_sharded_model
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.io.export import export_adapter, export_hf
from chattune.model.peft.adapters import add_adapters
from chattune.model.quantization.quantize import quantize_linears, quantized_modules, replicated_parameters
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.parallel.fsdp import shard_model
from chattune.train.step import UpdateRule, accumulate_gradients, train_step
from conftest import (
    demo_documents,
    demo_tokenizer,
    exported_weights,
    free_port,
    init_worker_process_group,
    mesh_dims,
    plain_mean_token_loss,
    relative_error,
    spawn,
    tiny_model,
)

bnb = pytest.importorskip("bitsandbytes")

NUM_DOCS = 8
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def settings(use_dora: bool):
    return OmegaConf.create(
        {
            "type": "lora",
            "rank": 4,
            "alpha": 8,
            "dropout": 0.0,
            "target_modules": "all-linear",
            "use_dora": use_dora,
            "modules_to_save": None,
            "quantize_base": "nf4",
        }
    )


def run_config(path: str):
    return OmegaConf.create(
        {
            "seed": 0,
            "model": {
                "path": path,
                "compile": False,
                "fsdp": {"param_dtype": "auto", "reduce_dtype": "float32", "activation_checkpointing": False},
            },
            "loss": {"chunk_size": 64, "implementation": "chunked", "router_aux_coef": None},
            "data": {"share_prompts": False},
        }
    )


def random_b(name: str, shape) -> torch.Tensor:
    """A non-zero B (at peft's init B = 0, so A's gradient is 0), the same for a name wherever it is made."""
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    return 0.05 * torch.randn(shape, generator=generator)


def _worker(rank: int, world_size: int, port: int, base: str, out: str, use_dora: bool) -> None:
    init_worker_process_group(rank, world_size, port)
    dist_info = init_distributed("cpu")
    hf_model, model, peft_model, placement = build_sharded_model(
        sections=ModelSections.of(run_config(base)),
        tokenizer=demo_tokenizer(),
        dims=dist_info,
        source=ModelSource(base),
        adapters=settings(use_dora),
    )
    quantized = [m for m in hf_model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 2 * len(LINEARS)
    assert all(m.weight.bnb_quantized and m.weight.dtype == torch.uint8 for m in quantized), "4 bits, replicated"
    assert all(not p.requires_grad for m in quantized for p in m.parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(
                    distribute_tensor(random_b(name.removeprefix("hf_model."), p.shape), p.device_mesh, p.placements)
                )
    model.train()
    docs = demo_documents(NUM_DOCS)
    mine = docs[rank::world_size]
    accumulate_gradients(
        model,
        TokenCrossEntropy(),
        StepBatches([collate_packed(mine[:2]), collate_packed(mine[2:])]),
        placement,
    )
    trained = {
        name.removeprefix("hf_model."): (p.full_tensor().detach().clone(), p.grad.full_tensor().clone())
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    export_hf(model, demo_tokenizer(), Path(out) / "hf", dist_info.is_main)
    export_adapter(model, peft_model, demo_tokenizer(), Path(out) / "adapter", dist_info.is_main, base)
    checkpoint_round_trip(model, Path(out) / "checkpoints")  # last: its optimizer step moves the adapters
    if rank == 0:
        torch.save(trained, f"{out}/trained.pt")
    shutdown_distributed()
    exit_process()


def checkpoint_round_trip(model, root: Path) -> None:
    """A checkpoint holds the adapters and their optimizer state, nothing of the 4-bit base (its weights nor
    its quantization state); loading it restores the adapters after they moved."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    optimizer.step()
    saved = {name: p.detach().full_tensor().clone() for name, p in model.named_parameters() if p.requires_grad}
    directory = save_checkpoint(root, 1, model_and_optimizer(model, optimizer), {"world_size": 2})
    keys = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), sorted(model_keys)[:5]
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    load_checkpoint(directory, model_and_optimizer(model, optimizer))
    assert all(
        torch.equal(p.detach().full_tensor(), saved[name]) for name, p in model.named_parameters() if p.requires_grad
    )
    optimizer.zero_grad(set_to_none=False)


def dequantized_base(base) -> AutoModelForCausalLM:
    """The base model with every decoder linear weight replaced by its NF4 round trip, made with bitsandbytes'
    own quantize/dequantize functions (not chattune's layers)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in LINEARS:
                packed, state = bnb.functional.quantize_4bit(
                    module.weight.data, blocksize=64, compress_statistics=True, quant_type="nf4"
                )
                module.weight.copy_(bnb.functional.dequantize_4bit(packed, state))
    return model


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
@pytest.mark.launch
def test_qlora_matches_a_plain_model_on_the_dequantized_base(tmp_path, base_dir, use_dora):
    from peft import LoraConfig, PeftModel, get_peft_model

    spawn(_worker, args=(2, free_port(), str(base_dir), str(tmp_path), use_dora), nprocs=2)
    trained = torch.load(tmp_path / "trained.pt")

    # The plain model: dequantized base, peft's own adapters (DoRA's magnitudes computed by peft from it), the
    # sharded run's A and B, one chat at a time.
    reference = dequantized_base(base_dir)
    peft_model = get_peft_model(
        reference, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=use_dora, task_type="CAUSAL_LM")
    )
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, (value, _) in trained.items():
            if "lora_A" in name or "lora_B" in name:
                params[name].copy_(value)
            else:  # DoRA's magnitudes, set by chattune from the loaded 4-bit rows: peft's own, from its base
                assert "lora_magnitude_vector" in name and torch.allclose(params[name], value, rtol=1e-6), name
    loss = plain_mean_token_loss(reference, NUM_DOCS)
    loss.backward()
    want = {name: p.grad for name, p in reference.named_parameters() if p.requires_grad}
    assert sorted(want) == sorted(trained) and len(want) == 2 * len(LINEARS) * (3 if use_dora else 2)
    assert relative_error({k: g for k, (_, g) in trained.items()}, want) < 1e-5

    # The merged export: the dequantized base with the adapters merged (peft's merge, on the plain model).
    merged = exported_weights(tmp_path / "hf")
    want_merged = peft_model.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(k for k in want_merged if k != "lm_head.weight")  # tied: written once
    assert relative_error(merged, {k: want_merged[k] for k in merged}) < 1e-6
    # The adapter directory, loaded by peft onto the dequantized base, gives the trained model's loss.
    with_adapter = PeftModel.from_pretrained(dequantized_base(base_dir), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert abs(float(plain_mean_token_loss(with_adapter, NUM_DOCS)) - float(loss)) / float(loss) < 1e-5


@pytest.mark.launch
def test_recipes_refuse_a_4bit_base_on_the_cpu(tmp_path, base_dir):
    result = conftest.launch(
        [
            sys.executable,
            "recipes/sft.py",
            f"output_dir={tmp_path / 'out'}",
            f"model.path={base_dir}",
            f"tokenizer.path={base_dir}",
            "peft=qlora",
            "device=cpu",
        ],
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "peft.quantize_base" in output and "CUDA only" in output
    assert "Traceback" not in output


def test_bf16_compute_quantizes_from_bf16_and_exports_the_biases_exactly(tmp_path, one_rank_group):
    """Quantized from the compute dtype, a layer dequantizes straight to it (quantized from fp32 it dequantized
    to fp32 and cast, every layer of every step); bitsandbytes' forward replaced a frozen fp32 bias by its
    bf16 copy, which the merged export then wrote (Qwen2's qkv biases)."""
    hf_model = tiny_model(seed=4, model_type="qwen2")
    biases = {name: p.detach().clone() for name, p in hf_model.named_parameters() if name.endswith("_proj.bias")}
    assert biases, "the test needs a model with linear biases"
    peft_model = add_adapters(hf_model, settings(use_dora=False))
    quantize_linears(decoder_layers(hf_model), "nf4", torch.bfloat16, torch.device("cpu"))
    modules = quantized_modules(hf_model)
    assert modules and all(m.weight.quant_state.dtype == torch.bfloat16 for m in modules)

    model = PackedCausalLM(hf_model, loss_chunk_size=64)
    placement = shard_model(model, mesh_dims(), param_dtype="bfloat16", replicated=replicated_parameters(hf_model))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    train_step(
        model,
        TokenCrossEntropy(),
        StepBatches([collate_packed(demo_documents(4))]),
        UpdateRule(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), 1.0),
        placement,
    )
    export_hf(model, demo_tokenizer(), tmp_path / "hf", is_main=True, dtype=torch.float32)
    export_adapter(model, peft_model, demo_tokenizer(), tmp_path / "adapter", is_main=True, base_path=None)
    exported = exported_weights(tmp_path / "hf")
    for name, bias in biases.items():
        stored = name.replace(".base_layer", "")
        assert torch.equal(exported[stored], bias), f"{stored}: the export is not the model's bias"
