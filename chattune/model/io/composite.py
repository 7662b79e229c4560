"""The text model of a vision-language checkpoint: the one place that knows it.

Many chat models ship only as vision-language checkpoints (Mistral Small 3.x / Ministral 3 as `mistral3`, Kimi K2.5
as `kimi_k25`, LLaVA-style models, PaliGemma, InternVL, LFM2-VL...): a composite class whose language model is a
causal LM that transformers also has on its own (`MistralForCausalLM`, `DeepseekV3ForCausalLM`). chattune trains
that language model on text chats and leaves the vision tower and projector untouched:

- **Built from the text config.** The trained model is the text config's own causal LM, built on the meta device
  like any checkpoint (`chattune.model.io.load`): the vision weights are never materialised on a training rank, and
  every check, the packed forward, the FLOP count and the memory lines see a plain causal LM.
- **Loaded from the checkpoint's own names.** Each text parameter's name in the composite is found on a meta-built
  composite (its language model module and its output layer), and each checkpoint tensor's name in the composite
  by transformers' own conversion of the checkpoint's keys (`mistral3`'s legacy `language_model.model.*` as well as
  the current `model.language_model.*`); a key that transformers converts by more than a rename (fused experts) is
  refused with its name, as rows of it could not be read per shard.
- **Exported in the checkpoint's own layout and class** (`chattune.model.io.export`): the language weights under the
  checkpoint's names, in the export dtype; every other tensor copied byte for byte from the source; the source's
  config and processor files. A LoRA adapter names the composite's modules, so peft loads it over the original
  checkpoint.

- **A causal LM where transformers has none.** Some composites' language models exist only inside them (Qwen2-VL to
  Qwen3-VL, GLM-4.xV): `text_causal_lm_class` puts the composite's own text model under a plain output layer, as
  transformers' `*ForCausalLM` classes do. It is used only for the text models in `WRAPPED_TEXT_MODELS`, each
  tested to give the stock composite's logits on text (tests/unit/model/io/test_composite_models.py); any other is refused.

Image-and-text training comes next and starts from here.
"""

from __future__ import annotations

import copy
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from chattune.errors import UnsupportedModel, UserError


@dataclass(frozen=True)
class CompositeCheckpoint:
    """A vision-language checkpoint whose language model chattune trains."""

    directory: Path
    class_name: str  # the composite class (what the export loads as)
    text_config: PretrainedConfig  # what the trained causal LM is built from
    module_names: dict[str, str]  # the causal LM's module/parameter name prefix -> the composite's
    stored_names: dict[str, str]  # the causal LM's tensor name -> its key in the checkpoint
    other_keys: tuple[str, ...]  # checkpoint keys the causal LM does not hold (vision tower, projector): copied
    # Every language tensor is a checkpoint tensor, renamed at most (read per shard); else `load_whole`, and the
    # converted ones are written back under the composite's own names, which transformers loads as they are.
    per_shard: bool = True

    def composite_name(self, name: str) -> str:
        """A module or parameter name of the trained causal LM as the composite names it."""
        for prefix, composite in self.module_names.items():
            if name == prefix or name.startswith(prefix + "."):
                return composite + name[len(prefix) :]
        raise KeyError(name)


def is_composite(config: PretrainedConfig) -> bool:
    """A vision-language config (its own type no causal LM of transformers) with a separate text config."""
    return (
        config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        and config.get_text_config() is not config
    )


# Text models that exist only inside their composite, given a causal LM here (`text_causal_lm_class`); each is
# tested against its stock composite on text. The composite types they come from, for messages.
WRAPPED_TEXT_MODELS = {
    "qwen2_vl_text": "qwen2_vl",
    "qwen2_5_vl_text": "qwen2_5_vl",
    "qwen3_vl_text": "qwen3_vl",
    "qwen3_vl_moe_text": "qwen3_vl_moe",
    "glm4v_text": "glm4v",
    "glm4v_moe_text": "glm4v_moe",
}


