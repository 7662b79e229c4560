"""Loading a model directory shard by shard, and the sharded export, with two real ranks.

After `build_sharded_model` (meta build, FSDP2, each rank reading its own rows), the gathered weights and
every buffer equal `from_pretrained`'s bit for bit: tied and untied, a bf16 and an fp32 source, first
dimensions that do not split evenly over the ranks, and a checkpoint stored under other names (the
from_pretrained fallback). A random-init model keeps the weights of a plain seeded build. The export is
read back with transformers and with safetensors alone.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, LlamaConfig

from chattune.distributed import exit_process, init_distributed, shutdown_distributed
from chattune.errors import UserError
from chattune.model.build import ModelSections, ModelSource, build_sharded_model
from chattune.model.causal_lm import build_hf_model
from chattune.model.io.export import export_dtype, export_hf
from conftest import demo_tokenizer, exported_weights, free_port, init_worker_process_group, spawn, tiny_config

# Odd first dimensions (vocabulary, heads * head_dim, MLP width): rank 1 holds one row fewer than rank 0.
ODD_SHAPES = dict(
    vocab_size=1031, hidden_size=64, intermediate_size=129, num_attention_heads=4, num_key_value_heads=2, head_dim=16
)
SOURCES = {  # name -> (config, dtype it is saved in)
    "qwen3_tied_bf16": (dict(model_type="qwen3", tie_word_embeddings=True, **ODD_SHAPES), torch.bfloat16),
    "llama_untied_fp32": (dict(tie_word_embeddings=False, **ODD_SHAPES), torch.float32),
    "qwen3_untied_bf16": (dict(model_type="qwen3", tie_word_embeddings=False, **ODD_SHAPES), torch.bfloat16),
}


def run_config(path: str | None, seed: int = 0):
    return OmegaConf.create(
        {
            "seed": seed,
            "model": {
                "path": path,
                "compile": False,
                "config": {
                    "_target_": "transformers.LlamaConfig",
                    **{k: v for k, v in ODD_SHAPES.items() if k not in ("vocab_size", "head_dim")},
                },
                "fsdp": {"param_dtype": "auto", "reduce_dtype": "float32", "activation_checkpointing": False},
            },
            "loss": {"chunk_size": 64, "implementation": "chunked", "router_aux_coef": None},
            "data": {"share_prompts": False},
        }
    )


def gathered(model, hf_model) -> dict[str, torch.Tensor]:
    """Full weights (collective) and buffers, by HF name."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    state = {k.removeprefix("hf_model."): v for k, v in state.items()}
    state.update({f"buffer:{k}": v for k, v in hf_model.named_buffers()})
    return state


def reference(directory: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return {**model.state_dict(), **{f"buffer:{k}": v for k, v in model.named_buffers()}}


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), (what, name)


