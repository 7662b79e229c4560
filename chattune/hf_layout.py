"""Where a Hugging Face model keeps its parts: the decoder a causal LM runs and its repeated decoder layers. Read
by the packed model, the parallelisms and the checks alike, so it sits below all of them."""

from __future__ import annotations

from torch import nn


def decoder_of(hf_model: nn.Module) -> nn.Module:
    """The decoder a causal LM runs: its `base_model_prefix` attribute, or `.model` where that names none (Llama 4's
    and Mllama's causal LMs: prefix language_model, decoder model)."""
    return getattr(hf_model, hf_model.base_model_prefix, None) or hf_model.model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of an HF model (or of the packed model around one: its `hf_model`), found through the
    class names HF lists in `_no_split_modules`; the outermost only where the list names a block and a module
    inside it (Mamba's MambaBlock and MambaMixer: sharding the block and then its mixer would shard the mixer's
    parameters twice)."""
    hf_model = getattr(model, "hf_model", model)
    names = set(hf_model._no_split_modules or [])
    # Match along the MRO: once sharded, a layer's class is FSDP2's dynamic subclass (FSDPLlamaDecoderLayer).
    matched = [m for m in hf_model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    inside = {id(inner) for m in matched for inner in m.modules() if inner is not m}
    layers = [m for m in matched if id(m) not in inside]
    if not layers:
        raise ValueError(f"found no decoder layers in {type(hf_model).__name__} (looked for {sorted(names)})")
    return layers
