"""Start-up probe: refuse a model whose packed forward lets a document see the documents before it.

chattune trains on packed rows: several documents back to back in one (1, N) row, kept apart by
`cu_seqlens` and by position ids that restart at 0 per document. The attention function sees `cu_seqlens`,
and so do the token mixers `chattune.model.packed.mixers` knows (the short convolutions, Mamba SSMs and linear
attention of Qwen3.5, Nemotron-H, LFM2, ...). Any other layer that mixes tokens along the sequence (MiniMax's
lightning attention, RWKV, a mixer of a new architecture, ...) runs over the whole row, so a document's hidden
states depend on the documents packed before it, and packed training trains something else than the model
run on one document at a time. The measurements below were made with the mixers over the whole row
(`chattune.model.packed.isolation.leaking`).

`check_packing_isolation` measures this rather than trusting a list of model types. It runs the decoder
exactly as `PackedCausalLM.forward` does on two packed rows of three short documents, [A, B, C] and
[C, B, A] (A and C of equal length, so B sits at the same offset of rows of the same shape), and on A and
B alone (rows of one document), and compares final hidden states per token, relative to their norm
(max over the document's tokens). Measured on random-init models built from configs (fp32, CPU):

- noise: A first in [A, B, C] vs A alone. Nothing precedes A, so this is the model's rounding between
  rows of different lengths (matmul blocking, MoE expert grouping): 2e-8 to 3e-6 on ordinary models up
  to 1B parameters, 1.4e-4 on a 3B Gemma-4. Above ALONE_TOLERANCE the output depends on the rest of the
  row (5e-3 to 1.4 on legacy models that bypass the registered attention function: BLOOM, XGLM, XLM,
  BigBird, RoFormer, ...): refused.
- swap: B after A vs B after C. Same tokens at the same place in rows of the same shape; only the
  document before B changes. Every dense ordinary model computes B bit for bit the same (0); MoE routing
  of A and C regroups expert matmuls (up to 5e-7, 2.5e-5 on a 0.9B Gemma-4 MoE, never above its noise).
  A layer that reads across the boundary shows even with random weights: 7e-4 for a 2-layer LFM2 whose
  one conv layer comes last (the smallest leak seen), 2e-3 to 1e-2 for LFM2, Falcon-H1, Jamba, Zamba,
  0.1 to 1.4 for Mamba(2), Bamba, Granite-MoE-hybrid, Nemotron-H, MiniMax, Kimi-Linear, RWKV, xLSTM.
- alone: B after A vs B alone. Also catches what changes no content, such as learned absolute positions
  that ignore position_ids (BART-style decoders: ~1): refused above ALONE_TOLERANCE.

The swap and alone limits rise to NOISE_FACTOR times the measured noise, so a model whose rounding is
amplified (deep random-init Gemma-4) is not refused for rounding. The probe runs whatever paths the
model takes on the device it is on: on CPU, the torch fallbacks of the SSM / conv kernels.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.packing import collate_packed
from chattune.errors import UnsupportedModel, UserError
from chattune.model.checks.code_failures import model_code_failure, where_it_fails
from chattune.model.packed import mixers
from chattune.model.packed.attention import ATTENTION_NAME, packed_hidden_states
from chattune.parallel.context_parallel import split_across, split_hidden_states, whole_rows

# A, B, C. A and C have the same length: swapping them keeps B at the same offset.
PROBE_LENGTHS = (11, 9, 11)
# Limits on max-over-tokens ||got - want|| / ||want|| of fp32 final hidden states (measurements in the
# module docstring and tests/unit/model/checks/test_packing_probe.py).
SWAP_TOLERANCE = 1e-5
ALONE_TOLERANCE = 1e-3
NOISE_FACTOR = 10.0

# CamelCase pieces of class names of modules that look like token mixers other than attention (used for
# the error message only): Lfm2ShortConv, MambaMixer, Qwen3NextGatedDeltaNet, MiniMaxLightningAttention...
_MIXER_NAME = re.compile(
    r"Conv|Mamba|Mixer|SSM|Ssm|Delta|LinearAttention|LinearAttn|Lightning|Recurren|Rglru|Rwkv|LSTM|Kda|KDA|"
    r"Retention|Hyena|TimeMix"
)
# Whole layers and models (which contain the mixers), norms and embeddings: never reported themselves.
_NOT_A_MIXER = re.compile(r"DecoderLayer|Block$|Model$|ForCausalLM$|ForConditionalGeneration$|PreTrained|Norm|Embed")


@dataclass(frozen=True)
class Difference:
    """How far one document's final hidden states moved between two runs."""

    max_relative: float  # max over its tokens of ||got - want|| / ||want||
    position: int  # the token (0-based, within the document) where the max is


