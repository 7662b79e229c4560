"""The model a recipe trains, and DPO's frozen reference: an HF causal LM from a local directory or from
`model.config` (random weights), with the chunked loss head, sharded with FSDP2 per decoder layer and
at the root. One builder, so the policy and a reference built from the config get the same weights."""

from __future__ import annotations

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from chattune.distributed import DistInfo
from chattune.model.causal_lm import PackedCausalLM, build_hf_model
from chattune.model.fsdp import compile_enabled, compute_dtype, shard_model
from chattune.model.fused_loss import resolve_loss_implementation


def build_sharded_model(cfg: DictConfig, tokenizer: PreTrainedTokenizerBase, dist_info: DistInfo,
                        path: str | None) -> tuple[PreTrainedModel, FSDPModule]:
    """(the HF model, the sharded loss-head model around it): loaded from `path`, or built from
    `cfg.model.config` when `path` is None."""
    # The same seed on every rank, and for every model built: identical initial weights before sharding.
    torch.manual_seed(cfg.seed)
    config = instantiate(cfg.model.config) if path is None else None
    hf_model = build_hf_model(tokenizer, path=path, config=config)  # on CPU; fully_shard moves each shard
    device_type = dist_info.device.type
    dtype = compute_dtype(cfg.model.fsdp.param_dtype, device_type)
    implementation = resolve_loss_implementation(cfg.loss.implementation, device_type, dtype)
    if device_type == "cuda" and dtype != "float32" and implementation == "chunked":
        # The one fp32 matmul left is the chunked loss head's, on bf16/fp16-valued inputs: TF32 represents
        # those exactly (10 mantissa bits) and accumulates in fp32, so it gives the fp32 result, faster.
        # The legacy setter keeps every reader consistent (mixing it with `fp32_precision` makes the
        # legacy getters raise, and cut-cross-entropy and Inductor read them).
        torch.set_float32_matmul_precision("high")
    model = shard_model(PackedCausalLM(hf_model, cfg.loss.chunk_size, implementation), device_type,
                        dist_info.world_size, **cfg.model.fsdp, compile=compile_enabled(cfg.model.compile, device_type))
    return hf_model, model
