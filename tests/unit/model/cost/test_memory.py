"""The memory estimate (`chattune.model.cost.memory`) against measured byte counts: parameters, gradients and
optimizer states exactly as FSDP2 shards them on 2 real ranks, activations within 10% of what autograd really
keeps in the packed forward on CPU (a saved-tensors hook), for three model shapes, full and LoRA."""

from __future__ import annotations

import subprocess
import sys
import weakref
from dataclasses import replace
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import DeepseekV3Config, GraniteConfig, LlamaConfig, LongcatFlashConfig, Qwen3Config, Qwen3MoeConfig

from chattune.config.schema import PeftConfig, TinyLlamaConfig
from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed
from chattune.distributed import ParallelDims, exit_process, shutdown_distributed
from chattune.errors import UserError
from chattune.hf_layout import decoder_layers
from chattune.model.causal_lm import PackedCausalLM, build_hf_model
from chattune.model.cost.memory import MemoryInputs, estimate, parse_size
from chattune.model.peft.adapters import add_adapters
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.parallel.fsdp import shard_model
from chattune.train.step import accumulate_gradients
from conftest import (
    PROJECT_ROOT,
    SMALL_MODEL,
    demo_documents,
    demo_tokenizer,
    free_port,
    init_worker_process_group,
    mesh_dims,
    spawn,
    tiny_model,
)

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
    "qwen3_moe": lambda: Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "deepseek_v3": lambda: DeepseekV3Config(  # MLA (the value's head size differs from the query's) and a dense layer
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
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


def _inputs(hf_model, ranks: int, tokens: int, lora: bool, optimizer: str = "torch.optim.AdamW") -> MemoryInputs:
    return MemoryInputs(
        hf_model.config,
        ranks=ranks,
        tokens=tokens,
        lora_rank=LORA.rank if lora else None,
        lora_targets=("all-linear",),
        optimizer=optimizer,
    )


def _low_bit_optimizers() -> dict:
    try:
        import torchao.optim
    except ImportError:  # an optional extra (chattune[lowbit]); the dev install has it
        return {}
    return {name: getattr(torchao.optim, name) for name in LOW_BIT}


LOW_BIT = ("AdamW8bit", "AdamW4bit", "AdamWFp8")  # torchao.optim's, where installed


def _tensor_bytes(tensor: torch.Tensor) -> int:
    """A tensor's bytes on this rank: a DTensor's local shard; a tensor subclass's inner tensors (torchao's
    quantized states: codes, scales, code book), whose apparent dtype is not what they store."""
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def _local_bytes(tensors) -> int:
    return sum(_tensor_bytes(t) for t in tensors)


def _state_bytes(optimizer) -> int:
    return _local_bytes(v for s in optimizer.state.values() for v in s.values())


def _units(model) -> list[list[torch.nn.Parameter]]:
    """The parameters of each FSDP2 unit of the sharded `model`: each decoder layer's, and the root's rest."""
    layers = [list(layer.parameters()) for layer in decoder_layers(model)]
    inside = {id(p) for layer in layers for p in layer}
    return [*layers, [p for p in model.parameters() if id(p) not in inside]]


def _counts_worker(rank: int, world_size: int, port: int, out: str) -> None:
    init_worker_process_group(rank, world_size, port)
    low_bit = _low_bit_optimizers()
    found = {}
    for shape in SHAPES:
        for lora in (False, True):
            hf_model = _model(shape, lora)
            estimated = estimate(_inputs(hf_model, world_size, 512, lora)).rows
            estimated.update(
                {
                    name: estimate(_inputs(hf_model, world_size, 512, lora, f"torchao.optim.{name}")).rows[
                        "optimizer states"
                    ]
                    for name in low_bit
                }
            )
            model = PackedCausalLM(hf_model)
            placement = shard_model(model, mesh_dims())
            trained = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trained, lr=1e-3)
            batch = collate_packed(demo_documents(4, start=4 * rank))
            accumulate_gradients(model, TokenCrossEntropy(), StepBatches([batch]), placement)
            measured = {
                "parameters (fp32 shards)": _local_bytes(model.parameters()),
                "gradients (fp32 shards)": _local_bytes(p.grad for p in trained),
                # optimizer.in_backward: the largest FSDP2 unit's (a decoder layer's, or the root's rest) gradients
                "gradients (one unit's shards)": max(
                    _local_bytes(p.grad for p in unit if p.grad is not None) for unit in _units(model)
                ),
            }
            estimated["gradients (one unit's shards)"] = estimate(
                replace(_inputs(hf_model, world_size, 512, lora), update_in_backward=True)
            ).rows["gradients (one unit's shards)"]
            optimizer.step()
            measured["optimizer states"] = _state_bytes(optimizer)
            for name, make in low_bit.items():
                quantized = make(trained, lr=1e-3)
                with mock.patch("torch.compile", lambda fn, **_: fn):  # its step eager: the same states, no compiles
                    quantized.step()
                measured[name] = _state_bytes(quantized)
            found[(shape, lora)] = (measured, {k: estimated[k] for k in measured})
    if rank == 0:  # (the first rank holds the largest shards: FSDP2 gives the last ones what is left)
        torch.save(found, out)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_parameters_gradients_and_optimizer_states_are_the_sharded_models_own(tmp_path):
    out = str(tmp_path / "counts.pt")
    spawn(_counts_worker, args=(2, free_port(), out), nprocs=2)
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


