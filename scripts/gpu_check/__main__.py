"""Verify chattune's GPU path in one command, on one GPU: one JSON file and one markdown table, a row per
check, PASS / FAIL / SKIP with its figure.

    python scripts/gpu_check.py [--out DIR] [--assets DIR] [--only ITEM ...]     # one GPU (the default device)
    python scripts/gpu_check.py --budget 540 [--estimate-scale F]                # within 540 s (+ 20 s margin)
    python scripts/gpu_check.py --device cpu                                      # the CPU smoke test (CI runs it)

Items, most valuable first (what `--budget` runs in this order): issue 68's ten (`float8`, `offload_races`,
`cce_anchor`, `tensor_parallel`, `in_backward`, `low_bit`, `cpu_offload`, `snapshots`, `estimate_bound`, then the
24-step `throughput_0.6b_sft` launch: about 430 s priced, within 8 minutes; `--plan` prints the order and the
estimates without running anything), the other in-process checks (`packed_vs_hf`, `cce_vs_chunked`, `tf32_scope`,
`compile_vs_eager`, `host_syncs`, `dpo_reference_memory`, `objectives_bf16`), `resume_and_export`, `cuda_tests`,
`trl_0.6b`, `throughput_1.7b_sft`, the 0.6B LoRA and QLoRA launches, then `trl_1.7b` and the 1.7B LoRA and QLoRA
launches (about eleven launches: well past ten minutes in all). With
`--budget SECONDS` (counted from the start) an item starts only where its estimate (`ESTIMATES`,
`LAUNCH_ESTIMATES`: rough H100 seconds; `--estimate-scale` multiplies them) fits the time left; an in-process
check still running when the budget ends is stopped (SIGALRM), a launch is stopped with everything it started
(its timeout is the time left). The script returns within the budget plus 20 s (a watchdog's last resort),
every item in the table and JSON (PASS / FAIL / SKIP, or NOT RUN: "not run (budget: needs ~N s, M s left)",
"not finished (...)"), rewritten after every item so that even a kill from outside leaves them, and prints the
second call that runs the rest (`--only` those items, `--out OUT-rest`, the same `--work`).
The in-process checks build their models as recipes/sft.py does, through chattune.model.build's
build_sharded_model (the architecture check, the loss head, `probe_native_gqa` on CUDA, FSDP2 with the
recipe's settings); the environment's `varlen_gqa` says how torch's varlen_attn took grouped-query attention
(flag: its enable_gqa; native: unequal head counts as they are, probed; repeat: kv heads repeated) and
`compute` the start-up line of those models.

Checks (the tolerances are the documented ones; a row shows the measured figure next to its bound):
- `float8`: `model.fp8=tensorwise` (emulate on the CPU): a float8 linear layer's forward and backward on rows of
  1001, 1008 and 1 tokens (CUDA's `_scaled_mm` refuses inner dimensions that are not multiples of 16; the weight
  gradient's is the row's tokens: torchao pads them), then 3 steps of the recipe's model against the same steps
  without float8 (losses within 1%). SKIP where torchao is absent or the GPU has no float8 matmuls.
- `packed_vs_hf`: a packed bf16 row (12 real chats) through chattune's sharded model (FSDP2 mixed precision,
  eager layers) against each chat alone through stock Hugging Face (sdpa) in bf16, both heads in fp32:
  per-token losses (max |diff| ≤ 0.05), their sum (relative ≤ 1e-3) and a q_proj gradient (relative ≤ 3e-2).
  `leak_control`: the same row with every document attending to the ones before it must miss the per-token
  bound tenfold, or the check proves nothing. On the CPU, fp32 and ≤ 1e-4 / 1e-6 / 1e-5.
- `cce_vs_chunked`: cut-cross-entropy against the exact fp32 chunked head on the same bf16 inputs (8192
  tokens, the tokenizer's vocabulary, peaked logits): per-token losses (≤ 1e-3 of the largest), their sum
  (≤ 1e-4) and the output layer's and hidden states' gradients (≤ 3e-2: CCE 25.1.1 sums them in bf16 and
  drops blocks below `filter_eps`, see chattune.model.head.fused_loss). On the CPU, CCE's torch implementation,
  which rounds the logits to bf16: ≤ 5e-3 / 2.5e-4 / 1e-2, as tests/unit/model/head/test_fused_loss.py.
- `cce_anchor`: cut-cross-entropy on half a vocabulary (loss-parallel's rows, the other half's targets on an
  anchor row of this half): the per-row error of its output-layer gradient against the exact fp32 chunked head,
  row 0's within 5x the median row's (the kernels sum that gradient in bf16; anchors all on row 0 collected the
  rounding of thousands of cancelling terms). CUDA only (tests/unit/model/head/test_fused_loss.py checks a stand-in on the CPU).
- `tensor_parallel` (rows `tensor_parallel_chunked`, `_cut_cross_entropy`, `_padded_slice`): the decoder layers
  and the vocabulary split over a tp mesh of one rank (loss-parallel; NCCL refuses two ranks on one GPU) with
  FSDP2, one SGD step (its update is the gradient) against the unsplit model on the same batch: loss within
  2e-3 and update within 2e-2 relative in bf16 (1e-5 / 1e-4 on the CPU in fp32), its device syncs no more than
  the unsplit step's; a padded row slice (a row two ranks do not divide) makes no device sync. Two-GPU layouts:
  docs/gpu-check.md.
- `in_backward`: `optimizer.in_backward` (each parameter updated as FSDP2 reduces its gradient) against the
  ordinary step, two steps on the same batch: every parameter within 1e-6; on CUDA its device syncs no more than
  the ordinary step's.
- `tf32_scope`: the chunked head with its matmuls in TF32 gives the fp32 forward (≤ 1e-5 relative) and leaves
  the process's matmul precision at `highest`.
- `compile_vs_eager`, `recompiles`: compiled decoder layers against eager on the same batches (losses ≤ 1e-2,
  gradients ≤ 5e-2 in bf16; 1e-5 / 1e-4 on the CPU), and the compiled graphs over 20 steps of packed rows of
  varying length (none after the third).
- `host_syncs`: device syncs in one warm `train_step` of 2 microbatches (torch.cuda.set_sync_debug_mode): at
  most the step's one transfer, plus cut-cross-entropy's `nonzero()` per microbatch. CUDA only.
- `dpo_reference_memory`: DPO with a live reference, peak memory with the forward-only reshard and without
  it (the reference's root left gathered). On the CPU: the reference's gathered parameters, 0 and not 0.
- `objectives_bf16` (rows `objectives_bf16_dpo_sigmoid`, `_orpo`, `_kto`, `_reward`): DPO (sigmoid, live
  reference), ORPO, KTO (live reference, alternating desirable labels) and the reward model (a sequence-score
  head), one update step (`accumulate_gradients`, 2 microbatches of 4 real-chat pairs, sides cut to 512 tokens)
  with the recipe's numerics (bf16 compute, loss.implementation auto, eager layers) against the exact fp32
  reference (fp32 parameters, the chunked head, no TF32) on the same documents and weights: the step's loss
  (relative ≤ 2e-2) and its gradient over all parameters (relative ≤ 1e-1). Bounds chosen from what bf16 can
  give, not yet measured: the first GPU run should tighten them (`OBJECTIVES_BF16_BOUNDS`). On the CPU both runs
  are fp32 (2 pairs a microbatch, sides cut to 64 tokens): ≤ 1e-5 / 1e-5, the path run end to end.
- `low_bit` (rows `low_bit_AdamW8bit`, `_AdamW4bit`, `_AdamWFp8`, `low_bit_resume`): torchao's low-bit AdamW
  as the recipe builds it, 20 steps of a 4-layer 0.6B against fp32 AdamW on the same rows, every step's loss
  within the documented tolerance (0.02 nats 8-bit, 0.4 4-bit; FP8 held to 8-bit's until measured); the 8-bit
  run saves asynchronously after step 10 and a resumed model gives steps 11-20 bit for bit. On the CPU 8 steps
  of the tiny shape, torchao's step eager. SKIP where torchao is absent.
- `offload_races` (rows `offload_{eager,compiled}_{ac,noac}`): activation offload in bf16 on one 16k-token row
  (4 layers of the 0.6B), eager and compiled, with and without checkpointing: 3 backwards each give the plain
  run's gradients as exactly as the plain run repeats itself (bit for bit where it does: a copy racing the
  compute shows in some repeat), a lower peak, the bytes moved at most the saved tensors' unique storages
  (counted eager by the check's own hook), and the host slab at most 1.05x the bytes moved (plus a first slab's 64 MiB); the figure also counts
  the copies back that the prefetch started before autograd asked for them. On the CPU the tiny shape, eager, no peak.
- `cpu_offload`: `model.fsdp.cpu_offload=true` (bf16 compute, layers compiled, activation checkpointing) against
  the same model without it, two steps on the same rows: every parameter within 1e-5 relative; the second
  step's time of each, the offloaded one's slowdown its figure. On the CPU the tiny shape, eager, fp32.
- `snapshots` (rows `snapshot_overhead`, `snapshot_exact`, `snapshot_resume`): `snapshot_steps`' copy of the run
  state to pinned host buffers after every step, on a side stream: the time it adds to a step (8 layers of the
  0.6B, compiled, 16,384-token rows) at most what the copy takes beyond the step's compute plus half of the copy's
  own time (the state's bytes over the device-to-host bandwidth measured there), since it overlaps the next
  step; then SIGTERM has the watcher write the staged step after the state
  moved on, and a fresh model loaded from it holds that step's weights and AdamW states bit for bit and gives
  the next step's loss bit for bit. On the CPU the tiny shape; the overhead row is SKIP (the copy is the step's).
- `estimate_bound` (rows `estimate_bound_{cce,chunked}_{ac,noac}[_offload]`): the start-up memory estimate of
  the recipe's config against the peak torch allocated in two steps of the model built from it (8 layers of the
  0.6B, one 16,384-token row, layers compiled), for each loss head with and without activation checkpointing and
  activation offload: within ±10%; the first row also gives what torch does not count (total - free -
  reserved). On the CPU the estimates and steps run on the tiny shape and the row is SKIP (no device peak).
- `throughput`: full SFT, LoRA and QLoRA steps of `recipes/sft.py` on the 0.6B and 1.7B Qwen3 shapes (random
  weights, 20k short real chats, 2 × 16,384-token microbatches a step; the 1.7B with activation
  checkpointing): tokens/s per device, MFU and peak memory beside rank 0's start-up estimate of it
  (chattune.model.cost.memory); TRL's SFTTrainer beside full SFT when `trl` is importable; last, on the first shape,
  float8 linear layers (`model.fp8=tensorwise`, needs torchao) and offloaded, recomputed activations, against the
  full SFT row's tokens/s and peak. Targets: MFU ≥ 45% on the 1.7B full step; ≥ 3× TRL's tokens/s; peak memory ≤
  TRL's. (The CPU smoke test runs the full SFT launch alone, on the tiny shape.) Each launch logs dynamo's
  recompiles (`TORCH_LOGS=recompiles`); `steady_steps_<shape>_<mode>`: no step after the first 2 over 2x the
  median step time, each that is named with what recompiled before it ("no recompile logged": it slowed for
  another reason) and its own wait for data and garbage-collection time (the step's `data_wait_s`, `gc_s`). The
  first shape's full SFT launch runs 24 steps on CUDA (the slow steps 11-12 of the first GPU run, BENCHMARKS.md).
- `longest_row`: the longest packed row (32k, 64k, 128k tokens, one step, activation checkpointing) the first shape
  trains on one GPU, without and with offloaded activations, each with its peak memory. CUDA only, last.
- `cuda_tests`: the project's CUDA-only tests, `pytest -k cuda` over the test files with a
  `torch.cuda.is_available()` skip and tests/unit/model/packed/test_varlen_fallback.py, in a subprocess (needs pytest). CUDA only.
- `resume_exact`: 8 steps straight against 4, stop, resume, 4 with `save_async=true` and evaluation on:
  bitwise equal losses. `export_masters`: the export after a final step that saved a checkpoint equals that
  checkpoint's fp32 masters, tensor for tensor; `export_after_eval`: the export after a final step that
  evaluated and saved nothing holds fp32 masters, not bf16 copies (issue 26, item 1).

On a GPU machine without internet (torch ≥ 2.11, transformers ≥ 5.17 preinstalled) it runs from a checkout
on PYTHONPATH with the wheels the machine lacks: `python scripts/gpu_carry.py` builds that carry folder
(hydra-core, omegaconf, antlr4-python3-runtime, torchdata, datasets, peft, cut-cross-entropy, trl, pytest)
and prints the one command that installs it and runs this script and bench_gpu.py within a budget; QLoRA's
bitsandbytes is a folder and a call of its own (`--with-bitsandbytes`). Real tokenizer and chats come from
--assets (../shared/assets: the Qwen3 tokenizer, the FastChat chats); without them the run uses chattune's demo
tokenizer and chats, and says so.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from unittest.mock import patch

STARTED = time.monotonic()  # --budget counts from here: torch's import is part of it

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_gpu  # noqa: E402
from bench_gpu import (  # noqa: E402
    BUDGET_MARGIN_S,
    Budget,
    OutOfBudget,
    add_budget_arguments,
    rerun_command,
    run_bounded,
    stop_process_group,
)

from chattune.config.paths import DEMO_ASSETS  # noqa: E402
from chattune.data.documents import IGNORE_INDEX, Document, shifted_labels  # noqa: E402
from chattune.data.packing import PackedBatch, collate_packed  # noqa: E402
from chattune.data.templates.chat_template import probe_template, tokenize_conversation  # noqa: E402
from chattune.launch.torchrun import torchrun_command  # noqa: E402

# hidden, intermediate, layers, heads, kv heads (Qwen3's published configs; head_dim 128, tied embeddings)
SHAPES = {"tiny": (64, 128, 2, 4, 2), "0.6b": (1024, 3072, 28, 16, 8), "1.7b": (2048, 6144, 28, 16, 8)}


@dataclass
class Row:
    check: str
    status: str  # PASS | FAIL | SKIP | NOT RUN (the budget: an item not started, or stopped)
    figure: str
    bound: str = ""
    detail: str = ""


@dataclass
class Context:
    device: torch.device
    out: Path
    work: Path
    tokenizer_dir: Path
    chats: Path  # a JSONL of {"messages": [...]}, the throughput corpus
    real_assets: bool
    budget: Budget = field(default_factory=lambda: Budget(None))
    rows: list[Row] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    not_run: list[str] = field(default_factory=list)  # the items a second call runs (--only)
    dims: object = None  # chattune.distributed.ParallelDims of the in-process checks' one-rank group
    figures: dict = field(default_factory=dict)  # (shape, mode): the throughput runs' figures
    compute: list[str] = field(default_factory=list)  # the start-up "compute:" lines of the models built here
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: list = field(default_factory=list)  # the items not yet done (run_items)
    current: object = None  # the item running

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def shape(self) -> str:
        """The model shape of the in-process checks."""
        return "0.6b" if self.cuda else "tiny"

    def add(self, check: str, passed: bool | None, figure: str, bound: str = "", detail: str = "") -> None:
        status = "SKIP" if passed is None else ("PASS" if passed else "FAIL")
        with self.lock:
            self.rows.append(Row(check, status, figure, bound, detail))
        print(f"[gpu_check] {status} {check}: {figure} {('(' + bound + ')') if bound else ''} {detail}", flush=True)

    def add_not_run(self, item: str, figure: str) -> None:
        with self.lock:
            self.rows.append(Row(item, "NOT RUN", figure))
            self.not_run.append(item)
        print(f"[gpu_check] NOT RUN {item}: {figure}", flush=True)


# --- models and data ---


def tokenizer(ctx: Context):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ctx.tokenizer_dir)


def qwen3_config(shape: str, layers: int | None = None) -> dict:
    """transformers.Qwen3Config's keywords for a shape (the vocabulary is the tokenizer's: build_hf_model)."""
    hidden, intermediate, num_layers, heads, kv_heads = SHAPES[shape]
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers or num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=128 if shape != "tiny" else 16,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    )


def hf_model(ctx: Context, shape: str, layers: int | None = None, seed: int = 0):
    """A random-init Qwen3-shaped model (fp32, on the CPU, chattune's packed attention), the vocabulary sized
    to the tokenizer: the weights `recipe_model` builds from the same seed."""
    from transformers import Qwen3Config

    from chattune.model.causal_lm import build_hf_model

    torch.manual_seed(seed)
    return build_hf_model(tokenizer(ctx), Qwen3Config(**qwen3_config(shape, layers)))


def recipe_config(
    ctx: Context,
    shape: str,
    layers: int | None = None,
    compile: bool = False,
    loss: str = "chunked",
    seed: int = 0,
    overrides: tuple[str, ...] = (),
):
    """recipes/sft.py's composed config (configs/sft/tiny.yaml's defaults) with `model.config` the Qwen3 shape:
    what `recipe_model` builds, and what chattune.model.cost.memory estimates."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from chattune.config.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(
            "sft/tiny",
            overrides=[
                f"seed={seed}",
                f"device={ctx.device.type}",
                f"model.compile={str(compile).lower()}",
                f"loss.implementation={loss}",
                *overrides,
            ],
        )
    with open_dict(cfg):
        cfg.model.config = {"_target_": "transformers.Qwen3Config", **qwen3_config(shape, layers)}
    return cfg


