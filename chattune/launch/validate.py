"""Check a config before a run: `chattune validate CONFIG [key=value ...]`, and `check_config` at the start
of every recipe (and, through `chattune.launch.app`, a command line Hydra cannot compose). Every problem is
reported at once, one line each ("key: problem"), without loading a model.

The modules: `compose` (Hydra, as a recipe composes), `schema_checks` (against the schema), `run_rules`
(the run's own rules), `findings` (the lines). What is checked:

- composition: a config name that does not exist, a config group's choice that does not exist (`peft=lorra`: the
  nearest of its configs), an override Hydra cannot parse or apply (an override
  of a key that is not in the config is retried as `+key=value`, so it is reported as below: the key a typo is
  close to, or how to add a new one), a key the
  config file marks ??? and no override sets (`chattune validate` only: the composed config cannot
  tell, as merging keeps the value of the config it builds on);
- keys: the valid keys of a recipe are those of its kind's schema (`chattune.launch.recipe_kinds`:
  `SFTConfig`, `DPOConfig`, whose defaults are the shipped base configs `sft/tiny` and `dpo/tiny`). A
  recipe passes its kind; `chattune validate` takes it from the config's name (`kind_of_config`: its
  group, or that of the config it builds on), never from the keys the config holds. An unknown key
  is reported with the nearest valid one; a key the recipe reads that was removed (`~key`) is
  reported missing. A section with a `_target_` is checked against the callable's
  signature instead: unknown and missing required arguments, arguments the recipe passes itself
  (the optimizer's parameters, the scheduler's optimizer and `num_training_steps`), and `_partial_`.
  Hugging Face config classes accept any extra keyword, so an unknown `model.config` key is a note.
  `wandb` is passed to `wandb.init` as it is: any key. Data sources are checked against `SourceSpec`;
- types, against the schema's type hints (an int is a number, a bool is not an int; `X | None` takes
  null);
- enum values (each key's `choices` in the schema; source formats for the recipe);
- paths: each data source (a file must exist and be .jsonl/.json/.parquet; a directory is a dataset;
  `hf:org/name` is a hub dataset: a note; a missing path never is one), tokenizer.path (`hf:org/name` a
  hub tokenizer: a note), model.path and reference.path
  (local directories; a model directory must hold config.json);
- numbers that cannot work: each key's `at_least` and `bound` in the schema (steps, intervals, budgets
  and counts below their minimum, max_grad_norm and loss.beta not positive, label smoothing outside
  [0, 0.5), a negative lr),
  stop_after_step after max_steps, a budget that is not a multiple of data.pad_to_multiple_of, neither
  model.path nor model.config;
- `chattune validate` only (a recipe decides these itself, holding the output directory's lock):
  output_dir must be writable and not locked by a live run, and what a launch would continue is
  decided as the launch decides it (`chattune.checkpoint.output_dir.decide_launch`: the resume's checks against the
  checkpoint, an earlier run that only overwrite=true may replace);
- `chattune validate` only: a model built from model.config gets the launch's start-up architecture check
  (`check_architecture_of`: a miniature of it, no data, no weights), so that what a launch would refuse is
  refused here;
- `chattune validate` only: the tokenizer is loaded (it must have a chat template) and the first
  `FIRST_RECORDS` records of every source are read as the recipe reads them (an empty or malformed
  file, a bad record), and data.eval_split is checked against the training sources' numbers of records
  (each must keep one to train).

Notes (not problems): hub ids, a microbatch budget above the max_position_embeddings of model.path
(documents that long get positions the model was not trained on), unknown HF config keys, an unused
reference.path, LoRA adapters over a random-init base (which nothing can load again), the checkpoint `chattune
validate` would resume from and the ranks it needs, what a
resume would accept and what would be moved aside, records of the first ones that would be skipped.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from chattune.config.paths import RECIPES_DIR
from chattune.config.typed import typed_config
from chattune.errors import UserError
from chattune.launch.compose import compose_reporting, required_keys
from chattune.launch.findings import ConfigError, Findings, format_report
from chattune.launch.memory_plan import MemoryPlan, memory_table
from chattune.launch.recipe_kinds import RECIPE_KINDS, RecipeKind, RecipeKindError, kind_of_config
from chattune.launch.run_rules import RunRules, runs_on_cuda
from chattune.launch.schema_checks import SchemaChecks, plain_values


def check_config(cfg: DictConfig, kind: RecipeKind, world_size: int | None = None) -> list[str]:
    """Raise ConfigError listing every problem of a composed config for recipe kind `kind`; otherwise return the
    notes. `world_size` defaults to the launch's (torchrun's WORLD_SIZE, else 1)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    findings = find_problems(cfg, kind, world_size, output_dir_checks=False)
    if findings.problems:
        raise ConfigError(findings.problems)
    return findings.notes