# DeepSeek-V3's attention (a value head smaller than the query's) runs per document with its score matrices on the
# CPU, which the estimate leaves out (it counts what the packed kernels keep): its counts are checked, not these.
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("shape", [shape for shape in SHAPES if shape != "deepseek_v3"])
def test_activations_are_within_ten_percent_of_what_the_packed_forward_keeps(shape, lora):
    batch = collate_packed(demo_documents(8))
    model = PackedCausalLM(_model(shape, lora))
    measured = _saved_bytes(model, lambda: model(batch))
    estimated = estimate(_inputs(model.hf_model, 1, batch.num_tokens, lora)).rows["activations"]
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


def test_a_forward_the_meta_device_cannot_run_is_not_estimated_and_says_why():
    """LongCat-Flash's zero-computation experts select tokens with nonzero(), whose shape the meta device cannot know."""
    longcat = LongcatFlashConfig(num_layers=2, vocab_size=512)
    estimated = estimate(MemoryInputs(longcat, ranks=1, tokens=256))
    assert estimated.rows["activations"] is None and estimated.total is None
    assert (
        "activations not estimated: LongcatFlashForCausalLM's forward does not run on the meta device"
        in estimated.notes[0]
    )
    table = estimated.table(parse_size("24GiB"))
    assert "not estimated" in table and "(unknown)" in table


def test_sizes_are_read_as_written():
    assert parse_size("24GiB") == 24 * 2**30 and parse_size("80GB") == 80 * 10**9 and parse_size("1024") == 1024
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("lots")


EIGHT_B = (  # Llama-3.1-8B's shape and vocabulary, random init from a config: nothing is loaded
    "model.config={_target_: transformers.LlamaConfig, hidden_size: 4096, intermediate_size: 14336, "
    "num_hidden_layers: 32, num_attention_heads: 32, num_key_value_heads: 8, max_position_embeddings: 8192, "
    "tie_word_embeddings: false, vocab_size: 128256}"
)
VALIDATE = [sys.executable, "-m", "chattune.cli.main", "validate", "sft/tiny"]


def _validate(*arguments: str) -> str:
    result = subprocess.run([*VALIDATE, *arguments], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _advised_settings(output: str) -> list[str]:
    """The settings the table advises, one per line after its 'changes'/'together' line, as written."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if "changes that make it fit" in line or "together" in line)
    return [line.split("  ")[2] for line in lines[start + 1 :] if line.startswith("    ")]


def _plan_with(device_memory: str, *settings: str) -> str:
    """`chattune validate sft/tiny --device-memory SIZE EIGHT_B SETTINGS` in process (`--ranks N` among them)."""
    flags = [part for setting in settings for part in setting.split()]
    ranks = int(flags[flags.index("--ranks") + 1]) if "--ranks" in flags else 1
    overrides = [flag for flag in flags if not flag.startswith("--") and not flag.isdigit()]
    return _plan("sft/tiny", [EIGHT_B, *overrides], ranks, device_memory)


def _documented_blocks(command: str) -> list[str]:
    """The first two output blocks docs/memory.md shows after `command` (its bash block)."""
    text = (PROJECT_ROOT / "docs" / "memory.md").read_text()
    after = text.split(f"```bash\n{command}\n```\n", 1)[1]
    return [block.rstrip("\n") for block in after.split("```\n")[1:4:2]]


@pytest.mark.launch
def test_validate_prints_the_table_whether_it_fits_and_advice_that_works_as_written():
    """Llama-3.1-8B's shape on a planned 24 GiB: it does not fit, CPU offload alone does (its layers compiled, as
    on CUDA by default) and so does QLoRA (its fp32 shards alone are 29.9 GiB); with eager layers CPU offload alone
    falls short (24.4 GiB: the copies of its 128,256-row embeddings and output layer) and with activation
    checkpointing fits; on 12 GiB no one change is enough. The change, or the changes together, that the table
    names, passed to validate as written, give a run that fits. docs/memory.md shows these lines (in process, as
    the command prints them; the command line itself is run once, on the tiny model, whose trace is quick)."""
    command = _validate("--device-memory", "80GB")
    assert "memory per rank, estimated on a GPU (1 rank(s)" in command and "(fits)" in command, command
    big = _plan_with("24GiB")
    assert "memory per rank, estimated on a GPU (1 rank(s), 2048 tokens a microbatch, bfloat16 compute" in big
    assert "device memory                       24.00 GiB  (does NOT fit)" in big
    assert "changes that make it fit, each alone, cheapest first:" in big
    assert _advised_settings(big) == ["model.fsdp.cpu_offload=true", "peft=qlora"]
    assert all("(fits)" in _plan_with("24GiB", setting) for setting in _advised_settings(big))
    offloaded = _plan_with("24GiB", "model.fsdp.cpu_offload=true")
    assert "in host memory instead (offloaded):\n    parameters (fp32 shards)          29.92 GiB" in offloaded
    eager = _plan_with("24GiB", "model.compile=false", "model.fsdp.cpu_offload=true")
    assert "(does NOT fit)" in eager and _advised_settings(eager)[0] == "model.fsdp.activation_checkpointing=true"
    fixed = _plan_with(
        "24GiB", "model.compile=false", "model.fsdp.cpu_offload=true", "model.fsdp.activation_checkpointing=true"
    )
    assert "(fits)" in fixed, fixed
    documented = _documented_blocks(f'chattune validate sft/tiny --device-memory 24GiB "{EIGHT_B}"')
    assert documented[0] + "\n" in big and documented[1] + "\n" in offloaded, documented

    smaller = _plan_with("12GiB")
    assert "no single change makes it fit; these together" in smaller
    advised = _advised_settings(smaller)
    assert advised and all(s.startswith("--ranks ") or "=" in s for s in advised), advised
    fixed = _plan_with("12GiB", *advised)
    assert "(fits)" in fixed and "does NOT fit" not in fixed, fixed
    small = _plan("sft/tiny", [], ranks=2, device_memory="80GB")
    assert "(2 rank(s)" in small and "(fits)" in small and "changes that make it fit" not in small, small


def test_each_change_that_fits_alone_is_listed_cheapest_first_with_its_peak():
    """Llama-3.1-8B's shape on 100 GiB with fp32 AdamW: 8-bit states alone fit, as do 4-bit, CPU offload, LoRA, QLoRA and
    a second rank; activation checkpointing or offloading alone does not (the states dominate), so it is not listed."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from chattune.model.cost.memory_advice import ways_to_fit

    spec = OmegaConf.create(EIGHT_B.split("=", 1)[1])
    inputs = MemoryInputs(instantiate(spec), ranks=1, tokens=2048, compute_dtype=torch.bfloat16)
    estimated = estimate(inputs)
    device = 100 * 2**30
    lines = ways_to_fit(inputs, device, estimated)
    assert lines[0] == "changes that make it fit, each alone, cheapest first:"
    settings = [line.split()[0] for line in lines[1:]]
    assert settings == [
        "optimizer._target_=torchao.optim.AdamW8bit",
        "optimizer._target_=torchao.optim.AdamW4bit",
        "model.fsdp.cpu_offload=true",
        "peft=lora",
        "peft=qlora",
        "--ranks",
    ]
    for line, change in zip(lines[1:], ("AdamW8bit", "AdamW4bit")):  # each peak is that change's own estimate
        peak = estimate(MemoryInputs(**{**inputs.__dict__, "optimizer": f"torchao.optim.{change}"})).total
        assert f"{peak / 2**30:.2f} GiB" in line and peak <= device < estimated.total