# The composite types whose language model, built as its text config's causal LM, gives the stock composite's
# per-token losses and gradients on text, packed (tests/unit/model/io/test_composite_models.py checks every one). Found by trying
# every composite of transformers 5.24 whose text model has a causal LM (2026-11-28): the rest differ (Aya Vision and
# Command-A Vision: Cohere's logit scale, which their composite does not apply; PaliGemma: 7e-2 in the loss) or are
# not laid out as their text model's causal LM (BLIP-2, InstructBLIP, Florence-2: encoder-decoder text models).
VERIFIED_COMPOSITES = (
    "aria",
    "cosmos3_omni",
    "deepseek_vl",
    "deepseek_vl_hybrid",
    "exaone4_5",
    "glm46v",
    "glm4v",
    "glm4v_moe",
    "hyperclovax_vision_v2",
    "idefics2",
    "idefics3",
    "internvl",
    "janus",
    "kimi_k25",
    "lfm2_vl",
    "lfm3_vl",
    "lighton_ocr",
    "llava",
    "llava_next",
    "llava_next_video",
    "llava_onevision",
    "minicpm_ocr",
    "minicpmv4_6",
    "minicpmv4_7",
    "minimax_m3_vl",
    "mistral3",
    "ovis2",
    "pp_chart2table",
    "qianfan_ocr",
    "qwen2_5_vl",
    "qwen2_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "smolvlm",
    "video_llama_3",
    "video_llava",
    "vipllava",
)


def text_config_of(config: PretrainedConfig) -> PretrainedConfig:
    """The composite's text config, set to tie its output layer as the composite does. A composite not in
    VERIFIED_COMPOSITES is refused (UnsupportedModel) with the reason."""
    text = copy.deepcopy(config.get_text_config())
    if config.model_type not in VERIFIED_COMPOSITES:
        lacks = text.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and text.model_type not in WRAPPED_TEXT_MODELS
        reason = (
            f"its language model ({text.model_type}) has no causal LM class, in transformers or in chattune"
            if lacks
            else f"its language model as {text.model_type}'s causal LM is not verified to compute what the composite "
            "computes on text (some differ: a logit scale, a prefix attention, another output layer)"
        )
        raise UnsupportedModel(
            f"{config.model_type}: a vision-language model that chattune cannot train on text yet: {reason}. "
            f"Vision-language types it trains: {', '.join(VERIFIED_COMPOSITES)}"
        )
    if text.model_type in WRAPPED_TEXT_MODELS:
        register_text_causal_lm(config)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    return text


def register_text_causal_lm(config: PretrainedConfig) -> None:
    """Make `AutoModelForCausalLM` build the composite's text model under an output layer
    (`text_causal_lm_class`): the miniature of the start-up checks and the trained model are built through it."""
    from transformers import AutoModelForCausalLM

    text = config.get_text_config()
    with torch.device("meta"):
        composite = AutoModelForImageTextToText.from_config(config)
    language = type(composite.get_decoder())
    AutoModelForCausalLM.register(type(text), text_causal_lm_class(language), exist_ok=True)


_WRAPPERS: dict[type, type] = {}


def text_causal_lm_class(text_model_class: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """`text_model_class` (a composite's language model) under a bias-free output layer: what transformers'
    `*ForCausalLM` classes are (MistralForCausalLM: `model`, `lm_head`, the same forward), named after it."""
    if text_model_class in _WRAPPERS:
        return _WRAPPERS[text_model_class]
    from torch import nn
    from transformers import GenerationMixin
    from transformers.modeling_outputs import CausalLMOutputWithPast

    base = next(c for c in text_model_class.__mro__[1:] if issubclass(c, PreTrainedModel))

    class TextCausalLM(base, GenerationMixin):
        config_class = text_model_class.config_class
        base_model_prefix = "model"
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
        _no_split_modules = getattr(text_model_class, "_no_split_modules", None)

        def __init__(self, config):
            super().__init__(config)
            self.model = text_model_class(config)
            self.vocab_size = config.vocab_size
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def forward(
            self,
            input_ids=None,
            attention_mask=None,
            position_ids=None,
            cache=None,
            inputs_embeds=None,
            labels=None,
            use_cache=None,
            logits_to_keep=0,
            **kwargs,
        ):
            outputs = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                **kwargs,
            )
            hidden_states = outputs.last_hidden_state
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden_states[:, keep, :])
            loss = None
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            return CausalLMOutputWithPast(
                loss=loss,
                logits=logits,
                cache=outputs.cache,
                hidden_states=outputs.hidden_states,
                attentions=outputs.attentions,
            )

    name = text_model_class.__name__.removesuffix("Model") + "ForCausalLM"
    TextCausalLM.__name__ = TextCausalLM.__qualname__ = name
    # transformers decides what a class supports (attention and experts implementations) by reading its module's
    # source: the text model's modeling file, where its layers are.
    TextCausalLM.__module__ = text_model_class.__module__
    _WRAPPERS[text_model_class] = TextCausalLM
    return TextCausalLM