def checked_config(cfg: DictConfig, kind: RecipeKind, world_size: int | None = None) -> tuple[Any, list[str]]:
    """`check_config`, then the config a run reads: an instance of the kind's schema (`chattune.config.typed`), with
    the notes."""
    notes = check_config(cfg, kind, world_size)
    return typed_config(cfg, kind.schema), notes


def run_validate(
    config_name: str,
    overrides: list[str],
    config_path: Path,
    world_size: int | None = None,
    config_dir: Path | None = None,
    read_data: bool = False,
    kind: RecipeKind | None = None,
    memory: MemoryPlan | None = None,
) -> tuple[str, bool]:
    """Compose `config_name` from `config_path` (and `config_dir`, Hydra's --config-dir, searched first)
    with `overrides` as a recipe would and check it: (the report, whether the config has no problem).
    `read_data`: also load the tokenizer and read the first records of every source. `kind`: the recipe's
    (`kind_of_recipe`), else the config name's. `memory`: end with the memory estimate's table."""
    findings = validate_command(
        config_name,
        overrides,
        (config_path, config_dir),
        world_size,
        read_data,
        kind=kind,
        memory=memory,
    )
    return format_report(findings), not findings.problems


# Hydra settings that would put a run's files elsewhere than output_dir (which the recipe writes itself, and
# which every rank must resolve alike): refused with what to write instead.
HYDRA_PLACEMENT = {
    "hydra.run.dir": "a run's directory is output_dir: set output_dir=DIR instead",
    "hydra.job.chdir": "chattune writes into output_dir itself, from the directory you launch in (a relative "
    "output_dir would land inside itself after the change of directory): leave hydra.job.chdir out",
}


def hydra_placement_problems(overrides: list[str]) -> list[str]:
    """A problem line for each override of `HYDRA_PLACEMENT`."""
    keys = [override.lstrip("+~").split("=", 1)[0] for override in overrides]
    return [f"{key}: {HYDRA_PLACEMENT[key]}" for key in keys if key in HYDRA_PLACEMENT]


def validate_command(
    config_name: str,
    overrides: list[str],
    configs: tuple[Path, Path | None],
    world_size: int | None = None,
    read_data: bool = False,
    output_dir_checks: bool = True,
    kind: RecipeKind | None = None,
    memory: MemoryPlan | None = None,
) -> Findings:
    """The findings of `run_validate`. `configs`: where the configs are (the config path, and Hydra's
    --config-dir searched first, or None). `output_dir_checks`: also what a launch would do with output_dir.
    `kind`: the recipe's, where one is launched; None: the config name's (`kind_of_config`)."""
    config_path, config_dir = configs
    findings = Findings()
    findings.problems += hydra_placement_problems(list(overrides))
    overrides = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in HYDRA_PLACEMENT]
    cfg, added = compose_reporting(config_name, list(overrides), Path(config_path), findings, config_dir)
    named = None
    if cfg is not None and kind is None:
        try:
            named = kind_of_config(config_name, config_path, config_dir)
        except RecipeKindError as error:
            findings.problem("config", str(error))
            return findings
        kind = named.kind
        if named.named_by != config_name:  # said, as a config of another kind would fail its checks
            findings.note("config", f"{config_name} is checked as a {kind.name} config: it builds on {named.named_by}")
    if cfg is not None:
        overridden = {override.lstrip("+~").split("=", 1)[0] for override in overrides}
        searched = [d for d in (config_dir, Path(config_path)) if d is not None]
        unset = [key for key in required_keys(config_name, searched) if key not in overridden]
        for key in unset:
            findings.problem(key, f"required by {config_name} (???), not set")
        # --device-memory plans for a GPU (from a laptop): CUDA-only settings are checked as on that GPU.
        planned_gpu = memory is not None and memory.device_memory is not None
        find_problems(cfg, kind, world_size, findings, output_dir_checks, planned_gpu=planned_gpu)
        # An unset required key still holds the value it inherited: its other problems are about that value.
        findings.problems = [
            line for line in findings.problems if line.split(":", 1)[0] not in unset or line.endswith("(???), not set")
        ]
        for key, override in added.items():  # keys Hydra adds only with "+": new ones, or typos of a known one
            if not findings.has_problem(key):
                findings.problem(key, added_key_problem(key, override, cfg, findings))
        if not findings.problems:
            check_architecture_of(cfg, findings, runs_on_cuda(cfg.device, planned_gpu))
        if read_data and not findings.problems:
            read_first_records(cfg, kind, findings)
        if memory is not None and not findings.problems:
            findings.memory = memory_table(cfg, world_size or 1, memory.device_memory)
        if named is not None and named.named_by != config_name and findings.problems:
            findings.note("config", other_kind_hint(config_name, named.kind))
    return findings


