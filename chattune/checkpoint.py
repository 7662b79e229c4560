"""Sharded training checkpoints (torch.distributed.checkpoint) and the final Hugging Face export.

Layout of `{output_dir}/checkpoints/step_{N}/`: DCP shards of {"model", "optimizer"} plus
`train_state_rank{R}.pt` per rank (step, scheduler, that rank's data-stream state), so a resume can
restore each rank's own position.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import PreTrainedTokenizerBase

from chattune.model import PackedCausalLM

HF_PREFIX = "hf_model."


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def save_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_state: dict) -> None:
    """Collective: every rank writes its shards and its own train_state."""
    directory.mkdir(parents=True, exist_ok=True)
    dcp.save(_sharded_state(model, optimizer), checkpoint_id=str(directory))
    torch.save(train_state, directory / f"train_state_rank{dist.get_rank()}.pt")


def load_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective: restore model and optimizer shards in place; returns this rank's train_state."""
    state = _sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return torch.load(directory / f"train_state_rank{dist.get_rank()}.pt", weights_only=False)


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