def read_composite(
    directory: Path, config: PretrainedConfig, files: dict[str, Path], text_model
) -> CompositeCheckpoint:
    """Where each tensor of `text_model` (built from `text_config_of(config)`, on meta) lies in the checkpoint at
    `directory` (`files`: its keys -> files). Errors name the tensor the checkpoint lacks."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    from chattune.model.io.load import saved_tensors

    with torch.device("meta"):
        composite = AutoModelForImageTextToText.from_config(config)
    language = composite.get_decoder()
    modules = {id(module): name for name, module in composite.named_modules()}
    module_names = {
        text_model.base_model_prefix: modules[id(language)],
        "lm_head": modules[id(composite.get_output_embeddings())],
    }
    transforms = get_model_conversion_mapping(composite)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    composite_state = composite.state_dict()
    renamed = {
        key: rename_source_key(key, renamings, converters, composite.base_model_prefix, composite_state)
        for key in files
    }  # the checkpoint's key -> (the composite's tensor name, the converter's pattern where more than a rename)
    key_of = {name: key for key, (name, converter) in renamed.items() if converter is None}
    converted = {name for name, converter in renamed.values() if converter is not None}
    layout = CompositeCheckpoint(directory, type(composite).__name__, text_model.config, module_names, {}, ())
    stored, per_shard = {}, True
    for name, tensor in saved_tensors(text_model):
        if isinstance(tensor, torch.nn.Parameter) and not tensor.is_meta:
            continue  # initialised by chattune, not loaded (a reward model's score head)
        wanted = layout.composite_name(name)
        if wanted not in composite_state:
            raise UnsupportedModel(
                f"{type(composite).__name__}: its language model is not laid out as {type(text_model).__name__} "
                f"(it has no {wanted}), so chattune cannot train it on text"
            )
        if wanted in key_of:
            stored[name] = key_of[wanted]
        elif wanted in converted:  # e.g. experts stored one by one, fused by transformers: written back fused
            stored[name], per_shard = wanted, False
        else:
            raise UserError(
                f"model.path {directory}: the checkpoint holds no tensor for {wanted} of {type(composite).__name__} "
                "(its language model)"
            )
    language = tuple(module_names.values())
    others = tuple(
        key
        for key, (name, _) in renamed.items()
        if not any(name == prefix or name.startswith(prefix + ".") for prefix in language)
    )
    return CompositeCheckpoint(directory, layout.class_name, text_model.config, module_names, stored, others, per_shard)


def load_whole(composite: CompositeCheckpoint, text_model: PreTrainedModel) -> None:
    """Fill the meta-built `text_model` from the whole composite, loaded by `from_pretrained` (fp32, on the CPU):
    for a checkpoint that transformers converts while loading (`CompositeCheckpoint.per_shard` false)."""
    stock = AutoModelForImageTextToText.from_pretrained(composite.directory, dtype=torch.float32)
    state = stock.state_dict()
    # What is already real keeps its value: buffers computed at the build, a reward model's new score head.
    wanted = {
        name: tensor.detach().clone() if not tensor.is_meta else state[composite.composite_name(name)]
        for name, tensor in text_model.state_dict().items()
    }
    buffers = {name: buffer.detach().clone() for name, buffer in text_model.named_buffers()}  # rotary tables too
    text_model.to_empty(device="cpu")
    text_model.load_state_dict(wanted, strict=True)
    text_model.tie_weights()  # `to_empty` gave the output layer and the embedding a tensor each
    with torch.no_grad():
        for name, buffer in text_model.named_buffers():
            if name not in wanted:  # non-persistent: not in a state dict, and `to_empty` left it uninitialised
                buffer.copy_(buffers[name])


# Files of a source directory that the export writes itself (weights and their index).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")


def copy_source_files(composite: CompositeCheckpoint, directory: Path) -> None:
    """The source's config, processor and template files into the export `directory` (its weights are written by
    the export). The tokenizer, saved after this, is the run's."""
    for path in sorted(composite.directory.iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) and not path.name.endswith(".index.json"):
            shutil.copy2(path, directory / path.name)


def adapter_targets(composite: CompositeCheckpoint, module_names: list[str]) -> str:
    """peft's `target_modules` for the adapter over the composite: exactly the trained modules, as the composite
    names them (peft full-matches a string), so it does not wrap the vision tower's layers of the same name."""
    names = sorted({composite.composite_name(name) for name in module_names})
    return "^(" + "|".join(re.escape(name) for name in names) + ")$"


def describe(model: PreTrainedModel, composite: CompositeCheckpoint) -> str:
    return (
        f"{composite.class_name} ({composite.directory}): training its language model as {type(model).__name__}; "
        f"{len(composite.other_keys)} tensors of its other parts (vision tower, projector) are not loaded and are "
        "copied unchanged into the export"
    )