QWEN3_30B_A3B = dict(  # Qwen3-30B-A3B's shape: 48 layers of 128 experts (8 routed per token)
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    tie_word_embeddings=False,
)  # fmt: skip


def test_expert_parallelism_is_offered_first_for_a_mixture_of_experts_where_it_fits():
    """Qwen3-30B-A3B's shape trained whole on 8 ranks, 4,096-token rows, recomputed activations, bf16: each rank
    gathers two layers of 128 experts; split over 8 ranks it gathers 16 of them and holds the tokens' dispatch
    buffers instead. On a device between the two peaks, parallel.expert=8 is the change listed first (it costs no
    precision and no compute), and `chattune validate` takes it as written for that model on 8 ranks; a dense
    model, and a run already split, are offered none."""
    from test_validate import compose_config

    from chattune.launch.recipe_kinds import SFT
    from chattune.launch.validate import check_config
    from chattune.model.cost.memory_advice import candidate_changes, ways_to_fit

    inputs = MemoryInputs(
        Qwen3MoeConfig(**QWEN3_30B_A3B), ranks=8, tokens=4096, compute_dtype=torch.bfloat16,
        activation_checkpointing=True, compiled=True,
    )  # fmt: skip
    whole, split = estimate(inputs), estimate(replace(inputs, expert=8))
    assert split.rows["gathered for compute"] < whole.rows["gathered for compute"] / 2
    assert split.total < whole.total
    device = (split.total + whole.total) // 2
    # ways_to_fit lists the changes that fit alone in this order (the others' estimates, shorter rows' and LoRA's
    # traces of 128 experts, take half a minute: test_each_change_that_fits_alone_is_listed_cheapest_first runs it)
    first = candidate_changes(inputs)[0]
    assert first.setting == "parallel.expert=8" and estimate(first.inputs).total == split.total <= device
    with mock.patch("chattune.model.cost.memory_advice.candidate_changes", lambda _: [first]):
        lines = ways_to_fit(inputs, device, whole)
    assert lines[:2] == [
        "changes that make it fit, each alone, cheapest first:",
        f"  {first.setting:<58} {split.total / 2**30:>6.2f} GiB  ({first.cost})",
    ]
    tiny_keys = set(TinyLlamaConfig.__dataclass_fields__)  # sft/tiny's model.config keys: set; others added (+)
    shape = {k: v for k, v in QWEN3_30B_A3B.items() if k != "head_dim"}  # (a keyword the config class does not name)
    overrides = [f"{'' if k in tiny_keys else '+'}model.config.{k}={v}" for k, v in shape.items()]
    overrides += ["model.config._target_=transformers.Qwen3MoeConfig", "parallel.expert=8"]
    assert check_config(compose_config("sft/tiny", overrides), SFT, world_size=8) == []
    dense = replace(inputs, hf_config=LlamaConfig(hidden_size=64, num_hidden_layers=2))
    assert not [c for c in candidate_changes(dense) if c.setting.startswith("parallel.expert")]
    assert not [c for c in candidate_changes(replace(inputs, expert=8)) if c.setting.startswith("parallel.expert")]


