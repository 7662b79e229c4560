"""The GPU check's rows and context, its models and data: the Qwen3 shapes, the recipe's config and model,
the chats, the one-rank group of the in-process checks."""

from __future__ import annotations

import json
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from bench_gpu import Budget

from chattune.data.documents import Document, shifted_labels
from chattune.data.templates.chat_template import probe_template, tokenize_conversation

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
