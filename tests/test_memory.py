"""The memory estimate (`chattune.model.memory`) against measured byte counts: parameters, gradients and
optimizer states exactly as FSDP2 shards them on 2 real ranks, activations within 10% of what autograd really
keeps in the packed forward on CPU (a saved-tensors hook), for three model shapes, full and LoRA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from transformers import GraniteConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig

from chattune.config.schema import PeftConfig
from chattune.data.packing import collate_packed
from chattune.distributed import exit_process, shutdown_distributed
from chattune.model.adapters import add_adapters
from chattune.model.causal_lm import PackedCausalLM, build_hf_model
from chattune.model.fsdp import shard_model
from chattune.model.memory import MemoryInputs, estimate, parse_size
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.train.feed import StepBatches
from chattune.train.step import accumulate_gradients
from conftest import PROJECT_ROOT, demo_documents, demo_tokenizer, free_port, init_worker_process_group

SHAPES = {
    "llama": lambda: LlamaConfig(
        hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2
    ),
    "qwen3": lambda: Qwen3Config(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
    ),
    "granite": lambda: GraniteConfig(
        hidden_size=80,
        intermediate_size=200,
        num_hidden_layers=2,
        num_attention_heads=5,
        num_key_value_heads=5,
        residual_multiplier=0.5,
        embedding_multiplier=2.0,
        logits_scaling=4.0,
    ),
}
LORA = PeftConfig(rank=4, alpha=8)


def _model(shape: str, lora: bool):
    torch.manual_seed(0)
    hf_model = build_hf_model(demo_tokenizer(), SHAPES[shape]())
    if lora:
        add_adapters(hf_model, LORA)
    return hf_model


def _inputs(hf_model, ranks: int, tokens: int, lora: bool) -> MemoryInputs:
    return MemoryInputs(
        hf_model.config, ranks=ranks, tokens=tokens, lora_rank=LORA.rank if lora else None, lora_targets=("all-linear",)
    )


def _local_bytes(tensors) -> int:
    return sum(
        t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
        for t in tensors
    )


def _counts_worker(rank: int, world_size: int, port: int, out: str) -> None:
    init_worker_process_group(rank, world_size, port)
    found = {}
    for shape in SHAPES:
        for lora in (False, True):
            hf_model = _model(shape, lora)
            estimated = estimate(_inputs(hf_model, world_size, 512, lora)).rows
            model = shard_model(PackedCausalLM(hf_model), "cpu", world_size)
            trained = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trained, lr=1e-3)
            batch = collate_packed(demo_documents(4, start=4 * rank))
            accumulate_gradients(model, TokenCrossEntropy(), StepBatches([batch]), torch.device("cpu"))
            measured = {
                "parameters (fp32 shards)": _local_bytes(model.parameters()),
                "gradients (fp32 shards)": _local_bytes(p.grad for p in trained),
            }
            optimizer.step()
            measured["optimizer states"] = _local_bytes(v for s in optimizer.state.values() for v in s.values())
            found[(shape, lora)] = (measured, {k: estimated[k] for k in measured})
    if rank == 0:  # (the first rank holds the largest shards: FSDP2 gives the last ones what is left)
        torch.save(found, out)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_parameters_gradients_and_optimizer_states_are_the_sharded_models_own(tmp_path):
    out = str(tmp_path / "counts.pt")
    mp.spawn(_counts_worker, args=(2, free_port(), out), nprocs=2, join=True)
    for case, (measured, estimated) in torch.load(out).items():
        assert measured == estimated, case


def _saved_bytes(model: torch.nn.Module, run) -> int:
    """What autograd keeps for the backward while `run` runs: each storage once, parameters excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(seen.values())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_activations_are_within_ten_percent_of_what_the_packed_forward_keeps(shape, lora):
    batch = collate_packed(demo_documents(8))
    model = PackedCausalLM(_model(shape, lora))
    measured = _saved_bytes(model, lambda: model(batch))
    estimated = estimate(_inputs(model.hf_model, 1, batch.num_tokens, lora)).rows["activations"]
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


def test_a_forward_the_meta_device_cannot_run_is_not_estimated_and_says_why():
    moe = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    estimated = estimate(MemoryInputs(moe, ranks=1, tokens=256))
    assert estimated.rows["activations"] is None and estimated.total is None
    assert (
        "activations not estimated: Qwen3MoeForCausalLM's forward does not run on the meta device" in estimated.notes[0]
    )
    table = estimated.table(parse_size("24GiB"))
    assert "not estimated" in table and "(unknown)" in table


def test_sizes_are_read_as_written():
    assert parse_size("24GiB") == 24 * 2**30 and parse_size("80GB") == 80 * 10**9 and parse_size("1024") == 1024
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("lots")


@pytest.mark.launch
def test_validate_prints_the_table_and_whether_it_fits():
    """An 8B-shaped config (Llama 3's widths, random init from a config: nothing is loaded) on a planned 24 GiB."""
    eight_b = (
        "model.config={_target_: transformers.LlamaConfig, hidden_size: 4096, intermediate_size: 14336, "
        "num_hidden_layers: 32, num_attention_heads: 32, num_key_value_heads: 8, max_position_embeddings: 8192, "
        "tie_word_embeddings: false}"
    )
    command = [sys.executable, "-m", "chattune.cli.main", "validate", "sft/tiny"]
    big = subprocess.run(
        [*command, "--device-memory", "24GiB", eight_b], cwd=PROJECT_ROOT, capture_output=True, text=True
    )
    assert big.returncode == 0, big.stdout + big.stderr
    assert "memory per rank, estimated on a GPU (1 rank(s), 2048 tokens a microbatch, bfloat16 compute" in big.stdout
    assert "device memory                       24.00 GiB  (does NOT fit)" in big.stdout
    small = subprocess.run(
        [*command, "--ranks", "2", "--device-memory", "80GB"], cwd=PROJECT_ROOT, capture_output=True, text=True
    )
    assert "(2 rank(s)" in small.stdout and "(fits)" in small.stdout, small.stdout + small.stderr


def test_the_estimate_leaves_the_live_models_config_as_it_was():
    """The meta model is built from a copy: from_config records its attention stand-in in the config it is given,
    which a live model shares (its attention was the stand-in's, and its losses garbage)."""
    hf_model = _model("llama", lora=False)
    before = (hf_model.config.to_dict(), hf_model.config._attn_implementation)
    estimate(_inputs(hf_model, 1, 128, lora=False))
    assert (hf_model.config.to_dict(), hf_model.config._attn_implementation) == before