def test_the_estimate_leaves_the_live_models_config_as_it_was():
    """The meta model is built from a copy: from_config records its attention stand-in in the config it is given,
    which a live model shares (its attention was the stand-in's, and its losses garbage)."""
    hf_model = _model("llama", lora=False)
    before = (hf_model.config.to_dict(), hf_model.config._attn_implementation)
    estimate(_inputs(hf_model, 1, 128, lora=False))
    assert (hf_model.config.to_dict(), hf_model.config._attn_implementation) == before


def test_what_fits_reports_the_estimate_and_the_advice_per_cell():
    """scripts/bench/what_fits.py's cells: the peak where it fits, else the advised change (the 0.6B shape, fp32 AdamW)."""
    sys.path.insert(0, str(PROJECT_ROOT / "scripts" / "bench"))
    from what_fits import SHAPES, advice

    inputs = MemoryInputs(SHAPES["0.6B (Qwen3-0.6B)"](), ranks=1, tokens=2048, compute_dtype=torch.bfloat16)
    peak = estimate(inputs).total
    assert advice(inputs, 24 * 2**30) == f"fits ({peak / 2**30:.1f})"
    tight = advice(inputs, int(peak * 0.9))  # 10% short: the cheapest single change, 8-bit states, fits
    assert tight == f"{peak / 2**30:.0f}: optimizer._target_=torchao.optim.AdamW8bit", tight


@pytest.mark.parametrize("shape", ["llama", "granite"])
def test_a_4_bit_base_is_counted_as_bitsandbytes_stores_it(one_rank_group, shape):
    """QLoRA: the decoder's linear weights replicated in 4 bits (codes, scales, code books) and their biases, exactly
    as measured on the quantized model; the fp32 shards are the rest, the adapters included."""
    pytest.importorskip("bitsandbytes")
    from chattune.model.quantization.quantize import quantize_linears, quantized_modules, replicated_parameters

    hf_model = _model(shape, lora=True)
    quantize_linears(decoder_layers(hf_model), "nf4", torch.float32, torch.device("cpu"))
    replicated = replicated_parameters(hf_model)
    four_bit = 0
    for module in quantized_modules(hf_model):
        state = module.weight.quant_state
        tensors = [module.weight.data, state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]
        four_bit += sum(t.numel() * t.element_size() for t in tensors)
        four_bit += 0 if module.bias is None else module.bias.numel() * 4
    shard_model(model := PackedCausalLM(hf_model), mesh_dims(), replicated=replicated)
    shards = sum(p.to_local().numel() * 4 for p in model.parameters() if id(p) not in {id(q) for q in replicated})
    rows = estimate(replace(_inputs(hf_model, 1, 128, lora=True), quantized_base=True)).rows
    assert rows["4-bit base (replicated)"] == four_bit
    assert rows["parameters (fp32 shards)"] == shards


@pytest.mark.parametrize(
    ("overrides", "second_model"),
    [
        ([], True),
        (["reference.cache=true"], False),
        (["peft=lora"], False),  # the policy's base with its adapters off: no second model
        (["peft=lora", "reference.path=/models/reference"], True),
        (["loss.type=simpo"], False),
    ],
    ids=["live", "cached", "lora's own base", "lora and a reference path", "reference-free loss"],
)
def test_a_live_reference_is_counted_where_the_recipe_builds_a_second_model(overrides, second_model):
    """DPO's live reference: a second model sharded like the policy, where chattune.train.reference builds one."""
    from chattune.launch.compose import composed
    from chattune.model.cost.memory import inputs_of

    cfg = composed("dpo/tiny", ["model.path=null", *overrides], PROJECT_ROOT / "configs")
    hf_model = _model("llama", lora=False)
    estimated = estimate(inputs_of(cfg, hf_model.config, ParallelDims.from_config(cfg.parallel, 2), on_cuda=True))
    assert ("live reference (fp32 shards)" in estimated.rows) == second_model
    if second_model:  # the reference's shards: the policy's full model's, whatever trains
        full = estimate(_inputs(hf_model, 2, 512, lora=False)).rows["parameters (fp32 shards)"]
        assert estimated.rows["live reference (fp32 shards)"] == full


