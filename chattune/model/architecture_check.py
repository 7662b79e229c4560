"""Start-up checks of a model's architecture, run on a miniature of it instead of the model itself.

Two things chattune must refuse before training: an output head that is not `hidden @ weight.T`
(`check_output_head`) and layers that let packed documents see each other (`check_packing_isolation`).
Both are properties of the architecture and its config (logit scaling, softcapping, a bias, a conv or SSM
layer), not of the trained weights, so they are checked on a random-init miniature: the same model class
and config, with only the first decoder layers (enough to hold every kind of layer the config lists) and a
small vocabulary. The real model is never built in full on one rank (it is loaded shard by shard, see
`chattune.model.load`), and the miniature costs two layers' weights instead of the whole model.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from chattune.model.attention import ATTENTION_NAME
from chattune.model.causal_lm import check_output_head
from chattune.model.context_parallel import active_group, check_heads, whole_rows
from chattune.model.mixers import check_context_parallel, choose_mixer_path, handled_mixers
from chattune.model.packing_probe import check_context_split, check_fast_mixers, check_packing_isolation

MINIATURE_LAYERS = 2
MINIATURE_VOCAB = 1024
# Per-layer lists of layer kinds, as configs name them; the miniature keeps a prefix holding every kind.
PER_LAYER_KINDS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern", "mlp_layer_types",
                   "no_rope_layers")
# Lists of the layer indices that differ from the rest (attention in a Mamba stack, dense in an MoE stack).
LAYER_INDEX_LISTS = ("attn_layer_indices", "mlp_only_layers", "full_attn_idxs")
# The first k layers differ from the rest (dense layers before the MoE ones).
LEADING_LAYERS = ("first_k_dense_replace", "num_dense_layers")
MINIATURE_SEED = 1234


def _layer_kinds(config: PretrainedConfig, num_layers: int) -> set[tuple[str, object]]:
    """Every (attribute, kind) the first `num_layers` layers of `config` have."""
    kinds = set()
    for attribute in PER_LAYER_KINDS:
        value = getattr(config, attribute, None)
        if isinstance(value, (list, tuple, str)):
            kinds.update((attribute, kind) for kind in value[:num_layers])
    for attribute in LAYER_INDEX_LISTS:
        value = getattr(config, attribute, None)
        if isinstance(value, (list, tuple)):
            kinds.update((attribute, i in value) for i in range(num_layers))
    for attribute in LEADING_LAYERS:
        value = getattr(config, attribute, None)
        if isinstance(value, int):
            kinds.update((attribute, i < value) for i in range(num_layers))
    return kinds


def miniature_config(config: PretrainedConfig, min_layers: int = MINIATURE_LAYERS) -> PretrainedConfig:
    """`config` with its first layers only (at least `min_layers`, and as many as it takes to hold every
    kind of layer the full model has) and a vocabulary of at most MINIATURE_VOCAB tokens."""
    text = config.get_text_config()
    total = text.num_hidden_layers
    every_kind = _layer_kinds(text, total)
    keep = min(total, min_layers)
    while keep < total and _layer_kinds(text, keep) != every_kind:
        keep += 1
    small = copy.deepcopy(config)
    small_text = small.get_text_config()
    for attribute in PER_LAYER_KINDS:
        value = getattr(small_text, attribute, None)
        if isinstance(value, (list, tuple, str)) and len(value) == total and attribute in small_text.__dict__:
            setattr(small_text, attribute, value[:keep])
    small_text.num_hidden_layers = keep
    if small_text.vocab_size > MINIATURE_VOCAB:
        small_text.vocab_size = MINIATURE_VOCAB
        for token in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids past the small vocabulary
            value = getattr(small_text, token, None)
            if isinstance(value, int) and value >= MINIATURE_VOCAB:
                setattr(small_text, token, None)
    return small


def build_miniature(config: PretrainedConfig) -> PreTrainedModel:
    """A random-init fp32 miniature of `config`'s model on the CPU. Some architectures tie or share weights
    across layers by index (Zamba's shared blocks) and cannot be built with fewer layers than their pattern
    spans: one more layer is tried until the model builds (at most the full depth)."""
    total = config.get_text_config().num_hidden_layers
    for min_layers in range(MINIATURE_LAYERS, total + 1):
        try:
            model = AutoModelForCausalLM.from_config(miniature_config(config, min_layers),
                                                     attn_implementation=ATTENTION_NAME, dtype=torch.float32)
            break
        except (ValueError, KeyError, IndexError):
            if min_layers >= total:
                raise
    model.config.use_cache = False
    return model


def check_architecture(config: PretrainedConfig, device: torch.device | None = None) -> None:
    """Refuse (UnsupportedModel) an architecture whose packed forward lets documents see each other or whose
    logits are not hidden @ output_embedding.T, measured on a random-init miniature. The global RNG is left
    as it was, so random-init weights built after the check do not change. Under context parallelism the
    miniature must also compute a row split across the context group as the whole row (`check_context_split`,
    on `device`)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MINIATURE_SEED)
        miniature = build_miniature(config)
    device = device or torch.device("cpu")
    choose_mixer_path(device, set(handled_mixers(miniature).values()))
    with whole_rows():  # each rank probes the miniature on its own
        check_packing_isolation(miniature)  # first: it turns a failing packed forward into a clear refusal
        check_output_head(miniature)
        if device.type == "cuda":
            check_fast_mixers(miniature, device)  # the varlen kernels, where chosen, against the exact path
    group = active_group()
    if group is not None:  # collective over the context group: every rank built the same miniature
        check_context_parallel(miniature, torch.distributed.get_world_size(group))
        check_heads(config.get_text_config().num_attention_heads, torch.distributed.get_world_size(group),
                    type(miniature).__name__)
        # on the run's device: the group's collectives (nccl on CUDA) take its tensors
        check_context_split(miniature.to(device), group)
