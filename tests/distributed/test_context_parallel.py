"""Context parallelism (parallel.context): one packed row split across the ranks of a group, attention exchanged
all-to-all (`chattune.parallel.context_parallel`).

- The gradient of a step over a long document (longer than one rank's slice) and a row of several documents (one
  straddling the slice boundaries, a length C does not divide) on C=2 and C=4 ranks equals a plain unpacked Hugging
  Face computation (SFT); a long DPO pair's equals its one-rank gradient, itself checked against the pair computed
  by hand from unpacked forwards. The model is Qwen3-shaped with 8 query and 2 kv heads: C=4 repeats the kv heads.
- A leak control: the same C=2 run with the documents of a row allowed to see each other fails the comparison.
- The start-up split probe passes the model, and refuses it when each slice's positions restart at 0.
- Recipes: 20 world-size-invariant steps on 1 group x C=2 follow the loss curve of 2 ranks x C=1 with the same row
  budget (the C=2 run with activation checkpointing), and so does the held-out loss; a C=2 checkpoint resumes on 1 rank (C=1) with the
  uninterrupted run's remaining losses; DPO with LoRA's first steps agree too. Config checks refuse a context size that does not divide the ranks or the heads.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_sft_recipe import read_metrics

import chattune.model.causal_lm as causal_lm
import conftest
from chattune.config.paths import DEMO_ASSETS
from chattune.config.schema import ParallelConfig
from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed
from chattune.distributed import ParallelDims, exit_process, init_distributed, shutdown_distributed
from chattune.errors import UnsupportedModel
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.checks.packing_probe import check_context_split
from chattune.objectives.cross_entropy import TokenCrossEntropy
from chattune.objectives.dpo import CachedReference, PreferenceObjective
from chattune.objectives.pair_losses import PreferenceLoss
from chattune.parallel import context_parallel
from chattune.parallel.fsdp import shard_model
from chattune.train.step import accumulate_gradients
from conftest import (
    SMALL_MODEL,
    demo_tokenizer,
    free_port,
    init_worker_process_group,
    mesh_dims,
    relative_error,
    spawn,
    tiny_model,
    torchrun,
)

# Qwen3-shaped (q/k norms, head_dim of its own), 8 query heads and 2 kv heads.
QWEN3 = dict(model_type="qwen3", num_attention_heads=8, num_key_value_heads=2, head_dim=16)
LOSS = PreferenceLoss(loss_type="sigmoid", beta=0.1)
REFERENCE = torch.tensor([[-180.0, -170.0]], dtype=torch.float64)  # the pair's (chosen, rejected) reference log-probs
TOLERANCE = 1e-5  # relative gradient error: fp32, the same sums in another order


def model(seed: int = 0):
    return tiny_model(seed=seed, **QWEN3)


def random_document(doc_id: int, length: int, trained_from: int, seed: int, vocab: int) -> Document:
    generator = np.random.default_rng(seed)
    ids = generator.integers(16, vocab, size=length)
    labels = np.full(length, IGNORE_INDEX)
    labels[trained_from : length - 1] = ids[trained_from + 1 :]  # shifted: position i predicts token i+1
    return Document(doc_id, ids, labels)


def sft_rows(vocab: int) -> list[list[Document]]:
    """A row of one long document, and a row of four (201 tokens: C=2 and C=4 pad it) whose second document
    straddles every slice boundary."""
    long = [random_document(0, 160, 20, seed=1, vocab=vocab)]
    several = [random_document(i + 1, n, n // 3, seed=i + 2, vocab=vocab) for i, n in enumerate((37, 90, 51, 23))]
    return [long, several]


def pair_document(vocab: int) -> Document:
    """One preference pair: chosen (120 tokens) then rejected (110), each training its last 40-odd tokens."""
    chosen, rejected = (
        random_document(0, 120, 80, seed=7, vocab=vocab),
        random_document(0, 110, 66, seed=8, vocab=vocab),
    )
    return Document(
        0,
        np.concatenate([chosen.input_ids, rejected.input_ids]),
        np.concatenate([chosen.labels, rejected.labels]),
        segments=(120, 110),
    )


def plain_sft_gradients(rows: list[list[Document]]) -> dict[str, torch.Tensor]:
    """Every document run alone through the stock HF forward (full logits); the mean over all trained tokens."""
    hf_model = model()
    hf_model.set_attn_implementation("sdpa")
    total, tokens = 0.0, 0
    for doc in (d for row in rows for d in row):
        logits = hf_model(input_ids=torch.tensor([doc.input_ids.tolist()]), use_cache=False).logits[0]
        labels = torch.tensor(doc.labels.tolist())
        total = total + F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        tokens += int((labels != IGNORE_INDEX).sum())
    (total / tokens).backward()
    return {name: p.grad for name, p in hf_model.named_parameters()}


def plain_pair_gradients(pair: Document) -> dict[str, torch.Tensor]:
    """The pair's sigmoid DPO loss from each side run alone (stock HF forward), against REFERENCE."""
    hf_model = model()
    hf_model.set_attn_implementation("sdpa")
    n = pair.segments[0]
    logps = []
    for ids, labels in ((pair.input_ids[:n], pair.labels[:n]), (pair.input_ids[n:], pair.labels[n:])):
        logits = hf_model(input_ids=torch.tensor([ids.tolist()]), use_cache=False).logits[0]
        logps.append(
            -F.cross_entropy(logits, torch.tensor(labels.tolist()), ignore_index=IGNORE_INDEX, reduction="sum")
        )
    margin = LOSS.beta * ((logps[0] - REFERENCE[0, 0].float()) - (logps[1] - REFERENCE[0, 1].float()))
    (-F.logsigmoid(margin)).backward()
    return {name: p.grad for name, p in hf_model.named_parameters()}