@pytest.mark.parametrize("loss_type", ["reverse_kl", "gkd"])
def test_a_distillation_teacher_is_counted_from_its_own_config(tmp_path, loss_type):
    """On-policy distillation's teacher, a model of another shape than the policy: its fp32 shards (on one rank, every
    parameter of the loaded teacher), kept through the rollout too; with gkd also its embeddings, final norm and output
    layer gathered in the compute dtype (bf16 on a GPU) through the run. No teacher where the loss has none."""
    from chattune.launch.compose import composed
    from chattune.model.cost.memory import inputs_of

    teacher = tiny_model(seed=1, hidden_size=96, num_hidden_layers=3, intermediate_size=160)
    teacher.save_pretrained(tmp_path / "teacher")
    overrides = ["model.path=null", f"teacher.path={tmp_path / 'teacher'}", f"loss.type={loss_type}"]
    cfg = composed("grpo/tiny", overrides, PROJECT_ROOT / "configs")
    policy = _model("llama", lora=False).config
    inputs = inputs_of(cfg, policy, ParallelDims.from_config(cfg.parallel, 1), on_cuda=True)
    estimated, alone = estimate(inputs), estimate(replace(inputs, teacher_config=None))
    whole = sum(p.numel() for p in teacher.parameters())  # (tied: once)
    assert estimated.rows["teacher (fp32 shards)"] == 4 * whole
    in_layers = {id(p) for layer in teacher.model.layers for p in layer.parameters()}
    root = sum(p.numel() for p in teacher.parameters() if id(p) not in in_layers)
    teacher_rows = 4 * whole + (2 * root if loss_type == "gkd" else 0)
    assert ("teacher's root, kept gathered (gkd)" in estimated.rows) == (loss_type == "gkd")
    assert estimated.training - alone.training == teacher_rows
    assert estimated.rollout - alone.rollout == teacher_rows
    plain = composed("grpo/tiny", ["model.path=null", f"teacher.path={tmp_path / 'teacher'}"], PROJECT_ROOT / "configs")
    assert inputs_of(plain, policy, ParallelDims.from_config(plain.parallel, 1), on_cuda=True).teacher_config is None


@pytest.mark.parametrize("recipe", ["dpo", "kto"])
def test_a_live_reference_run_logs_its_memory_table_once(one_rank_group, caplog, recipe):
    """DPO and KTO build their live reference with the policy's builder: the start-up table is the run's, logged once
    (with the reference's row), not again for the reference."""
    import logging

    from chattune.config.typed import typed_config
    from chattune.data.templates.tokenizer import load_tokenizer
    from chattune.launch.compose import composed
    from chattune.launch.recipe_kinds import DPO, KTO
    from chattune.model.build import build_trained_model
    from chattune.train.reference import reference_log_probs

    small = list(SMALL_MODEL)
    cfg = composed(f"{recipe}/tiny", ["model.path=null", "reference.cache=false", *small], PROJECT_ROOT / "configs")
    cfg = typed_config(cfg, {"dpo": DPO, "kto": KTO}[recipe].schema)
    tokenizer, dims = load_tokenizer(cfg.tokenizer), mesh_dims()
    with caplog.at_level(logging.INFO, logger="chattune.model.build"):
        built = build_trained_model(cfg, tokenizer, dims)
        reference_log_probs(cfg, tokenizer, dims, built, data=None, documents=recipe)  # live: built, not run
    tables = [record.getMessage() for record in caplog.records if "memory per rank" in record.getMessage()]
    assert len(tables) == 1 and "live reference (fp32 shards)" in tables[0], tables


CONFIGS = PROJECT_ROOT / "configs"


def _plan(config: str, overrides: list[str], ranks: int = 1, device_memory: str | None = None) -> str:
    """`chattune validate CONFIG OVERRIDES --ranks RANKS [--device-memory SIZE]`'s report, in process (it is OK)."""
    from chattune.launch.memory_plan import MemoryPlan
    from chattune.launch.validate import run_validate

    size = parse_size(device_memory) if device_memory is not None else None
    report, ok = run_validate(config, overrides, CONFIGS, world_size=ranks, memory=MemoryPlan(size))
    assert ok, report
    return report


def test_a_vision_language_checkpoint_is_estimated_as_the_language_model_the_run_builds(tmp_path):
    """A Mistral 3 checkpoint directory (`model.path` to the composite class): the estimate counts the language model
    the run builds and trains (its vision tower and projector are never loaded on a rank), no raw exception."""
    from test_composite_models import save_composite

    from chattune.config.paths import DEMO_ASSETS
    from chattune.launch.compose import composed
    from chattune.model.build import _empty_or_full
    from chattune.model.cost.memory import hf_config_of, inputs_of

    stock = save_composite("mistral3", tmp_path, vocab_size=len(demo_tokenizer()))
    demo_tokenizer().save_pretrained(tmp_path)
    language = ("model.language_model.", "lm_head.")  # the stock composite's names for its language model
    trained = sum(p.numel() for name, p in stock.named_parameters() if name.startswith(language))
    vision = sum(p.numel() for name, p in stock.named_parameters() if not name.startswith(language))
    hf_model, _, _ = _empty_or_full(tmp_path)  # what the run builds (on the meta device)
    assert sum(p.numel() for p in hf_model.parameters()) == trained

    overrides = [f"model.path={tmp_path}", f"data.train=[{DEMO_ASSETS / 'chat_train.jsonl'}]", "output_dir=out"]
    report = _plan("sft/local_model", overrides)
    assert "not estimated" not in report and "Unrecognized" not in report and "Error" not in report, report
    assert (
        "(Mistral3ForConditionalGeneration: its language model, as the run trains it (MistralForCausalLM); its other "
        f"parts (vision tower, projector: {vision / 1e6:.2f}M parameters) are not loaded on a training rank and not "
        "counted)"
    ) in report
    cfg = composed("sft/local_model", overrides, CONFIGS)
    rows = estimate(inputs_of(cfg, hf_config_of(cfg), ParallelDims.from_config(cfg.parallel, 1), on_cuda=False)).rows
    assert rows["parameters (fp32 shards)"] == rows["gradients (fp32 shards)"] == 4 * trained


