"""Vision-language checkpoints end to end on 2 ranks (chattune.model.io.composite): a tiny bf16 Mistral 3 checkpoint
directory (legacy names, a processor file) trains with SFT, resumes bit for bit after stop_after_step, and comes back
in its own class: the vision tower byte for byte, the language model moved, bf16, the processor file kept. DPO with
LoRA from the same directory writes an adapter that peft loads over the original checkpoint, touching no vision
layer, and that equals the merged export. A Qwen3-VL directory (its text model given a causal LM by chattune) takes
DPO with the sample replies, resumes bit for bit and exports as Qwen3VLForConditionalGeneration. The reward recipe
trains Mistral 3's language model under a new score head and exports a stock sequence classifier; KTO trains it
and exports it in its own class."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors import safe_open
from test_composite_models import save_composite
from test_resume import assert_same_weights, losses
from test_sft_recipe import read_metrics
from transformers import AutoModelForImageTextToText

from conftest import demo_tokenizer, free_port, launch

pytestmark = pytest.mark.launch  # every test here starts processes

PROCESSOR = {"image_processor_type": "PixtralImageProcessor", "patch_size": 8}  # kept by the export as it is


def torchrun(recipe: str, out, *overrides: str):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    return launch([*command, str(free_port()), recipe, f"output_dir={out}", "log_every=1", *overrides])


def stored(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


@pytest.fixture(scope="module")
def mistral3_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mistral3")
    save_composite("mistral3", directory, torch.bfloat16, vocab_size=len(demo_tokenizer()))
    demo_tokenizer().save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return directory


def sft(out, source, *overrides: str):
    return torchrun(
        "recipes/sft.py",
        out,
        f"model.path={source}",
        "max_steps=4",
        "save_every=2",
        "eval_every=0",
        "eval.samples=0",
        "optimizer.lr=3e-3",
        "scheduler.num_warmup_steps=0",
        "data.max_tokens_per_microbatch=512",
        "data.buffer_records=16",
        *overrides,
    )


def test_mistral3_trains_resumes_exactly_and_comes_back_in_its_own_class(mistral3_dir, tmp_path):
    straight = tmp_path / "straight"
    result = sft(straight, mistral3_dir)
    assert "training its language model as MistralForCausalLM" in result.stdout + result.stderr
    # the start-up memory table: the language model the run builds, estimated (not "not estimated: Mistral3Config ...")
    assert "Mistral3ForConditionalGeneration: its language model, as the run trains it (MistralForCausalLM)" in (
        result.stdout + result.stderr
    )
    assert "not estimated" not in result.stdout + result.stderr
    resumed = tmp_path / "resumed"
    sft(resumed, mistral3_dir, "stop_after_step=2")
    sft(resumed, mistral3_dir)
    assert losses(resumed) == losses(straight)
    assert_same_weights(resumed, straight)

    source, exported = stored(mistral3_dir), stored(straight / "hf")
    assert exported.keys() == source.keys()  # the checkpoint's own (legacy) names
    vision = [key for key in source if key.startswith(("vision_tower.", "multi_modal_projector."))]
    assert vision and all(torch.equal(exported[key].view(torch.int16), source[key].view(torch.int16)) for key in vision)
    language = [key for key in source if key not in vision]
    assert all(exported[key].dtype == torch.bfloat16 for key in exported)
    moved = [key for key in language if not torch.equal(exported[key], source[key])]
    assert len(moved) >= len(language) // 2, (len(moved), len(language))
    assert json.loads((straight / "hf" / "preprocessor_config.json").read_text()) == PROCESSOR
    model = AutoModelForImageTextToText.from_pretrained(straight / "hf")  # stock transformers
    assert type(model).__name__ == "Mistral3ForConditionalGeneration" and model.dtype == torch.bfloat16


def test_a_lora_adapter_on_mistral3_loads_over_the_original_checkpoint(mistral3_dir, tmp_path):
    from peft import PeftModel

    out = tmp_path / "dpo"
    torchrun(
        "recipes/dpo.py",
        out,
        f"model.path={mistral3_dir}",
        "peft=lora",
        "export.merge=true",
        "max_steps=2",
        "save_every=0",
        "eval_every=0",
        "eval.samples=0",
        "optimizer.lr=1e-2",
        "data.max_tokens_per_microbatch=1024",
    )
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    adapted = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(mistral3_dir), out / "adapter")
    wrapped = [name for name, module in adapted.named_modules() if hasattr(module, "lora_A")]
    assert wrapped and all(".language_model." in name for name in wrapped)  # no vision layer of the same name
    merged = AutoModelForImageTextToText.from_pretrained(out / "hf")
    ids = torch.tensor([[5, 17, 33, 2, 91, 7, 64]])
    with torch.no_grad():
        base = AutoModelForImageTextToText.from_pretrained(mistral3_dir)(input_ids=ids).logits.float()
        want, got = adapted(input_ids=ids).logits.float(), merged(input_ids=ids).logits.float()
    assert float((want - base).abs().max()) > 1e-2  # the adapter trained
    assert float((got - want).abs().max()) <= 3e-2  # the merged export equals base + adapter (bf16 weights)


def dpo_on(source, out, *overrides: str):
    return torchrun(
        "recipes/dpo.py",
        out,
        f"model.path={source}",
        "max_steps=2",
        "save_every=1",
        "eval_every=2",
        "eval.samples=2",
        "data.max_tokens_per_microbatch=1024",
        *overrides,
    )


def test_qwen3_vl_takes_dpo_with_the_sample_replies_resumes_exactly_and_exports_in_its_own_class(tmp_path):
    source = tmp_path / "qwen3_vl"
    save_composite("qwen3_vl", source, torch.bfloat16, vocab_size=len(demo_tokenizer()))
    demo_tokenizer().save_pretrained(source)
    straight = tmp_path / "straight"
    result = dpo_on(source, straight)
    assert "training its language model as Qwen3VLTextForCausalLM" in result.stdout + result.stderr
    replies = [json.loads(line) for line in (straight / "samples.jsonl").read_text().splitlines()]
    assert {line["step"] for line in replies} == {0, 2} and len(replies) == 4
    resumed = tmp_path / "resumed"
    dpo_on(source, resumed, "stop_after_step=1")
    dpo_on(source, resumed)
    assert losses(resumed) == losses(straight)
    assert_same_weights(resumed, straight)
    model = AutoModelForImageTextToText.from_pretrained(straight / "hf")
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert stored(straight / "hf").keys() == stored(source).keys()


def test_a_reward_model_trained_from_mistral3_exports_as_a_stock_sequence_classifier(mistral3_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "reward"
    torchrun(
        "recipes/reward.py",
        out,
        f"model.path={mistral3_dir}",
        "max_steps=2",
        "save_every=0",
        "eval_every=0",
        "data.max_tokens_per_microbatch=1024",
    )
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    model = AutoModelForSequenceClassification.from_pretrained(out / "hf")  # stock transformers
    assert type(model).__name__ == "MistralForSequenceClassification" and model.config.num_labels == 1
    # Its decoder is the checkpoint's language model, trained (close to where it started, not a random init).
    source = stored(mistral3_dir)["language_model.model.layers.0.self_attn.q_proj.weight"].float()
    trained = model.model.layers[0].self_attn.q_proj.weight.detach().float()
    assert not torch.equal(trained, source) and float((trained - source).norm() / source.norm()) < 0.05


def test_kto_from_mistral3_trains_its_language_model_and_exports_in_its_own_class(mistral3_dir, tmp_path):
    out = tmp_path / "kto"
    result = torchrun(
        "recipes/kto.py",
        out,
        f"model.path={mistral3_dir}",
        "max_steps=2",
        "save_every=0",
        "eval_every=0",
        "eval.samples=0",
        "data.max_tokens_per_microbatch=1024",
    )
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    assert stored(out / "hf").keys() == stored(mistral3_dir).keys()
    assert type(AutoModelForImageTextToText.from_pretrained(out / "hf")).__name__ == "Mistral3ForConditionalGeneration"
    # The run's last line says what it made and what to do with it.
    assert f"done: {out / 'hf'} (talk to it: chattune chat {out}; its curves: chattune plot {out})" in (
        result.stdout + result.stderr
    )