def _model_and_placement(built) -> tuple:
    """(the sharded model, its `Placement`) of a `BuiltModel`: what the step and the evaluation are handed."""
    return built.model, built.placement


def recipe_model(
    ctx: Context,
    shape: str,
    layers: int | None = None,
    compile: bool = False,
    loss: str = "chunked",
    seed: int = 0,
    head=None,
    overrides: tuple[str, ...] = (),
):
    """The model as recipes/sft.py builds it from `recipe_config`'s config (see built_from): random weights
    from `seed`, equal to hf_model(ctx, shape, layers, seed)'s. `head`: the model's head (chattune.model.head.kinds;
    None: the causal LM's, SCORE_HEAD: a reward model's, as recipes/reward.py builds it); `overrides`: more of
    the recipe's keys (`model.fsdp.param_dtype=float32` for an exact reference: auto is bf16 compute on CUDA,
    fp32 on the CPU; `model.fp8=tensorwise`). A BuiltModel (hf_model, model, ...)."""
    return built_from(ctx, recipe_config(ctx, shape, layers, compile, loss, seed, overrides), head)


def built_from(ctx: Context, cfg, head=None, dims=None):
    """The model of a recipe config, through recipes/sft.py's own function (chattune.model.build's
    build_sharded_model, which build_trained_model calls): the architecture check, the loss head's choice and
    its TF32 scope, `probe_native_gqa` on CUDA (how torch's varlen_attn takes grouped-query attention: the path
    a recipe's attention then takes), FSDP2 with the recipe's `model.fsdp` settings and the start-up "compute:"
    line."""
    from chattune.model.build import ModelSections, ModelSource, build_sharded_model

    dims = dims or ctx.dims  # `dims`: another layout on the same group (check_tensor_parallel's kept tp mesh)
    if head is None:
        return build_sharded_model(
            sections=ModelSections.of(cfg), tokenizer=tokenizer(ctx), dims=dims, source=ModelSource(None)
        )
    return build_sharded_model(
        sections=ModelSections.of(cfg), tokenizer=tokenizer(ctx), dims=dims, source=ModelSource(None), head=head
    )


def model_dir(ctx: Context, shape: str) -> Path:
    """A model directory for the recipes: the same model saved in bf16 with the tokenizer."""
    directory = ctx.work / "models" / f"qwen3-{shape}"
    if not (directory / "config.json").is_file():
        model = hf_model(ctx, shape).to(torch.bfloat16)
        model.config._attn_implementation = "sdpa"
        model.save_pretrained(directory)
        tokenizer(ctx).save_pretrained(directory)
    return directory


def chat_documents(ctx: Context, count: int, start: int = 0) -> list[Document]:
    """Real chats tokenized with assistant-only labels, as training sees them."""
    tok = tokenizer(ctx)
    markers = probe_template(tok)
    lines = ctx.chats.read_text().splitlines()[start : start + count]
    documents = []
    for i, line in enumerate(lines):
        tokenized = tokenize_conversation(tok, json.loads(line)["messages"], markers)
        documents.append(
            Document(start + i, tokenized.input_ids, shifted_labels(tokenized.input_ids, tokenized.assistant_mask))
        )
    return documents


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def within(figure: float, bound: float) -> bool:
    return figure <= bound


# --- in-process checks (a one-rank group) ---


def check_packed_vs_hf(ctx: Context) -> None:
    from torch.distributed.tensor import DTensor

    documents = chat_documents(ctx, 12)
    built = recipe_model(ctx, ctx.shape)  # eager layers
    model, ours = built.hf_model, built.model
    reference = hf_model(ctx, ctx.shape)  # the same seed: the same weights, checked here
    reference.set_attn_implementation("sdpa")
    reference = reference.to(ctx.device)
    differing = [
        name
        for name, parameter in model.named_parameters()
        if not torch.equal(
            parameter.full_tensor() if isinstance(parameter, DTensor) else parameter, reference.get_parameter(name)
        )
    ]
    if differing:
        ctx.add("packed_vs_hf", False, f"the reference's weights differ from the recipe-built model's: {differing[:3]}")
        return
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    reference = reference.to(dtype)
    batch = collate_packed(documents).to(ctx.device)
    losses = ours(batch)
    losses.sum().backward()
    layer = len(model.model.layers) // 2
    grad = model.model.layers[layer].self_attn.q_proj.weight.grad.full_tensor().float()
    head = reference.lm_head.weight

    def head_losses(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # our head's computation, fp32
        return F.cross_entropy(hidden.float() @ head.float().t(), labels, ignore_index=IGNORE_INDEX, reduction="none")

    want = []
    for document in documents:
        ids = torch.as_tensor(document.input_ids, device=ctx.device).unsqueeze(0)
        hidden = reference.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        want.append(head_losses(hidden, torch.as_tensor(document.labels, device=ctx.device)))
    want = torch.cat(want)
    want.sum().backward()
    want_grad = reference.model.layers[layer].self_attn.q_proj.weight.grad.float()
    with torch.no_grad():  # the control: one causal attention over the whole row, documents see each other
        # (an explicit all-ones mask: with none, transformers finds the documents from the position ids)
        hidden = reference.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            use_cache=False,
            attention_mask=torch.ones_like(batch.input_ids),
        ).last_hidden_state[0]
        leaked = head_losses(hidden, batch.labels[0])
    bounds = (0.05, 1e-3, 3e-2) if ctx.cuda else (1e-4, 1e-6, 1e-5)
    token = float((losses.detach() - want.detach()).abs().max())
    total = abs(float(losses.sum()) - float(want.sum())) / abs(float(want.sum()))
    grad_error = relative(grad, want_grad)
    ok = token <= bounds[0] and total <= bounds[1] and grad_error <= bounds[2]
    ctx.add(
        "packed_vs_hf",
        ok,
        f"token max|diff| {token:.3g}, sum rel {total:.2g}, q_proj grad rel {grad_error:.2g}",
        f"≤ {bounds[0]:g} / {bounds[1]:g} / {bounds[2]:g}",
        f"{batch.num_tokens} tokens, {len(documents)} chats",
    )
    control = float((leaked - want.detach()).abs().max())
    ctx.add(
        "leak_control",
        control > 10 * bounds[0],
        f"token max|diff| {control:.3g} with documents leaking",
        f"> {10 * bounds[0]:g}: ten times the check's bound",
    )


def check_cce(ctx: Context) -> None:
    from chattune.model.head import fused_loss
    from chattune.model.head.chunked_loss import chunked_token_losses

    if not fused_loss.cce_available():
        ctx.add("cce_vs_chunked", None, "cut-cross-entropy cannot be imported", detail=str(fused_loss._import_cce()[1]))
        return
    tokens, width, vocab = (8192, 1024, len(tokenizer(ctx))) if ctx.cuda else (200, 32, 500)
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    hidden = torch.randn(tokens, width, generator=generator, device=ctx.device).bfloat16()
    # Peaked logits (std ~4), like a trained model's, not the near-uniform softmax of random weights.
    weight = (torch.randn(vocab, width, generator=generator, device=ctx.device) * 4 / width**0.5).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), generator=generator, device=ctx.device)
    labels[::7] = IGNORE_INDEX
    upstream = torch.linspace(0.5, 1.5, tokens, device=ctx.device)

    def run(loss_fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        losses = loss_fn(h, w)
        (losses * upstream).sum().backward()
        return losses.detach(), h.grad.float(), w.grad.float()

    want = run(lambda h, w: chunked_token_losses(h, w, labels, chunk_size=1024))
    got = run(lambda h, w: fused_loss.cce_token_losses(h, w, labels))
    token = float((got[0] - want[0]).abs().max() / want[0].abs().max())
    total = abs(float(got[0].sum() - want[0].sum())) / abs(float(want[0].sum()))
    hidden_grad, head_grad = relative(got[1], want[1]), relative(got[2], want[2])
    # CUDA: the kernels accumulate the logits in fp32 and never round them; the CPU's torch implementation
    # rounds them to bf16 (tests/unit/model/head/test_fused_loss.py's bounds).
    bounds = (1e-3, 1e-4, 3e-2) if ctx.cuda else (5e-3, 2.5e-4, 1e-2)
    ok = token <= bounds[0] and total <= bounds[1] and max(hidden_grad, head_grad) <= bounds[2]
    options = fused_loss.cce_options(ctx.cuda)
    ctx.add(
        "cce_vs_chunked",
        ok,
        f"token {token:.2g} of max, sum rel {total:.2g}, hidden grad rel {hidden_grad:.2g}, "
        f"head grad rel {head_grad:.2g}",
        f"≤ {bounds[0]:g} / {bounds[1]:g} / {bounds[2]:g} / {bounds[2]:g}",
        f"{tokens}x{width}, vocab {vocab}, options {options}",
    )


def check_float8(ctx: Context) -> None:
    """model.fp8 (tensorwise on CUDA, emulate on the CPU): one float8 linear layer's forward and backward on rows
    of 1001, 1008 and 1 tokens (CUDA's _scaled_mm wants every inner dimension a multiple of 16; the weight
    gradient's is the row's token count), then 3 optimizer steps of the recipe's model in float8 against the same
    steps without it: every step's loss within 1%."""
    import importlib.util

    from chattune.model.quantization.float8 import convert_linear_layers, fp8_problem

    mode = "tensorwise" if ctx.cuda else "emulate"
    problem = fp8_problem(mode, ctx.device, adapted=False)
    if problem is None and importlib.util.find_spec("torchao") is None:
        problem = "torchao is not installed (the lowbit extra; gpu_carry.py carries it)"
    if problem is not None:
        ctx.add("float8", None, problem)
        return
    width = 1024 if ctx.cuda else 64
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    for tokens in (1001, 1008, 1):  # raises where a matmul's shape is refused
        torch.manual_seed(0)
        layer = torch.nn.Sequential(torch.nn.Linear(width, width, bias=False)).to(ctx.device, dtype)
        convert_linear_layers([layer], mode)
        inputs = torch.randn(tokens, width, device=ctx.device, dtype=dtype, requires_grad=True)
        layer(inputs).float().pow(2).sum().backward()
        if not (torch.isfinite(inputs.grad).all() and torch.isfinite(layer[0].weight.grad).all()):
            ctx.add("float8", False, f"non-finite gradients of a float8 layer at {tokens} tokens")
            return
    documents = chat_documents(ctx, 24, start=200)
    batches = [collate_packed(documents[start : start + 8]) for start in (0, 8, 16)]
    layers = 4 if ctx.cuda else None
    losses = {}
    for name, overrides in (("plain", ()), ("float8", (f"model.fp8={mode}",))):
        model = recipe_model(ctx, ctx.shape, layers, overrides=overrides).model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses[name] = []
        for batch in batches:
            trained = int((batch.labels != IGNORE_INDEX).sum())
            loss = model(batch.to(ctx.device)).sum() / trained
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[name].append(float(loss))
        del model, optimizer
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["float8"], losses["plain"]))
    plain = "bf16" if ctx.cuda else "fp32"
    ctx.add(
        "float8",
        worst <= 0.01,
        f"rows of 1001, 1008 and 1 tokens ran; 3 steps' losses within {worst:.2g} of {plain}'s",
        "≤ 0.01",
        f"model.fp8={mode}; losses {[round(x, 4) for x in losses['float8']]} vs {[round(x, 4) for x in losses['plain']]}",
    )


def check_cce_anchor(ctx: Context) -> None:
    """Cut-cross-entropy under loss-parallel (a vocabulary split over tp): a token whose target is another rank's
    is computed at an anchor row of this rank's whose logit is added back. The kernels sum the output layer's
    gradient in bf16, so one anchor row taking (T-1)/T of the tokens kept their cancelling terms' rounding (a CPU
    simulation: 860x a row's error). Per-row error of the weight gradient of this rank's half of the vocabulary
    against the exact fp32 chunked head: row 0's within 5x the median row's. CUDA only (CCE's kernels)."""
    import torch.distributed as dist

    from chattune.model.head import fused_loss
    from chattune.model.head.chunked_loss import chunked_token_losses
    from chattune.parallel.vocab_parallel import VocabShard

    if not ctx.cuda:
        ctx.add(
            "cce_anchor",
            None,
            "CUDA only: the kernels' bf16 sums (tests/unit/model/head/test_fused_loss.py checks a stand-in)",
        )
        return
    if not fused_loss.cce_available():
        ctx.add("cce_anchor", None, "cut-cross-entropy cannot be imported", detail=str(fused_loss._import_cce()[1]))
        return
    tokens, width, vocab = 8192, 1024, len(tokenizer(ctx))
    half = vocab // 2
    generator = torch.Generator(device=ctx.device).manual_seed(3)
    hidden = torch.randn(tokens, width, generator=generator, device=ctx.device).bfloat16()
    weight = (torch.randn(half, width, generator=generator, device=ctx.device) * 4 / width**0.5).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), generator=generator, device=ctx.device)  # half of them elsewhere
    rows = VocabShard(0, half, dist.group.WORLD)  # this rank's half (the one-rank group: its sums are its own)

    def weight_gradient(loss_fn, dtype: torch.dtype) -> torch.Tensor:
        h, w = hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
        loss_fn(h, w).sum().backward()
        return w.grad.float()

    exact = weight_gradient(lambda h, w: chunked_token_losses(h, w, labels, chunk_size=1024, rows=rows), torch.float32)
    fused = weight_gradient(lambda h, w: fused_loss.cce_token_losses(h, w, labels, rows=rows), torch.bfloat16)
    errors = (fused - exact).norm(dim=1)
    median = float(errors.median())
    ratio = float(errors[0]) / median if median > 0 else float("inf")
    ctx.add(
        "cce_anchor",
        ratio <= 5,
        f"row 0's error {ratio:.2g}x the median row's (largest {float(errors.max()) / median:.2g}x)",
        "≤ 5",
        f"{tokens}x{width}, {half} of {vocab} rows, options {fused_loss.cce_options(True)}",
    )