@pytest.mark.skipif(torch.cuda.is_available(), reason="planned from a machine without CUDA")
def test_a_cpu_run_is_planned_on_the_cpu_in_float32_and_a_planned_gpu_says_so():
    """`device=cpu` is planned as the run it is (fp32 on the CPU: twice the bf16 activations), --device-memory then
    its memory per rank; the advice offers only what helps there (no offloading to the host it is on, no CUDA-only
    4-bit base, no more ranks on the host), and passed as written it fits. device=auto with --device-memory on a
    machine without CUDA is a GPU's plan, which the header says, and its remedy (device=cpu) plans the CPU run."""
    gpu = _plan("sft/tiny", [], device_memory="24GiB")
    assert "memory per rank, estimated on a GPU (1 rank(s), 2048 tokens a microbatch, bfloat16 compute;" in gpu
    assert (
        "  (a GPU planned with --device-memory: this machine has none, and a launch here would compute on the CPU in "
        "float32, which device=cpu plans)"
    ) in gpu
    cpu = _plan("sft/tiny", ["device=cpu"], device_memory="24GiB")
    assert "memory per rank, estimated on the CPU (1 rank(s), 2048 tokens a microbatch, float32 compute;" in cpu
    assert "  (device=cpu: the run computes on the CPU, and its ranks on one host share its memory)" in cpu
    assert "  memory (--device-memory)            24.00 GiB  (fits)" in cpu
    auto = _plan("sft/tiny", [], ranks=2)
    assert "estimated on the CPU (2 rank(s), 2048 tokens a microbatch, float32 compute;" in auto
    assert "(device=auto on a machine without a GPU: the run computes on the CPU" in auto

    on_gpu, on_cpu = _tiny_inputs(on_cuda=True), _tiny_inputs(on_cuda=False)
    assert (on_gpu.compute_dtype, on_cpu.compute_dtype, on_cpu.on_cpu) == (torch.bfloat16, torch.float32, True)
    assert on_gpu.compiled and not on_cpu.compiled  # model.compile=auto
    gpu_rows, cpu_rows = estimate(replace(on_gpu, compiled=False)).rows, estimate(on_cpu).rows
    # fp32 keeps up to twice bf16's bytes (less: the norms' fp32 intermediates and attention's log-sum-exp are fp32 in both)
    assert 1.5 * gpu_rows["activations"] < cpu_rows["activations"] <= 2 * gpu_rows["activations"]

    tight = f"{int(estimate(on_cpu).total * 0.7)}"  # 30% short: the advice must be for the CPU
    short = _plan("sft/tiny", ["device=cpu"], device_memory=tight)
    assert "(does NOT fit)" in short, short
    advised = _advised_settings(short)
    assert advised and not any(
        s.startswith(("--ranks", "model.fsdp.cpu_offload", "model.fsdp.offload_activations", "peft=qlora"))
        for s in advised
    ), advised
    fixed = _plan("sft/tiny", ["device=cpu", *advised[0].split()], device_memory=tight)
    assert "(fits)" in fixed, fixed


def _tiny_inputs(on_cuda: bool) -> MemoryInputs:
    """The memory inputs of sft/tiny on 1 rank, on CUDA or on the CPU."""
    from chattune.launch.compose import composed
    from chattune.model.cost.memory import hf_config_of, inputs_of

    cfg = composed("sft/tiny", [], CONFIGS)
    return inputs_of(cfg, hf_config_of(cfg, len(demo_tokenizer())), ParallelDims.from_config(cfg.parallel, 1), on_cuda)


def _tiny_run(vocab_size: int | None):
    """sft/tiny's config (SMALL_MODEL's widths), typed, with `model.config.vocab_size` written where given."""
    from chattune.config.typed import typed_config
    from chattune.launch.compose import composed
    from chattune.launch.recipe_kinds import SFT

    written = [] if vocab_size is None else [f"+model.config.vocab_size={vocab_size}"]
    return typed_config(composed("sft/tiny", [*SMALL_MODEL, *written], CONFIGS), SFT.schema)