def added_key_problem(key: str, override: str, cfg: DictConfig, findings: Findings) -> str:
    """The problem of an override whose `key` is not in the config (Hydra takes it only as `+key=value`): the key it
    is close to where there is one (a typo inside model.config is passed on to the config class as an extra keyword,
    which "+" would only make silent), its note then dropped; else how to add it."""
    meant = findings.near_misses.get(key)
    if meant is None:
        return f"not in the config; add it with +{override}"
    findings.notes = [note for note in findings.notes if not note.startswith(f"{key}:")]
    section, _, name = meant.rpartition(".")
    present = name in (OmegaConf.select(cfg, section, default=None) or {})
    corrected = ("" if present else "+") + meant + override[len(key) :]
    return f"unknown key; did you mean {meant}? ({corrected})"


def other_kind_hint(config_name: str, checked_as: RecipeKind) -> str:
    """How to check a config whose kind came from the config it builds on as another kind's: a copy of dpo/tiny
    (which builds on sft/tiny) saved outside a dpo/ directory is checked as SFT."""
    others = [kind for kind in RECIPE_KINDS.values() if kind.name != checked_as.name]
    return f"if {config_name} is a config of another recipe, check it with that recipe: " + "; ".join(
        f"chattune validate --recipe {RECIPES_DIR / kind.recipe_file} ... (a {kind.name} config)" for kind in others
    )


# A miniature larger than this is left to the launch's own check: building and probing it takes seconds per hundred
# million parameters on a CPU (an 8B-shaped config's miniature holds 436M: half a minute on 2 busy cores).
ARCHITECTURE_CHECK_PARAMETERS = 50_000_000


def check_architecture_of(cfg: DictConfig, findings: Findings, on_cuda: bool) -> None:
    """The architecture check a launch runs at start-up (`chattune.model.checks.architecture`: a random-init
    miniature of the model's class and config, probed for what would train wrong), for a model built from
    model.config: what the launch would refuse (BLOOM's ALiBi lets packed documents see each other) is a problem
    here, found from the config alone (no data, no weights). A model directory's architecture is checked when the
    launch builds it, as is a miniature over ARCHITECTURE_CHECK_PARAMETERS (said in a note)."""
    if cfg.model.path is not None or not isinstance(cfg.model.config, DictConfig):
        return
    from chattune.parallel.fsdp import compute_dtype

    config = json.dumps(OmegaConf.to_container(cfg.model.config, resolve=True), sort_keys=True)
    dtype = compute_dtype(cfg.model.fsdp.param_dtype, "cuda" if on_cuda else "cpu")
    outcome = _architecture_outcome(config, dtype, cfg.data.get("share_prompts") is True)
    if isinstance(outcome, int):
        findings.note(
            "model.config",
            f"its architecture is checked when the run starts: its miniature ({outcome / 1e6:.0f}M parameters) "
            "takes too long to build here",
        )
    elif outcome is not None:
        findings.problem("model.config", outcome)


@functools.lru_cache(maxsize=32)
def _architecture_outcome(config: str, dtype: str, shared_prompts: bool = False) -> str | int | None:
    """What the launch's architecture check says of the model.config `config` (JSON) in `dtype` (and with shared
    prompts): None where it passes, the refusal, or the miniature's number of parameters where it is too large to
    check here."""
    from hydra.utils import instantiate

    from chattune.errors import UnsupportedModel
    from chattune.model.checks.architecture import check_architecture, miniature_config
    from chattune.model.cost.activation_trace import meta_model

    hf_config = instantiate(json.loads(config), _convert_="all")  # as the launch builds it
    try:
        size = sum(p.numel() for p in meta_model(miniature_config(hf_config)).parameters())
    except Exception:  # a model that does not build: the check below says why, as the launch would
        size = 0
    if size > ARCHITECTURE_CHECK_PARAMETERS:
        return size
    try:
        check_architecture(hf_config, compute_dtype=dtype, shared_prompts=shared_prompts)
    except UnsupportedModel as refusal:
        return str(refusal)
    return None