@dataclass(frozen=True)
class ProbeResult:
    noise: Difference  # A first in [A, B, C] vs A alone
    swapped: Difference  # B in [A, B, C] vs B in [C, B, A]
    alone: Difference  # B in [A, B, C] vs B alone

    @property
    def swap_limit(self) -> float:
        return max(SWAP_TOLERANCE, NOISE_FACTOR * self.noise.max_relative)

    @property
    def alone_limit(self) -> float:
        return max(ALONE_TOLERANCE, NOISE_FACTOR * self.noise.max_relative)

    @property
    def isolated(self) -> bool:
        return (
            self.noise.max_relative <= ALONE_TOLERANCE
            and self.swapped.max_relative <= self.swap_limit
            and self.alone.max_relative <= self.alone_limit
        )  # NaN fails


def probe_documents(vocab_size: int, lengths: tuple[int, ...] = PROBE_LENGTHS) -> list[Document]:
    """Deterministic documents of scattered token ids (ids below 16, often special tokens, avoided where
    the vocabulary allows)."""
    low = 16 if vocab_size > 64 else 0
    docs, offset = [], 0
    for index, length in enumerate(lengths):
        k = np.arange(offset, offset + length, dtype=np.int64)
        ids = low + (7 + 131 * k + 17 * k * k) % (vocab_size - low)
        docs.append(Document(doc_id=index, input_ids=ids, labels=np.full(length, IGNORE_INDEX)))
        offset += length
    return docs


def _difference(got: torch.Tensor, want: torch.Tensor) -> Difference:
    got, want = got.double(), want.double()
    relative = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(torch.finfo(torch.float64).tiny)
    relative = torch.nan_to_num(relative, nan=float("inf"))
    worst = int(relative.argmax())
    return Difference(float(relative[worst]), worst)


def _vocab_size(hf_model: PreTrainedModel) -> int:
    """The token ids the probe may draw: the embedding rows the config's vocabulary really uses."""
    embeddings = hf_model.get_input_embeddings()
    return min(
        embeddings.num_embeddings,
        getattr(hf_model.config.get_text_config(), "vocab_size", None) or embeddings.num_embeddings,
    )


@torch.no_grad()
def _stock_failure(hf_model: PreTrainedModel) -> Exception | None:
    """What stock transformers raises on one short document, or None: a fresh model of the same class and config
    built with eager attention (the path every model's own code supports, and the architecture walk's reference),
    no packing."""
    a, _, _ = probe_documents(_vocab_size(hf_model))
    try:
        with torch.random.fork_rng(devices=[]):
            stock = type(hf_model)._from_config(copy.deepcopy(hf_model.config), attn_implementation="eager").eval()
        stock(input_ids=torch.tensor([a.input_ids.tolist()]), use_cache=False)
    except Exception as error:  # the model's own code on its own path: returned for the caller's message
        return error
    return None


@torch.no_grad()
def probe_packing(hf_model: PreTrainedModel) -> ProbeResult:
    """The three measurements of the module docstring (four forwards of 9 to 31 tokens). Eval mode
    during the probe, the training mode restored after. Exceptions of the model's forward propagate."""
    device = hf_model.get_input_embeddings().weight.device
    a, b, c = probe_documents(_vocab_size(hf_model))

    def packed(documents: list[Document]) -> torch.Tensor:
        return packed_hidden_states(hf_model, collate_packed(documents).to(device))  # as PackedCausalLM.forward

    was_training = hf_model.training
    hf_model.eval()
    try:
        abc, cba, a_alone, b_alone = packed([a, b, c]), packed([c, b, a]), packed([a]), packed([b])
    finally:
        hf_model.train(was_training)
    b_at = slice(len(a), len(a) + len(b))
    return ProbeResult(
        noise=_difference(abc[: len(a)], a_alone),
        swapped=_difference(abc[b_at], cba[b_at]),
        alone=_difference(abc[b_at], b_alone),
    )