def test_a_vocab_size_written_in_model_config_is_kept_by_the_run_and_the_estimate(one_rank_group):
    """A random-init model keeps the vocab_size the user wrote (the demo tokenizer's 1,024 ids fit in it); one that
    writes none takes the tokenizer's size, not the config class's default (LlamaConfig's 32,000). The run's model and
    the estimate's parameters agree; a vocab_size the tokenizer's ids do not fit is refused by both, naming the key,
    and each remedy the message gives builds."""
    from chattune.model.build import build_trained_model
    from chattune.model.cost.memory import hf_config_of, inputs_of

    tokenizer = demo_tokenizer()
    for written, embeddings in ((2048, 2048), (None, len(tokenizer)), (len(tokenizer), len(tokenizer))):
        cfg = _tiny_run(written)
        built = build_trained_model(cfg, tokenizer, mesh_dims())
        assert built.hf_model.get_input_embeddings().num_embeddings == embeddings
        parameters = sum(p.numel() for p in built.hf_model.parameters())  # (1 rank: each shard is the whole tensor)
        inputs = inputs_of(cfg, hf_config_of(cfg, len(tokenizer)), ParallelDims.from_config(cfg.parallel, 1), False)
        assert estimate(inputs).rows["parameters (fp32 shards)"] == 4 * parameters, written
    refusal = (
        "model.config.vocab_size: 512, but the tokenizer has 1024 tokens, whose ids must fit the model's embeddings: "
        "set it to at least 1024, or leave vocab_size out (the model then takes the tokenizer's size)"
    )
    with pytest.raises(UserError) as run:
        build_trained_model(_tiny_run(512), tokenizer, mesh_dims())
    with pytest.raises(UserError) as plan:
        _plan("sft/tiny", [*SMALL_MODEL, "+model.config.vocab_size=512"], device_memory="24GiB")
    assert str(run.value) == str(plan.value) == refusal
    # plain validate (no plan) says it too, where it loads the tokenizer: before a launch, not at it
    from chattune.config.paths import CONFIG_DIR
    from chattune.launch.validate import run_validate

    report, ok = run_validate("sft/tiny", [*SMALL_MODEL, "+model.config.vocab_size=512"], CONFIG_DIR, read_data=True)
    assert not ok and refusal in report, report


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of the storages that ops create while it is active (each storage once, freed with it)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()
        self._before: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for tensor in tree_leaves((args, kwargs)):  # storages made before: never counted (their views, in place)
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in self._seen:
                self._before.add(tensor.untyped_storage().data_ptr())
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().nbytes():
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in self._seen | self._before:
                    self._seen.add(storage.data_ptr())
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, storage.data_ptr(), storage.nbytes())
        return out

    def _freed(self, pointer: int, size: int) -> None:
        self._seen.discard(pointer)
        self.live -= size


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_loss_head_rows_are_what_the_chunked_head_allocates(dtype):
    """The chunked head's forward and backward on one microbatch, measured op by op: in bf16 the output layer
    upcast to fp32, its fp32 gradient and its bf16 gradient come on top of a chunk's logits (about 10 bytes per
    weight element, 1.5 GiB at 0.6B), which the estimate counted as the chunk alone; in fp32 a chunk's gradient
    and autograd's sum of it beside the weight's own gradient (the gradients row)."""
    from chattune.model.head.chunked_loss import chunked_token_losses

    vocab, hidden, tokens, chunk = 4096, 256, 256, 64
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=512, num_hidden_layers=1)
    rows = estimate(MemoryInputs(config, ranks=1, tokens=tokens, loss_chunk=chunk, compute_dtype=dtype)).rows
    counted = sum(value for name, value in rows.items() if name.startswith("loss head"))
    torch.manual_seed(0)
    states = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, hidden) * 0.02).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    with _LiveBytes() as measured:
        chunked_token_losses(states, weight, labels, chunk).sum().backward()
    gradient = 4 * vocab * hidden if dtype == torch.float32 else 0  # the fp32 weight's own gradient: its row's
    assert abs(counted - (measured.peak - gradient)) <= 0.1 * (measured.peak - gradient), (rows, measured.peak)


def test_the_verdict_and_the_gathered_replies_count_what_the_gpu_really_has_free():
    """A GPU's total is not what a run can allocate: the CUDA context, NCCL's buffers and other processes take their
    share before the run starts. The plan on this machine's GPU compares with its free memory and what torch's
    allocator holds (here 1 GiB short of the estimate, on a device whose total would fit it); and the sample
    replies' decision to gather the whole model counts the allocator's cached blocks, which `mem_get_info` leaves
    out (a trained model's device is mostly cached, not free)."""
    from chattune.parallel.fsdp import Placement, can_stay_gathered

    # (eager layers: a compiled trace under the mocked CUDA would read CUDA's random state)
    needed = estimate(replace(_tiny_inputs(on_cuda=True), compiled=False)).total
    free, cached, allocated = needed - 2**30, 2**29, 2**28
    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.mem_get_info", return_value=(free - cached, needed + 2**30)),
        mock.patch("torch.cuda.memory_reserved", return_value=cached),
        mock.patch("torch.cuda.memory_allocated", return_value=allocated),
        mock.patch("torch.cuda.get_device_properties", return_value=mock.Mock(total_memory=needed + 2**30)),
    ):
        planned = _plan("sft/tiny", ["model.compile=false"])
        assert "estimated on a GPU" in planned and f"{free / 2**30:.2f} GiB  (does NOT fit)" in planned, planned
        model = PackedCausalLM(build_hf_model(demo_tokenizer(), SHAPES["llama"]()))
        size = sum(4 * p.numel() for p in model.parameters())  # gathered in fp32 (no compute dtype set)
        # free: the model once; cached: three times, of which one is in use: room for it twice more
        with (
            mock.patch("torch.cuda.mem_get_info", return_value=(size, 80 * 2**30)),
            mock.patch("torch.cuda.memory_reserved", return_value=3 * size),
            mock.patch("torch.cuda.memory_allocated", return_value=size),
        ):
            assert can_stay_gathered(model, Placement.one_rank("cuda"))


@pytest.mark.parametrize("setting", ["auto", "chunked", "cut_cross_entropy"])
@pytest.mark.parametrize("device_type,dtype_name", [("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")])
def test_the_estimate_counts_the_loss_head_the_run_builds(setting, device_type, dtype_name):
    """The estimate's loss head is the one the run resolves (build's call, which warns and refuses): CCE's torch
    implementation on CPU when asked for (the estimate used to count the chunked head there), CCE's kernels for
    bf16 on CUDA; a setting the run refuses is estimated as the chunked head."""
    from chattune.errors import UserError
    from chattune.model.cost.memory import _loss_head_of
    from chattune.model.head import fused_loss

    counted = _loss_head_of(setting, device_type == "cuda", dtype_name)["loss_implementation"]
    try:
        built = fused_loss.resolve_loss_implementation(setting, device_type, dtype_name)
    except UserError:
        built = None  # refused at start-up
    assert counted == (built or "chunked"), (counted, built)
    if (setting, device_type) == ("cut_cross_entropy", "cpu"):
        assert counted == "cut_cross_entropy" and _loss_head_of(setting, False, dtype_name)["cce_fp32_gradients"]


