"""LoRA (peft=lora): adapter gradients invariant to the split and equal to a plain peft forward's; both
recipes train with it on two ranks; resume is exact; the exported adapter and the merged model reproduce
the trained model's held-out loss, computed the plain way; the DPO reference is the base itself."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from test_sft_recipe import read_metrics
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from chattune.config.paths import DEMO_ASSETS
from chattune.data.documents import IGNORE_INDEX, shifted_labels
from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed
from chattune.data.templates.chat_template import probe_template, tokenize_conversation
from chattune.distributed import exit_process, shutdown_distributed
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.peft.adapters import BaseModelView, add_adapters
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.parallel.fsdp import shard_model
from chattune.train.step import accumulate_gradients, clip_gradients
from conftest import (
    demo_documents,
    demo_tokenizer,
    exported_weights,
    free_port,
    init_worker_process_group,
    launch,
    mesh_dims,
    plain_mean_token_loss,
    relative_error,
    spawn,
    tiny_model,
    torchrun,
)

NUM_DOCS = 12
LORA = OmegaConf.create(
    {
        "type": "lora",
        "rank": 4,
        "alpha": 8,
        "dropout": 0.0,
        "target_modules": "all-linear",
        "use_dora": False,
        "modules_to_save": None,
        "quantize_base": None,
    }
)


# The adapter kinds the invariance test covers: plain LoRA, DoRA (a trained magnitude per row) and LoRA with
# the tied embedding trained in full (one matrix at the input and the output).
VARIANTS = {
    "lora": LORA,
    "dora": OmegaConf.merge(LORA, {"use_dora": True}),
    "embeddings": OmegaConf.merge(LORA, {"modules_to_save": ["embed_tokens"]}),
}
TRAINED = {"lora": 2 * 7 * 2, "dora": 2 * 7 * 3, "embeddings": 2 * 7 * 2 + 1}  # 2 layers x 7 linears x (A, B[, m])


def lora_model(settings=LORA):
    """The tiny model with adapters whose B is not zero (at peft's init B = 0, so A's gradient is 0)."""
    model = tiny_model(seed=0)
    peft_model = add_adapters(model, settings)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model, peft_model


def _worker(rank: int, world_size: int, port: int, splits, out_path: str, checkpointing: bool, variant: str) -> None:
    init_worker_process_group(rank, world_size, port)
    docs = demo_documents(NUM_DOCS)
    hf_model, _ = lora_model(VARIANTS[variant])
    model = PackedCausalLM(hf_model, loss_chunk_size=16)
    placement = shard_model(model, mesh_dims(), activation_checkpointing=checkpointing)
    model.train()
    microbatches = [collate_packed([docs[i] for i in mb]) for mb in splits[rank]]
    accumulate_gradients(model, TokenCrossEntropy(), StepBatches(microbatches), placement)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad), "the base must stay frozen"
    grads = {
        name.removeprefix("hf_model."): p.grad.full_tensor().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    grad_norm, _ = clip_gradients(model, placement, max_norm=None)
    if rank == 0:
        torch.save({"grads": grads, "grad_norm": grad_norm}, out_path)
    shutdown_distributed()
    exit_process()


def reference_gradients(variant: str) -> dict[str, torch.Tensor]:
    """Plain peft model, stock SDPA, one document at a time: mean over every trained token."""
    model, _ = lora_model(VARIANTS[variant])
    model.set_attn_implementation("sdpa")
    plain_mean_token_loss(model, NUM_DOCS).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.launch
def test_adapter_gradients_do_not_depend_on_the_split(tmp_path, variant):
    want = reference_gradients(variant)
    want_norm = float(torch.sqrt(sum(g.float().pow(2).sum() for g in want.values())))
    splits = {
        "1x1": [[list(range(NUM_DOCS))]],
        "1x4": [[[0, 1, 2], [3, 4, 5, 6, 7], [8, 9], [10, 11]]],
        "2x2": [[[0, 1, 2, 3, 4], [5, 6, 7, 8]], [[9], [10, 11]]],
    }
    if variant != "lora":  # the split machinery is the same: one sharded split against the plain model
        splits = {"2x2": splits["2x2"]}
    for name, split in splits.items():
        for checkpointing in (False, True) if name == "2x2" and variant == "lora" else (False,):
            out = str(tmp_path / f"{name}_{checkpointing}.pt")
            spawn(
                _worker,
                args=(len(split), free_port(), split, out, checkpointing, variant),
                nprocs=len(split),
            )
            got = torch.load(out)
            assert sorted(got["grads"]) == sorted(want) and len(want) == TRAINED[variant]
            assert relative_error(got["grads"], want) < 1e-5, name
            assert abs(got["grad_norm"] - want_norm) / want_norm < 1e-5, name


def test_the_base_view_switches_off_everything_the_adapters_train():
    """DPO's reference with LoRA is the policy with its adapters off: DoRA's magnitudes and a tied embedding
    trained in full (modules_to_save) must be off too, giving the untouched base's losses."""
    settings = OmegaConf.merge(LORA, {"use_dora": True, "modules_to_save": ["embed_tokens"]})
    hf_model = tiny_model(seed=0)
    peft_model = add_adapters(hf_model, settings)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in hf_model.parameters():
            if p.requires_grad:  # every trained tensor moves away from the base
                p.add_(0.05 * torch.randn_like(p))
    policy = PackedCausalLM(hf_model, loss_chunk_size=16)
    batch = collate_packed(demo_documents(3))
    with torch.no_grad():
        base_losses = PackedCausalLM(tiny_model(seed=0), loss_chunk_size=16)(batch)
        assert torch.equal(BaseModelView(policy, peft_model)(batch), base_losses)
        assert not torch.allclose(policy(batch), base_losses)


