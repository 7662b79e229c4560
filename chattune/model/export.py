"""The final Hugging Face export: gathered full weights as safetensors, config and tokenizer, loadable
without chattune."""

from __future__ import annotations

import copy
from pathlib import Path

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PreTrainedTokenizerBase

from chattune.model.causal_lm import PackedCausalLM

HF_PREFIX = "hf_model."


def export_hf(model: PackedCausalLM, tokenizer: PreTrainedTokenizerBase, directory: Path, is_main: bool) -> None:
    """Collective: gather full weights and have rank 0 write a Hugging Face directory (safetensors,
    config, tokenizer with its chat template) that loads without chattune."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return
    state_dict = {k.removeprefix(HF_PREFIX): v for k, v in full.items()}
    hf_model = model.hf_model
    config = copy.deepcopy(hf_model.config)
    config.use_cache = True  # training needs it off; generation wants it on
    config._attn_implementation = "sdpa"  # readers do not have chattune's packed attention registered
    saved_config = hf_model.config
    hf_model.config = config
    try:
        hf_model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    finally:
        hf_model.config = saved_config
    tokenizer.save_pretrained(directory)