@pytest.mark.launch  # inductor compiles its kernels in processes of its own
@pytest.mark.parametrize("shape", ["llama", "qwen3"])
def test_compiled_layers_keep_what_the_compiled_estimate_counts(shape):
    """A compiled layer keeps less than an eager one (the compiler recomputes a norm's fp32 upcast and the MLP's
    activation in the backward instead of keeping them: the eager count was 46% above a GPU run's peak): the
    layers compiled by inductor as a run compiles them (`compile_layers`), their saved tensors counted in a real
    forward, against the estimate of `model.compile=true`, within 10%."""
    from chattune.parallel.fsdp import compile_layers

    torch._dynamo.reset()
    batch = collate_packed(demo_documents(8))
    model = PackedCausalLM(_model(shape, lora=False))
    compile_layers(decoder_layers(model), activation_checkpointing=False)
    measured = _saved_bytes(model, lambda: model(batch))
    inputs = _inputs(model.hf_model, 1, batch.num_tokens, lora=False)
    compiled = estimate(replace(inputs, compiled=True)).rows["activations"]
    eager = estimate(inputs).rows["activations"]
    assert abs(compiled - measured) <= 0.10 * measured, (compiled, measured, eager)
    assert compiled < 0.9 * eager, (compiled, eager)


def test_a_compiled_trace_dynamo_cannot_make_counts_the_eager_layers_and_says_so():
    """Where dynamo fails on a family's layer (on the meta device), the estimate is the eager count, an upper bound,
    with the reason beside it: never a start-up crash of a run whose own compile would have worked."""
    import functools

    from chattune.model.cost import activation_trace

    def failing_backend(graph, example_inputs):
        raise RuntimeError("a backend that cannot compile this layer")

    def compile_failing(layers):
        compiled = torch.compile(type(layers[0]).forward, backend=failing_backend)
        for layer in layers:
            layer.forward = functools.partial(compiled, layer)

    config = SHAPES["llama"]()
    config.vocab_size = 512
    inputs = MemoryInputs(config, ranks=1, tokens=256)
    torch._dynamo.reset()
    with mock.patch.object(activation_trace, "_compile_for_the_trace", compile_failing):
        fell_back = estimate(replace(inputs, compiled=True))
    torch._dynamo.reset()
    assert fell_back.rows["activations"] == estimate(inputs).rows["activations"]
    note = next(n for n in fell_back.notes if "counted as eager layers" in n)
    assert "a backend that cannot compile this layer" in note and "upper bound" in note, fell_back.notes


def test_a_rollout_is_counted_as_the_gathered_model_its_kv_cache_and_a_steps_scores():
    """The GRPO recipe's rollout: the whole model in the compute dtype, the KV cache that transformers' generate holds
    for the rank's sequences at their longest (measured on a real cache here), and one step's scores; the peak is the
    higher of a training step's and a rollout's, and a KL reference counts in both."""
    from chattune.launch.compose import composed
    from chattune.model.cost.memory import inputs_of

    cfg = composed("grpo/tiny", ["model.path=null", "loss.beta=0.04", *SMALL_GRPO], PROJECT_ROOT / "configs")
    hf_model = _model("llama", lora=False)
    inputs = inputs_of(cfg, hf_model.config, ParallelDims.from_config(cfg.parallel, 2), on_cuda=False)
    assert (inputs.rollout_sequences, inputs.rollout_tokens) == (8 // 2 * 4, 48)  # 4 prompts a rank, 4 each
    estimated = estimate(inputs)
    rows = estimated.rollout_rows
    assert rows["the model gathered whole"] == 4 * sum(p.numel() for p in hf_model.parameters())
    # the cache generate holds for 16 sequences of 48 tokens: a 40-token prompt, 9 new tokens (the last not fed back)
    model = hf_model.eval()
    model.set_attn_implementation("sdpa")
    prompt = torch.randint(5, 100, (inputs.rollout_sequences, 40))
    with torch.no_grad():
        output = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=9,
            min_new_tokens=9,
            do_sample=False,
            use_cache=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    cache = output.past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == rows["KV cache"]
    assert rows["a decoding step's scores"] == 3 * 4 * inputs.rollout_sequences * hf_model.config.vocab_size
    assert "live reference (fp32 shards)" in estimated.rows  # loss.beta > 0: a second model, through both phases
    assert estimated.rollout == sum(
        v for k, v in estimated.rows.items() if k.startswith(("parameters", "optimizer", "live reference"))
    ) + sum(rows.values())
    assert estimated.total == max(estimated.training, estimated.rollout)
    assert "a rollout (at once)" in estimated.table()


SMALL_GRPO = (
    "rollout.prompts_per_step=8",
    "rollout.completions_per_prompt=4",
    "data.max_tokens_per_microbatch=48",
)