def sequence_mixers(hf_model: PreTrainedModel) -> list[str]:
    """Class names (with counts) of modules that look like token mixers other than attention: modules
    holding a Conv1d, or names such as *ShortConv, *MambaMixer, *GatedDeltaNet, *LightningAttention, read
    without the model's own prefix (RecurrentGemmaMlp is no recurrence) unless nothing else matches
    (RwkvSelfAttention is RWKV's time mixing)."""
    family = re.sub(r"For[A-Z]\w*$", "", type(hf_model).__name__)  # Lfm2ForCausalLM -> Lfm2
    holding_conv: Counter[str] = Counter()
    by_name: Counter[str] = Counter()
    by_prefixed_name: Counter[str] = Counter()
    for module in hf_model.modules():
        name = type(module).__name__
        # torch's own convolutions are reported through the module holding them; GPT-2's Conv1D is a Linear.
        if _NOT_A_MIXER.search(name) or isinstance(module, (nn.modules.conv._ConvNd, Conv1D)):
            continue
        if any(isinstance(child, nn.Conv1d) for child in module.children()):
            holding_conv[name] += 1
        elif _MIXER_NAME.search(name.removeprefix(family)):
            by_name[name] += 1
        elif _MIXER_NAME.search(name):
            by_prefixed_name[name] += 1
    found = holding_conv + by_name or by_prefixed_name
    return [f"{name} x{count}" for name, count in found.items()]


def layer_kinds(hf_model: PreTrainedModel) -> str | None:
    """The config's per-layer kinds (layer_types, layers_block_type, ...) counted, if it lists them."""
    config = hf_model.config.get_text_config()
    for attribute in ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern"):
        value = getattr(config, attribute, None)
        if value:
            return f"config.{attribute}: " + ", ".join(f"{kind} x{count}" for kind, count in Counter(value).items())
    return None


def check_packing_isolation(hf_model: PreTrainedModel) -> None:
    """Refuse (UnsupportedModel, a NotImplementedError) a model whose final hidden states for a document change when it is
    packed after another document, as chattune trains it, or whose packed forward fails. Four forwards
    of 9 to 31 tokens. The builder runs it on a random-init miniature of the model
    (`chattune.model.checks.architecture`), like check_output_head."""
    name = type(hf_model).__name__
    try:
        result = probe_packing(hf_model)
    except Exception as error:
        stock = _stock_failure(hf_model)
        if stock is not None:  # not chattune's packing: the model does not run with this config at all
            raise UserError(
                f"{name} fails in stock transformers on a single document with this config, "
                f"{where_it_fails(stock)}: the config is wrong (model.config, or model.path's config.json), not the "
                "packing"
            ) from stock
        raise UnsupportedModel(
            f"{name} cannot run chattune's packed forward (one row of several documents: position ids "
            f"restarting per document, cu_seq_lens_q/k, max_length_q/k): {model_code_failure(error, ATTENTION_NAME)}. "
            "chattune trains only on packed rows, so this model is not supported for training yet."
        ) from error
    if result.isolated:
        return
    lengths = "+".join(str(n) for n in PROBE_LENGTHS)
    findings = []
    if not result.swapped.max_relative <= result.swap_limit:
        findings.append(
            f"document B changes by up to {result.swapped.max_relative:.2e} (at its token {result.swapped.position}) "
            f"when the document packed before it is replaced by another of the same length (limit "
            f"{result.swap_limit:.1e}; exactly 0 for a dense model that keeps documents apart)"
        )
    if not result.alone.max_relative <= result.alone_limit:
        findings.append(
            f"document B packed after A differs from B alone by up to {result.alone.max_relative:.2e} (at its token "
            f"{result.alone.position}; limit {result.alone_limit:.1e})"
        )
    if not result.noise.max_relative <= ALONE_TOLERANCE:
        findings.append(
            f"even document A, with nothing packed before it, differs from A alone by up to "
            f"{result.noise.max_relative:.2e} (at its token {result.noise.position}; limit {ALONE_TOLERANCE:.0e}): "
            "the output depends on the rest of the row"
        )
    mixers, kinds = sequence_mixers(hf_model), layer_kinds(hf_model)
    if mixers:
        cause = (
            f"Its sequence layers other than attention ({', '.join(mixers)}{'; ' + kinds if kinds else ''}) "
            "run over the whole packed row and ignore the document boundaries (cu_seqlens), so packed training "
            "would let every document see the ones before it"
        )
    else:
        cause = (
            f"No module looks like a convolution, SSM or linear-attention mixer{' (' + kinds + ')' if kinds else ''}: "
            "the model mixes tokens outside the attention function, ignores position_ids or depends on the row, "
            "so packed training would train a different model than the one run on a single document"
        )
    raise UnsupportedModel(
        f"{name} does not keep packed documents apart. Probe rows of documents A, B, C ({lengths} tokens), "
        f"final hidden states relative to their norm: {'; '.join(findings)}. {cause}. chattune trains only on "
        "packed rows (packing cannot be turned off), so this model is not supported for training yet; models "
        "whose only sequence mixing is softmax attention (Llama, Qwen2/3, Mistral, Gemma, Phi-3, OLMo, ...) are."
    )