def sft(out, base, *overrides: str, nproc: int = 2):
    return launch(
        torchrun(
            "recipes/sft.py",
            f"output_dir={out}",
            f"model.path={base}",
            f"tokenizer.path={base}",
            "peft=lora",
            "peft.rank=4",
            "max_steps=6",
            "save_every=3",
            "eval_every=6",
            "log_every=1",
            "data.report_records=0",
            "optimizer.lr=1e-2",
            *overrides,
            nproc=nproc,
        )
    )


def eval_documents():
    tokenizer = demo_tokenizer()
    markers = probe_template(tokenizer)
    for line in (DEMO_ASSETS / "chat_eval.jsonl").read_text().splitlines():
        tokenized = tokenize_conversation(tokenizer, json.loads(line)["messages"], markers)
        yield tokenized.input_ids, shifted_labels(tokenized.input_ids, tokenized.assistant_mask)


@torch.no_grad()
def plain_eval_loss(model) -> float:
    """Mean assistant-token loss over the demo eval chats, one plain forward per chat."""
    total, tokens = 0.0, 0
    for ids, labels in eval_documents():
        logits = model(input_ids=torch.tensor([list(ids)]), use_cache=False).logits[0].float()
        labels = torch.tensor(list(labels))
        total += float(F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"))
        tokens += int((labels != IGNORE_INDEX).sum())
    return total / tokens


@pytest.mark.launch
def test_sft_lora_resumes_exactly_and_exports_what_it_trained(tmp_path, base_dir):
    from peft import PeftModel

    sft(tmp_path / "straight", base_dir, "export.merge=true")
    # `chattune export` of the last checkpoint writes what the run's end wrote: the adapter and the merged model
    exported = launch(
        [sys.executable, "-m", "chattune.cli.main", "export", str(tmp_path / "straight"), "--to", str(tmp_path / "x")]
    )
    for name in ("adapter", "hf"):
        written, ended = tmp_path / "x" / name, tmp_path / "straight" / name
        assert sorted(p.name for p in written.iterdir()) == sorted(p.name for p in ended.iterdir()), exported.stderr
        assert all((written / p.name).read_bytes() == p.read_bytes() for p in ended.iterdir()), name
    sft(tmp_path / "resumed", base_dir, "stop_after_step=4")
    saved = FileSystemReader(str(tmp_path / "resumed" / "checkpoints" / "step_4")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert len(model_keys) == 2 * 7 * 2 and all("lora_" in k for k in model_keys), "only the adapters are saved"
    assert sum(k.startswith("optimizer.state.") for k in saved) == 3 * len(model_keys)  # step, exp_avg, exp_avg_sq
    sft(tmp_path / "resumed", base_dir)
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [(m["step"], m["loss"]) for m in resumed] == [(m["step"], m["loss"]) for m in straight]
    adapter = tmp_path / "straight" / "adapter"
    from safetensors.torch import load_file

    a, b = (
        load_file(adapter / "adapter_model.safetensors"),
        load_file(tmp_path / "resumed" / "adapter" / "adapter_model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in a) and len(a) == 2 * 7 * 2

    # The trained model's held-out loss (chattune's packed eval at the last step) against the adapter loaded
    # by peft onto the base, and the merged model, each run the plain way.
    trained = [m for m in straight if "eval_loss" in m][-1]["eval_loss"]
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "hf", dtype=torch.float32).eval()
    assert "lm_head.weight" not in exported_weights(tmp_path / "straight" / "hf")  # tied, written once
    loss_adapter, loss_merged = plain_eval_loss(with_adapter), plain_eval_loss(merged)
    assert abs(loss_adapter - trained) / trained < 1e-5, (loss_adapter, trained)
    assert abs(loss_merged - trained) / trained < 1e-5, (loss_merged, trained)
    assert abs(loss_adapter - plain_eval_loss(AutoModelForCausalLM.from_pretrained(base_dir))) > 1e-3  # it trained


@pytest.mark.launch
def test_dora_and_trained_embeddings_resume_exactly_and_export_what_they_trained(tmp_path, base_dir):
    """DoRA with the tied embedding trained in full, from a model directory (DoRA's magnitudes computed from
    the base loaded shard by shard). At the first step the model is its base exactly, as with plain LoRA."""
    from peft import PeftModel
    from safetensors.torch import load_file

    options = ("peft.use_dora=true", "peft.modules_to_save=[embed_tokens]")
    sft(tmp_path / "plain", base_dir, "max_steps=1", "save_every=0", "eval_every=0")
    sft(tmp_path / "straight", base_dir, *options, "export.merge=true")
    sft(tmp_path / "resumed", base_dir, *options, "stop_after_step=4")
    sft(tmp_path / "resumed", base_dir, *options)
    plain, straight, resumed = (read_metrics(tmp_path / run) for run in ("plain", "straight", "resumed"))
    assert abs(straight[0]["loss"] - plain[0]["loss"]) <= 1e-6 * plain[0]["loss"], "DoRA at init is its base"
    assert [(m["step"], m["loss"]) for m in resumed] == [(m["step"], m["loss"]) for m in straight]

    adapter = tmp_path / "straight" / "adapter"
    a, b = (
        load_file(adapter / "adapter_model.safetensors"),
        load_file(tmp_path / "resumed" / "adapter" / "adapter_model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sum("lora_magnitude_vector" in k for k in a) == 2 * 7
    # One matrix under both of its names, as peft writes a tied module it trained in full.
    assert torch.equal(a["base_model.model.model.embed_tokens.weight"], a["base_model.model.lm_head.weight"])

    trained = [m for m in straight if "eval_loss" in m][-1]["eval_loss"]
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "hf", dtype=torch.float32).eval()
    assert merged.lm_head.weight is merged.model.embed_tokens.weight  # still tied
    loss_adapter, loss_merged = plain_eval_loss(with_adapter), plain_eval_loss(merged)
    assert abs(loss_adapter - trained) / trained < 1e-5, (loss_adapter, trained)
    assert abs(loss_merged - trained) / trained < 1e-5, (loss_merged, trained)
    embedding = exported_weights(tmp_path / "straight" / "hf")["model.embed_tokens.weight"]
    original = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).model.embed_tokens.weight
    assert not torch.equal(embedding, original), "the embedding trained"


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.launch
def test_dpo_lora_uses_the_base_as_its_reference(tmp_path, base_dir, cache):
    """At the first step the policy is its base exactly (B = 0), so a reference that is the base gives
    rewards of exactly 0; later they move. No second model is built (the log says which reference), live
    or for the one pass of reference.cache."""
    result = launch(
        torchrun(
            "recipes/dpo.py",
            f"output_dir={tmp_path / 'dpo'}",
            f"model.path={base_dir}",
            f"tokenizer.path={base_dir}",
            "peft=lora",
            "peft.rank=4",
            "max_steps=4",
            "eval_every=0",
            "log_every=1",
            "save_every=0",
            "data.report_records=0",
            "optimizer.lr=1e-2",
            f"reference.cache={cache}",
            f"reference.cache_dir={tmp_path / 'cache'}",
            nproc=2,
        )
    )
    metrics = read_metrics(tmp_path / "dpo")
    # Live: the same forward, bit for bit. Cached: the table's pass packed the pairs otherwise (float rounding).
    tolerance = 1e-4 if cache else 0.0
    assert abs(metrics[0]["rewards/chosen"]) <= tolerance and abs(metrics[0]["rewards/rejected"]) <= tolerance
    assert metrics[-1]["rewards/margins"] != 0
    assert "reference: the policy's base (adapters off)" in result.stdout + result.stderr
    assert (tmp_path / "dpo" / "adapter" / "adapter_model.safetensors").is_file()


def test_adapter_module_names_must_name_modules_of_the_model():
    """peft.modules_to_save=[embed_tokenz] used to train nothing more than plain LoRA, silently; a single
    string target_modules is one module name (peft would read it as a regular expression over full paths)."""
    from chattune.errors import UserError

    with pytest.raises(
        UserError,
        match=r"peft.modules_to_save: 'embed_tokenz' names no module of LlamaForCausalLM; "
        r"did you mean embed_tokens\?",
    ):
        add_adapters(tiny_model(), OmegaConf.merge(LORA, {"modules_to_save": ["embed_tokenz"]}))
    with pytest.raises(UserError, match=r"peft.target_modules: 'q_projj' names no module .*did you mean q_proj"):
        add_adapters(tiny_model(), OmegaConf.merge(LORA, {"target_modules": ["q_projj", "v_proj"]}))
    model = tiny_model()
    add_adapters(model, OmegaConf.merge(LORA, {"target_modules": "q_proj"}))
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert len(trained) == 2 * 2 and all(".self_attn.q_proj.lora_" in name for name in trained), trained
    # an adapter on the output layer got no gradient (the losses read its weight directly), silently
    with pytest.raises(UserError, match=r"peft.target_modules: names the output layer"):
        add_adapters(tiny_model(tie_word_embeddings=False), OmegaConf.merge(LORA, {"target_modules": ["lm_head"]}))
