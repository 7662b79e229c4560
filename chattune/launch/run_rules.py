"""The rules of a run that its schema cannot state: data sources and their files, the tokenizer's and models'
paths, the chat template a config names, the step counts and the microbatch budget, the step layout on the
ranks, a 4-bit base, the device and, for `chattune validate`, what a launch would do with output_dir.

Each check adds lines to a `Findings`; nothing stops at the first problem.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
from dataclasses import fields
from pathlib import Path

from omegaconf import DictConfig

from chattune.config.layout_rules import (
    EXPERT_COUNT_KEYS,
    EXPERT_LORA_REFUSED,
    context_ranks_problem,
    expert_ranks_problem,
    experts_split_problem,
    microbatch_ranks_problem,
    pad_multiple_problem,
    replicate_ranks_problem,
    tensor_ranks_problem,
)
from chattune.config.losses import needs_reference
from chattune.config.policy_losses import compares_vocabularies, needs_teacher
from chattune.config.schema import FP8_MODES, QUANTIZE_BASE, TinyLlamaConfig
from chattune.config.typed import typed_config
from chattune.data.ingest.formats import DataError, SourceSpec
from chattune.data.templates.prompts import prompts_file_problem
from chattune.data.templates.template_choice import KEY as TEMPLATE_KEY
from chattune.data.templates.template_choice import template_problem
from chattune.errors import UserError
from chattune.hub import HUB_LIKE, HUB_PREFIX, hub_hint, hub_id
from chattune.launch.findings import UNSET, Findings, did_you_mean, get_value, show
from chattune.launch.recipe_kinds import RecipeKind
from chattune.launch.schema_checks import SchemaChecks, number
from chattune.model.io.weights import weights_problem

HUB_NOTE = "downloaded once per node into the Hugging Face cache, or read from it offline"

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")  # the files data.records.RecordSource reads itself
SOURCE_KEYS = tuple(f.name for f in fields(SourceSpec))
EXAMPLE_DATA_FILE = "/data/train.jsonl"  # the path of the data sources a message gives as an example


def _cuda_available() -> bool:
    import torch  # only for a config that asks for a 4-bit base

    return torch.cuda.is_available()


def runs_on_cuda(device: object, planned_gpu: bool = False) -> bool:
    """Whether a run of `device` (the config's) computes on CUDA: cuda, or auto where there is (or, `planned_gpu`, is
    planned to be) a GPU."""
    return device == "cuda" or (device == "auto" and (planned_gpu or _cuda_available()))


def output_dir_problem(directory: Path) -> str | None:
    """Why a run could not create or write `directory` (its nearest existing ancestor decides), or None."""
    existing = next(p for p in (directory, *directory.resolve().parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot write into {existing} (permission denied, or a read-only file system)"
    return None


DEFAULT_MODEL_CONFIG = dataclasses.asdict(TinyLlamaConfig())  # sft/tiny's model, which every recipe builds on


class RunRules:
    """The run's own rules, for a config of recipe kind `kind`. `cfg`: the composed config, to check output_dir and
    the resume as a launch would (None: not checked)."""

    def __init__(
        self,
        values: dict,
        kind: RecipeKind,
        findings: Findings,
        schema: SchemaChecks,
        cfg: DictConfig | None = None,
        planned_gpu: bool = False,
    ):
        """`planned_gpu`: the run is planned for a GPU from another machine (`chattune validate --device-memory`):
        settings that need CUDA are checked as if it were there."""
        self.values, self.kind, self.findings, self.schema, self.cfg = values, kind, findings, schema, cfg
        self.planned_gpu = planned_gpu

    def on_cuda(self) -> bool:
        """Whether the run computes on CUDA: device=cuda, or auto where there is (or is planned to be) a GPU."""
        return runs_on_cuda(get_value(self.values, "device"), self.planned_gpu)

    def sources(self, key: str, required: bool) -> None:
        sources = get_value(self.values, key)
        if sources is UNSET or (sources is None and not required):
            return
        if required and not sources:  # null or [] (the local_model configs' own: the user's data, never the demo's)
            self.findings.problem(
                key, f"no data sources: training needs at least one; give your files, e.g. {self.example_sources(key)}"
            )
            return
        if not isinstance(sources, list):
            self.findings.problem(key, f"expected a list of data sources, got {show(sources)}")
            return
        accepted = self.kind.data
        formats = list(accepted.formats)
        for index, entry in enumerate(sources):
            where = f"{key}[{index}]"
            if isinstance(entry, str):
                entry = {"path": entry}
            if not isinstance(entry, dict):
                if entry is not UNSET:
                    self.findings.problem(
                        where, "a data source is a path or a mapping {path, format, columns, roles, split}"
                    )
                continue
            if UNSET in entry.values():
                continue
            unknown = [name for name in entry if name not in SOURCE_KEYS]
            for name in unknown:
                self.schema.unknown(f"{where}.{name}", [f"{where}.{k}" for k in SOURCE_KEYS])
            fmt = entry.get("format", SourceSpec.format)
            if fmt not in formats:
                self.findings.problem(
                    f"{where}.format",
                    f"{fmt!r} is not one of {', '.join(formats)}{accepted.reads}{did_you_mean(str(fmt), formats)}",
                )
            elif not unknown:
                try:
                    SourceSpec.from_config(entry)
                except DataError as error:
                    self.findings.problem(where, str(error))
            if not isinstance(entry.get("path"), str):
                self.findings.problem(f"{where}.path", f"a source needs a path, got {show(entry.get('path'))}")
            else:
                self.data_path(where, entry["path"])

    def example_sources(self, key: str) -> str:
        """An override that sets `key` to one source of this recipe kind's first format, quoted for a shell (a bare
        path is a messages file; another format is named)."""
        fmt = self.kind.data.formats[0]
        source = EXAMPLE_DATA_FILE if fmt == SourceSpec.format else f"{{path: {EXAMPLE_DATA_FILE}, format: {fmt}}}"
        return f"'{key}=[{source}]'"

    def data_path(self, key: str, path: str) -> None:
        if Path(path).is_dir():
            return  # a dataset directory, read with datasets.load_dataset
        if Path(path).is_file():
            if not path.endswith(DATA_SUFFIXES):
                self.findings.problem(key, f"data file {path!r}: expected .jsonl, .json or .parquet")
        elif path.startswith(HUB_PREFIX):
            self.findings.note(key, f"{path!r}: a hub dataset (needs the machine online)")
        else:
            hint = (
                f" (a hub dataset is written {HUB_PREFIX}{path})"
                if HUB_LIKE.fullmatch(path) and not path.endswith(DATA_SUFFIXES)
                else ""
            )
            self.findings.problem(key, f"data file {path!r} does not exist{hint}")

    def paths(self) -> None:
        tokenizer = get_value(self.values, "tokenizer.path")
        if isinstance(tokenizer, str) and not Path(tokenizer).is_dir():
            if hub_id(tokenizer) is not None:
                self.findings.note("tokenizer.path", f"{tokenizer!r}: a hub tokenizer ({HUB_NOTE})")
            elif Path(tokenizer).exists():
                self.findings.problem("tokenizer.path", f"{tokenizer!r} is not a directory")
            else:
                self.findings.problem(
                    "tokenizer.path", f"{tokenizer!r} does not exist{hub_hint(tokenizer, 'tokenizer')}"
                )
        template = get_value(self.values, TEMPLATE_KEY)
        problem = template_problem(template) if template is None or isinstance(template, str) else None
        if problem is not None:  # (a value of another type is reported by the schema checks)
            self.findings.problem(TEMPLATE_KEY, problem)
        for key in ("model.path", *(("reference.path",) if self.kind.needs_reference else ())):
            path = get_value(self.values, key)
            if not isinstance(path, str):
                continue
            if hub_id(path) is not None:
                self.findings.note(key, f"{path!r}: a hub model ({HUB_NOTE})")
            elif not Path(path).is_dir():
                self.findings.problem(key, f"{path!r} is not a local directory{hub_hint(path, 'model')}")
            elif not (Path(path) / "config.json").is_file():
                self.findings.problem(key, f"{path!r} has no config.json: not a Hugging Face model directory")
            elif (problem := weights_problem(Path(path))) is not None:
                self.findings.problem(key, f"{path!r}: {problem}")
        prompts = get_value(self.values, "eval.sample_prompts")
        if isinstance(prompts, str) and (problem := prompts_file_problem(prompts)) is not None:
            self.findings.problem("eval.sample_prompts", problem)
        if get_value(self.values, "model.path") is None and get_value(self.values, "model.config") is None:
            self.findings.problem("model", "neither model.path nor model.config is set")
        if isinstance(get_value(self.values, "reference.path"), str) and not needs_reference(
            get_value(self.values, "loss.type")
        ):
            self.findings.note(
                "reference.path", f"unused: loss.type={get_value(self.values, 'loss.type')} needs no reference"
            )

    def model_config(self) -> None:
        """A model built from model.config: its config object builds (cheap: no weights), so that a class that does
        not exist or values transformers rejects (a hidden size that is no multiple of the heads) are one problem
        here, not a traceback on every rank."""
        config = get_value(self.values, "model.config")
        path = get_value(self.values, "model.path")
        if path is not None and isinstance(config, dict):
            changed = sorted(key for key, value in config.items() if DEFAULT_MODEL_CONFIG.get(key) != value)
            if changed:  # set, but the directory's config.json is the model's: said, not ignored in silence
                self.findings.note(
                    "model.config",
                    f"{', '.join(f'model.config.{key}' for key in changed)} ignored: model.path {path} is loaded with "
                    "its own config.json (model.config builds a random-init model only with model.path=null)",
                )
        if path is not None or not isinstance(config, dict):
            return
        target = config.get("_target_")
        if any(line.startswith(("model.config", "model:")) for line in self.findings.problems):
            return  # its keys or its class are reported already
        from hydra.utils import instantiate

        try:
            instantiate(config, _convert_="all")
        except Exception as error:  # the config class's own validation (or Hydra's): reported as one problem
            cause = error
            while cause.__cause__ is not None:
                cause = cause.__cause__
            lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
            self.findings.problem(
                "model.config", f"{target} rejects it: {lines[-1] if lines else type(cause).__name__}"
            )

    def adapters_base(self) -> None:
        """LoRA over a random-init base (model.path null): the base is saved nowhere, so the adapter alone can never be
        loaded again (it names no base); said at the start, with the two ways to a model that loads."""
        if not isinstance(get_value(self.values, "peft"), dict) or get_value(self.values, "model.path") is not None:
            return
        if get_value(self.values, "export.merge") is True:
            return  # output_dir/hf holds the base with the adapters merged: that loads
        self.findings.note(
            "peft",
            "the adapters train on a random-init base built from model.config, saved nowhere: output_dir/adapter "
            "names no base, so neither chattune chat nor PeftModel.from_pretrained can load it. Start from a model "
            "directory (model.path=DIR), or set export.merge=true to also write the base with the adapters merged "
            "(output_dir/hf)",
        )

    def steps_and_budget(self) -> None:
        """stop_after_step within the run, a warm-up or save interval longer than it (notes), a budget that padding
        could exceed, and a budget beyond the positions model.path was trained on (a note)."""
        max_steps, stop = number(self.values, "max_steps"), number(self.values, "stop_after_step")
        if max_steps is not None and stop is not None and stop > max_steps:
            self.findings.problem("stop_after_step", f"{stop} is after max_steps {max_steps}: the run ends first")
        warmup, save_every = number(self.values, "scheduler.num_warmup_steps"), number(self.values, "save_every")
        if max_steps is not None and warmup is not None and warmup > max_steps:
            self.findings.note(
                "scheduler.num_warmup_steps",
                f"{warmup} is more than max_steps {max_steps}: the learning rate never reaches optimizer.lr",
            )
        split, eval_every = get_value(self.values, "data.eval_split"), number(self.values, "eval_every")
        if isinstance(split, (int, float)) and not isinstance(split, bool) and split > 0 and eval_every == 0:
            self.findings.note(
                "data.eval_split",
                f"{split} holds records out of training, and eval_every=0 never evaluates them: set eval_every, "
                "or data.eval_split=0 to train on every record",
            )
        if max_steps is not None and save_every is not None and save_every > max_steps:
            self.findings.note(
                "save_every",
                f"{save_every} is more than max_steps {max_steps}: no checkpoint is written, so "
                "the run can be neither resumed nor extended (its export is still written)",
            )
        budget, multiple = (
            number(self.values, "data.max_tokens_per_microbatch"),
            number(self.values, "data.pad_to_multiple_of"),
        )
        problem = pad_multiple_problem(budget, multiple)
        if problem:
            self.findings.problem("data.max_tokens_per_microbatch", problem)
        # Positions restart with every document (and every side of a preference pair), so the longest sequence is a
        # row's: a document of the whole budget, or a pair's side beside a short other side.
        positions, context = self.max_positions(), self.context_size()
        sequence = self.kind.data.sequence
        if budget and positions and budget * context > positions:
            self.findings.note(
                "data.max_tokens_per_microbatch",
                f"{budget}{f' x parallel.context={context}' if context > 1 else ''} is more than "
                f"model.path's max_position_embeddings {positions}: {sequence} longer than {positions} "
                "tokens gets positions the model was not trained on",
            )

    def rollouts(self) -> None:
        """The GRPO recipe's own rules: what it does not read yet (a split of the training prompts, a mixture, vLLM)
        is refused, not ignored; held-out prompts are evaluated; each reward function can be imported and takes the
        keys its entry gives; a reference without a KL penalty is unused."""
        if self.kind.name != "grpo":
            return
        held_out = get_value(self.values, "data.eval")
        if isinstance(held_out, list) and held_out and number(self.values, "eval_every") == 0:
            self.findings.problem(
                "eval_every",
                "is 0, so data.eval's held-out prompts are never answered: set eval_every (steps between "
                "evaluations), or data.eval=null",
            )
        for key, refused, why in (
            (
                "data.eval_split",
                lambda v: v not in (None, UNSET),
                "the training prompts are not split yet: give held-out prompts as data.eval, and set this to null",
            ),
            ("data.mixing.mode", lambda v: v not in ("none", UNSET), "prompts are not mixed by weight yet: none"),
            (
                "rollout.engine",
                lambda v: v == "vllm",
                "vllm is not available in this chattune yet: rollout.engine=hf samples with transformers",
            ),
        ):
            if refused(get_value(self.values, key)):
                self.findings.problem(key, why)
        if isinstance(get_value(self.values, "reference.path"), str) and number(self.values, "loss.beta") == 0:
            self.findings.note("reference.path", "unused: loss.beta=0 builds no reference")
        distilled, teacher = needs_teacher(get_value(self.values, "loss.type")), get_value(self.values, "teacher.path")
        if distilled and not isinstance(teacher, str):
            self.findings.problem(
                "teacher.path",
                f"loss.type={get_value(self.values, 'loss.type')} distills from a teacher: name its directory",
            )
        elif isinstance(teacher, str) and not distilled:
            self.findings.note(
                "teacher.path", "unused: only loss.type=reverse_kl or gkd scores the samples with a teacher"
            )
        elif isinstance(teacher, str) and not (Path(teacher) / "config.json").is_file():
            self.findings.problem("teacher.path", f"{teacher!r} is not a Hugging Face model directory (no config.json)")
        whole_distributions = compares_vocabularies(get_value(self.values, "loss.type"))
        if whole_distributions:
            # gkd's divergence needs each position's whole distribution from both models on one rank
            if (number(self.values, "parallel.tensor") or 1) > 1:
                self.findings.problem(
                    "parallel.tensor",
                    "must be 1 with loss.type=gkd: its divergence compares whole vocabularies, which tensor "
                    "parallelism splits over ranks (loss.type=reverse_kl compares sampled tokens only and may split)",
                )
            if (number(self.values, "loss.beta") or 0) > 0:
                self.findings.problem(
                    "loss.beta",
                    "must be 0 with loss.type=gkd: its loss is the divergence to the teacher, with no reference",
                )
        share = number(self.values, "rollout.on_policy_share")
        if share is not None and share < 1 and not whole_distributions:
            self.findings.problem(
                "rollout.on_policy_share",
                "must be 1 unless loss.type=gkd: the other losses learn from the policy's own samples (their "
                "log-probs, rewards or importance ratios); gkd's divergence also trains on the data's replies",
            )
        if distilled and get_value(self.values, "rollout.skip_uniform_groups") is True:
            self.findings.problem(
                "rollout.skip_uniform_groups",
                "must be false with a teacher: distillation learns from every completion, whatever its rewards",
            )
        functions = get_value(self.values, "reward.functions")
        if not isinstance(functions, list):
            return
        if not functions and not distilled:
            self.findings.problem("reward.functions", "no reward function: the policy would learn nothing")
        from chattune.rl.rewards import RewardError, entry_problem

        for index, entry in enumerate(functions):
            key = f"reward.functions[{index}]"
            try:
                problem = entry_problem(entry)
            except RewardError as error:
                problem = str(error)
            if problem is not None:
                self.findings.problem(key, problem)

    def shared_prompts(self) -> None:
        """data.share_prompts: a pair's replies continue one prompt (DPO, ORPO/SimPO, reward pairs), a GRPO group's
        completions theirs; refused where the recipe has no pairs or groups and where a layout splits the row by its
        own boundaries."""
        if get_value(self.values, "data.share_prompts") is not True:
            return
        if self.kind.name not in ("dpo", "reward", "grpo"):
            why = {"kto": "KTO's records are unpaired: nothing to share"}.get(
                self.kind.name, f"the {self.kind.name} recipe trains no pairs or groups: nothing to share"
            )
            self.findings.problem("data.share_prompts", f"must be false: {why}")
        for key in ("context", "tensor"):
            if self._degree(key) > 1:
                self.findings.problem(
                    f"parallel.{key}",
                    "must be 1 with data.share_prompts=true: a row whose replies continue a shared prompt is not "
                    "split over ranks yet (or set data.share_prompts=false)",
                )

    def quantized_base(self) -> None:
        """QLoRA (peft.quantize_base) needs CUDA and bitsandbytes (an optional install)."""
        if get_value(self.values, "peft.quantize_base") not in QUANTIZE_BASE:
            return  # null (full precision), or not a format (reported by enums)
        if not self.on_cuda():
            self.findings.problem(
                "peft.quantize_base",
                "a 4-bit base (QLoRA) trains on CUDA only: it saves GPU memory "
                "with bitsandbytes' GPU kernels. On the CPU, set "
                "peft.quantize_base=null (LoRA on the full-precision base)",
            )
        elif importlib.util.find_spec("bitsandbytes") is None:
            self.findings.problem("peft.quantize_base", 'needs bitsandbytes: pip install "chattune[qlora]"')

    def float8(self) -> None:
        """model.fp8 needs torchao, and float8 matmuls (a GPU) unless emulated; LoRA's layers are not converted."""
        mode = get_value(self.values, "model.fp8")
        if mode not in FP8_MODES:
            return  # null (off), or not a mode (reported by the choices)
        if importlib.util.find_spec("torchao") is None:
            self.findings.problem("model.fp8", 'needs torchao: pip install "chattune[lowbit]"')
            return
        import torch  # only for a config that asks for float8

        from chattune.model.quantization.float8 import fp8_problem

        adapted = isinstance(get_value(self.values, "peft"), dict)
        problem = fp8_problem(mode, torch.device("cuda" if self.on_cuda() else "cpu"), adapted)
        if problem:
            self.findings.problem("model.fp8", problem)

    def device(self) -> None:
        if get_value(self.values, "device") == "cuda" and not self.planned_gpu and not _cuda_available():
            self.findings.problem(
                "device",
                "cuda, but torch finds no CUDA device on this machine (torch.cuda.is_available() "
                "is False): use device=auto (CUDA where there is one) or device=cpu",
            )

    def step_layout(self, world_size: int | None) -> None:
        """World-size-invariant steps (data.microbatches_per_step) are dealt to the ranks, which must divide
        them; the microbatches per rank follow from them, so grad_accum_steps stays at 1."""
        total = number(self.values, "data.microbatches_per_step")
        if not isinstance(total, int) or total < 1:
            return
        accum = number(self.values, "grad_accum_steps")
        if accum not in (None, 1):
            self.findings.problem(
                "grad_accum_steps",
                f"{accum} with data.microbatches_per_step={total}: the microbatches "
                "per rank follow from it (data.microbatches_per_step / ranks); "
                "leave grad_accum_steps at 1",
            )
        problem = microbatch_ranks_problem(total, world_size, self.context_size()) if world_size is not None else None
        if problem:
            self.findings.problem("data.microbatches_per_step", problem)

    def update_in_backward(self, world_size: int | None) -> None:
        """optimizer.in_backward updates each parameter before the whole gradient exists, so nothing may need the
        whole gradient first (chattune.train.in_backward): no clipping, one microbatch per rank, no fp16 scaling."""
        if get_value(self.values, "optimizer.in_backward") is not True:
            return
        needs = "optimizer.in_backward updates each parameter before the whole model's gradient exists"
        clip = get_value(self.values, "max_grad_norm")
        if clip is not None:
            self.findings.problem(
                "max_grad_norm",
                f"{clip}: clipping scales every gradient by the whole model's norm, and {needs}: set "
                "max_grad_norm=null (the norm is still logged), or optimizer.in_backward=false",
            )
        accum, total = number(self.values, "grad_accum_steps"), number(self.values, "data.microbatches_per_step")
        data_ranks = world_size // self.context_size() if world_size else None  # a context group shares its rows
        if total is None and accum is not None and accum > 1:
            self.findings.problem(
                "grad_accum_steps",
                f"{accum} microbatches per rank per step sum their gradients before the update, and {needs}: set "
                "grad_accum_steps=1 (a larger data.max_tokens_per_microbatch keeps a step's tokens), or "
                "optimizer.in_backward=false",
            )
        elif total is not None and data_ranks and total > data_ranks:
            self.findings.problem(
                "data.microbatches_per_step",
                f"{total} over {data_ranks} data-parallel rank(s) is {total // data_ranks} microbatches per rank per "
                f"step, which sum their gradients before the update, and {needs}: set "
                f"data.microbatches_per_step={data_ranks} (or launch {total} data-parallel ranks), or "
                "optimizer.in_backward=false",
            )
        if get_value(self.values, "model.fsdp.param_dtype") == "float16":
            self.findings.problem(
                "model.fsdp.param_dtype",
                f"float16 scales the loss and checks the whole gradient for overflow before the update, and "
                f"{needs}: use bfloat16, or optimizer.in_backward=false",
            )
        if get_value(self.values, "model.fsdp.cpu_offload") is True:
            self.findings.problem(
                "model.fsdp.cpu_offload",
                f"the host's copy of each gradient is complete only when the whole backward is, and {needs}: "
                "choose one, model.fsdp.cpu_offload=false or optimizer.in_backward=false (the gradients already "
                "live on the host under CPU offload)",
            )

    def offload(self) -> None:
        """model.fsdp's offloading on the CPU: exact, but the memory it would free is the host's already."""
        if not self.on_cuda():
            for name in ("offload_activations", "cpu_offload"):
                if get_value(self.values, f"model.fsdp.{name}") is True:
                    self.findings.note(
                        f"model.fsdp.{name}", "on the CPU the device's memory is the host's: it saves nothing"
                    )

    def _degree(self, key: str) -> int:
        """A parallel degree (parallel.<key>) where it is a valid size, else 1 (an invalid one is reported by the
        schema checks)."""
        degree = number(self.values, f"parallel.{key}")
        return degree if isinstance(degree, int) and degree >= 1 else 1

    def tensor_size(self) -> int:
        return self._degree("tensor")

    def context_size(self) -> int:
        return self._degree("context")

    def context_parallel(self, world_size: int | None) -> None:
        """parallel.context: it divides the number of ranks (each group of that many ranks shares a row) and the
        model's attention heads (each rank attends with heads/context of them)."""
        context = self.context_size()
        if context == 1:
            return
        problem = context_ranks_problem(context, world_size) if world_size is not None else None
        if problem:
            self.findings.problem("parallel.context", problem)
        heads = self.attention_heads()
        if heads and heads % context:
            self.findings.problem(
                "parallel.context",
                f"{context} does not divide the model's {heads} attention heads: "
                f"each rank of a context group attends with heads/context of them; choose a divisor "
                f"of {heads}",
            )

    def tensor_parallel(self, world_size: int | None) -> None:
        """parallel.tensor: the ranks split into groups of tensor x context consecutive ranks, the heads split
        over both, and what is not built for a split model yet is refused with the reason."""
        tensor = number(self.values, "parallel.tensor")
        if not isinstance(tensor, int) or tensor <= 1:
            return  # below 1: the schema checks' problem
        context = self.context_size()
        problem = tensor_ranks_problem(tensor, context, world_size) if world_size is not None else None
        if problem:
            self.findings.problem("parallel.tensor", problem)
        heads = self.attention_heads()
        if heads and heads % (tensor * context):
            self.findings.problem(
                "parallel.tensor",
                f"{tensor}{f' x parallel.context={context}' if context > 1 else ''} does not divide the model's "
                f"{heads} attention heads: each rank attends with heads/(tensor x context) of them",
            )
        kv_heads = self.attention_heads("num_key_value_heads")
        if kv_heads and kv_heads % tensor:
            self.findings.problem(
                "parallel.tensor",
                f"{tensor} does not divide the model's {kv_heads} key-value heads: each rank holds 1/{tensor} of them",
            )
        refused = {
            "peft.use_dora": "DoRA's magnitudes need each output row's whole norm, which a row-wise split divides",
            "peft.quantize_base": "a 4-bit base's linear layers are not split over tp ranks",
            "peft.modules_to_save": "modules trained in full beside the adapters are not split over tp ranks",
            "model.fp8": "float8 layers are not split over tp ranks yet",
        }
        for key, reason in refused.items():
            value = get_value(self.values, key)
            if value is not UNSET and value:  # (set: true, a name, a non-empty list)
                self.findings.problem(key, f"{reason}: set parallel.tensor=1 or drop {key}")
        per_machine = os.environ.get("LOCAL_WORLD_SIZE", "")  # torchrun's: the ranks of this machine
        if per_machine.isdigit() and tensor > int(per_machine):
            self.findings.note(
                "parallel.tensor",
                f"{tensor} is more than the {per_machine} ranks per machine of this launch: each layer's all-reduces "
                f"would cross machines; keep it within one (at most {per_machine})",
            )

    def replicated_shards(self, world_size: int | None) -> None:
        """parallel.replicate (HSDP): the ranks split into that many equal groups of whole context groups."""
        replicate = number(self.values, "parallel.replicate")
        if not isinstance(replicate, int) or replicate <= 1 or world_size is None:
            return  # below 1: the schema checks' problem
        problem = replicate_ranks_problem(replicate, self.context_size() * self.tensor_size(), world_size)
        if problem:
            self.findings.problem("parallel.replicate", problem)

    def expert_parallel(self, world_size: int | None) -> None:
        """parallel.expert: groups of that many of the ranks FSDP2 shards over split every MoE layer's experts; it
        divides those ranks and the model's experts per layer, and what is not built with it is refused."""
        expert = number(self.values, "parallel.expert")
        if not isinstance(expert, int) or expert <= 1:
            return  # below 1: the schema checks' problem
        tensor, replicate = self.tensor_size(), self._degree("replicate")
        shard_ranks = world_size // (replicate * tensor) if world_size and not world_size % (replicate * tensor) else 0
        problem = expert_ranks_problem(expert, shard_ranks, tensor)
        if problem:
            self.findings.problem("parallel.expert", problem)
        experts = self.experts_per_layer()
        if experts is None and self.model_described():
            self.findings.problem(
                "parallel.expert",
                "the model has no mixture-of-experts layers (no num_experts, num_local_experts or n_routed_experts in "
                "its config) whose experts it could split; set parallel.expert=1",
            )
        elif experts is not None and (problem := experts_split_problem(expert, experts)):
            self.findings.problem("parallel.expert", problem)
        peft = get_value(self.values, "peft")
        if isinstance(peft, dict) and peft:
            self.findings.problem("peft", f"{EXPERT_LORA_REFUSED}; set parallel.expert=1 or drop peft")

    def experts_per_layer(self) -> int | None:
        """The model's routed experts per MoE layer (its config's num_experts, num_local_experts or
        n_routed_experts), None where it names none."""
        defaults = None
        for name in EXPERT_COUNT_KEYS:
            count = self.attention_heads(name)
            if count is None:  # model.config's class's own default, where its keys leave the count unset
                defaults = defaults or self.config_class_defaults()
                count = getattr(defaults, name, None)
            if isinstance(count, int) and not isinstance(count, bool) and count > 0:
                return count
        return None

    def config_class_defaults(self) -> object | None:
        """An instance of model.config's `_target_` class with its defaults (its text config for a composite), for a
        model built from a config; None where there is none or it cannot be made here (the launch reports why)."""
        target = get_value(self.values, "model.config._target_")
        if isinstance(get_value(self.values, "model.path"), str) or not isinstance(target, str):
            return None
        module, _, name = target.rpartition(".")
        try:
            config = getattr(importlib.import_module(module), name)()
        except Exception:  # (an unknown or unimportable class: the schema checks report it)
            return None
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def model_described(self) -> bool:
        """Whether the model's config can be read here: a model directory's config.json, or model.config."""
        if isinstance(get_value(self.values, "model.path"), str):
            return bool(self.pretrained_config)
        return isinstance(get_value(self.values, "model.config"), dict)

    def attention_heads(self, name: str = "num_attention_heads") -> int | None:
        """The model's query heads (`name`: another head count of its config): model.path's config.json, or
        model.config for a model built from a config."""
        if isinstance(get_value(self.values, "model.path"), str):
            config = self.pretrained_config
            config = config.get("text_config", config)
            heads = config.get(name) if isinstance(config, dict) else None
        else:
            heads = get_value(self.values, f"model.config.{name}")
        return heads if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 else None

    @functools.cached_property
    def pretrained_config(self) -> dict:
        """model.path's config.json ({} where there is none, or it is unreadable: reported by paths())."""
        try:
            config = json.loads((Path(get_value(self.values, "model.path")) / "config.json").read_text())
        except (OSError, ValueError, TypeError):
            return {}
        return config if isinstance(config, dict) else {}

    def max_positions(self) -> int | None:
        """max_position_embeddings of the pretrained model at model.path (a model built from model.config
        has been trained on no position yet)."""
        if not isinstance(get_value(self.values, "model.path"), str):
            return None
        value = self.pretrained_config.get("max_position_embeddings")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def output_dir(self, cfg: DictConfig, world_size: int | None) -> None:
        """What a launch would do with output_dir, decided as the recipe decides it (`chattune.checkpoint.output_dir`):
        writable, not locked by a live run, and the checkpoint it continues fits this config (or an
        earlier run's results would be overwritten without overwrite=true)."""
        if world_size is not None and world_size < 1:
            self.findings.problem("world_size", f"must be at least 1, got {world_size}")
        output_dir = get_value(self.values, "output_dir")
        if not isinstance(output_dir, str) or self.findings.problems:
            return  # the decision needs a config without other problems (the fingerprint resolves it whole)
        directory = Path(output_dir)
        problem = output_dir_problem(directory)
        if problem is not None:
            self.findings.problem("output_dir", problem)
            return
        resume = get_value(self.values, "resume")
        if not directory.is_dir() and not (isinstance(resume, str) and resume != "auto"):
            return  # nothing there to resume, lock or overwrite (and no need to import torch to say so)
        # torch.distributed.checkpoint and the data fingerprints take seconds to import: only where needed.
        from chattune.checkpoint.output_dir import OutputDirLock, decide_launch, describe_holder
        from chattune.checkpoint.resume import ResumeError, run_fingerprint, run_identity

        lock = OutputDirLock(directory)
        if lock.is_held():
            self.findings.problem("output_dir", f"in use by another run: {describe_holder(lock.holder())}")
        try:
            typed = typed_config(cfg, self.kind.schema)  # as the launch decides: on the config it runs with
            decision = decide_launch(typed, run_identity(world_size, run_fingerprint(typed)))
        except UserError as error:
            key = "resume" if isinstance(error, ResumeError) else "output_dir"
            self.findings.problem(key, str(error))
            return
        if decision.complete is not None:  # the launch would change nothing
            self.findings.note("output_dir", decision.complete)
            return
        for line in decision.notes:  # e.g. a run that committed no checkpoint, started again
            self.findings.note("output_dir", line)
        start = decision.start
        if start.resume_from is not None:
            saved = start.checkpoint_manifest
            invariant = get_value(self.values, "data.microbatches_per_step")
            if world_size is not None:
                ranks = ""
            elif isinstance(invariant, int):  # world-size-invariant steps: any divisor of M resumes it
                divisors = ", ".join(str(n) for n in range(1, invariant + 1) if invariant % n == 0)
                ranks = (
                    f", written by {saved['world_size']} rank(s): launch with any --nproc_per_node that divides "
                    f"data.microbatches_per_step={invariant} ({divisors})"
                )
            else:
                ranks = (
                    f", written by {saved['world_size']} rank(s): launch with --nproc_per_node {saved['world_size']}"
                )
            self.findings.note("resume", f"continues from {start.resume_from} at step {saved['step']}{ranks}")
        for line in start.accepted.notes + [
            f"{h} (the schedule is recomputed for the new horizon)" for h in start.accepted.horizon
        ]:
            self.findings.note("resume", line)
        for path in decision.move_aside + decision.copy_aside:
            self.findings.note("output_dir", f"{path} would be set aside as {path.name}.abandoned")