def check_context_split(hf_model: PreTrainedModel, group) -> None:
    """Under context parallelism (`chattune.parallel.context_parallel`): refuse a model whose packed row, split
    across the ranks of `group` (each its slice, attention exchanged), does not compute what the row run whole
    computes. Every rank of the group runs it on the same miniature, at start-up. One probe row [A, B, C] (31
    tokens) has document boundaries inside the slices and documents straddling them for any group size; the
    limit is the probe's ALONE_TOLERANCE (the split changes only the shapes the matmuls see)."""
    batch = collate_packed(probe_documents(_vocab_size(hf_model))).to(hf_model.get_input_embeddings().weight.device)
    was_training = hf_model.training
    hf_model.eval()
    try:
        with torch.no_grad(), whole_rows(hf_model):
            whole = packed_hidden_states(hf_model, batch)
        with split_across(hf_model, group):
            split = split_hidden_states(lambda piece: packed_hidden_states(hf_model, piece), batch, group)
    finally:
        hf_model.train(was_training)
    difference = _difference(split, whole)
    if not difference.max_relative <= ALONE_TOLERANCE:
        raise UnsupportedModel(
            f"{type(hf_model).__name__} computes a packed row split across the {torch.distributed.get_world_size(group)} "
            f"ranks of parallel.context differently from the whole row: final hidden states differ by up to "
            f"{difference.max_relative:.2e} (at token {difference.position} of {batch.num_tokens}; limit "
            f"{ALONE_TOLERANCE:.0e}). Its layers read more of the row than their own tokens and position ids; train it "
            "with parallel.context=1"
        )


# The varlen kernels against the per-document path on the device, in bf16: a few units of bf16's precision.
FAST_MIXER_TOLERANCE = 3e-2


def check_fast_mixers(hf_model: PreTrainedModel, device: torch.device) -> None:
    """Where a varlen path was chosen for the model's mixers (`chattune.model.packed.mixers.choose_mixer_path`): run the
    probe's rows through a bf16 copy of the miniature on `device` both ways, its mixers in training mode (the
    fused Mamba-2 kernel is the training path); a varlen path that fails or differs from the per-document path
    by more than FAST_MIXER_TOLERANCE is dropped for the per-document path, with a warning that says what was
    measured."""
    if not mixers.varlen_kinds():
        return
    batch = collate_packed(probe_documents(_vocab_size(hf_model))).to(device)
    model = copy.deepcopy(hf_model).to(device=device, dtype=torch.bfloat16).eval()
    for module in model.modules():
        if type(module).__name__ in mixers.HANDLED:
            module.train()
    try:
        with torch.no_grad():
            fast = packed_hidden_states(model, batch)
            with mixers.per_document():
                exact = packed_hidden_states(model, batch)
    except Exception as error:  # a kernel that refuses the row: the exact path instead, said
        mixers.fall_back_to_per_document(f"they failed on the probe's packed row ({type(error).__name__}: {error})")
        return
    difference = _difference(fast, exact)
    if not difference.max_relative <= FAST_MIXER_TOLERANCE:
        mixers.fall_back_to_per_document(
            f"on the probe's packed row they differ from the per-document path by up to {difference.max_relative:.2e} "
            f"(limit {FAST_MIXER_TOLERANCE:.0e}, bf16 on {device})"
        )