def leaking_row_slice(batch, context_size, context_rank, slice_multiple=1):
    """The control: each slice's attention sees the whole row as one document."""
    piece = row_slice(batch, context_size, context_rank, slice_multiple)
    length = int(piece.cu_seqlens[-1])
    return dataclasses.replace(piece, cu_seqlens=torch.tensor([0, length], dtype=torch.int32), max_seqlen=length)


row_slice = causal_lm.row_slice


def _gradients(objective, rows, dims: ParallelDims) -> dict[str, torch.Tensor]:
    policy = PackedCausalLM(model(), loss_chunk_size=64, context_group=dims.cp_group)
    placement = shard_model(policy, dims)
    policy.train()
    accumulate_gradients(policy, objective, StepBatches([collate_packed(row) for row in rows]), placement)
    return {name.removeprefix("hf_model."): p.grad.full_tensor().clone() for name, p in policy.named_parameters()}


def _probe_refusals(dims: ParallelDims) -> list[str | None]:
    """The start-up split probe on the model as it is, and on slices whose positions restart at 0 (what a model
    that reads positions from its input's length, not its position ids, would compute): its refusals."""
    refusals = []
    for positions_restart in (False, True):
        original = context_parallel.row_slice
        if positions_restart:
            context_parallel.row_slice = lambda *args: dataclasses.replace(
                original(*args), position_ids=torch.arange(original(*args).num_tokens).unsqueeze(0)
            )
        try:
            check_context_split(model(), dims.cp_group)
            refusals.append(None)
        except UnsupportedModel as error:
            refusals.append(str(error))
        finally:
            context_parallel.row_slice = original
    return refusals


def _worker(rank: int, world_size: int, port: int, out_path: str, leak: bool) -> None:
    init_worker_process_group(rank, world_size, port)
    dims = init_distributed("cpu", ParallelConfig(context=world_size))  # one context group of every rank
    vocab = len(demo_tokenizer())
    got = {
        "sft": _gradients(TokenCrossEntropy(), sft_rows(vocab), dims),
        "dpo": _gradients(PreferenceObjective(LOSS, CachedReference(REFERENCE)), [[pair_document(vocab)]], dims),
    }
    if leak:
        causal_lm.row_slice = leaking_row_slice
        got["sft_leaking"] = _gradients(TokenCrossEntropy(), sft_rows(vocab), dims)
        got["probe"] = _probe_refusals(dims)
    if rank == 0:
        torch.save(got, out_path)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_long_documents_split_across_ranks_train_as_on_one(tmp_path, one_rank_group):
    vocab = len(demo_tokenizer())
    want = {"sft": plain_sft_gradients(sft_rows(vocab)), "dpo": plain_pair_gradients(pair_document(vocab))}
    # DPO's gradient is a difference of the two sides' log-prob gradients, which largely cancel: fp32 rounding of
    # the packed path against the unpacked one is 9e-6 of it here on one rank already. So the split runs are held
    # to the one-rank gradient of the same path, which is held to the unpacked computation.
    one_rank = _gradients(PreferenceObjective(LOSS, CachedReference(REFERENCE)), [[pair_document(vocab)]], mesh_dims())
    assert relative_error(one_rank, want["dpo"]) <= 2e-5
    for context in (2, 4):
        out_path = str(tmp_path / f"c{context}.pt")
        spawn(_worker, args=(context, free_port(), out_path, context == 2), nprocs=context)
        got = torch.load(out_path)
        for objective, reference in (("sft", want["sft"]), ("dpo", one_rank)):
            error = relative_error(got[objective], reference)
            print(f"C={context} {objective}: relative gradient error {error:.2e}")
            assert error <= TOLERANCE, f"C={context} {objective}: relative gradient error {error:.3g}"
        if context == 2:  # the control: documents that see each other across the row are caught
            leaking = relative_error(got["sft_leaking"], want["sft"])
            print(f"C=2 with documents seeing each other: relative gradient error {leaking:.2e}")
            assert leaking > 1e-3
            as_it_is, positions_restart = got["probe"]
            assert as_it_is is None
            assert "computes a packed row split across the 2 ranks of parallel.context differently" in positions_restart