def _worker(rank: int, world_size: int, port: int, tmp: str) -> None:
    init_worker_process_group(rank, world_size, port)
    tmp_path, tokenizer, dist_info = Path(tmp), demo_tokenizer(), init_distributed("cpu")
    for name, (_, dtype) in SOURCES.items():
        directory = tmp_path / name
        hf_model, model, _, _ = build_sharded_model(
            sections=ModelSections.of(run_config(str(directory))),
            tokenizer=tokenizer,
            dims=dist_info,
            source=ModelSource(str(directory)),
        )
        local = sum(p.to_local().numel() for p in model.parameters())
        assert local < 0.6 * sum(p.numel() for p in model.parameters()), "each rank should hold about half"
        got = gathered(model, hf_model)
        if rank == 0:
            assert_bit_equal(got, reference(directory), name)
            assert (hf_model.lm_head.weight is hf_model.model.embed_tokens.weight) == ("tied" in name.split("_"))
        assert model.source_dtype == dtype
        # The export: the source's dtype by default, several shards, one gathered tensor at a time.
        out = tmp_path / f"export_{name}"
        export_hf(model, tokenizer, out, rank == 0, export_dtype("auto", model.source_dtype), max_shard_bytes=40_000)
        export_hf(
            model, tokenizer, tmp_path / f"export32_{name}", rank == 0, export_dtype("float32", model.source_dtype)
        )
    # Stored under other names (no "model." prefix): every rank falls back to from_pretrained, same weights.
    hf_model, model, _, _ = build_sharded_model(
        sections=ModelSections.of(run_config(str(tmp_path / "legacy"))),
        tokenizer=tokenizer,
        dims=dist_info,
        source=ModelSource(str(tmp_path / "legacy")),
    )
    got = gathered(model, hf_model)
    if rank == 0:
        assert_bit_equal(got, reference(tmp_path / "legacy"), "legacy")
    # Random init from model.config: the weights of a plain seeded build of the whole model.
    hf_model, model, _, _ = build_sharded_model(
        sections=ModelSections.of(run_config(None, seed=7)),
        tokenizer=tokenizer,
        dims=dist_info,
        source=ModelSource(None),
    )
    got = {k: v for k, v in gathered(model, hf_model).items() if not k.startswith("buffer:")}
    if rank == 0:
        torch.manual_seed(7)
        settings = {k: v for k, v in run_config(None).model.config.items() if k != "_target_"}
        plain = build_hf_model(tokenizer, LlamaConfig(**settings))
        assert_bit_equal(got, dict(plain.state_dict()), "random init")
    shutdown_distributed()
    exit_process()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("sharded_load")
    for name, (overrides, dtype) in SOURCES.items():
        torch.manual_seed(len(name))
        model = AutoModelForCausalLM.from_config(tiny_config(**overrides)).to(dtype)
        model.save_pretrained(tmp_path / name)
    legacy = tmp_path / "legacy"
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_config(**ODD_SHAPES))
    model.save_pretrained(legacy)
    (legacy / "model.safetensors").unlink()
    save_file(
        {k.removeprefix("model."): v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
        legacy / "model.safetensors",
        metadata={"format": "pt"},
    )
    spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    return tmp_path


def test_two_ranks_load_exactly_what_from_pretrained_loads(loaded):
    """The assertions run in the workers (bit equality, half the parameters per rank, the fallback and the
    random init); here: they got through every case and exported."""
    assert all((loaded / f"export_{name}").is_dir() for name in SOURCES)


@pytest.mark.parametrize("name", SOURCES)
def test_the_export_is_a_sharded_hf_directory_in_the_source_dtype(loaded, name):
    source, export, export32 = loaded / name, loaded / f"export_{name}", loaded / f"export32_{name}"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(p.name for p in export.glob("*.safetensors"))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    dtype = SOURCES[name][1]
    written = {"BF16": torch.bfloat16, "F32": torch.float32}
    for file in files:
        with safe_open(export / file, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert all(
                f.get_slice(k).get_dtype() in ("BF16", "F32") and written[f.get_slice(k).get_dtype()] == dtype
                for k in f.keys()
            )
    weights = exported_weights(export)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in weights.values())
    tied = "tied" in name.split("_")
    assert ("lm_head.weight" in weights) != tied  # a tied output layer is saved once, as save_pretrained does
    # transformers reads it back: the source's weights exactly (no training happened), in the source dtype.
    for directory in (export, export32):
        assert_bit_equal(reference(directory), reference(source), str(directory))
    assert AutoModelForCausalLM.from_pretrained(export, dtype="auto").dtype == dtype
    assert all(v.dtype == torch.float32 for v in exported_weights(export32).values())


def test_a_checkpoint_of_another_shape_is_refused_naming_the_tensor(tmp_path):
    """config.json and the weights disagree (an edited config): a clear error, not a silent partial load."""
    import torch.distributed as dist

    from chattune.model.io import load

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(**ODD_SHAPES)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 130}))
    model = load.build_empty(tmp_path)
    files = load.checkpoint_files(tmp_path)
    assert not load.missing_tensors(model, files)
    with pytest.raises(
        UserError,
        match=r"tensor model.layers.0.mlp.gate_proj.weight has shape \[129, 64\] in the checkpoint.*expects \[130, 64\]",
    ):
        load.materialise_and_load(model, model, tmp_path, files, torch.device("cpu"))
    assert not dist.is_initialized()


def test_the_fallback_is_announced(tmp_path, caplog):
    from chattune.model.build import _empty_or_full

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(**ODD_SHAPES))
    model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # an old-style checkpoint
    with caplog.at_level(logging.WARNING):
        loaded, files, composite = _empty_or_full(tmp_path)
    assert (
        files is None
        and composite is None
        and "holds no safetensors weights" in caplog.text
        and "whole model" in caplog.text
    )
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