# Tensor parallelism on one GPU: the split model at degree 1 runs the same arithmetic as the unsplit one, so its
# bounds are the rounding of a different order of operations (the vocabulary's logsumexp and target logit reduced
# over the group, DTensor's redistributions): fp32 on the CPU, the recipe's bf16 on CUDA.
TENSOR_PARALLEL_BOUNDS = {"cpu": (1e-5, 1e-4), "cuda": (2e-3, 2e-2)}  # (loss, update) relative


def check_tensor_parallel(ctx: Context) -> None:
    """Tensor parallelism and loss-parallel (the decoder layers and the vocabulary split over a tp mesh,
    chattune.parallel.tensor_parallel and vocab_parallel) composed with FSDP2, on a tp mesh of one rank
    (`ParallelDims.build(keep={"tp"})`: NCCL refuses two ranks on one GPU): for the chunked head and
    cut-cross-entropy, one step of SGD (lr 1: the update is the gradient) against the unsplit model on the same
    batch, its loss and update within TENSOR_PARALLEL_BOUNDS; on CUDA the split step's device syncs no more than
    the unsplit one's, and none in a padded row slice (context_parallel.row_slice of a row whose length the
    ranks do not divide: its padding made on the device, not copied from pageable memory)."""
    from chattune.data.feed import StepBatches
    from chattune.distributed import ParallelDims
    from chattune.model.head import fused_loss
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.parallel.context_parallel import row_slice
    from chattune.train.step import UpdateRule, train_step

    split_dims = ParallelDims.build(ctx.device, None, keep=frozenset({"tp"}))
    documents = chat_documents(ctx, 8, start=500)
    layers = 4 if ctx.cuda else None
    loss_bound, update_bound = TENSOR_PARALLEL_BOUNDS[ctx.device.type]
    for loss in ("chunked", "cut_cross_entropy"):
        if loss == "cut_cross_entropy" and not fused_loss.cce_available():
            ctx.add(f"tensor_parallel_{loss}", None, "cut-cross-entropy cannot be imported")
            continue
        losses, updates, syncs = {}, {}, {}
        for name, dims in (("unsplit", ctx.dims), ("split", split_dims)):
            cfg = recipe_config(ctx, ctx.shape, layers, loss=loss, overrides=("model.compile=false",))
            model, placement = _model_and_placement(built_from(ctx, cfg, dims=dims))
            if name == "split":
                meshes = {p.device_mesh.mesh_dim_names for p in model.parameters()}
                if model.stream is None or ("dp_shard_cp", "tp") not in meshes:
                    raise AssertionError(f"the kept tp mesh did not split the model (parameters on {meshes})")
            before = {n: p.full_tensor().float().cpu() for n, p in model.named_parameters()}
            optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            batches = StepBatches([collate_packed(documents)])
            result, _ = train_step(
                model, TokenCrossEntropy(), batches, UpdateRule(optimizer, scheduler, None), placement
            )
            losses[name] = torch.tensor(result.loss_sum / result.global_units)
            updates[name] = torch.cat(
                [(p.full_tensor().float().cpu() - before[n]).flatten() for n, p in model.named_parameters()]
            )
            syncs[name] = _count_syncs(
                ctx,
                lambda m=model, b=batches, o=optimizer, s=scheduler, p=placement: train_step(
                    m, TokenCrossEntropy(), b, UpdateRule(o, s, None), p
                ),
            )
            del model, optimizer
        loss_error, update_error = (
            relative(losses["split"], losses["unsplit"]),
            relative(updates["split"], updates["unsplit"]),
        )
        synced = syncs["split"] is None or syncs["split"] <= syncs["unsplit"]
        counts = "" if syncs["unsplit"] is None else f"; device syncs {syncs['split']} vs {syncs['unsplit']}"
        ctx.add(
            f"tensor_parallel_{loss}",
            loss_error <= loss_bound and update_error <= update_bound and synced,
            f"loss rel {loss_error:.2g}, update rel {update_error:.2g} against the unsplit model{counts}",
            f"≤ {loss_bound:g} / {update_bound:g}; syncs no more than unsplit",
            "tp mesh of 1 rank with FSDP2, one SGD step",
        )
    odd = collate_packed(documents[:3])
    odd = replace(  # a row whose length 2 ranks do not divide: row_slice pads it
        odd, **{f: getattr(odd, f).to(ctx.device) for f in ("input_ids", "labels", "position_ids", "cu_seqlens")}
    )
    if odd.num_tokens % 2 == 0:
        odd = replace(
            odd,
            input_ids=odd.input_ids[:, :-1],
            labels=odd.labels[:, :-1],
            position_ids=odd.position_ids[:, :-1],
            cu_seqlens=torch.cat([odd.cu_seqlens[:-1], odd.cu_seqlens[-1:] - 1]),
        )
    sliced = _count_syncs(ctx, lambda: row_slice(odd, 2, 1))
    ctx.add(
        "tensor_parallel_padded_slice",
        None if sliced is None else sliced == 0,
        "CUDA only (its slice ran)" if sliced is None else f"{sliced} device syncs in the padded row slice",
        "" if sliced is None else "0",
        f"a row of {odd.num_tokens} tokens over 2 ranks",
    )


def check_in_backward(ctx: Context) -> None:
    """optimizer.in_backward: one step of the recipe's model with each parameter updated as FSDP2 reduces its
    gradient (in FSDP2's post-reduce stream on CUDA) against the ordinary step on the same batch: every parameter
    within 1e-6 relative (the same AdamW arithmetic, element for element); on CUDA also the step's device syncs
    (torch.cuda.set_sync_debug_mode): the ordinary step's count, not one per parameter."""
    from chattune.data.feed import StepBatches
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.train.in_backward import UpdateInBackward
    from chattune.train.step import UpdateRule, train_step

    documents = chat_documents(ctx, 8, start=300)
    layers = 4 if ctx.cuda else None
    after, syncs = {}, {}
    for name in ("ordinary", "in_backward"):
        model, placement = _model_and_placement(recipe_model(ctx, ctx.shape, layers))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=ctx.cuda)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        updater = UpdateInBackward(model, optimizer, placement) if name == "in_backward" else None
        rule = UpdateRule(optimizer, scheduler, None, in_backward=updater)
        batches = StepBatches([collate_packed(documents)])
        train_step(model, TokenCrossEntropy(), batches, rule, placement)  # warm (the optimizer's states exist)
        counted = _count_syncs(
            ctx, lambda m=model, b=batches, r=rule, p=placement: train_step(m, TokenCrossEntropy(), b, r, p)
        )
        syncs[name] = counted
        after[name] = {n: p.full_tensor().float().cpu() for n, p in model.named_parameters()}
        del model, optimizer
    worst = max(relative(after["in_backward"][n], after["ordinary"][n]) for n in after["ordinary"])
    synced = syncs["in_backward"] is None or syncs["in_backward"] <= syncs["ordinary"]
    counts = "" if syncs["ordinary"] is None else f"; device syncs {syncs['in_backward']} vs {syncs['ordinary']}"
    ctx.add(
        "in_backward",
        worst <= 1e-6 and synced,
        f"parameters after 2 steps within {worst:.2g} of the ordinary step's{counts}",
        "≤ 1e-6; syncs no more than the ordinary step's",
    )


def _count_syncs(ctx: Context, step: Callable[[], object]) -> int | None:
    """The device syncs `step` makes (CUDA's sync debug mode warns at each); None on the CPU."""
    if not ctx.cuda:
        step()
        return None
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def check_tf32_scope(ctx: Context) -> None:
    from chattune.model.head.chunked_loss import chunked_token_losses

    tokens, width, vocab = (4096, 1024, 32768) if ctx.cuda else (256, 64, 1024)
    generator = torch.Generator(device=ctx.device).manual_seed(1)
    hidden = torch.randn(tokens, width, generator=generator, device=ctx.device).bfloat16()
    weight = (
        (torch.randn(vocab, width, generator=generator, device=ctx.device) / width**0.5).bfloat16().requires_grad_()
    )
    labels = torch.randint(0, vocab, (tokens,), generator=generator, device=ctx.device)
    before = torch.get_float32_matmul_precision()
    fast = chunked_token_losses(hidden, weight, labels, 1024, tf32=True)
    fast.sum().backward()
    exact = chunked_token_losses(hidden, weight, labels, 1024, tf32=False).detach()
    error = relative(fast.detach(), exact)
    after = torch.get_float32_matmul_precision()
    ctx.add(
        "tf32_scope",
        error <= 1e-5 and before == after == "highest",
        f"forward rel {error:.2g} against fp32; precision {before} -> {after}",
        "≤ 1e-5; highest",
    )


def check_compile(ctx: Context) -> None:
    from chattune.parallel.fsdp import compiled_graphs

    torch._dynamo.reset()
    documents = chat_documents(ctx, 80, start=100)
    rows, start = [], 0
    for size in [3, 5, 2, 7, 4, 6, 3, 5, 8, 2, 4, 6, 5, 3, 7, 4, 2, 6, 5, 3]:  # 20 packed lengths
        rows.append(collate_packed(documents[start % 60 : start % 60 + size]))
        start += size
    layers = 4 if ctx.cuda else None

    def losses_and_grads(model, batches):
        out = []
        for batch in batches:
            losses = model(batch.to(ctx.device))
            losses.sum().backward()
            out.append((losses.detach(), {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}))
            model.zero_grad(set_to_none=True)
        return out

    eager = losses_and_grads(recipe_model(ctx, ctx.shape, layers).model, rows[:3])
    compiled_model = recipe_model(ctx, ctx.shape, layers, compile=True).model
    graphs, compiled = [compiled_graphs()], []
    for index, batch in enumerate(rows):
        result = losses_and_grads(compiled_model, [batch])
        if index < 3:
            compiled += result
        graphs.append(compiled_graphs())
    bounds = (1e-2, 5e-2) if ctx.cuda else (1e-5, 1e-4)
    loss_error = max(relative(c[0], e[0]) for c, e in zip(compiled, eager))
    grad_error = max(relative(c[1][n], e[1][n]) for c, e in zip(compiled, eager) for n in e[1])
    ctx.add(
        "compile_vs_eager",
        loss_error <= bounds[0] and grad_error <= bounds[1],
        f"losses rel {loss_error:.2g}, gradients rel {grad_error:.2g}",
        f"≤ {bounds[0]:g} / {bounds[1]:g}",
    )
    later = graphs[-1] - graphs[3]
    ctx.add("recompiles", later == 0, f"graphs after each of 20 steps: {graphs[1:]}", "none after the third")