FIRST_RECORDS = 8  # records `chattune validate` reads of each source


def read_first_records(cfg: DictConfig, kind: RecipeKind, findings: Findings, count: int = FIRST_RECORDS) -> None:
    """Load the tokenizer and read the first `count` records of every source as the recipe reads them
    (format, chat template, masks, budget): an empty or malformed file, a bad first record or a tokenizer
    without a chat template is reported here rather than after the model is loaded."""
    from chattune.data.documents import Skipped
    from chattune.data.ingest.held_out import split_problem
    from chattune.data.ingest.records import source_specs
    from chattune.data.templates.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(cfg.tokenizer)
    except UserError as error:
        findings.problems.append(str(error))  # it names tokenizer.path or tokenizer.chat_template
        return
    if cfg.model.path is None:  # a random-init model: the vocabulary its config writes must hold the tokenizer's ids
        from chattune.model.causal_lm import written_vocab_size

        try:
            written_vocab_size(cfg.model.config, len(tokenizer))
        except UserError as error:
            findings.problems.append(str(error))  # "model.config.vocab_size: ..."
    data, context = cfg.data, cfg.parallel.context
    context = context if isinstance(context, int) and context >= 1 else 1  # (an invalid one is reported already)
    train_sizes: list[tuple[str, int]] = []  # (name, records) of each readable training source, for data.eval_split
    for split in ("train", "eval"):
        for index, spec in enumerate(source_specs(data[split])):
            key = f"data.{split}[{index}]"
            try:
                documents = kind.data.read([spec], tokenizer, data, context)
                outcomes = documents.get_many(range(min(count, len(documents))))
            except UserError as error:
                findings.problem(key, str(error))
                continue
            if split == "train":
                train_sizes.append((spec.display_name, len(documents)))
            skipped = [o for o in outcomes if isinstance(o, Skipped)]
            if skipped:
                findings.note(
                    key,
                    f"{len(skipped)} of its first {min(count, len(documents))} records would be skipped, "
                    f"e.g. {skipped[0].reason}: {skipped[0].detail}",
                )
    if train_sizes and len(train_sizes) == len(source_specs(data.train)):  # all read: what eval_split leaves
        problem = split_problem(*zip(*train_sizes), data.eval_split)
        if problem is not None:
            findings.problems.append(problem)


def find_problems(
    cfg: DictConfig,
    kind: RecipeKind,
    world_size: int | None = None,
    findings: Findings | None = None,
    output_dir_checks: bool = True,
    planned_gpu: bool = False,
) -> Findings:
    """Every problem (and note) of a composed config for recipe kind `kind`, added to `findings`.
    `output_dir_checks`: also what a launch would do with output_dir (a recipe decides that itself, holding the
    directory's lock). `planned_gpu`: checked for a GPU this machine may lack (`RunRules`)."""
    findings = findings if findings is not None else Findings()
    values = plain_values(cfg, "", findings)
    schema = SchemaChecks(values, kind.schema, findings)
    rules = RunRules(values, kind, findings, schema, cfg if output_dir_checks else None, planned_gpu)
    # In this order, which is the report's: keys and values first, then what they point to, then the launch.
    schema.keys_and_types(values, schema.schema, "")
    schema.choices()
    rules.sources("data.train", required=True)
    rules.sources("data.eval", required=False)
    rules.paths()
    rules.model_config()
    rules.adapters_base()
    schema.bounds()
    rules.steps_and_budget()
    rules.rollouts()
    rules.shared_prompts()
    rules.quantized_base()
    rules.float8()
    rules.device()
    rules.step_layout(world_size)
    rules.update_in_backward(world_size)
    rules.offload()
    rules.context_parallel(world_size)
    rules.tensor_parallel(world_size)
    rules.replicated_shards(world_size)
    rules.expert_parallel(world_size)
    if rules.cfg is not None:
        rules.output_dir(rules.cfg, world_size)
    return findings