# The shared-prompt probe: a prompt, two replies, and a document packed before them (`check_shared_prompts`).
SHARED_PROBE_LENGTHS = (9, 6, 5, 11)  # prompt, first reply, second reply, the document before


@torch.no_grad()
def probe_shared_prompts(hf_model: PreTrainedModel) -> tuple[Difference, Difference]:
    """(noise, shared): the row [D][prompt + X][Y continuing the prompt] against the unshared [D][prompt + X][prompt
    + Y], final hidden states relative to their norm: noise over D and prompt + X (the same tokens at the same
    places in rows of other lengths), shared over Y."""
    device = hf_model.get_input_embeddings().weight.device
    prompt, x, y, before = (d.input_ids for d in probe_documents(_vocab_size(hf_model), SHARED_PROBE_LENGTHS))
    untrained = np.full(len(prompt) + len(x) + len(y) + len(prompt), IGNORE_INDEX)
    first = np.concatenate([prompt, x])
    d = Document(doc_id=0, input_ids=before, labels=np.full(len(before), IGNORE_INDEX))
    unshared = Document(1, np.concatenate([first, prompt, y]), untrained, segments=(len(first), len(prompt) + len(y)))
    shared = Document(
        1,
        np.concatenate([first, y]),
        untrained[: len(first) + len(y)],
        segments=(len(first), len(y)),
        shared_prefix=len(prompt),
    )
    was_training = hf_model.training
    hf_model.eval()
    try:
        want = packed_hidden_states(hf_model, collate_packed([d, unshared]).to(device))
        got = packed_hidden_states(hf_model, collate_packed([d, shared]).to(device))
    finally:
        hf_model.train(was_training)
    common = len(before) + len(first)
    return _difference(got[:common], want[:common]), _difference(got[common:], want[common + len(prompt) :])


def check_shared_prompts(hf_model: PreTrainedModel) -> None:
    """Refuse (UnsupportedModel) a model that does not compute a reply continuing a shared prompt (data.share_prompts)
    as the reply after its own copy of the prompt: its layers other than attention (a convolution's or an SSM's state
    would have to be handed from the prompt to each reply: refused by kind, unmeasured), or anything the probe
    (`probe_shared_prompts`) sees differ beyond SWAP_TOLERANCE (raised to NOISE_FACTOR times the row's own rounding)."""
    name = type(hf_model).__name__
    kinds = sorted(set(mixers.handled_mixers(hf_model).values()))
    if kinds:
        raise UnsupportedModel(
            f"{name}: shared prompts (data.share_prompts) need each reply to start from the prompt's state, and its "
            f"{', '.join(kinds)} layers keep a state per document that chattune does not hand from a prompt to its "
            "replies yet; set data.share_prompts=false"
        )
    try:
        noise, shared = probe_shared_prompts(hf_model)
    except UnsupportedModel:
        raise
    except Exception as error:  # the model's own code on a shared row: the refusal's cause
        raise UnsupportedModel(
            f"{name} cannot run a row whose replies share a prompt (data.share_prompts): "
            f"{model_code_failure(error, ATTENTION_NAME)}; set data.share_prompts=false"
        ) from error
    limit = max(SWAP_TOLERANCE, NOISE_FACTOR * noise.max_relative)
    if not shared.max_relative <= limit:
        raise UnsupportedModel(
            f"{name} computes a reply that continues a shared prompt differently from the reply after its own copy "
            f"of the prompt: final hidden states differ by up to {shared.max_relative:.2e} (at its token "
            f"{shared.position}; limit {limit:.1e}). Some layer reads the row by more than its attention's key "
            "ranges and position ids, or does not pass the row's arguments on to its attention (StableLM's and "
            "Nemotron's decoder layers do not: their attention never learns of the prompt); set data.share_prompts=false"
        )