def _pair_documents(ctx: Context, count: int, max_side: int | None = None) -> list[Document]:
    """Preference pairs made of real chats: chosen = a chat, rejected = another, one document of two segments each;
    `max_side`: each side cut to its first tokens (its last position then predicts nothing; a chat with no trained
    token left is passed over: a side without one makes per-token losses such as ORPO's 0 / 0), None: whole."""

    def side(document: Document) -> tuple[list[int], list[int]]:
        ids, labels = list(document.input_ids), list(document.labels)
        if max_side is not None and len(ids) > max_side:
            ids, labels = ids[:max_side], [*labels[: max_side - 1], IGNORE_INDEX]
        return ids, labels

    if max_side is None:
        sides = [side(document) for document in chat_documents(ctx, 2 * count, start=300)]
    else:
        sides = [side(document) for document in chat_documents(ctx, 8 * count, start=300)]
        sides = [(ids, labels) for ids, labels in sides if any(label != IGNORE_INDEX for label in labels)]
        if len(sides) < 2 * count:
            raise RuntimeError(f"{len(sides)} chats keep a trained token in their first {max_side}: {2 * count} needed")
    pairs = []
    for k in range(count):
        (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = sides[2 * k], sides[2 * k + 1]
        pairs.append(
            Document(
                k,
                [*chosen_ids, *rejected_ids],
                [*chosen_labels, *rejected_labels],
                segments=(len(chosen_ids), len(rejected_ids)),
            )
        )
    return pairs


def _pair_batches(ctx: Context, count: int) -> list:
    """Preference pairs made of real chats (`_pair_documents`), packed four to a microbatch."""
    pairs = _pair_documents(ctx, count)
    return [collate_packed(pairs[i : i + 4]) for i in range(0, count, 4)]


def check_dpo_reference(ctx: Context) -> None:
    from torch.distributed.tensor import DTensor

    from chattune.data.feed import StepBatches
    from chattune.objectives.dpo import LiveReference, PreferenceObjective, pair_logps
    from chattune.objectives.pair_losses import PreferenceLoss
    from chattune.train.step import UpdateRule, train_step

    class WithoutReshard(LiveReference):  # the reference as it was: its root left gathered after a forward
        @torch.no_grad()
        def __call__(self, batch):
            chosen, rejected, _, _ = pair_logps(self.model(batch), batch)
            return chosen, rejected

    batches = _pair_batches(ctx, 8)

    def run(reference_class) -> tuple[float, int]:
        """(peak memory above what was allocated before, GiB; the reference's parameters left gathered).
        Whatever an earlier run or check left in reference cycles is collected first: freed during this run,
        it would lower this run's figure by its size (the first GPU run measured the two runs 4 GiB apart,
        the wrong way round, before this)."""
        gc.collect()
        if ctx.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(ctx.device)
        before = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
        befores.append(before / 2**30)
        policy, placement = _model_and_placement(recipe_model(ctx, ctx.shape))
        reference_model = recipe_model(ctx, ctx.shape).model
        objective = PreferenceObjective(PreferenceLoss(loss_type="sigmoid", beta=0.1), reference_class(reference_model))
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        for step in range(2):
            train_step(
                policy,
                objective,
                StepBatches(batches[step : step + 1]),
                UpdateRule(optimizer, scheduler, 1.0),
                placement,
            )
        gathered = sum(not isinstance(p, DTensor) for p in reference_model.parameters())
        peak = (torch.cuda.max_memory_allocated(ctx.device) - before) / 2**30 if ctx.cuda else float("nan")
        del policy, reference_model, objective, optimizer, scheduler
        return peak, gathered

    befores: list[float] = []
    fixed, unfixed = run(LiveReference), run(WithoutReshard)
    if ctx.cuda:
        ctx.add(
            "dpo_reference_memory",
            fixed[0] < unfixed[0] and fixed[1] == 0,
            f"peak {fixed[0]:.2f} GiB resharded vs {unfixed[0]:.2f} GiB gathered",
            "lower",
            f"gathered reference parameters: {fixed[1]} vs {unfixed[1]}; allocated before each run "
            f"{befores[0]:.2f} / {befores[1]:.2f} GiB",
        )
    else:
        ctx.add(
            "dpo_reference_memory",
            fixed[1] == 0 < unfixed[1],
            f"reference parameters left gathered: {fixed[1]} resharded vs {unfixed[1]} without",
            "0 and not 0",
        )


@contextmanager
def exact_matmuls():
    """fp32 matmuls in full precision (no TF32: torch.set_float32_matmul_precision("highest"), which sets
    torch.backends.cuda.matmul.allow_tf32=False, and cuDNN's TF32 off), restored after."""
    precision, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


# objectives_bf16's bounds, (the step's loss, its gradient over all parameters), relative. CUDA: the recipe's bf16
# compute against fp32. bf16 keeps 8 bits of mantissa (a rounding of 2^-9 ≈ 2e-3 relative per value); the heads
# and the loss reductions run in fp32, so a step's loss (a mean of log-sigmoids of differences of sequence log-prob
# sums) drifts by the per-token errors' sum: packed_vs_hf bounds one token's loss by 0.05, a sum by 1e-3 relative;
# differences of two such sums (policy vs reference, chosen vs rejected) lose relative precision, hence 2e-2. The
# gradient goes back through 28 bf16 layers (packed_vs_hf's q_proj gradient: ≤ 3e-2 relative) and through the
# objectives' sigmoid weights, which inherit the loss's error: 1e-1 over all parameters. Guesses from what bf16
# can give, never yet measured on a GPU: the first GPU run should tighten them from its figures (to about twice
# those). CPU: both runs are fp32 (param_dtype auto is fp32 there), so the figures are rounding (about 0).
OBJECTIVES_BF16_BOUNDS = {"cuda": (2e-2, 1e-1), "cpu": (1e-5, 1e-5)}


def check_objectives_bf16(ctx: Context) -> None:
    """DPO (sigmoid, live reference), ORPO, KTO (live reference) and the reward model: one update step's
    forward/backward (chattune.train.step.accumulate_gradients on 2 microbatches, so the step-level parts run: ORPO's
    chosen-token count, KTO's no-grad reference-point pass) twice on the same documents: with the recipe's numerics
    (recipe_model: model.fsdp.param_dtype auto, bf16 compute on CUDA, loss.implementation auto: cut-cross-entropy
    where installed; eager layers, compile being compile_vs_eager's) and as the exact reference (param_dtype float32,
    the chunked fp32 head, no TF32 anywhere: `exact_matmuls`). The same seeds give both the same fp32 weights; the
    policy is seed 0, the reference seed 1 (a reference equal to the policy would make every log-ratio 0 and DPO's
    and KTO's losses constants). A row per objective: the step's loss and its gradient over all parameters (full
    tensors), relative, against OBJECTIVES_BF16_BOUNDS. On the CPU both numerics resolve to fp32 and the chunked
    head: the same models serve both runs, and the check shows that the whole path runs (figures about 0)."""
    from dataclasses import replace

    from torch.distributed.tensor import DTensor

    from chattune.data.feed import StepBatches
    from chattune.model.head.fused_loss import resolve_loss_implementation
    from chattune.model.head.kinds import SCORE_HEAD
    from chattune.objectives.dpo import LiveReference, PreferenceObjective
    from chattune.objectives.kto import KTOObjective, KTOWeights
    from chattune.objectives.pair_losses import PreferenceLoss
    from chattune.objectives.reward import RewardObjective
    from chattune.parallel.fsdp import Placement, compute_dtype
    from chattune.train.step import accumulate_gradients

    # 2 microbatches: of 4 pairs on CUDA, each side cut to 512 tokens (the fp32 reference of the 0.6B shape keeps
    # every layer's activations of a microbatch, ≤ 4096 tokens, for its backward); of 2 pairs on the CPU, each side
    # cut to 64 tokens (the demo chats' sides are about 55: some are cut, as on CUDA).
    count = 8 if ctx.cuda else 4
    pairs = _pair_documents(ctx, count, max_side=512 if ctx.cuda else 64)
    examples = [replace(pair, doc_values={"desirable": float(k % 2 == 0)}) for k, pair in enumerate(pairs)]  # KTO
    pair_batches = [collate_packed(pairs[: count // 2]), collate_packed(pairs[count // 2 :])]
    kto_batches = [collate_packed(examples[: count // 2]), collate_packed(examples[count // 2 :])]

    def step(model, objective, batches) -> tuple[float, dict[str, torch.Tensor]]:
        """(the step's mean loss, every parameter's whole gradient, an fp32 copy on the device: four objectives'
        of the 0.6B shape are 10 GiB a run, compared there faster than on the host)."""
        model.zero_grad(set_to_none=True)
        # (every model here is built on ctx.dims, nothing offloaded: what the step reads of its placement)
        result = accumulate_gradients(model, objective, StepBatches(batches), Placement(ctx.dims))
        grads = {
            name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().float().clone()
            for name, p in model.named_parameters()
            if p.grad is not None
        }
        model.zero_grad(set_to_none=True)
        return result.loss_sum / max(result.global_units, 1), grads

    def build(group: str, exact: bool) -> tuple:
        """The models of a group of objectives: the policy (seed 0) and its live reference (seed 1), or the
        reward model (seed 0), with the exact or the recipe's numerics."""
        numerics = dict(loss="chunked", overrides=("model.fsdp.param_dtype=float32",)) if exact else dict(loss="auto")
        if group == "reward":
            return (recipe_model(ctx, ctx.shape, seed=0, head=SCORE_HEAD, **numerics).model.train(),)
        policy = recipe_model(ctx, ctx.shape, seed=0, **numerics).model.train()
        return policy, LiveReference(recipe_model(ctx, ctx.shape, seed=1, **numerics).model)

    def run(group: str, models: tuple) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
        if group == "reward":
            return {"reward": step(models[0], RewardObjective(), pair_batches)}
        policy, reference = models
        dpo = PreferenceObjective(PreferenceLoss(loss_type="sigmoid", beta=0.1), reference)
        kto = KTOObjective(KTOWeights(beta=0.1), reference)
        out = {
            "dpo_sigmoid": step(policy, dpo, pair_batches),
            "orpo": step(policy, PreferenceObjective(PreferenceLoss(loss_type="orpo"), None), pair_batches),
            "kto": step(policy, kto, kto_batches),
        }
        reference_points.append(float(kto.reference_point))  # KTO's z (0: clamped, its numerics not in play)
        return out

    def free() -> None:
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()

    # Where the recipe's numerics resolve to the exact ones (the CPU: fp32, the chunked head), the models are built
    # once and both runs use them.
    dtype = compute_dtype("auto", ctx.device.type)
    same = (dtype, resolve_loss_implementation("auto", ctx.device.type, dtype)) == ("float32", "chunked")
    fast: dict = {}
    exact: dict = {}
    reference_points: list[float] = []  # KTO's z: the recipe's numerics', the exact one's
    for group in ("policy", "reward"):
        models = build(group, exact=False)
        fast |= run(group, models)
        if not same:
            del models
            free()
            models = build(group, exact=True)
        with exact_matmuls():
            exact |= run(group, models)
        del models
        free()
    bounds = OBJECTIVES_BF16_BOUNDS["cuda" if ctx.cuda else "cpu"]
    tokens = sum(batch.num_tokens for batch in pair_batches)
    for name, (want_loss, want_grads) in exact.items():
        got_loss, got_grads = fast[name]
        if set(got_grads) != set(want_grads):
            ctx.add(f"objectives_bf16_{name}", False, "the two runs have gradients of different parameters")
            continue
        loss_error = abs(got_loss - want_loss) / max(abs(want_loss), 1e-30)
        difference = sum(float((got_grads[n] - want_grads[n]).double().square().sum()) for n in want_grads)
        norm = sum(float(want_grads[n].double().square().sum()) for n in want_grads)
        grad_error = (difference / max(norm, 1e-300)) ** 0.5
        worst = max(want_grads, key=lambda n: relative(got_grads[n], want_grads[n]))
        ctx.add(
            f"objectives_bf16_{name}",
            math.isfinite(loss_error) and loss_error <= bounds[0] and grad_error <= bounds[1],
            f"loss rel {loss_error:.2g}, gradient rel {grad_error:.2g}",
            f"≤ {bounds[0]:g} / {bounds[1]:g}",
            f"loss {got_loss:.6g} vs fp32 {want_loss:.6g}; worst parameter {worst} "
            f"{relative(got_grads[worst], want_grads[worst]):.2g}; {tokens} tokens in 2 microbatches"
            + (f"; z {reference_points[0]:.4g} vs fp32 {reference_points[1]:.4g}" if name == "kto" else ""),
        )


def check_host_syncs(ctx: Context) -> None:
    """The set-up and two warm steps run on every device (so the CPU smoke test covers them); the count of
    syncs needs CUDA's sync debug mode."""
    from omegaconf import OmegaConf

    from chattune.data.feed import StepBatches
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.train.optimizer import build_optimizer
    from chattune.train.step import UpdateRule, train_step

    model, placement = _model_and_placement(recipe_model(ctx, ctx.shape, layers=4, loss="auto"))  # not compiled
    loss = model.loss_implementation
    optimizer = build_optimizer(
        OmegaConf.create({"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-5}),
        [p for p in model.parameters() if p.requires_grad],
        ctx.device,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    documents = chat_documents(ctx, 16, start=400)
    microbatches = [collate_packed(documents[:8]), collate_packed(documents[8:])]
    for _ in range(2):  # warm: the first steps allocate, autotune and initialise the optimizer's state
        train_step(
            model, TokenCrossEntropy(), StepBatches(microbatches), UpdateRule(optimizer, scheduler, 1.0), placement
        )
    if not ctx.cuda:
        ctx.add("host_syncs", None, "CUDA only (its set-up and two warm steps ran)")
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(
                model, TokenCrossEntropy(), StepBatches(microbatches), UpdateRule(optimizer, scheduler, 1.0), placement
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    allowed = 1 + (len(microbatches) if loss == "cut_cross_entropy" else 0)
    ctx.add(
        "host_syncs",
        len(syncs) <= allowed,
        f"{len(syncs)} in a step of 2 microbatches ({loss})",
        f"≤ {allowed}",
        "; ".join(sorted(set(syncs)))[:300],
    )


@contextmanager
def one_rank_group(ctx: Context):
    """The in-process checks' one-rank group, made by the recipe's own start-up (chattune.distributed's
    init_distributed: the CUDA allocator's settings, the device, the group), as a plain `python recipes/sft.py`
    makes it; the environment restored after."""
    from chattune.distributed import init_distributed, shutdown_distributed

    saved_environment = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)  # a group of its own, whatever the shell or a caller left set
    ctx.dims = init_distributed(ctx.device.type)
    try:
        yield
    finally:
        shutdown_distributed()
        os.environ.clear()
        os.environ.update(saved_environment)


# --- recipe runs (torchrun, one process each) ---


def recipe_environment() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def run_recipe(
    ctx: Context, name: str, overrides: list[str], recipe: str = "sft", env: dict[str, str] | None = None
) -> tuple[Path, str]:
    """Launch a recipe into work/<name> (a fresh directory unless a launch continues it); (output dir, log: its
    standard output and error as one stream, in the order the ranks wrote them). `env`: variables added to the
    launch's environment. The launch is stopped when the budget runs out (OutOfBudget)."""
    output_dir = ctx.work / name
    command = [
        *torchrun_command(str(ROOT / "recipes" / f"{recipe}.py"), nproc=1),
        "--config-name",
        f"{recipe}/local_model",
        f"output_dir={output_dir}",
        f"device={ctx.device.type}",
        "progress=lines",
        "data.report_records=0",
        *overrides,
    ]
    done = run_bounded(
        command, ctx.budget.timeout(), stderr=subprocess.STDOUT, env={**recipe_environment(), **(env or {})}, cwd=ROOT
    )
    log = done.stdout
    (ctx.out / f"{name}.log").write_text(log)
    if done.returncode:
        raise RuntimeError(f"{name} failed ({done.returncode}): {log[-1200:]}")
    return output_dir, log


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def throughput_run(ctx: Context, shape: str, mode: str, steps: int, warmup: int) -> None:
    """One SFT (mode sft), LoRA or QLoRA launch of recipes/sft.py: its tokens/s, MFU and peak memory; after
    the 1.7B SFT run the MFU target."""
    name = f"throughput_{shape}_{mode}"
    if mode == "qlora" and not ctx.cuda:
        ctx.add(name, None, "a 4-bit base is CUDA only")
        return
    if mode == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        ctx.add(name, None, "bitsandbytes is not importable")
        return
    if mode == "fp8" and importlib.util.find_spec("torchao") is None:
        ctx.add(name, None, "torchao is not importable")
        return
    budget, accum = (16384, 2) if ctx.cuda else (2048, 1)
    extra = {
        "sft": [],
        "lora": ["peft=lora"],
        "qlora": ["peft=qlora"],
        "fp8": ["model.fp8=tensorwise"],  # against the sft row's tokens/s: float8's speed-up
        "offload": ["model.fsdp.offload_activations=true"],  # against the sft row's peak and tokens/s
    }[mode]
    directory = model_dir(ctx, shape)
    try:
        output_dir, log = run_recipe(
            ctx,
            name,
            [
                f"model.path={directory}",
                f"data.train=[{ctx.chats}]",
                "data.eval=[]",
                "overwrite=true",
                f"max_steps={steps}",
                "log_every=1",
                "save_every=0",
                "eval_every=0",
                f"data.max_tokens_per_microbatch={budget}",
                f"grad_accum_steps={accum}",
                "data.num_workers=2",
                f"model.fsdp.activation_checkpointing={'true' if shape == '1.7b' or mode == 'offload' else 'false'}",
                *extra,
            ],
            env={"TORCH_LOGS": "recompiles"},  # what compiled again, for steady_steps
        )
    except RuntimeError as error:
        ctx.add(name, False, str(error).splitlines()[0][:200])
        return
    rows = [m for m in metrics(output_dir) if warmup < m["step"] <= steps]
    seconds = sum(m["step_time_s"] for m in rows)
    tokens = sum(m["all_tokens_per_sec_per_device"] * m["step_time_s"] for m in rows) / seconds
    mfu = sum(m.get("mfu", 0.0) * m["step_time_s"] for m in rows) / seconds if "mfu" in rows[-1] else None
    peak = max(m.get("peak_memory_allocated_gib", 0.0) for m in rows) or None
    compute = next((line.split("] ", 1)[-1] for line in log.splitlines() if "] compute:" in line), "")
    # rank 0's start-up estimate (chattune.model.cost.memory), beside the measured peak
    estimated = re.search(r"peak per rank \(the rows at once\)\s+([0-9.]+) GiB", log)
    estimate = float(estimated.group(1)) if estimated else None
    ctx.figures[shape, mode] = {"tokens_per_s": tokens, "mfu": mfu, "peak_gib": peak, "estimated_gib": estimate}
    ctx.add(
        name,
        True,
        f"{tokens:,.0f} tokens/s per device, MFU {mfu:.1%}"
        if mfu is not None
        else f"{tokens:,.0f} tokens/s per device",
        ", ".join(([f"peak {peak:.1f} GiB"] if peak else []) + ([f"estimated {estimate:.2f} GiB"] if estimate else [])),
        compute,
    )
    if ctx.cuda and shape == "1.7b" and mode == "sft" and mfu is not None:
        ctx.add("target_mfu_1.7b", mfu >= 0.45, f"MFU {mfu:.1%}", "≥ 45%")
    check_steady_steps(ctx, f"steady_steps_{shape}_{mode}", metrics(output_dir), log)


STEP_LINE = re.compile(r"\] step (\d+) \|")
SLOW_STEP = 2.0  # a step over this many times the median step time is named
STEADY_AFTER = 2  # the first steps compile (and a 1-token empty microbatch's graphs may come later: named too)


def check_steady_steps(ctx: Context, name: str, rows: list[dict], log: str) -> None:
    """The launch's steps after the first STEADY_AFTER: none over SLOW_STEP times the median step time, and each
    that is, named with what dynamo logged between the step before it and it (`TORCH_LOGS=recompiles`: the
    guard that failed), and with its own wait for data and Python's garbage collection (the step's `data_wait_s`,
    `gc_s`); a slow step with none of these is one that neither recompiled, waited for data nor collected (a
    Triton kernel specialised anew, an allocator's growth, the host)."""
    times = {m["step"]: m["step_time_s"] for m in rows if "step_time_s" in m}
    parts = {m["step"]: ", ".join(f"{key} {m[key]:.2f} s" for key in ("data_wait_s", "gc_s") if key in m) for m in rows}
    steady = sorted(t for step, t in times.items() if step > STEADY_AFTER)
    if not steady:
        ctx.add(name, None, "no steps after the first to compare")
        return
    median = steady[len(steady) // 2]
    said: dict[int, list[str]] = {}  # the recompile lines printed before each step's own line
    pending: list[str] = []
    for line in log.splitlines():
        found = STEP_LINE.search(line)
        if found:
            said[int(found.group(1))], pending = pending, []
        elif "recompil" in line.lower() or "guard" in line.lower():
            pending.append(line.split("] ", 1)[-1].strip()[:160])
    slow = {step: t for step, t in sorted(times.items()) if step > STEADY_AFTER and t > SLOW_STEP * median}
    named = "; ".join(
        f"step {step} {t:.2f} s"
        + (f" ({parts[step]})" if parts.get(step) else "")
        + ": "
        + (" / ".join(said.get(step, [])[:3]) or "no recompile logged")
        for step, t in slow.items()
    )
    recompiled = [step for step, lines in said.items() if step > STEADY_AFTER and lines]
    ctx.add(
        name,
        not slow,
        f"median step {median:.3f} s; " + (named or "none slower than 2x"),
        f"no step after the first {STEADY_AFTER} over {SLOW_STEP:g}x the median",
        f"steps that recompiled: {recompiled or 'none'}",
    )


LONG_ROWS = (32768, 65536, 131072)  # tokens a microbatch, tried in turn until one does not run


def longest_row(ctx: Context, shape: str) -> None:
    """The longest packed row one GPU trains (one step, activation checkpointing), without and with activations
    offloaded to host memory (`model.fsdp.offload_activations`): each setting tries LONG_ROWS in turn until a launch
    fails (out of memory) and reports the longest that ran with its peak. CUDA only."""
    name = f"longest_row_{shape}"
    if not ctx.cuda:
        ctx.add(name, None, "CUDA only")
        return
    longest = {}
    for offload in (False, True):
        for tokens in LONG_ROWS:
            try:
                output_dir, _ = run_recipe(
                    ctx,
                    f"{name}_{tokens}{'_offload' if offload else ''}",
                    [
                        f"model.path={model_dir(ctx, shape)}",
                        f"data.train=[{ctx.chats}]",
                        "data.eval=[]",
                        "overwrite=true",
                        "max_steps=1",
                        "save_every=0",
                        "eval_every=0",
                        f"data.max_tokens_per_microbatch={tokens}",
                        "model.fsdp.activation_checkpointing=true",
                        f"model.fsdp.offload_activations={'true' if offload else 'false'}",
                    ],
                )
            except RuntimeError:  # out of memory, most likely: the log is in the output folder
                break
            peak = max(m.get("peak_memory_allocated_gib", 0.0) for m in metrics(output_dir))
            longest[offload] = (tokens, peak)
    described = "; ".join(
        f"{'offloaded' if offload else 'plain'}: "
        + (f"{longest[offload][0]:,} tokens ({longest[offload][1]:.1f} GiB)" if offload in longest else "none ran")
        for offload in (False, True)
    )
    plain, offloaded = longest.get(False, (0, 0.0))[0], longest.get(True, (0, 0.0))[0]
    ctx.add(name, offloaded >= plain and offloaded > 0, described, "offloaded ≥ plain", f"tried {LONG_ROWS}")


def compare_with_trl(ctx: Context, shape: str, steps: int, warmup: int) -> None:
    """TRL's SFTTrainer on the throughput run's model, chats and token budget (bench_gpu.run_trl): the targets
    ≥ 3× its tokens/s and peak memory ≤ its."""
    if importlib.util.find_spec("trl") is None:
        ctx.add(f"trl_{shape}", None, "trl is not importable: no comparison")
        return
    if (shape, "sft") not in ctx.figures:
        ctx.add(f"trl_{shape}", None, f"throughput_{shape}_sft has no figure to compare with")
        return
    run = {"0.6b": "short06", "1.7b": "short17"}[shape]
    arguments = argparse.Namespace(work=ctx.work / "trl", steps=steps, warmup=warmup)
    arguments.work.mkdir(parents=True, exist_ok=True)
    try:
        theirs = bench_gpu.run_trl(run, model_dir(ctx, shape), ctx.chats, arguments, ctx.budget.timeout())
    except SystemExit as error:
        ctx.add(f"trl_{shape}", False, str(error))
        return
    ours = ctx.figures[shape, "sft"]
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
    ctx.add(
        f"target_vs_trl_{shape}", ratio >= 3.0, f"{ratio:.2f}× TRL's {theirs['tokens_per_s']:,.0f} tokens/s", "≥ 3×"
    )
    if ours["peak_gib"] is not None:
        ctx.add(
            f"target_memory_vs_trl_{shape}",
            ours["peak_gib"] <= theirs["peak_memory_gib"],
            f"{ours['peak_gib']:.1f} GiB vs TRL's {theirs['peak_memory_gib']:.1f} GiB",
            "≤ TRL's",
        )


def cuda_test_files() -> list[str]:
    """The test files with CUDA-only tests (a `torch.cuda.is_available()` skip), and
    tests/unit/model/packed/test_varlen_fallback.py (torch's varlen_attn as the GPU machine's torch has it)."""
    files = {
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        if "cuda.is_available()" in path.read_text()
    }
    return sorted(files | {"tests/unit/model/packed/test_varlen_fallback.py"})


def cuda_tests_command() -> list[str]:
    """The pytest command of `cuda_tests`: runs where pytest does but pytest-xdist is absent (the carry folder)."""
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",  # pyproject's `--dist worksteal` needs pytest-xdist, which the carry folder does not hold
        *cuda_test_files(),
        "-k",
        "cuda or varlen_fallback",  # -k matches module names too: every test of test_varlen_fallback.py
    ]


def cuda_tests_environment() -> dict[str, str]:
    """The recipes' environment without PYTEST_ADDOPTS: a shell's xdist options (`--dist load`) would stop the
    plugin-less pytest as pyproject's addopts did."""
    return {name: value for name, value in recipe_environment().items() if name != "PYTEST_ADDOPTS"}


def cuda_tests(ctx: Context) -> None:
    """The project's CUDA-only tests (`-k cuda` over cuda_test_files()) and the varlen stand-ins' tests (whose
    signature test then compares them with this machine's torch), a subprocess: CUDA only."""
    if not ctx.cuda:
        ctx.add("cuda_tests", None, "CUDA only")
        return
    importable = subprocess.run([sys.executable, "-c", "import pytest"], capture_output=True, text=True)
    if importable.returncode:  # absent, or a dependency of it missing (pygments for pytest 9)
        ctx.add("cuda_tests", None, "pytest does not import", detail=importable.stderr.strip()[-300:])
        return
    command = cuda_tests_command()
    done = run_bounded(command, ctx.budget.timeout(), env=cuda_tests_environment(), cwd=ROOT)
    log = done.stdout + done.stderr
    (ctx.out / "cuda_tests.log").write_text(log)
    counts = re.compile(r"\d+ (passed|failed|error|deselected|skipped)")
    summary = next(
        (line.strip("= ") for line in reversed(log.splitlines()) if counts.search(line)), f"exit {done.returncode}"
    )
    skipped = "; ".join(line.split("] ", 1)[-1] for line in log.splitlines() if line.startswith("SKIPPED"))
    ctx.add(
        "cuda_tests",
        done.returncode == 0 and "passed" in summary,
        summary,
        "all selected pass",
        f"{shlex.join(command[3:])}; {skipped}"[:300],
    )


def resume_and_export(ctx: Context) -> None:
    """8 steps straight against 4 + stop + resume + 4 (async checkpoints, evaluation on); the exports. On the CPU
    (the smoke test of this script) 4 steps against 2 + 2: the same launches, their code paths, at half the steps."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    eval_file = ctx.work / "eval.jsonl"
    eval_file.write_text("\n".join(ctx.chats.read_text().splitlines()[-48:]) + "\n")
    budget = 4096 if ctx.cuda else 1024
    steps = 8 if ctx.cuda else 4
    half = steps // 2
    common = [
        f"model.path={model_dir(ctx, ctx.shape)}",
        f"data.train=[{ctx.chats}]",
        f"data.eval=[{eval_file}]",
        f"max_steps={steps}",
        "log_every=1",
        f"eval_every={half}",
        "save_async=true",
        "export.dtype=float32",
        f"data.max_tokens_per_microbatch={budget}",
        "grad_accum_steps=2",
        # loader workers resumed with their stream; the CPU smoke test leaves them out (two more processes a
        # launch on 2 cores; tests/e2e/test_resume.py resumes them)
        f"data.num_workers={2 if ctx.cuda else 0}",
    ]
    started = time.perf_counter()
    straight, _ = run_recipe(ctx, "resume_straight", [*common, "save_every=3", "overwrite=true"])  # saves 3, 6
    resumed, _ = run_recipe(
        ctx, "resume_resumed", [*common, "save_every=3", "overwrite=true", f"stop_after_step={half}"]
    )
    resumed, log = run_recipe(
        ctx, "resume_resumed", [*common, f"save_every={half}"]
    )  # resumes at the stop, saves at the end
    ctx.seconds["resume_and_export"] = time.perf_counter() - started
    if "resumed from" not in log:
        ctx.add("resume_exact", False, "the second launch did not resume")
        return
    losses = {m["step"]: m["loss"] for m in metrics(straight) if "loss" in m}
    again = {m["step"]: m["loss"] for m in metrics(resumed) if "loss" in m}
    differing = [step for step in losses if losses[step] != again.get(step)]
    ctx.add(
        "resume_exact",
        not differing and sorted(losses) == list(range(1, steps + 1)),
        f"bitwise equal losses at steps 1-{steps}" if not differing else f"losses differ at steps {differing}",
        "bitwise",
        f"max rel diff {max(abs(losses[s] - again[s]) / abs(losses[s]) for s in losses):.2g}",
    )

    def exported(run: Path) -> dict[str, torch.Tensor]:
        index = json.loads((run / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
        weights = {}
        for file in sorted(set(index.values())):
            weights.update(load_file(run / "hf" / file))
        return weights

    checkpoint = ctx.work / "resume_masters.pt"
    dcp_to_torch_save(resumed / "checkpoints" / f"step_{steps}", checkpoint)
    masters = {name.removeprefix("hf_model."): value for name, value in torch.load(checkpoint)["model"].items()}
    weights = exported(resumed)
    mismatched = [name for name, value in weights.items() if not torch.equal(value, masters.get(name, value + 1))]
    # A tied output layer is one parameter, written once (under the embedding's name).
    unwritten = [
        name
        for name in masters
        if name not in weights and not any(torch.equal(masters[name], value) for value in weights.values())
    ]
    ctx.add(
        "export_masters",
        not mismatched and not unwritten,
        f"{len(weights) - len(mismatched)} of {len(weights)} exported tensors equal to the step-{steps} checkpoint's "
        f"fp32 masters; {len(unwritten)} masters not written",
        "all, bitwise",
        ", ".join((mismatched + unwritten)[:3]),
    )
    after_eval = exported(straight)
    shares = {
        name: float((after_eval[name].bfloat16().float() != after_eval[name]).float().mean())
        for name in ("model.embed_tokens.weight", "model.norm.weight")
    }
    ctx.add(
        "export_after_eval",
        min(shares.values()) > 0.5,
        "share of values that are not bf16 values: " + ", ".join(f"{k} {v:.2f}" for k, v in shares.items()),
        "> 0.5 (bf16 copies: 0)",
    )


# torchao's low-bit AdamW on FSDP2's shards (issue 68, item 6): the documented per-step tolerance against fp32
# AdamW (docs/memory.md, "Low-bit optimizer states": 0.02 nats for 8-bit, 0.4 for 4-bit; FP8 states have no
# documented figure yet: held to 8-bit's, provisionally). Measured on the CPU over 50 steps of the tiny model.
LOW_BIT_STEP_TOLERANCE = {"AdamW8bit": 0.02, "AdamW4bit": 0.4, "AdamWFp8": 0.02}


def check_low_bit(ctx: Context) -> None:
    """torchao.optim.AdamW8bit, AdamW4bit and AdamWFp8 as the recipe builds them (chattune.train.optimizer:
    each class's inductor cache of its own), 20 steps of the recipe's model (4 layers of the 0.6B shape, bf16
    compute) against fp32 AdamW on the same rows, every step's loss within LOW_BIT_STEP_TOLERANCE; the 8-bit run
    saves its model and optimizer asynchronously after step 10 (chattune.checkpoint.checkpoint: DCP through the
    pinned stager) and a second model resumed from that save gives steps 11-20 bit for bit. On the CPU 8 steps
    of the tiny shape, the save after step 4, torchao's step eager (dynamo off: it compiles per shard shape,
    tens of seconds on the CPU)."""
    from chattune.checkpoint.checkpoint import BackgroundSaves, load_sharded, save_checkpoint
    from chattune.checkpoint.run_state import model_and_optimizer
    from chattune.data.feed import StepBatches
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.train.optimizer import build_optimizer
    from chattune.train.step import UpdateRule, train_step

    if importlib.util.find_spec("torchao") is None:
        ctx.add("low_bit", None, "torchao is not importable")
        return
    steps, layers = (20, 4) if ctx.cuda else (8, None)
    saved_after = steps // 2
    documents = chat_documents(ctx, 4 * steps, start=500)
    rows = [collate_packed(documents[4 * i : 4 * i + 4]) for i in range(steps)]
    eager = nullcontext() if ctx.cuda else patch.dict(os.environ, TORCHDYNAMO_DISABLE="1")  # read at each torch.compile

    def build(optimizer: str):
        cfg = recipe_config(ctx, ctx.shape, layers, overrides=(f"optimizer._target_={optimizer}", "optimizer.lr=1e-3"))
        model, placement = _model_and_placement(built_from(ctx, cfg))
        made = build_optimizer(cfg.optimizer, [p for p in model.parameters() if p.requires_grad], ctx.device)
        rule = UpdateRule(made, torch.optim.lr_scheduler.LambdaLR(made, lambda step: 1.0), None)
        return model, made, rule, placement

    def train(model, placement, rule, first: int, last: int) -> dict[int, float]:
        losses = {}
        for step in range(first, last + 1):
            result, _ = train_step(model, TokenCrossEntropy(), StepBatches([rows[step - 1]]), rule, placement)
            losses[step] = result.loss_sum / result.global_units
        return losses

    with eager:
        model, _, rule, placement = build("torch.optim.AdamW")
        reference = train(model, placement, rule, 1, steps)
        del model, rule
        for name, tolerance in LOW_BIT_STEP_TOLERANCE.items():
            model, optimizer, rule, placement = build(f"torchao.optim.{name}")
            saves = BackgroundSaves(ctx.device) if name == "AdamW8bit" else None
            losses = train(model, placement, rule, 1, saved_after)
            if saves is not None:
                checkpoint = save_checkpoint(
                    ctx.work / "low_bit",
                    saved_after,
                    model_and_optimizer(model, optimizer),
                    {"world_size": 1},
                    background=saves,
                )
            losses |= train(model, placement, rule, saved_after + 1, steps)  # the save in flight while these step
            worst = max(abs(losses[s] - reference[s]) for s in reference)
            ctx.add(
                f"low_bit_{name}",
                worst <= tolerance,
                f"worst step {worst:.4f} nats from fp32 AdamW over {steps} steps; last {losses[steps]:.4f} vs "
                f"{reference[steps]:.4f}",
                f"≤ {tolerance:g} a step",
            )
            del model, optimizer, rule
            if saves is None:
                continue
            saves.close()  # written and committed
            straight = losses
            model, optimizer, rule, placement = build(f"torchao.optim.{name}")
            load_sharded(checkpoint, model_and_optimizer(model, optimizer))
            resumed = train(model, placement, rule, saved_after + 1, steps)
            differing = [s for s in resumed if resumed[s] != straight[s]]
            ctx.add(
                "low_bit_resume",
                not differing,
                f"steps {saved_after + 1}-{steps} after an async save and a resume: "
                + (f"differ at {differing}" if differing else "bit for bit"),
                "bitwise equal",
            )
            del model, optimizer, rule


OFFLOAD_TOKENS = 16384  # the row of the offload check on CUDA (a long row: what offloading is for)
OFFLOAD_REPEATS = 3  # a race between the copies and the compute shows as a gradient that differs in some repeat


def check_offload_races(ctx: Context) -> None:
    """`model.fsdp.offload_activations=true` (chattune.parallel.offload: the saved tensors copied to pinned host
    memory on a side stream and back in the backward) in bf16 on one 16k-token row, eager and compiled, with and
    without activation checkpointing (rows `offload_{eager,compiled}_{ac,noac}`): OFFLOAD_REPEATS backwards each
    give the plain run's gradients as exactly as the plain run repeats itself (bit for bit where it does: a copy
    that raced the compute changes some repeat); the peak lower than the plain run's; the bytes moved at most the
    saved tensors' unique storages (each moved once however often it is saved; counted eager, by a hook of this
    check's around the plain forward). On the CPU the tiny shape, eager (the hooks copy on the host)."""
    from chattune.data.feed import StepBatches
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.parallel.offload import MIN_OFFLOAD_BYTES, MIN_SLAB_BYTES, _is_weight
    from chattune.train.step import accumulate_gradients

    documents, tokens = [], 0
    for document in chat_documents(ctx, 400 if ctx.cuda else 8, start=1100):
        if ctx.cuda and tokens + len(document.input_ids) > OFFLOAD_TOKENS:
            break
        documents.append(document)
        tokens += len(document.input_ids)
    row = StepBatches([collate_packed(documents)])
    layers = 4 if ctx.cuda else None

    def gradients(model, placement, hooks=None) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with hooks or nullcontext():
            accumulate_gradients(model, TokenCrossEntropy(), row, placement)
        return {n: p.grad.to_local().clone() for n, p in model.named_parameters() if p.grad is not None}

    unique: dict[int, int] = {}

    def count(tensor: torch.Tensor) -> torch.Tensor:  # what the offload could move: its storages, once
        if tensor.device == ctx.device and tensor.numel() * tensor.element_size() >= MIN_OFFLOAD_BYTES:
            if not _is_weight(tensor):
                unique[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    for compiled in (False, True) if ctx.cuda else (False,):
        for checkpointing in (False, True):
            name = f"offload_{'compiled' if compiled else 'eager'}_{'ac' if checkpointing else 'noac'}"
            runs, peaks, moved, host, ahead = {}, {}, 0, 0, 0
            for offload in (False, True):
                settings = (
                    f"model.fsdp.activation_checkpointing={str(checkpointing).lower()}",
                    f"model.fsdp.offload_activations={str(offload).lower()}",
                )
                model, placement = _model_and_placement(
                    built_from(ctx, recipe_config(ctx, ctx.shape, layers, compile=compiled, overrides=settings))
                )
                gradients(model, placement)  # (warm: compiles, allocates)
                if ctx.cuda:
                    torch.cuda.reset_peak_memory_stats()
                counting = not offload and not compiled
                if counting:
                    unique.clear()
                hooks = torch.autograd.graph.saved_tensors_hooks(count, lambda t: t) if counting else None
                runs[offload] = [
                    gradients(model, placement, hooks if i == 0 else None)
                    for i in range(OFFLOAD_REPEATS if offload else 2)
                ]
                peaks[offload] = torch.cuda.max_memory_allocated() / 2**30 if ctx.cuda else None
                if offload:
                    offload_hooks = placement.activation_offload
                    assert offload_hooks is not None
                    moved, host, ahead = (
                        offload_hooks.offloaded_bytes,
                        offload_hooks.host_bytes,
                        offload_hooks.brought_ahead,
                    )
                del model
            plain = runs[False][0]
            noise = max(relative(runs[False][1][n], plain[n]) for n in plain)
            errors_ = [max(relative(grads[n], plain[n]) for n in plain) for grads in runs[True]]
            exact = all(e <= 4 * noise for e in errors_)
            lower = peaks[True] < peaks[False] if ctx.cuda else True
            storages = sum(unique.values()) if not compiled else None
            once = storages is None or moved <= storages
            # one slab of what a forward moved (each copy's start aligned; a first slab's least size), not a
            # power-of-two pinned block each
            slab_fits = host <= 1.05 * moved + MIN_SLAB_BYTES
            peak_text = f"; peak {peaks[True]:.2f} vs {peaks[False]:.2f} GiB" if ctx.cuda else ""
            share = f"; moved {moved / 2**20:,.1f} MiB" + (
                f" of {storages / 2**20:,.1f} MiB saved storages" if storages else ""
            )
            share += f"; host slab {host / 2**20:,.1f} MiB; {ahead} copies back started ahead of their use"
            ctx.add(
                name,
                exact and lower and once and slab_fits,
                f"{len(errors_)} backwards {', '.join(f'{e:.2g}' for e in errors_)} from plain "
                f"(plain against itself {noise:.2g}){peak_text}{share}",
                "≤ 4x plain's own spread (0: bitwise); peak lower; moved ≤ unique storages; slab ≤ 1.05x moved + 64 MiB",
                f"{tokens:,} tokens",
            )


CPU_OFFLOAD_TOLERANCE = 1e-5  # the same bf16 compute; only AdamW's kernel differs (the host's against CUDA's fused)


def check_cpu_offload(ctx: Context) -> None:
    """`model.fsdp.cpu_offload=true` as the recipe builds it (bf16 compute, layers compiled, activation
    checkpointing: what the memory advice tells an 8B run on one GPU to do) against the same model without it:
    two steps on the same rows, every parameter within CPU_OFFLOAD_TOLERANCE relative of the plain run's (the
    shards, their gradients and AdamW's step on the host, copied in for each all-gather); the second step's time
    of each, the offloaded one's slowdown as its figure. On the CPU the tiny shape, layers eager (compiling is the
    `compile_vs_eager` item's), fp32."""
    from chattune.data.feed import StepBatches
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.train.optimizer import build_optimizer
    from chattune.train.step import UpdateRule, train_step

    documents = chat_documents(ctx, 8, start=700)
    rows = [collate_packed(documents[:4]), collate_packed(documents[4:])]
    layers = 4 if ctx.cuda else None
    after, seconds = {}, {}
    for name, offload in (("plain", False), ("cpu_offload", True)):
        settings = (f"model.fsdp.cpu_offload={str(offload).lower()}", "model.fsdp.activation_checkpointing=true")
        cfg = recipe_config(ctx, ctx.shape, layers, compile=ctx.cuda, overrides=(*settings, "optimizer.lr=1e-3"))
        model, placement = _model_and_placement(built_from(ctx, cfg))
        optimizer = build_optimizer(cfg.optimizer, [p for p in model.parameters() if p.requires_grad], ctx.device)
        rule = UpdateRule(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), None)
        for row in rows:
            synchronize(ctx)
            started = time.perf_counter()
            train_step(model, TokenCrossEntropy(), StepBatches([row]), rule, placement)
            synchronize(ctx)
            seconds[name] = time.perf_counter() - started  # the last: the first compiles and makes the states
        after[name] = {n: p.full_tensor().float().cpu() for n, p in model.named_parameters()}
        del model, optimizer, rule
    worst = max(relative(after["cpu_offload"][n], after["plain"][n]) for n in after["plain"])
    ctx.add(
        "cpu_offload",
        worst <= CPU_OFFLOAD_TOLERANCE,
        f"parameters after 2 steps within {worst:.2g} of the plain run's; step 2 {seconds['cpu_offload']:.3f} s "
        f"offloaded vs {seconds['plain']:.3f} s ({seconds['cpu_offload'] / seconds['plain']:.1f}x)",
        f"≤ {CPU_OFFLOAD_TOLERANCE:g}",
    )


SNAPSHOT_OVERLAP = 0.5  # at most this share of the staged copy's own time (bytes / bandwidth) added to a step
SNAPSHOT_LAYERS = 8  # of the 0.6B on CUDA: 3.3 GB of state a step (the 8-minute call; 28 layers: 7.2 GB)


def check_snapshots(ctx: Context) -> None:
    """`snapshot_steps=true`'s per-step copy of the run state to the host (chattune.checkpoint.snapshot: pinned
    buffers, a side stream, the next optimizer step waits for it). `snapshot_overhead`: steps with a snapshot
    staged after each against the same steps without, the added time per step beside the copy's own time (the
    state's bytes over the device-to-host bandwidth measured here): at most what the copy takes beyond the plain
    step plus SNAPSHOT_OVERLAP of it, since the copy overlaps the next step's forward and backward (CUDA only: on
    the host the copy is the step's). On CUDA SNAPSHOT_LAYERS of the 0.6B and 16,384-token rows. Then a
    stop signal (SIGTERM, to a handler of this check's) has the watcher write the staged step while the state has
    moved on: `snapshot_exact`: a fresh model loaded from it holds that step's weights and AdamW states bit for bit;
    `snapshot_resume`: its next step's loss equals the uninterrupted run's, bit for bit."""
    from chattune.checkpoint.checkpoint import load_checkpoint
    from chattune.checkpoint.run_state import model_and_optimizer
    from chattune.checkpoint.snapshot import Snapshots
    from chattune.data.feed import StepBatches
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.train.optimizer import build_optimizer
    from chattune.train.step import UpdateRule, train_step

    warm, timed = (3, 6) if ctx.cuda else (2, 3)
    if ctx.cuda:  # a training row (16,384 tokens), not a few chats: the copy overlaps what a real step computes
        rows = [_row_of(ctx, 16384)] * (warm + timed + 1)
    else:
        documents = chat_documents(ctx, 4 * (warm + timed + 1), start=900)
        rows = [collate_packed(documents[4 * i : 4 * i + 4]) for i in range(len(documents) // 4)]
    layers = SNAPSHOT_LAYERS if ctx.cuda else None

    def build(seed: int):
        cfg = recipe_config(ctx, ctx.shape, layers, seed=seed, compile=ctx.cuda, overrides=("optimizer.lr=1e-3",))
        model, placement = _model_and_placement(built_from(ctx, cfg))
        optimizer = build_optimizer(cfg.optimizer, [p for p in model.parameters() if p.requires_grad], ctx.device)
        return (
            model,
            optimizer,
            UpdateRule(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), None),
            placement,
        )

    def step(model, placement, rule, row) -> float:
        result, _ = train_step(model, TokenCrossEntropy(), StepBatches([row]), rule, placement)
        return float(result.loss_sum / result.global_units)

    def local_state(model, optimizer) -> dict[str, torch.Tensor]:
        """Every local shard of the weights and AdamW's states, cloned on the device."""
        found = {f"model.{n}": p.to_local().detach().clone() for n, p in model.named_parameters()}
        for index, parameter in enumerate(model.parameters()):
            for key, value in optimizer.state[parameter].items():
                if torch.is_tensor(value) and value.dim():
                    found[f"optimizer.{index}.{key}"] = getattr(value, "to_local", lambda v=value: v)().clone()
        return found

    model, optimizer, rule, placement = build(0)
    state = model_and_optimizer(model, optimizer)
    snapshots = Snapshots(ctx.work / "snapshots" / "checkpoints", state, {"world_size": 1}, {}, ctx.device, optimizer)
    for row in rows[:warm]:
        step(model, placement, rule, row)
    state_bytes = sum(t.numel() * t.element_size() for t in local_state(model, optimizer).values())
    bandwidth = _host_bandwidth(ctx, min(max(state_bytes, 2**26), 2**30))
    seconds = {}
    for phase, staged in (("plain", False), ("snapshots", True)):
        synchronize(ctx)
        started = time.perf_counter()
        for number in range(warm, warm + timed):  # the same rows: their lengths decide a step's time
            step(model, placement, rule, rows[number])
            if staged:
                snapshots.stage(timed + number + 1)
        synchronize(ctx)
        seconds[phase] = (time.perf_counter() - started) / timed
    added, copy_alone = seconds["snapshots"] - seconds["plain"], state_bytes / bandwidth
    # A copy that overlaps the next step perfectly still adds what it takes beyond that step's compute
    unhidden = max(copy_alone - seconds["plain"], 0.0)
    ctx.add(
        "snapshot_overhead",
        added <= unhidden + SNAPSHOT_OVERLAP * copy_alone if ctx.cuda else None,
        f"{added * 1e3:+.1f} ms a step ({seconds['plain'] * 1e3:.1f} ms plain); the copy alone "
        f"{copy_alone * 1e3:.1f} ms ({state_bytes / 2**20:,.1f} MiB at {bandwidth / 2**30:.1f} GiB/s)",
        f"≤ the copy beyond the step ({unhidden * 1e3:.1f} ms) + {SNAPSHOT_OVERLAP:g} of the copy alone",
        "" if ctx.cuda else "CUDA only: on the host the copy is part of the step",
    )
    last = warm + 2 * timed  # the staged step
    expected = local_state(model, optimizer)
    straight = step(model, placement, rule, rows[-1])  # the state moves on; the staged copy must not
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # (the watcher wakes on the signal's byte)
    try:
        snapshots.watch()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 120
        while snapshots.written_step != last and time.monotonic() < deadline:
            time.sleep(0.05)
        written = snapshots.written_step == last
        snapshots.settle()
    finally:
        snapshots.close()
        signal.signal(signal.SIGTERM, previous)
    del model, optimizer, rule, state
    model, optimizer, rule, placement = build(1)  # other weights, replaced by the load
    step(model, placement, rule, rows[0])  # (AdamW's states exist, to be replaced)
    load_checkpoint(ctx.work / "snapshots" / "checkpoints" / f"step_{last}", model_and_optimizer(model, optimizer))
    loaded = local_state(model, optimizer)
    differing = [key for key in expected if not torch.equal(loaded.get(key, torch.empty(0)), expected[key])]
    ctx.add(
        "snapshot_exact",
        written and not differing and loaded.keys() == expected.keys(),
        f"step {last}'s snapshot written on SIGTERM after step {last + 1} ran: "
        + (
            "not written"
            if not written
            else f"{len(differing)} of {len(expected)} tensors differ"
            if differing
            else f"{len(expected)} tensors bit for bit"
        ),
        "bitwise equal",
    )
    resumed = step(model, placement, rule, rows[-1])
    ctx.add(
        "snapshot_resume",
        resumed == straight,
        f"step {last + 1}'s loss after the resume {resumed!r} vs {straight!r}",
        "bitwise equal",
    )
    del model, optimizer, rule


def _host_bandwidth(ctx: Context, size: int) -> float:
    """Bytes a second of the fastest of three copies of `size` bytes from the device into pinned host memory (on the CPU: a memcpy)."""
    source = torch.empty(size, dtype=torch.uint8, device=ctx.device)
    target = torch.empty(size, dtype=torch.uint8, pin_memory=ctx.cuda)
    fastest = math.inf
    for _ in range(3):  # (the first warms)
        synchronize(ctx)
        started = time.perf_counter()
        target.copy_(source, non_blocking=ctx.cuda)
        synchronize(ctx)
        fastest = min(fastest, time.perf_counter() - started)
    return size / fastest


def synchronize(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


# The memory estimate held as a bound (issue 68, item 9): every combination of the loss head, activation
# checkpointing and activation offload; the 0.6B shape at 16k tokens on CUDA. The bound is the documented one
# (docs/memory.md): the estimate within 10% of the peak torch allocated.
ESTIMATE_BOUND_ROWS = [
    (loss, checkpointing, offload)
    for loss in ("cut_cross_entropy", "chunked")
    for checkpointing in (True, False)
    for offload in (False, True)
]
ESTIMATE_BOUND = 0.10
# 8 of the 0.6B's 28 layers on CUDA: each layer's activations, the head's rows and the states are what a whole
# model holds (layer by layer the same arithmetic), at two fifths of the build time (the 8-minute call, item 9)
ESTIMATE_BOUND_LAYERS = 8


def _row_of(ctx: Context, tokens: int) -> PackedBatch:
    """One packed row of exactly `tokens` tokens of real chats (the last one cut where the row ends)."""
    documents, total, start = [], 0, 0
    while total < tokens:
        for document in chat_documents(ctx, 200, start=start):
            take = min(len(document.input_ids), tokens - total)
            documents.append(Document(document.doc_id, document.input_ids[:take], document.labels[:take]))
            total += take
            if total == tokens:
                break
        start += 200
    return collate_packed(documents)


def check_estimate_bound(ctx: Context) -> None:
    """The start-up memory estimate (chattune.model.cost.memory, from the recipe's own config) against the peak torch
    allocated in two optimizer steps of the model built from that config, one row per combination of
    ESTIMATE_BOUND_ROWS (layers compiled, as `model.compile=auto` compiles them on CUDA): within 10% of the peak;
    the first row also says what the device holds that torch does not count (total - free - reserved: the CUDA
    context, NCCL's and cuBLAS's buffers). On the CPU the estimates are made and the steps run on the tiny shape
    (chunked rows: the CPU's CCE is its torch implementation), no peak to hold them to: SKIP."""
    from chattune.data.feed import StepBatches
    from chattune.model.cost.memory import estimate, hf_config_of, inputs_of
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.train.optimizer import build_optimizer
    from chattune.train.step import UpdateRule, train_step

    tokens = 16384 if ctx.cuda else 256
    row = _row_of(ctx, tokens)
    rows = ESTIMATE_BOUND_ROWS if ctx.cuda else [r for r in ESTIMATE_BOUND_ROWS if r[0] == "chunked"]
    figures = []
    for loss, checkpointing, offload in rows:
        name = f"estimate_bound_{'cce' if loss == 'cut_cross_entropy' else loss}_{'ac' if checkpointing else 'noac'}"
        name += "_offload" if offload else ""
        keys = (
            f"data.max_tokens_per_microbatch={tokens}",
            f"model.fsdp.activation_checkpointing={str(checkpointing).lower()}",
            f"model.fsdp.offload_activations={str(offload).lower()}",
        )
        cfg = recipe_config(
            ctx, ctx.shape, ESTIMATE_BOUND_LAYERS if ctx.cuda else None, compile=ctx.cuda, loss=loss, overrides=keys
        )
        inputs = inputs_of(cfg, hf_config_of(cfg, len(tokenizer(ctx))), ctx.dims, on_cuda=ctx.cuda)
        estimated = estimate(inputs).total
        gc.collect()
        if ctx.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(ctx.device)
        before = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
        model, placement = _model_and_placement(built_from(ctx, cfg))
        optimizer = build_optimizer(cfg.optimizer, [p for p in model.parameters() if p.requires_grad], ctx.device)
        rule = UpdateRule(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), None)
        for _ in range(2):  # the second step holds the optimizer's states the first made
            train_step(model, TokenCrossEntropy(), StepBatches([row]), rule, placement)
        if ctx.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(ctx.device) - before
            free, total = torch.cuda.mem_get_info(ctx.device)
            uncounted = total - free - torch.cuda.memory_reserved(ctx.device)
        del model, optimizer, rule
        if not ctx.cuda:
            figures.append(f"{name} {estimated / 2**30:.3f} GiB")
            continue
        error = (estimated - peak) / peak if estimated is not None else math.inf
        extra = f"; not counted by torch {uncounted / 2**30:.2f} GiB" if not figures else ""
        figures.append(name)
        ctx.add(
            name,
            abs(error) <= ESTIMATE_BOUND,
            f"estimated {estimated / 2**30 if estimated else float('nan'):.2f} GiB, peak {peak / 2**30:.2f} GiB "
            f"({error:+.1%}){extra}",
            f"within ±{ESTIMATE_BOUND:.0%}",
        )
    if not ctx.cuda:
        ctx.add("estimate_bound", None, "no device peak on the CPU; estimated " + ", ".join(figures))


# --- the items, in priority order, within a budget ---

# Estimated seconds of each item: (one H100/H200, the CPU smoke test's tiny shape on two cores). The CUDA column
# is each item's work (docs/gpu-check.md, "The 8-minute call") priced at what the first GPU run measured
# (2026-11-26, one H200, torch 2.11; BENCHMARKS.md), times GPU_MARGIN: a recipe build of the 0.6B shape (random
# weights made on the host, sharded, moved: packed_vs_hf's two 28-layer builds and a step took 26 s) by its layers
# (the tokenizer's 151,669-row embedding is 155M of a 4-layer model's 215M parameters), the first compile of a
# decoder layer's graphs in the process (compile_vs_eager: 28 s for two 4-layer builds, the compile and 23 small
# steps; later builds of the same layer reuse them), a forward and backward of 16,384 tokens by layers (the 0.6B
# launch's steady steps: 0.29-0.36 s for 2 x 16,384 tokens over 28 layers), and what an item does besides. A
# launch is start-up (torchrun, tokenizing, building, compiling, the two slow first steps) plus its steps: 0.6B
# SFT 71 s for 12 steps, 1.7B 98 s, 0.6B LoRA 83 s; QLoRA and TRL are not measured yet (guesses from the
# ../shared/gpu/README.md baseline). The CPU column is the smoke test's own time on two cores. The first GPU run of
# an item replaces its pricing with its measured seconds (gpu_check.json's `seconds`); --estimate-scale adjusts
# them all.
BUILD_SECONDS = {4: 4.5, 8: 6.0, 28: 12.0}  # a recipe build of the 0.6B shape by its decoder layers
FIRST_COMPILE_SECONDS = 15.0  # a decoder layer's graphs, the first time in the process, per checkpointing setting
STEP_SECONDS = {4: 0.04, 8: 0.06, 28: 0.16}  # a forward and backward of 16,384 tokens by decoder layers
GPU_MARGIN = 1.25  # the pricing's error: a margin, not a measurement


def gpu_seconds(
    builds: dict[int, int], compiles: int = 0, steps: dict[int, float] | None = None, other: float = 0.0
) -> int:
    """An item's CUDA estimate: `builds` (decoder layers: how many recipe builds), `compiles` (first compiles of a
    layer's graphs), `steps` (decoder layers: forwards and backwards, in 16,384-token rows), `other` seconds."""
    work = sum(BUILD_SECONDS[layers] * count for layers, count in builds.items())
    work += FIRST_COMPILE_SECONDS * compiles + other
    work += sum(STEP_SECONDS[layers] * rows for layers, rows in (steps or {}).items())
    return math.ceil(GPU_MARGIN * work)


ESTIMATES = {
    # issue 68's ten items first (the 24-step launch is plan()'s)
    "float8": (gpu_seconds({4: 2}, steps={4: 1.5}, other=5), 4),  # + torchao's conversion, three float8 layers
    "offload_races": (gpu_seconds({4: 8}, compiles=2, steps={4: 28}), 6),  # 4 x (1 warm + 2 or 3) backwards each
    "cce_anchor": (gpu_seconds({}, other=4), 0),  # one CCE and one chunked backward of 8192 tokens; CUDA only
    "tensor_parallel": (gpu_seconds({4: 4}, steps={4: 2}), 8),
    "in_backward": (gpu_seconds({4: 2}, steps={4: 1}), 3),
    # + torchao compiling its step per parameter shape (about 8 shapes, 2 s each, for each of the 3 classes)
    "low_bit": (gpu_seconds({4: 5}, steps={4: 9}, other=48), 6),
    "cpu_offload": (gpu_seconds({4: 2}, steps={4: 1}, other=6), 3),  # + AdamW on the host over 215M parameters
    "snapshots": (gpu_seconds({8: 2}, steps={8: 11}, other=15), 4),  # + the bandwidth probe, a write and a load
    "estimate_bound": (gpu_seconds({ESTIMATE_BOUND_LAYERS: 8}, steps={ESTIMATE_BOUND_LAYERS: 16}), 3),
    # measured in the first GPU run: packed_vs_hf 26 s, cce 9, compile 28, dpo 38, cuda_tests 15 (x 1.5)
    "packed_vs_hf": (40, 6),
    "cce_vs_chunked": (15, 8),
    "tf32_scope": (5, 2),
    "compile_vs_eager": (45, 25),
    "host_syncs": (30, 3),
    "dpo_reference_memory": (60, 3),
    "objectives_bf16": (90, 6),  # (a guess: six 0.6B builds, eight small steps; never run on a GPU yet)
    "resume_and_export": (240, 75),  # (one resume launch took 84 s)
    "cuda_tests": (30, 0),
}
# issue 68's order for the one call: items 1-9 in process, then the first shape's 24-step SFT launch (item 10)
FIRST_ITEMS = (
    "float8",
    "offload_races",
    "cce_anchor",
    "tensor_parallel",
    "in_backward",
    "low_bit",
    "cpu_offload",
    "snapshots",
    "estimate_bound",
)
ONE_CALL_SECONDS = 480  # issue 68: the first ten items within 8 minutes of one GPU
# A throughput launch: (start-up, per step) on one H100 by shape and mode; tiny on the CPU: (15, 1.5).
LAUNCH_ESTIMATES = {
    ("0.6b", "sft"): (65, 0.6),  # (71 s for 12 steps: start-up ~63 s, steps 0.3 s, two of 2.3-2.6 s)
    ("0.6b", "lora"): (75, 1.5),
    ("0.6b", "qlora"): (110, 2.0),
    ("0.6b", "fp8"): (90, 1.5),  # (guesses until measured: torchao's float8 conversion and compile at start-up)
    ("0.6b", "offload"): (75, 2.0),
    ("0.6b", "trl"): (150, 4.0),
    ("1.7b", "sft"): (90, 2.5),
    ("1.7b", "lora"): (95, 2.5),
    ("1.7b", "qlora"): (140, 3.0),
    ("1.7b", "trl"): (180, 6.0),
}
IN_PROCESS = {
    "float8": check_float8,
    "offload_races": check_offload_races,
    "cce_anchor": check_cce_anchor,
    "tensor_parallel": check_tensor_parallel,
    "in_backward": check_in_backward,
    "low_bit": check_low_bit,
    "cpu_offload": check_cpu_offload,
    "snapshots": check_snapshots,
    "estimate_bound": check_estimate_bound,
    "packed_vs_hf": check_packed_vs_hf,
    "cce_vs_chunked": check_cce,
    "tf32_scope": check_tf32_scope,
    "compile_vs_eager": check_compile,
    "host_syncs": check_host_syncs,
    "dpo_reference_memory": check_dpo_reference,
    "objectives_bf16": check_objectives_bf16,
}


@dataclass
class Item:
    name: str  # as --only takes it
    estimate: float  # seconds
    run: Callable[[Context], None]
    in_process: bool = False


def plan(ctx: Context, shapes: list[str], steps: int) -> list[Item]:
    """Every item, most valuable first: issue 68's ten (FIRST_ITEMS in process, then the first shape's SFT
    throughput over 24 steps on CUDA), the other in-process exactness checks, resume and export, the CUDA-only
    tests, TRL beside the first shape, the next shape's SFT throughput (the MFU target), then LoRA and QLoRA and
    the remaining TRL runs."""
    warmup = max(1, steps // 3)

    def estimate(shape: str, mode: str, steps: int = steps) -> float:
        start_up, per_step = LAUNCH_ESTIMATES.get((shape, mode), (150, 5.0)) if ctx.cuda else (15, 1.5)
        return start_up + per_step * steps

    def launch(shape: str, mode: str, steps: int = steps) -> Item:
        if mode == "trl":
            return Item(f"trl_{shape}", estimate(shape, mode), lambda c: compare_with_trl(c, shape, steps, warmup))
        needed = 0 if mode == "qlora" and not ctx.cuda else estimate(shape, mode, steps)
        return Item(f"throughput_{shape}_{mode}", needed, lambda c: throughput_run(c, shape, mode, steps, warmup))

    cost = 0 if ctx.cuda else 1  # the (CUDA, CPU) column of ESTIMATES
    checks = [Item(name, ESTIMATES[name][cost], check, in_process=True) for name, check in IN_PROCESS.items()]
    first, *others = shapes
    items = [item for item in checks if item.name in FIRST_ITEMS]
    # 24 steps on CUDA (issue 68, item 10): steady_steps sees past a slow step 11 or 12
    items.append(launch(first, "sft", max(steps, 24) if ctx.cuda else steps))
    items += [item for item in checks if item.name not in FIRST_ITEMS]
    items += [
        Item("resume_and_export", ESTIMATES["resume_and_export"][cost], resume_and_export),
        Item("cuda_tests", ESTIMATES["cuda_tests"][cost], cuda_tests),
    ]
    # the CPU smoke test: the SFT launch, no LoRA launch; float8 and offloading last (issue 53's GPU rows)
    modes = ["lora", "qlora", "fp8", "offload"] if ctx.cuda else ["qlora"]
    if ctx.cuda:
        items.append(launch(first, "trl"))
    items += [launch(shape, "sft") for shape in others]
    items += [launch(first, mode) for mode in modes]
    for shape in others:
        items += [launch(shape, "trl")] if ctx.cuda else []
        items += [launch(shape, mode) for mode in modes]
    if ctx.cuda:  # six one-step launches at most: last
        items.append(Item(f"longest_row_{first}", 6 * estimate(first, "sft"), lambda c: longest_row(c, first)))
    return items


def plan_text(items: list[Item], started: float, scale: float, device: str) -> str:
    """The dry run (`--plan`): each item's estimate and where the call stands after it, counted as --budget
    counts (from the script's start), and whether issue 68's ten items (FIRST_ITEMS and the first SFT launch)
    end within ONE_CALL_SECONDS."""
    lines, elapsed = [f"start-up (imports, counted by --budget): {started:.0f} s"], started
    first_ten = {*FIRST_ITEMS, next((i.name for i in items if i.name.startswith("throughput_")), "")}
    ten_done = None
    for item in items:
        elapsed += item.estimate * scale
        lines.append(f"{item.name:<32} ~{item.estimate * scale:5.0f} s   at {elapsed:6.0f} s")
        if item.name in first_ten:
            ten_done = elapsed
    if ten_done is not None and first_ten <= {item.name for item in items}:
        verdict = "within" if ten_done <= ONE_CALL_SECONDS else "NOT within"
        lines.append(f"issue 68's ten items end at ~{ten_done:.0f} s on {device}: {verdict} {ONE_CALL_SECONDS} s")
    return "\n".join(lines)


def run_items(ctx: Context, items: list[Item], report: Callable[[], None]) -> None:
    """Each item in order where its estimate fits the budget left, else a NOT RUN row; the in-process ones in
    the one-rank group and stopped (SIGALRM) when the budget runs out, a launch stopped then by its timeout.
    The report is rewritten after every item."""
    pending = list(items)
    ctx.pending = pending
    group = None
    try:
        while pending:
            item = pending[0]
            if not ctx.budget.fits(item.estimate):
                ctx.add_not_run(item.name, ctx.budget.not_run(item.estimate))
                pending.pop(0)
                report()
                continue
            if item.in_process and group is None:
                group = one_rank_group(ctx)
                group.__enter__()
            elif not item.in_process and group is not None:
                group.__exit__(None, None, None)
                group = None
            ctx.current, started = item, time.perf_counter()
            report()  # the files list this item as not finished until it is
            try:
                with alarm(ctx.budget.left() if item.in_process else None):
                    item.run(ctx)
            except OutOfBudget as stopped:
                ctx.add_not_run(
                    item.name, f"not finished ({stopped}; estimate ~{item.estimate * ctx.budget.scale:.0f} s)"
                )
            except Exception as error:  # a broken check is a FAIL with its reason; the other checks still run
                ctx.add(
                    item.name, False, f"{type(error).__name__}: {error}"[:300], detail=traceback.format_exc()[-1500:]
                )
            ctx.seconds.setdefault(item.name, time.perf_counter() - started)
            ctx.current = None
            pending.pop(0)
            if ctx.cuda:
                torch.cuda.empty_cache()
            report()
    finally:
        if group is not None:
            group.__exit__(None, None, None)


@contextmanager
def alarm(seconds: float | None):
    """OutOfBudget raised in the main thread after `seconds` (None: no limit): an in-process check stopped
    when the budget runs out (at its next Python bytecode: a long kernel or compile finishes first)."""
    if seconds is None or seconds == float("inf"):
        yield
        return

    def expire(signum, frame):
        raise OutOfBudget(f"stopped by the budget after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def watchdog(ctx: Context, report: Callable[[], None]) -> None:
    """The last resort when the budget's margin is spent too (the main thread stuck in a kernel, a collective
    or a child's shutdown): the item running and those pending are NOT RUN rows, the report is written, the
    children stopped, the process ends (exit 1)."""
    if ctx.budget.seconds is None:
        return

    def expire() -> None:
        for item in list(ctx.pending):
            if item is ctx.current:
                ctx.add_not_run(
                    item.name, f"not finished (stopped by the watchdog at the budget + {BUDGET_MARGIN_S // 2} s)"
                )
            else:
                ctx.add_not_run(item.name, ctx.budget.not_run(item.estimate))
        ctx.pending.clear()
        report()
        for child in list(bench_gpu.CHILDREN):
            stop_process_group(child)
        os._exit(1)

    timer = threading.Timer(max(0.0, ctx.budget.left()) + BUDGET_MARGIN_S // 2, expire)
    timer.daemon = True
    timer.start()


# --- the report ---


def environment(ctx: Context) -> dict:
    import transformers

    facts = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(ctx.device),
        "assets": "shared (Qwen3 tokenizer, FastChat chats)"
        if ctx.real_assets
        else "chattune's demo tokenizer and chats",
    }
    if ctx.cuda:
        facts["gpu"] = torch.cuda.get_device_name(ctx.device)
    for package in ("cut_cross_entropy", "bitsandbytes", "flash_attn", "trl", "peft"):
        spec = importlib.util.find_spec(package)
        facts[package] = "absent" if spec is None else _version(package)
    facts["varlen_gqa"] = varlen_gqa(ctx)
    if ctx.compute:
        facts["compute"] = " / ".join(dict.fromkeys(ctx.compute))
    return facts


def varlen_gqa(ctx: Context) -> str:
    """How torch's varlen_attn takes grouped-query attention in this process (chattune.model.packed.kernels'
    `_varlen_gqa`: flag, native or repeat), and who settled it."""
    from chattune.model.packed import kernels as attention_kernels

    value = attention_kernels._varlen_gqa
    if value == "flag":
        how = "torch's varlen_attn has enable_gqa"
    elif not ctx.cuda:
        how = "torch's signature, no probe off CUDA"
    elif attention_kernels._FLASH_ATTN_VARLEN is not None:  # probe_native_gqa returns without probing
        how = "not probed: flash-attn is installed and takes the varlen path (attention sinks repeat the kv heads)"
    elif ctx.dims is None:
        how = "not probed yet: no model was built in this process"
    else:
        how = "settled by probe_native_gqa in chattune.model.build.build_sharded_model"
    return f"{value} ({how})"


class ComputeLines(logging.Handler):
    """Keeps the start-up "compute:" lines (chattune.model.build.describe_compute) of the models built here."""

    def __init__(self, ctx: Context):
        super().__init__(logging.INFO)
        self.ctx = ctx

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("compute:"):
            self.ctx.compute.append(message)


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    names = {"cut_cross_entropy": "cut-cross-entropy", "flash_attn": "flash-attn"}
    try:
        return version(names.get(package, package))
    except PackageNotFoundError:
        return "present"


def write_report(
    ctx: Context, facts: dict, rows: list[Row], not_run: list[str], rerun: str | None = None, final: bool = True
) -> bool:
    """gpu_check.json and gpu_check.md (rewritten after every item) of `rows`; printed when `final`. True: no
    FAIL. `not_run`: the items a second call runs (`rerun`)."""
    with ctx.lock:
        failed = [row for row in rows if row.status == "FAIL"]
        budget = (
            None
            if ctx.budget.seconds is None
            else {
                "seconds": ctx.budget.seconds,
                "elapsed": round(time.monotonic() - ctx.budget.started, 1),
                "margin": BUDGET_MARGIN_S,
                "estimate_scale": ctx.budget.scale,
            }
        )
        (ctx.out / "gpu_check.json").write_text(
            json.dumps(
                {
                    "environment": facts,
                    "rows": [asdict(row) for row in rows],
                    "seconds": ctx.seconds,
                    "budget": budget,
                    "not_run": not_run,
                    "rerun": rerun,
                },
                indent=1,
            )
        )
        lines = _table(ctx, facts, rows, failed)
        if rerun:
            lines.append(f"Not run within the budget ({', '.join(not_run)}); the second call:\n\n    {rerun}")
        (ctx.out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    if final:
        print("\n".join(lines), flush=True)
    return not failed


def _table(ctx: Context, facts: dict, rows: list[Row], failed: list[Row]) -> list[str]:
    lines = [
        f"gpu_check on {facts.get('gpu', facts['device'])}, torch {facts['torch']}, transformers "
        f"{facts['transformers']}, cut-cross-entropy {facts['cut_cross_entropy']}, bitsandbytes "
        f"{facts['bitsandbytes']}, trl {facts['trl']}; {facts['assets']}; varlen gqa: {facts['varlen_gqa']}"
        + (f"; {facts['compute']}" if facts.get("compute") else ""),
        "",
        "| check | result | figure | bound | detail |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        detail = row.detail.replace("|", "/").replace("\n", " ")[:200]
        lines.append(f"| {row.check} | {row.status} | {row.figure} | {row.bound} | {detail} |")
    lines.append(
        f"\n{len(rows)} rows, {len(failed)} FAIL, {sum(r.status == 'NOT RUN' for r in rows)} NOT RUN; "
        f"{sum(ctx.seconds.values()):.0f} s in the checks"
    )
    return lines


def find_assets(given: Path | None) -> Path | None:
    candidates = (
        [given]
        if given
        else [Path(os.environ["ASSETS"])]
        if os.environ.get("ASSETS")
        else [ROOT.parent / "shared" / "assets", ROOT / "shared" / "assets"]
    )
    return next((c for c in candidates if c and (c / "tokenizers" / "qwen3").is_dir()), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("gpu_check_results"))
    parser.add_argument("--work", type=Path, default=None, help="models, data and runs (default: OUT/work)")
    parser.add_argument("--assets", type=Path, default=None, help="../shared/assets (the Qwen3 tokenizer, real chats)")
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        choices=sorted(SHAPES),
        help="throughput shapes (default: 0.6b 1.7b on CUDA, tiny on the CPU)",
    )
    parser.add_argument("--steps", type=int, default=None, help="throughput steps (default: 12 on CUDA, 4 on the CPU)")
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run only these items (names as in the table's NOT RUN "
        "rows and the header; `throughput` for every throughput and TRL launch)",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the items in order with their estimates for --device (cuda: the priced work; no GPU needed) "
        "and whether issue 68's first ten fit in 8 minutes, and run nothing",
    )
    add_budget_arguments(
        parser,
        "the items in priority order, each only where its estimate fits what is left, the "
        "one running stopped when it runs out, every item in the table and the command for "
        "the rest",
    )
    args = parser.parse_args()
    torch.set_float32_matmul_precision("highest")  # what chattune must leave as it is (tf32_scope)
    out = args.out.resolve()
    work = (args.work or out / "work").resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    assets = find_assets(args.assets) if args.device == "cuda" and not args.plan else None
    if assets is not None:
        chats = bench_gpu.make_corpora(assets, work / "data")["short"]
        tokenizer_dir = assets / "tokenizers" / "qwen3"
    else:
        chats, tokenizer_dir = DEMO_ASSETS / "chat_train.jsonl", DEMO_ASSETS / "tokenizer"
    ctx = Context(
        torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu"),
        out,
        work,
        tokenizer_dir,
        chats,
        assets is not None,
        Budget(args.budget, started=STARTED, scale=args.estimate_scale),
    )
    shapes = args.shapes or (["0.6b", "1.7b"] if ctx.cuda else ["tiny"])
    items = plan(ctx, shapes, args.steps or (12 if ctx.cuda else 4))
    names = [item.name for item in items]
    if args.only:
        aliases = {"throughput": [n for n in names if n.startswith(("throughput_", "trl_"))]}
        unknown = [name for name in args.only if name not in names and name not in aliases]
        if unknown:
            parser.error(f"--only {' '.join(unknown)}: the items are {', '.join(names)} (and `throughput`)")
        wanted = {n for name in args.only for n in aliases.get(name, [name])}
        items = [item for item in items if item.name in wanted]
    if args.plan:
        print(plan_text(items, time.monotonic() - STARTED, ctx.budget.scale, args.device))
        return 0
    handler = ComputeLines(ctx)
    build_logger = logging.getLogger("chattune.model.build")
    build_logger.addHandler(handler)
    build_logger.setLevel(logging.INFO)
    print(f"[gpu_check] {environment(ctx)}", flush=True)
    print(
        f"[gpu_check] items in order: {', '.join(f'{i.name} (~{i.estimate * ctx.budget.scale:.0f} s)' for i in items)}"
        + (f"; budget {args.budget:.0f} s" if args.budget is not None else ""),
        flush=True,
    )

    def rerun(not_run: list[str]) -> str | None:
        if not not_run:
            return None
        return rerun_command(
            __file__, sys.argv[1:], {"--only": not_run, "--out": [f"{out}-rest"], "--work": [str(work)]}
        )

    def report(final: bool = False) -> bool:
        """The report so far; the items not done yet in it as NOT RUN rows (what the files say if the process
        is killed from outside), which the next report replaces."""
        with ctx.lock:
            rows, not_run = list(ctx.rows), list(ctx.not_run)
        provisional = [
            Row(
                item.name,
                "NOT RUN",
                "not finished (gpu_check stopped while it ran)"
                if item is ctx.current
                else "not run (gpu_check stopped before it)",
            )
            for item in list(ctx.pending)
        ]
        not_run += [row.check for row in provisional]
        return write_report(ctx, environment(ctx), rows + provisional, not_run, rerun(not_run), final)

    ctx.pending = []
    watchdog(ctx, report)
    try:
        run_items(ctx, items, report)
    finally:  # a crash or an interrupt still leaves the report, every item in it
        for item in list(ctx.pending):
            ctx.add_not_run(item.name, "not run (gpu_check stopped before it)")
        ctx.pending.clear()
        passed = report(final=True)
        if ctx.not_run:
            print(f"[gpu_check] the second call, for what did not run:\n  {rerun(list(ctx.not_run))}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
