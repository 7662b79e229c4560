"""Start-up checks of a model's architecture, run on a miniature of it instead of the model itself.

What chattune must refuse before training: an output head that is not `hidden @ weight.T` (`check_output_head`),
layers that let packed documents see each other (`check_packing_isolation`), attention that masks more than
chattune's causal attention per document does (`check_stock_attention`), and a model that cannot be built with
chattune's attention at all (`build_miniature`). These are properties of the architecture and its config (logit
scaling, softcapping, a bias, a conv or SSM layer, chunked attention), not of the trained weights, so they are
checked on a random-init miniature: the same model class and config, with only the first decoder layers (enough
to hold every kind of layer the config lists), a small vocabulary and short windows. The real model is never built
in full on one rank (it is loaded shard by shard, see `chattune.model.io.load`), and the miniature costs two layers'
weights instead of the whole model. Whatever the model's own code raises on the way is a refusal that names it,
not a crash.
"""

from __future__ import annotations

import copy
import logging

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from chattune.data.packing import collate_packed
from chattune.errors import UnsupportedModel
from chattune.hf_layout import decoder_of
from chattune.model.causal_lm import check_output_head
from chattune.model.checks.code_failures import model_code_failure
from chattune.model.checks.packing_probe import (
    ALONE_TOLERANCE,
    PROBE_LENGTHS,
    check_context_split,
    check_fast_mixers,
    check_packing_isolation,
    check_shared_prompts,
    probe_documents,
)
from chattune.model.cost.flops import attention_heads, text_config
from chattune.model.packed.attention import ATTENTION_NAME, packed_hidden_states
from chattune.model.packed.indexed_attention import check_context_parallel as check_indexed_context_parallel
from chattune.model.packed.indexed_attention import check_indexed_attention
from chattune.model.packed.mixers import check_context_parallel, choose_mixer_path, handled_mixers
from chattune.model.packed.rotary import check_rotary_tables
from chattune.parallel.context_parallel import check_heads, whole_rows

logger = logging.getLogger(__name__)