# --- the recipes ---

STEPS = 20
ROW = 512  # tokens of a row: data.max_tokens_per_microbatch x parallel.context


def launch(
    out: Path,
    nproc: int,
    context: int,
    *overrides: str,
    recipe: str = "sft",
    steps: int = STEPS,
    evaluate: bool = False,
) -> list[float]:
    """The run's training losses. `evaluate`: the held-out loss at steps 0, 10 and 20 (else none)."""
    conftest.launch(
        torchrun(
            f"recipes/{recipe}.py",
            *SMALL_MODEL,
            f"output_dir={out}",
            f"max_steps={steps}",
            "log_every=1",
            *(["eval_every=10"] if evaluate else ["eval_every=0", "data.eval=[]"]),
            "save_every=0",
            "data.microbatches_per_step=2",
            "data.buffer_records=8",
            "data.report_records=0",
            f"parallel.context={context}",
            f"data.max_tokens_per_microbatch={ROW // context}",
            *overrides,
            nproc=nproc,
        )
    )
    return [m["loss"] for m in read_metrics(out)]


def assert_same_curve(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst <= TOLERANCE, f"{what}: relative difference {worst:.2e}"


@pytest.mark.launch
def test_a_context_group_follows_the_data_parallel_loss_curve_and_resumes_on_one_rank(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join((DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines(keepends=True)[:40]))
    data = f"data.train=[{chats}]"
    data_parallel = launch(tmp_path / "dp2", 2, 1, data, evaluate=True)
    # (with activation checkpointing: the recomputed forward runs the exchange again)
    context_parallel = launch(
        tmp_path / "cp2", 2, 2, data, "save_every=10", "model.fsdp.activation_checkpointing=true", evaluate=True
    )
    assert len(set(data_parallel)) > 5, "the loss should move"
    assert_same_curve(context_parallel, data_parallel, "1 group x C=2 against 2 ranks x C=1")
    held_out = [
        [m["eval_loss"] for m in read_metrics(tmp_path / run, include_start=True) if "eval_loss" in m]
        for run in ("cp2", "dp2")
    ]
    assert len(held_out[1]) == 3
    assert_same_curve(*held_out, "the held-out loss at steps 0, 10 and 20")

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "cp2" / "checkpoints" / "step_10", resumed / "checkpoints" / "step_10")
    got = launch(resumed, 1, 1, data)
    assert_same_curve(got, context_parallel[10:], "a C=2 checkpoint resumed on 1 rank (C=1)")


@pytest.mark.launch
def test_dpo_with_lora_trains_the_same_pairs_split_across_a_context_group(tmp_path):
    # LoRA: the reference is the policy's base with the adapters off, a second forward through the same exchange
    overrides = ["model.path=null", "reference.cache=false", "peft=lora", "optimizer.lr=1e-2"]
    want = launch(tmp_path / "dp2", 2, 1, *overrides, recipe="dpo", steps=6)
    got = launch(tmp_path / "cp2", 2, 2, *overrides, recipe="dpo", steps=6)
    assert_same_curve(got, want, "DPO: 1 group x C=2 against 2 ranks x C=1")


def test_a_context_size_must_divide_the_ranks_and_the_heads():
    from test_validate import compose_config

    from chattune.launch.recipe_kinds import SFT
    from chattune.launch.validate import ConfigError, check_config

    cfg = compose_config("sft/tiny", ["parallel.context=4"])  # the tiny model has 6 heads
    with pytest.raises(ConfigError) as caught:
        check_config(cfg, SFT, world_size=2)
    message = str(caught.value)
    assert "parallel.context: 4 does not divide the 2 ranks" in message
    assert "does not divide the model's 6 attention heads" in message
    cfg = compose_config("sft/tiny", ["parallel.context=2", "data.microbatches_per_step=3", "grad_accum_steps=1"])
    with pytest.raises(
        ConfigError,
        match=r"3 cannot be dealt to 2 data-parallel ranks: the number of ranks divided by "
        r"parallel.context=2 \(2\) must divide it",
    ):
        check_config(cfg, SFT, world_size=4)
    check_config(compose_config("sft/tiny", ["parallel.context=2"]), SFT, world_size=2)  # fine


def test_a_resume_accepts_another_context_size_only_with_world_size_invariant_steps(tmp_path):
    from test_validate import CONFIGS, compose_config, fake_checkpoint, problems

    from chattune.checkpoint.resume import run_fingerprint
    from chattune.launch.validate import run_validate

    per_rank = [f"output_dir={tmp_path}"]
    checkpoint = fake_checkpoint(
        tmp_path, {"world_size": 2, "step": 5, "fingerprint": run_fingerprint(compose_config("sft/tiny", per_rank))}
    )
    report, ok = run_validate("sft/tiny", [*per_rank, "parallel.context=2"], CONFIGS, world_size=2)
    assert problems(report) == [
        f"resume: {checkpoint} was written with parallel.context=1, this run has 2: the data-parallel ranks (ranks / "
        "parallel.context) each hold a place in their own share of the epoch, and another context size would share "
        "it differently. Relaunch with parallel.context=1 (runs with data.microbatches_per_step resume with any "
        "layout of ranks)."
    ], report
    report, ok = run_validate("sft/tiny", [*per_rank, "parallel.context=1"], CONFIGS, world_size=2)  # the remedy
    assert ok, report

    invariant = tmp_path / "invariant"
    written = [f"output_dir={invariant}", "data.microbatches_per_step=2"]
    fake_checkpoint(
        invariant,
        {
            "world_size": 2,
            "step": 5,
            "fingerprint": run_fingerprint(
                compose_config("sft/tiny", [*written, "parallel.context=2", "data.max_tokens_per_microbatch=1024"])
            ),
        },
    )
    report, ok = run_validate("sft/tiny", [*written, "data.max_tokens_per_microbatch=2048"], CONFIGS, world_size=1)
    assert ok, report
    assert (
        "note: resume: config data.max_tokens_per_microbatch: 1024 -> 2048 with parallel.context 2 -> 1: the same "
        "row budget"
    ) in report
    # Another row budget packs other rows: refused like any change of what is trained
    report, ok = run_validate("sft/tiny", [*written, "data.max_tokens_per_microbatch=1024"], CONFIGS, world_size=1)
    assert (
        not ok and "config parallel.context: 2 -> 1" in report and "resume_allow_changes=[parallel.context]" in report
    )


# gpt-oss: attention sinks (one per query head) and sliding windows; 8 query heads so each rank holds 4 of them.
GPT_OSS = dict(
    model_type="gpt_oss",
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention"],
)


def _gpt_oss_model():
    hf_model = tiny_model(seed=0, **GPT_OSS)
    with torch.no_grad():  # sinks far from 0 and unequal per head: a rank given another rank's heads' sinks shows
        for name, parameter in hf_model.named_parameters():
            if name.endswith("sinks"):
                parameter.copy_(torch.linspace(-2.0, 3.0, parameter.numel()))
    return hf_model


def _sink_worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    init_worker_process_group(rank, world_size, port)
    dims = init_distributed("cpu", ParallelConfig(context=world_size))
    policy = PackedCausalLM(_gpt_oss_model(), loss_chunk_size=64, context_group=dims.cp_group)
    placement = shard_model(policy, dims)
    policy.train()
    rows = sft_rows(len(demo_tokenizer()))
    accumulate_gradients(policy, TokenCrossEntropy(), StepBatches([collate_packed(row) for row in rows]), placement)
    grads = {name.removeprefix("hf_model."): p.grad.full_tensor().clone() for name, p in policy.named_parameters()}
    check_context_split(_gpt_oss_model(), dims.cp_group)  # the start-up probe passes it too
    if rank == 0:
        torch.save(grads, out_path)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_attention_sinks_split_across_a_context_group_train_as_on_one(tmp_path):
    """Each rank of the group attends with its share of the heads, and must take those heads' sinks."""
    rows = sft_rows(len(demo_tokenizer()))
    stock = _gpt_oss_model()
    stock.set_attn_implementation("eager")
    total, tokens = 0.0, 0
    for document in (d for row in rows for d in row):
        logits = stock(input_ids=torch.tensor(document.input_ids).unsqueeze(0)).logits[0]
        labels = torch.tensor(document.labels)
        total = total + F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        tokens += int((labels != IGNORE_INDEX).sum())
    (total / tokens).backward()
    want = {name: p.grad for name, p in stock.named_parameters()}
    out_path = str(tmp_path / "sinks.pt")
    spawn(_sink_worker, args=(2, free_port(), out_path), nprocs=2)
    got = torch.load(out_path)
    assert relative_error(got["model.layers.0.self_attn.sinks"], want["model.layers.0.self_attn.sinks"]) <= TOLERANCE
    assert relative_error(got, want) <= TOLERANCE


def _positions_worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    """Each family's start-up checks under a context group of `world_size` (their `check_context_split` included);
    then the split check of a LongRoPE miniature whose rotary reads its input whole, as transformers' does."""
    from test_every_architecture import THRESHOLDS, tiny_config

    from chattune.model.checks.architecture import build_miniature, check_architecture
    from chattune.model.packed import isolation, rotary

    init_worker_process_group(rank, world_size, port)
    dims = init_distributed("cpu", ParallelConfig(context=world_size))
    outcomes = {}
    for name in ("phi3-longrope", "llama-dynamic", "llama4_text-chunks"):
        model_type, change, _ = THRESHOLDS[name]
        config = change(tiny_config(model_type))
        check_architecture(config, context_group=dims.cp_group)
        outcomes[name] = "accepted"
    model_type, change, _ = THRESHOLDS["phi3-longrope"]
    torch.manual_seed(0)  # the same miniature on every rank, as check_architecture builds it
    miniature = build_miniature(change(tiny_config(model_type)))
    try:
        with isolation.leaking(
            rotary.ROTARIES
        ):  # each rank's slice picks its own factors, from its own largest position
            check_context_split(miniature, dims.cp_group)
        outcomes["whole-row rotary"] = "accepted"
    except UnsupportedModel as refusal:
        outcomes["whole-row rotary"] = str(refusal)
    if rank == 0:
        torch.save(outcomes, out_path)
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_positions_that_depend_on_the_document_split_across_a_context_group(tmp_path):
    """Under context parallelism each rank holds a slice of the row with the row's position ids: LongRoPE's and
    dynamic NTK's per-document tables and Llama 4's chunks and temperature must come from each document's length and
    start in the whole row. The start-up check of the split row (`check_context_split`, on the probe's row of
    documents of 11, 9 and 11 tokens, the switches between their lengths) accepts all three on 4 ranks; a rotary
    that reads its input whole picks its factors from each rank's slice (the first quarter reaches position 7, the
    row 10), which the split check refuses. On 2 ranks both halves reach position 10, as the row does, and that
    rotary would pick the row's factors: so 4 ranks. The miniature is seeded: ranks with different weights would
    be refused for that alone."""
    out_path = str(tmp_path / "outcomes.pt")
    spawn(_positions_worker, args=(4, free_port(), out_path), nprocs=4)
    outcomes = torch.load(out_path)
    assert {name: outcomes[name] for name in ("phi3-longrope", "llama-dynamic", "llama4_text-chunks")} == dict.fromkeys(
        ("phi3-longrope", "llama-dynamic", "llama4_text-chunks"), "accepted"
    )
    assert "split across the 4 ranks of parallel.context differently" in outcomes["whole-row rotary"]


def test_a_padded_row_slice_copies_nothing_from_the_host():
    """A row that C does not divide is padded on its own device: a tensor built on the host and copied over (from
    pageable memory) waits for the device, two syncs a microbatch. Shown on the meta device, where any such copy is
    an operation that takes a CPU tensor and returns a meta one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    copies = []

    class HostCopies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(t.device.type == "cpu" and t.dim() > 0 for t in inputs) and any(
                t.device.type == "meta" for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
            ):
                copies.append(str(func))
            return out

    documents = [Document(0, np.arange(1, 8), np.arange(2, 9)), Document(1, np.arange(5, 8), np.full(3, IGNORE_INDEX))]
    batch = collate_packed(documents).to("meta")
    assert batch.num_tokens % 4
    with HostCopies():
        piece = context_parallel.row_slice(batch, 4, 3)
    assert copies == [] and piece.input_ids.shape == (1, 3) and piece.cu_seqlens.shape == (4,)