MINIATURE_LAYERS = 2
MINIATURE_VOCAB = 1024
# Per-layer lists of layer kinds, as configs name them; the miniature keeps a prefix holding every kind.
PER_LAYER_KINDS = (
    "layer_types",
    "layers_block_type",
    "block_types",
    "hybrid_override_pattern",
    "mlp_layer_types",
    "no_rope_layers",
    "num_attention_heads_per_layer",
)
# Lists of the layer indices that differ from the rest (attention in a Mamba stack, dense in an MoE stack).
LAYER_INDEX_LISTS = ("attn_layer_indices", "mlp_only_layers", "full_attn_idxs")
# The first k layers differ from the rest (dense layers before the MoE ones).
LEADING_LAYERS = ("first_k_dense_replace", "num_dense_layers")
MINIATURE_SEED = 1234
# Windows and attention chunks of the miniature, shorter than the checks' documents, so that they are checked too.
MINIATURE_WINDOW = 4
WINDOWS = ("sliding_window", "attention_chunk_size")
# Lengths past which a model computes differently, cut in the miniature so that the probe's documents (11, 9 and
# 11 tokens: `PROBE_LENGTHS`) lie on both sides of them: a row mixing documents below and above such a switch is
# where a model that reads the whole row (rather than each document) shows it. The rotary switches sit at
# ROTARY_SWITCH, between document B (9 tokens) and A and C (11), so B alone is below the switch and its row above:
# LongRoPE's short and long factors (`original_max_position_embeddings`; the same length is cut for YaRN and Llama 3
# rotaries, static in transformers, and read by Ministral 3's position-dependent query scaling), dynamic NTK's
# rescaling (`max_position_embeddings`, only where the rotary is dynamic: absolute position tables are sized by it).
# Llama 4's attention temperature grows every `floor_scale` tokens: cut below the documents too, and its growth
# (`attn_scale`, 0.1) raised to 1, so that a temperature read from the row's places rather than the document's moves
# a document by more than the probe's tolerance (2.6e-4 at 0.1, 7.7e-3 at 1: a random-init miniature's attention is
# nearly uniform, which the temperature barely sharpens).
ROTARY_SWITCH = 10
SCALES = {"floor_scale": MINIATURE_WINDOW}
# Attention that selects its keys (`chattune.model.packed.indexed_attention`) selects only once a document has more keys
# than its budget: the budgets cut below the probe's documents (at their defaults, 2048 keys or 128-token blocks, a
# selection dropped or made over the whole row would pass the probe unseen).
SCALES |= {
    "index_topk": 4,  # DeepSeek Sparse Attention and kin
    "indexer_budget": 4,  # Qwen4-Exp's QSA: a multiple of its compress ratio
    "indexer_compress_ratio": 2,
    "index_block_size": 2,  # MiniMax-M3's block selection
    "index_topk_blocks": 2,
}
# Chunked recurrences and scans cross a chunk within the probe's row (31 tokens): Mamba-2's and xLSTM's chunks at
# 16 (what their kernels take on CUDA, whose varlen paths `check_fast_mixers` compares on that row), MiniMax's
# lightning attention blocks at MINIATURE_WINDOW (its torch code takes any size) so that each document crosses them.
SCALES |= {"chunk_size": 16, "mamba_chunk_size": 16, "block_size": MINIATURE_WINDOW}
# DeepSeek-V4's compression rates, per kind of compressed attention.
COMPRESS_RATES = {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}
RAISED = {"attn_scale": 1.0}


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
    kind of layer the full model has) and a vocabulary of at most MINIATURE_VOCAB tokens. Everything the config
    keeps per layer is cut to the kept layers: the lists of layer kinds, the per-layer overrides of a heterogeneous
    config (Gemma 4's `per_layer_config`), and layers that reuse the keys and values of earlier ones (Gemma 3n and
    Gemma 4's `num_kv_shared_layers`) keep layers of their own to reuse them from. A config without a depth of
    its own (`num_hidden_layers`: BLT's, set per stack: ProphetNet's) keeps its depth. Sliding windows and
    attention chunks are cut to MINIATURE_WINDOW tokens, shorter than the checks' documents, and the lengths where a
    model switches its computation (`ROTARY_SWITCH`, `SCALES`) between the probe's documents."""
    small = copy.deepcopy(config)
    small_text = text_config(small)
    total = getattr(small_text, "num_hidden_layers", None)
    if isinstance(total, int):
        keep, shared = _kept_layers(small_text, total, min_layers)
        if keep < total:
            _cut_layers(small_text, total, keep, shared)
    _cut_vocabulary(small_text)
    for attribute, cut in {**dict.fromkeys(WINDOWS, MINIATURE_WINDOW), **SCALES}.items():
        value = getattr(small_text, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > cut:
            setattr(small_text, attribute, cut)
    for attribute, floor in RAISED.items():
        value = getattr(small_text, attribute, None)
        if isinstance(value, float) and 0 < value < floor:
            setattr(small_text, attribute, floor)
    rates = getattr(small_text, "compress_rates", None)
    if isinstance(rates, dict):
        small_text.compress_rates = {kind: min(rate, COMPRESS_RATES.get(kind, rate)) for kind, rate in rates.items()}
    _cut_rotary_switches(small_text)
    return small


def _rope_parameter_sets(text: PretrainedConfig) -> list[dict]:
    """The config's rotary parameters: one dict, or one per layer type (Gemma 3's and kin's)."""
    parameters = getattr(text, "rope_parameters", None)
    if not isinstance(parameters, dict):
        return []
    if isinstance(parameters.get("rope_type"), str):
        return [parameters]
    return [value for value in parameters.values() if isinstance(value, dict) and "rope_type" in value]


def _cut_rotary_switches(text: PretrainedConfig) -> None:
    """Move the lengths where a rotary embedding changes its frequencies to ROTARY_SWITCH (see there)."""
    for parameters in _rope_parameter_sets(text):
        if isinstance(parameters.get("original_max_position_embeddings"), int):  # LongRoPE, YaRN, Llama 3, ...
            parameters["original_max_position_embeddings"] = ROTARY_SWITCH
            if isinstance(getattr(text, "original_max_position_embeddings", None), int):
                text.original_max_position_embeddings = ROTARY_SWITCH
        if "dynamic" in parameters["rope_type"]:
            text.max_position_embeddings = ROTARY_SWITCH


def _kept_layers(text: PretrainedConfig, total: int, min_layers: int) -> tuple[int, int]:
    """(layers kept, of which the last ones reuse earlier layers' keys and values)."""
    every_kind = _layer_kinds(text, total)
    keep = min(total, min_layers)
    while keep < total and _layer_kinds(text, keep) != every_kind:
        keep += 1
    shared = getattr(text, "num_kv_shared_layers", None)
    if not isinstance(shared, int) or shared <= 0:
        return keep, 0
    # The last `shared` layers reuse the keys and values of the last layer of their kind before them: the
    # miniature keeps `keep` layers of its own (every kind) followed by as many reusing ones.
    reusing = min(shared, keep)
    return min(total - shared, keep) + reusing, reusing


def _cut_layers(text: PretrainedConfig, total: int, keep: int, shared: int) -> None:
    try:
        text.num_hidden_layers = keep
    except NotImplementedError:  # a depth set per stack (ProphetNet's num_decoder_layers): the whole depth is kept
        return
    if getattr(text, "num_blocks", None) == total:  # xLSTM's own name for its depth (mirrored only at init)
        text.num_blocks = keep
    for attribute in PER_LAYER_KINDS:
        value = getattr(text, attribute, None)
        if isinstance(value, (list, tuple, str)) and len(value) == total and attribute in text.__dict__:
            setattr(text, attribute, value[:keep])
    if shared:
        text.num_kv_shared_layers = shared
    if getattr(text, "is_heterogeneous", False):  # per-layer overrides of the kept layers only
        overrides = text._heterogeneity_spec.per_layer_overrides
        text.per_layer_config = {index: dict(values) for index, values in overrides.items() if index < keep}


def _cut_vocabulary(text: PretrainedConfig) -> None:
    if text.vocab_size <= MINIATURE_VOCAB:
        return
    text.vocab_size = MINIATURE_VOCAB
    # Per-layer input embeddings (Gemma 3n, Gemma 4) are looked up by the same token ids.
    if (getattr(text, "vocab_size_per_layer_input", None) or 0) > MINIATURE_VOCAB:
        text.vocab_size_per_layer_input = MINIATURE_VOCAB
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(text, token, None)
        if isinstance(value, int) and value >= MINIATURE_VOCAB:
            # the last id of the small vocabulary rather than None: some configs type these ids as int (CWM's)
            setattr(text, token, MINIATURE_VOCAB - 1)


def build_miniature(config: PretrainedConfig) -> PreTrainedModel:
    """A random-init fp32 miniature of `config`'s model on the CPU. Some architectures tie or share weights
    across layers by index (Zamba's shared blocks) and cannot be built with fewer layers than their pattern
    spans: one more layer is tried until the model builds (at most the full depth). A model that builds with
    transformers' own attention but not with chattune's (its attention classes are picked from a table by name:
    Falcon, GPT-Neo, GIT), or not at all, is refused."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, type(config).__name__)
    total = getattr(text_config(config), "num_hidden_layers", None)
    depths = range(MINIATURE_LAYERS, total + 1) if isinstance(total, int) and total > MINIATURE_LAYERS else [total]
    for min_layers in depths:
        small = miniature_config(config, min_layers or MINIATURE_LAYERS)
        try:
            model = AutoModelForCausalLM.from_config(small, attn_implementation=ATTENTION_NAME, dtype=torch.float32)
            break
        except Exception as error:  # one refusal below names it, whatever the model's constructor raised
            failure = error
            if _builds_with_stock_attention(small):
                raise UnsupportedModel(
                    f"{name}: its model builds with transformers' own attention but not with chattune's packed "
                    f"attention ({model_code_failure(error, ATTENTION_NAME)}); its attention layers do not go through "
                    "transformers' attention interface, so chattune cannot keep packed documents apart in them"
                ) from error
    else:
        raise UnsupportedModel(
            f"{name}: no causal LM can be built from its config ({model_code_failure(failure, ATTENTION_NAME)})"
        ) from failure
    model.config.use_cache = False
    return model


def _builds_with_stock_attention(config: PretrainedConfig) -> bool:
    try:
        AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    except Exception:  # the model does not build at all: not chattune's attention's doing
        return False
    return True


def check_architecture(
    config: PretrainedConfig,
    device: torch.device | None = None,
    context_group: torch.distributed.ProcessGroup | None = None,
    compute_dtype: str = "float32",
    shared_prompts: bool = False,
) -> None:
    """Refuse (UnsupportedModel) an architecture whose packed forward lets documents see each other or whose
    logits are not hidden @ output_embedding.T, measured on a random-init miniature. The global RNG is left
    as it was, so random-init weights built after the check do not change. Under context parallelism
    (`context_group`, the run's: `ParallelDims.cp_group`) the miniature must also compute a row split across the
    context group as the whole row (`check_context_split`, on `device`). In a `compute_dtype` other than fp32 the
    miniature must also train a packed row in it (`check_compute_dtype`). With `shared_prompts` (data.share_prompts)
    it must compute a reply continuing a shared prompt as after its own copy (`check_shared_prompts`)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MINIATURE_SEED)
        miniature = build_miniature(config)
    device = device or torch.device("cpu")
    choose_mixer_path(device, set(handled_mixers(miniature).values()))
    check_indexed_attention(miniature)  # an indexer chattune does not run per document: refused by name
    with whole_rows(miniature):  # each rank probes the miniature on its own
        check_packing_isolation(miniature)  # first: it turns a failing packed forward into a clear refusal
        check_rotary_tables(miniature, PROBE_LENGTHS)  # switches too small for the probe's tolerance
        _check_output_head(miniature)
        check_stock_attention(miniature)
        check_compute_dtype(miniature, compute_dtype)
        if shared_prompts:
            check_shared_prompts(miniature)
        if device.type == "cuda":
            check_fast_mixers(miniature, device)  # the varlen kernels, where chosen, against the exact path
    group = context_group
    if group is not None:  # collective over the context group: every rank built the same miniature
        context_size = torch.distributed.get_world_size(group)
        check_context_parallel(miniature, context_size)
        check_indexed_context_parallel(miniature, context_size)
        for heads in sorted(set(attention_heads(miniature))):  # per layer: they may differ
            check_heads(heads, context_size, type(miniature).__name__)
        # on the run's device: the group's collectives (nccl on CUDA) take its tensors
        check_context_split(miniature.to(device), group)


# Longer than the miniature's chunks (`SCALES`: 16): xLSTM's chunkwise kernel, where it fails in bf16, runs only past one
# chunk; the probe's documents (PROBE_LENGTHS) never reach it.
DTYPE_CHECK_LENGTHS = (40, 23)


def check_compute_dtype(miniature: PreTrainedModel, compute_dtype: str) -> None:
    """Refuse a model whose own code cannot train in `compute_dtype` (the run's `model.fsdp.param_dtype`, resolved):
    the other checks run in fp32, and some models' kernels mix their own fp32 states with bf16 inputs (xLSTM's
    chunkwise mLSTM: a matmul of a float state and a bf16 key) and would crash at the first step. One packed forward
    and backward of DTYPE_CHECK_LENGTHS, on the CPU in that dtype (a dtype error is the same on CUDA); the numbers
    are not compared here (bf16 against fp32 is the GPU check's)."""
    if compute_dtype == "float32":
        return
    model = copy.deepcopy(miniature).to(getattr(torch, compute_dtype))
    batch = collate_packed(probe_documents(_vocabulary(miniature), lengths=DTYPE_CHECK_LENGTHS))
    try:
        packed_hidden_states(model, batch).float().square().mean().backward()
    except Exception as error:  # the model's own code: any exception it raises is the refusal's cause
        raise UnsupportedModel(
            f"{type(miniature).__name__} cannot train in {compute_dtype} (model.fsdp.param_dtype): "
            f"{model_code_failure(error, ATTENTION_NAME)}. Set model.fsdp.param_dtype=float32 to train it in fp32"
        ) from error


def _vocabulary(miniature: PreTrainedModel) -> int:
    return min(miniature.get_input_embeddings().num_embeddings, text_config(miniature.config).vocab_size)


# The miniature's output layer is scaled by this in the output-layer check: random-init logits are far below any
# softcap (tanh(x / c) · c ≈ x for |x| ≪ c, within the check's tolerance: the caps of NanoChat (15) and Gemma 3n
# (30) went unseen), scaled they saturate it.
HEAD_CHECK_SCALE = 100.0


def _check_output_head(miniature: PreTrainedModel) -> None:
    """`check_output_head` on logits large enough for a softcap to show (HEAD_CHECK_SCALE), the model's own forward
    failing a refusal with the cause rather than a crash."""
    head = miniature.get_output_embeddings().weight
    original = head.detach().clone()
    try:
        with torch.no_grad():
            head.mul_(HEAD_CHECK_SCALE)
        check_output_head(miniature)
    except UnsupportedModel:
        raise
    except Exception as error:  # the model's own forward: any exception it raises is the refusal's cause
        raise UnsupportedModel(
            f"{type(miniature).__name__}: its forward with chattune's attention fails on the output-layer check's "
            f"document (8 tokens): {model_code_failure(error, ATTENTION_NAME)}. chattune cannot check its output "
            "layer, so the model is not supported for training yet"
        ) from error
    finally:
        with torch.no_grad():
            head.copy_(original)


@torch.no_grad()
def check_stock_attention(miniature: PreTrainedModel) -> None:
    """Refuse a model whose forward on one document with chattune's attention differs from its forward with
    transformers' own (eager) attention: what the packing probe cannot see, as it compares chattune's attention with
    itself. Its causal attention per document keeps a sliding window but knows no other mask: chunked attention
    (Llama 4's attention_chunk_size), bidirectional attention or any mask of the model's own would train another
    model. Final hidden states of one document of the probe, fp32, limit
    ALONE_TOLERANCE (the two attentions differ by rounding, ~1e-6)."""
    stock = copy.deepcopy(miniature)
    document = probe_documents(_vocabulary(miniature), lengths=(sum(PROBE_LENGTHS),))
    batch = collate_packed(document)
    was_training = miniature.training
    miniature.eval(), stock.eval()
    try:
        ours = packed_hidden_states(miniature, batch)
        try:
            stock.set_attn_implementation("eager")
            theirs = decoder_of(stock)(input_ids=batch.input_ids, use_cache=False)
        except Exception as error:  # transformers' own forward: whatever it raises, there is nothing to compare with
            logger.warning(
                "%s: transformers' own forward fails on the miniature (%s: %s), so its attention masks are "
                "not compared with chattune's",
                type(miniature).__name__,
                type(error).__name__,
                error,
            )
            return
    finally:
        miniature.train(was_training)
    theirs = theirs.last_hidden_state[0]
    difference = (ours.double() - theirs.double()).norm(dim=-1) / theirs.double().norm(dim=-1).clamp_min(1e-30)
    worst = float(torch.nan_to_num(difference, nan=float("inf")).max())
    if not worst <= ALONE_TOLERANCE:
        raise UnsupportedModel(
            f"{type(miniature).__name__} computes a single document differently with chattune's attention than with "
            f"transformers' own: final hidden states differ by up to {worst:.2e} (limit {ALONE_TOLERANCE:.0e}, one "
            f"document of {batch.num_tokens} tokens, windows and attention chunks of {MINIATURE_WINDOW}). Its "
            "attention masks more than causal attention within a sliding window (chunked or bidirectional "
            "attention, a mask of its own), which chattune's packed attention does not implement yet"
        )
