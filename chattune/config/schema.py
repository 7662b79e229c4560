"""The config schema: every key a recipe reads, with its type, default and one-line meaning.

`SFTConfig` and `DPOConfig` describe the config `recipes/sft.py` and `recipes/dpo.py` read. Their defaults are the
shipped base configs (`configs/sft/tiny.yaml`, `configs/dpo/tiny.yaml`, the embedded default run);
tests/unit/launch/test_validate.py checks that the two agree key for key. The YAML files stay the user-facing
configs that Hydra composes; `chattune validate` and each recipe's start-up check (`chattune.launch.schema_checks`)
check a composed config against these classes: unknown keys (with the nearest valid one), missing keys,
types (`X | None`: null allowed), choices, minimums and the other bounds in each key's metadata.

Hydra does not enforce the schema itself (no structured config in the defaults lists): its first error
would stop composition, where validate reports every problem at once, each with a suggestion.

The choices of enum keys are defined here once and imported by the modules that act on them.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any, TypedDict

from typing_extensions import Unpack

from chattune.config.losses import LOSS_SETTINGS, PREFERENCE_LOSSES, setting_help
from chattune.config.policy_losses import (
    ADVANTAGE_SCALES,
    IS_CORRECTIONS,
    POLICY_LOSSES,
    REWARD_ON_ERROR,
    ROLLOUT_ENGINES,
)

# --- the choices of enum keys ---

DEVICES = ("auto", "cpu", "cuda")
LOGGERS = ("stdout", "wandb")
PROGRESS_MODES = ("auto", "bar", "lines")
NONFINITE_LOSS = ("skip", "stop")
TRAIN_ON = ("assistant", "last_assistant", "all")
OVERLONG = ("drop", "truncate", "split", "error")
OVERLONG_DPO = ("drop", "error")  # a pair is never cut: both replies share the prompt
ON_BAD_RECORD = ("error", "skip")
MIXING_MODES = ("none", "static", "online")
MIXING_STOPPING = ("first_exhausted", "all_exhausted")
FP8_MODES = ("tensorwise", "rowwise", "emulate")  # model.fp8 (chattune.model.quantization.float8)
MIXING_REWARDS = ("mean_loss", "loss_decrease")
DTYPES = ("float32", "bfloat16", "float16")
LOSS_TYPES = PREFERENCE_LOSSES.keys()  # the catalogue's (a view: a loss registered later is a choice too)
LOSS_IMPLEMENTATIONS = ("auto", "chunked", "cut_cross_entropy")
PEFT_TYPES = ("lora",)
QUANTIZE_BASE = ("nf4", "fp4")  # bitsandbytes' 4-bit formats (QLoRA: nf4)
# What a resumed run may change of a key without resume_allow_changes (`chattune.checkpoint.resume`): "free" (where and
# how often it logs, saves and evaluates: not the trajectory), "horizon" (the run's length: the schedule is
# recomputed, with a warning) or "numerics" (how, not what, is computed: a note).
RESUME_CHANGES = ("free", "horizon", "numerics")


class KeyRules(TypedDict, total=False):
    """What the checks (`chattune.launch.schema_checks`) hold a key to, each rule optional (`key`'s `**rules`)."""

    choices: Collection[str] | None  # the values it may take
    at_least: int | None  # its minimum ...
    hint: str  # ... and what to add to the message when it is below
    bound: tuple[Callable[[Any], bool], str] | None  # (predicate on a number or a list, message when it fails)
    open_section: bool  # a mapping passed on as it is: any key
    # A `_target_` section called with `_partial_`: how many positional arguments and which keywords the recipe adds.
    recipe_passes: tuple[int, tuple[str, ...]] | None
    # A key of a `_target_` section that chattune reads itself and does not pass to the target.
    not_passed: bool
    aliases: tuple[str, ...]  # what users write for this key elsewhere (e.g. peft's own names): suggested as it


# Every rule's value when a key does not set it (each is in every key's metadata).
_NO_RULES: KeyRules = {
    "choices": None,
    "at_least": None,
    "hint": "",
    "bound": None,
    "open_section": False,
    "recipe_passes": None,
    "not_passed": False,
    "aliases": (),
}


def key(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    resume: str | None = None,
    **rules: Unpack[KeyRules],
) -> Any:
    """A config key: its default (or `factory` for a mutable one) and one-line meaning (`help`), what a
    resumed run may do with it (`resume`, one of `RESUME_CHANGES`; None: a change is refused unless
    resume_allow_changes names it), and the `rules` the checks hold it to (`KeyRules`: `choices`, `at_least`
    with a `hint` on failure, `bound`, `open_section`, `recipe_passes`, `aliases`)."""
    unknown = sorted(set(rules) - set(_NO_RULES))
    if unknown:
        raise TypeError(f"key() got unexpected keyword argument(s) {unknown}: the rules are {sorted(_NO_RULES)}")
    if resume is not None and resume not in RESUME_CHANGES:
        raise ValueError(f"resume={resume!r} is not one of {RESUME_CHANGES}")
    metadata = {"help": help, **_NO_RULES, **rules, "resume": resume}  # every rule, in `_NO_RULES`' order
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def loss_setting(name: str) -> Any:
    """A preference loss's `loss.*` key as the loss catalogue declares it (`chattune.config.losses.LOSS_SETTINGS`):
    its default, meaning and bound written once there."""
    setting = LOSS_SETTINGS[name]
    return key(setting.default, setting_help(name), bound=setting.bound)


def section(cls: Callable[[], Any], help: str = "", *, resume: str | None = None, **rules: Unpack[KeyRules]) -> Any:
    """A nested section, defaulting to `cls()`."""
    return key(help=help, factory=cls, resume=resume, **rules)


def is_eval_split(value: float) -> bool:
    """data.eval_split: a fraction in (0, 1), or a whole number of records (an int, not 5.0) of at least 1."""
    return (isinstance(value, int) and value >= 1) or (isinstance(value, float) and 0 < value < 1)


# --- the sections ---


@dataclass
class WandbConfig:
    project: str = key("chattune", "wandb project")
    name: str | None = key(None, "run name (null: wandb picks one)")
    mode: str | None = key(None, "null: $WANDB_MODE or online | offline: no network or API key, `wandb sync` later")


@dataclass
class TokenizerConfig:
    path: str = key("${demo_asset:tokenizer}", "a local tokenizer directory with a chat template, or hf:org/name")
    chat_template: str | None = key(
        None,
        "the template records are rendered with and the export writes: null (the "
        "tokenizer's own) | a name chattune ships (chatml, llama3) | a file | "
        "inline Jinja",
    )


@dataclass
class TinyLlamaConfig:
    """The embedded default model (`model.config` is instantiated: any HF config class and its keys)."""

    _target_: str = key("transformers.LlamaConfig", "the HF config class")
    hidden_size: int = key(192, "model width")
    intermediate_size: int = key(512, "MLP width")
    num_hidden_layers: int = key(4, "decoder layers")
    num_attention_heads: int = key(6, "query heads")
    num_key_value_heads: int = key(2, "key/value heads (grouped-query attention)")
    max_position_embeddings: int = key(
        2048,
        "longest sequence the model is built for (written into its export, "
        "where a run from it checks its budget against it)",
    )
    tie_word_embeddings: bool = key(True, "the output layer shares the embedding matrix")


@dataclass
class FSDPConfig:
    param_dtype: str = key(
        "auto", "compute dtype; auto: bfloat16 on CUDA, float32 on CPU (shards stay fp32)", choices=("auto", *DTYPES)
    )
    reduce_dtype: str = key("float32", "dtype of the gradient reduction", choices=DTYPES)
    activation_checkpointing: bool = key(
        False, "recompute each decoder layer's activations in the backward", resume="numerics"
    )
    offload_activations: bool = key(
        False,
        "move what the forward saves for the backward to host memory and back (on CUDA on a side stream, "
        "overlapped with compute); with activation_checkpointing: each decoder layer's input",
        resume="free",
    )
    cpu_offload: bool = key(
        False,
        "keep the parameter shards, gradients and optimizer states in host memory and step the optimizer "
        "there (FSDP2's CPUOffloadPolicy): a model of several times the device's memory trains, each step "
        "slower by its copies and the host's optimizer step",
        resume="free",
    )


@dataclass
class ParallelConfig:
    replicate: int = key(
        1,
        "HSDP: groups of ranks that each hold a whole sharded copy of the parameters; each parameter is sharded "
        "over the ranks / parallel.replicate of a group and its gradients are summed across the groups (shard "
        "within a node, replicate across nodes); with parallel.context, divides the number of ranks",
        at_least=1,
        resume="numerics",
    )
    tensor: int = key(
        1,
        "tensor parallelism: consecutive ranks that split each decoder layer's linear layers (attention heads and "
        "MLP width; llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, smollm3, granite, exaone4, and "
        "the mixtures of experts qwen3_moe, qwen2_moe, mixtral), within a machine; with parallel.context and "
        "parallel.replicate, divides the number of ranks",
        at_least=1,
        resume="numerics",
    )
    context: int = key(
        1,
        "context parallelism: ranks that share each packed row (of parallel.context x "
        "data.max_tokens_per_microbatch tokens), each computing a slice; divides the number of ranks "
        "and the model's attention heads",
        at_least=1,
    )
    expert: int = key(
        1,
        "expert parallelism: consecutive ranks that split each MoE layer's experts (num_experts / expert whole "
        "experts each) and exchange tokens all-to-all, borrowed from the ranks FSDP2 shards over (the experts "
        "sharded over the rest); divides those ranks and the experts per layer; not with parallel.tensor",
        at_least=1,
        resume="numerics",
    )


@dataclass
class ModelConfig:
    path: str | None = key(None, "a local Hugging Face model directory; null builds `config` with random weights")
    config: TinyLlamaConfig | None = section(TinyLlamaConfig, "an HF config (_target_ and its keys) for random init")
    fsdp: FSDPConfig = section(FSDPConfig, "FSDP2 sharding and mixed precision")
    compile: bool | str = key(
        "auto",
        "torch.compile each decoder layer: auto (on CUDA, not on CPU) | true | false",
        choices=("auto",),
        resume="numerics",
    )
    fp8: str | None = key(
        None,
        "float8 matmuls in the decoder's linear layers (torchao): tensorwise | rowwise (GPUs with compute "
        "capability 8.9+) | emulate (float8 rounding emulated: the CPU check) | null: off",
        choices=FP8_MODES,
        resume="numerics",
    )


@dataclass
class MixingConfig:
    mode: str = key(
        "none",
        "none: sources concatenated, every record once per epoch | static: by weight | online: bandit",
        choices=MIXING_MODES,
    )
    stopping: str = key(
        "all_exhausted",
        "a mixture's epoch ends when the first source or every source has finished a pass",
        choices=MIXING_STOPPING,
    )
    gamma: float = key(0.1, "online: share of the probability spread evenly over the sources (exploration)")
    eta: float = key(0.1, "online: step size of the log-weights")
    update_every: int = key(10, "online: steps between updates")
    reward: str = key("mean_loss", "online: mean_loss | loss_decrease", choices=MIXING_REWARDS)


@dataclass
class DataConfig:
    train: list[Any] = key(
        factory=lambda: ["${demo_asset:chat_train.jsonl}"],
        help="training sources: paths or {path, format, columns, roles, ...}",
    )
    eval: list[Any] | None = key(
        factory=lambda: ["${demo_asset:chat_eval.jsonl}"], help="held-out sources", resume="free"
    )
    eval_split: float | None = key(
        None,
        "records of the training sources held out and evaluated, never trained: a "
        "fraction in (0, 1) of each source, or a count over all of them (in "
        "proportion to their sizes); the same records on any ranks and resumes. "
        "null: none",
        bound=(is_eval_split, "must be a fraction in (0, 1) or a whole number of records of at least 1 (null: none)"),
    )
    train_on: str = key("assistant", "the tokens trained on", choices=TRAIN_ON)
    max_tokens_per_microbatch: int = key(2048, "the token budget of one packed microbatch", at_least=1)
    buffer_records: int = key(256, "records tokenized and packed together (best-fit decreasing)", at_least=1)
    microbatches_per_step: int | None = key(
        None,
        "world-size-invariant steps: the step's microbatches over all "
        "ranks, the next ones of one packing of all the data that every "
        "rank makes alike; the number of ranks must divide it "
        "(grad_accum_steps follows). null: each rank packs its own share",
        at_least=1,
    )
    num_workers: int = key(
        0,
        "tokenizing processes per rank (0: in the training process); with a token cache, those that build it",
        at_least=0,
        resume="numerics",
    )
    cache: str = key(
        "auto",
        "the token cache: auto (in $CHATTUNE_CACHE_DIR, else ~/.cache/chattune) | off (tokenize "
        "as read, every launch) | a directory",
        resume="free",
    )
    pad_to_multiple_of: int | None = key(
        None, "round each microbatch up (padding is never trained or attended)", at_least=1
    )
    overlong: str = key("drop", "a record over the budget: drop | truncate | split | error", choices=OVERLONG)
    on_bad_record: str = key("error", "a record that cannot be read or trained on: error | skip", choices=ON_BAD_RECORD)
    num_epochs: int | None = key(
        None, "stop after this many epochs (null: max_steps decides)", at_least=1, resume="horizon"
    )
    report_records: int | None = key(
        1000, "records counted for the data report (null: all, 0: none)", at_least=0, resume="free"
    )
    share_prompts: bool = key(
        False,
        "preference and reward pairs, GRPO groups: the prompt computed once, each reply attending to it "
        "(exact; docs/dpo.md); false: each reply with its own copy of the prompt",
        resume="numerics",
    )
    mixing: MixingConfig = section(MixingConfig, "how training sources are sampled")


@dataclass
class LossConfig:
    chunk_size: int = key(1024, "tokens per chunk of the output-layer cross-entropy", at_least=1, resume="numerics")
    implementation: str = key(
        "auto",
        "the output-layer loss: auto (cut_cross_entropy on CUDA when installed) | "
        "chunked (exact fp32) | cut_cross_entropy",
        choices=LOSS_IMPLEMENTATIONS,
        resume="numerics",
    )
    router_aux_coef: float | None = key(
        None,
        "MoE models: the router load-balancing loss's coefficient (null: the "
        "model's router_aux_loss_coef where its config sets output_router_logits; "
        "0: off)",
        bound=(lambda v: v is None or v >= 0, "must be >= 0"),
    )


@dataclass
class OptimizerConfig:
    _target_: str = key("torch.optim.AdamW", "the optimizer class")
    _partial_: bool = key(True, "the recipe passes the parameters")
    lr: float = key(3e-3, "learning rate", bound=(lambda v: v >= 0, "must not be negative"))
    betas: list[float] = key(
        factory=lambda: [0.9, 0.95],
        help="AdamW's moment decay rates",
        bound=(lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "must be two numbers in [0, 1)"),
    )
    weight_decay: float = key(0.01, "decoupled weight decay")
    in_backward: bool = key(
        False,
        "step each parameter as soon as its gradient is reduced, so the whole model's gradients never exist at "
        "once (needs max_grad_norm=null and one microbatch per rank per step)",
        resume="free",
        not_passed=True,
    )


@dataclass
class SchedulerConfig:
    _target_: str = key(
        "chattune.train.schedule.cosine_with_warmup",
        "the schedule function (the default equals transformers.get_cosine_schedule_with_warmup)",
    )
    _partial_: bool = key(True, "the recipe passes the optimizer and num_training_steps")
    num_warmup_steps: int = key(10, "linear warm-up steps", at_least=0)


@dataclass
class ExportConfig:
    dtype: str = key(
        "auto",
        "dtype of the exported weights; auto: the source checkpoint's (float32 for random init)",
        choices=("auto", *DTYPES),
    )
    merge: bool = key(False, "with peft: also write the base with the adapters merged into it (output_dir/hf)")


@dataclass
class EvalConfig:
    samples: int = key(
        4,
        "prompts answered greedily by the model at every evaluation, written to samples.jsonl (and wandb); 0: none",
        at_least=0,
        hint=" (0: none)",
    )
    sample_prompts: str | None = key(
        None,
        "a prompts file (.jsonl of {messages} or {prompt}, else one prompt a "
        "line) to sample from; null: the held-out set's first records (data.eval)",
    )
    max_new_tokens: int = key(64, "the longest sample reply, in tokens", at_least=1)


@dataclass
class PeftConfig:
    type: str = key("lora", "the adapter kind", choices=PEFT_TYPES)
    rank: int = key(16, "the adapters' inner dimension (r)", at_least=1, aliases=("r",))
    alpha: float = key(
        32, "the update is scaled by alpha / rank", bound=(lambda v: v > 0, "must be positive"), aliases=("lora_alpha",)
    )
    dropout: float = key(
        0.0,
        "dropout on the adapters' input (0 keeps gradients independent of the split)",
        bound=(lambda v: 0 <= v < 1, "must be in [0, 1)"),
        aliases=("lora_dropout",),
    )
    target_modules: str | list[str] = key(
        "all-linear",
        "all-linear (every linear layer but the output layer, and an MoE model's stacked experts) or module "
        "names (a list, or one name; an MoE model's expert stacks by name, e.g. down_proj, or experts)",
    )
    train_router: bool = key(
        False, "an MoE model's router weight gets an adapter too (false: it routes as the base model does)"
    )
    use_dora: bool = key(False, "DoRA: a trained magnitude per output row on top of the LoRA direction")
    modules_to_save: list[str] | None = key(
        None,
        "modules trained in full next to the adapters, e.g. [embed_tokens, "
        "lm_head] (tied embeddings stay tied: one matrix)",
    )
    quantize_base: str | None = key(
        None,
        "QLoRA: the frozen base's linear layers in 4 bits with bitsandbytes, "
        "CUDA only (null: the base in full precision)",
        choices=QUANTIZE_BASE,
    )


@dataclass
class RunConfig:
    """The keys every recipe's run has: its output, steps, data, model, loss head, optimizer, parallelism, checkpoints
    and metrics. SFT's config is this alone (`SFTConfig`); each preference recipe's adds its own (`PreferenceConfig`)."""

    output_dir: str = key("outputs/sft-tiny", "where checkpoints, metrics and the HF export go", resume="free")
    seed: int = key(42, "seeds model init, data order and dropout")
    device: str = key("auto", "auto | cpu | cuda", choices=DEVICES)
    max_steps: int = key(200, "optimizer steps", at_least=1, resume="horizon")
    grad_accum_steps: int = key(1, "microbatches per optimizer step, per rank", at_least=1)
    max_grad_norm: float | None = key(
        1.0,
        "gradient clipping (null: none; the norm is still logged)",
        bound=(lambda v: v > 0, "must be positive (null: no clipping)"),
    )
    log_every: int = key(5, "steps between metric lines", at_least=1, resume="free")
    save_every: int = key(
        100, "steps between sharded checkpoints (0: never)", at_least=0, hint=" (0: never)", resume="free"
    )
    keep_last_n: int | None = key(
        3, "checkpoints kept (null: all)", at_least=1, hint=" (null keeps every checkpoint)", resume="free"
    )
    save_async: bool = key(
        False, "write checkpoints in the background while training goes on (committed when complete)", resume="free"
    )
    snapshot_steps: bool | str = key(
        "auto",
        "keep each step's state in host memory, so that a stop that cannot finish its step (plain torchrun kills "
        "its workers 30 s after a signal) writes the step before it, without collectives; auto: under plain "
        "torchrun, from the first step longer than half of that grace",
        choices=("auto",),
        resume="free",
    )
    resume: str | None = key("auto", "auto: the newest checkpoint in output_dir | PATH | null: never", resume="free")
    overwrite: bool = key(False, "start over in an output_dir that holds an earlier run (moved aside)", resume="free")
    resume_allow_changes: bool | list[str] = key(
        False, "keys, data files or FILE:N records a resume accepts changed (true: any)", resume="free"
    )
    stop_after_step: int | None = key(None, "save a checkpoint and exit after this step", at_least=1, resume="free")
    nonfinite_loss: str = key(
        "skip", "skip: drop that step's update | stop: raise", choices=NONFINITE_LOSS, resume="free"
    )
    ledger: bool = key(False, "log each step's document ids per rank under output_dir/ledger/", resume="free")
    eval_every: int = key(
        50, "held-out loss every N steps and at the end (0: never)", at_least=0, hint=" (0: never)", resume="free"
    )
    eval: EvalConfig = section(EvalConfig, "sample replies at every evaluation", resume="free")
    logger: str = key("stdout", "stdout | wandb (metrics.jsonl is always written)", choices=LOGGERS, resume="free")
    progress: str = key(
        "auto", "auto: a bar on a terminal, metric lines otherwise | bar | lines", choices=PROGRESS_MODES, resume="free"
    )
    wandb: WandbConfig = section(WandbConfig, "passed to wandb.init", open_section=True, resume="free")
    tokenizer: TokenizerConfig = section(TokenizerConfig)
    model: ModelConfig = section(ModelConfig)
    parallel: ParallelConfig = section(ParallelConfig, "how ranks share the work beyond FSDP's sharding")
    data: DataConfig = section(DataConfig)
    loss: LossConfig = section(LossConfig)
    optimizer: OptimizerConfig = section(
        OptimizerConfig, "instantiated with the trainable parameters", recipe_passes=(1, ())
    )
    scheduler: SchedulerConfig = section(
        SchedulerConfig, "instantiated with the optimizer", recipe_passes=(1, ("num_training_steps",))
    )
    peft: PeftConfig | None = key(
        None, "null: full fine-tuning | peft=lora: adapters on a frozen base (configs/peft/lora.yaml)"
    )
    export: ExportConfig = section(
        ExportConfig, "the Hugging Face directory written at the end (output_dir/hf)", resume="free"
    )


@dataclass
class ReferenceConfig:
    path: str | None = key(None, "the frozen reference model directory (null: the initial policy, model.path)")
    cache: bool = key(False, "reference log-probs computed once before training, stored and reused")
    cache_dir: str = key(
        "${output_dir}/reference_cache",
        "where the table is kept: the run's own (name one directory for runs to share tables: a table is "
        "reused wherever data and reference match)",
        resume="free",
    )


@dataclass
class DPODataConfig(DataConfig):
    train: list[Any] = key(
        factory=lambda: [{"path": "${demo_asset:preference_train.jsonl}", "format": "preference"}],
        help="preference sources",
    )
    eval: list[Any] | None = key(
        factory=lambda: [{"path": "${demo_asset:preference_eval.jsonl}", "format": "preference"}],
        help="held-out preference sources",
        resume="free",
    )
    overlong: str = key("drop", "a pair over the budget: drop | error", choices=OVERLONG_DPO)


@dataclass
class DPOLossConfig(LossConfig):
    type: str = key("sigmoid", "the preference loss (simpo, orpo: reference-free)", choices=LOSS_TYPES)
    beta: float = loss_setting("beta")
    label_smoothing: float = loss_setting("label_smoothing")
    simpo_gamma: float = loss_setting("simpo_gamma")
    sft_weight: float = loss_setting("sft_weight")
    orpo_lambda: float = loss_setting("orpo_lambda")


@dataclass
class SFTConfig(RunConfig):
    """The keys of `recipes/sft.py` (defaults: configs/sft/tiny.yaml): a run's, none of its own."""


@dataclass
class PreferenceConfig(RunConfig):
    """The defaults the preference recipes share (DPO, the reward model, KTO): a short run that starts from the SFT
    demo's export."""

    max_steps: int = key(60, "optimizer steps", at_least=1, resume="horizon")
    save_every: int = key(
        30, "steps between sharded checkpoints (0: never)", at_least=0, hint=" (0: never)", resume="free"
    )
    eval_every: int = key(
        20, "held-out metrics every N steps and at the end (0: never)", at_least=0, hint=" (0: never)", resume="free"
    )
    model: ModelConfig = section(lambda: ModelConfig(path="outputs/sft-tiny/hf"))
    scheduler: SchedulerConfig = section(
        lambda: SchedulerConfig(num_warmup_steps=5),
        "instantiated with the optimizer",
        recipe_passes=(1, ("num_training_steps",)),
    )


@dataclass
class DPOConfig(PreferenceConfig):
    """The keys of `recipes/dpo.py` (defaults: configs/dpo/tiny.yaml, which builds on sft/tiny)."""

    output_dir: str = key("outputs/dpo-tiny", "where checkpoints, metrics and the HF export go", resume="free")
    data: DPODataConfig = section(DPODataConfig)
    loss: DPOLossConfig = section(DPOLossConfig)
    optimizer: OptimizerConfig = section(
        lambda: OptimizerConfig(lr=5e-4), "instantiated with the trainable parameters", recipe_passes=(1, ())
    )
    reference: ReferenceConfig = section(ReferenceConfig, "the frozen reference of the preference loss")


@dataclass
class RewardLossConfig(LossConfig):
    center_rewards_coefficient: float = key(
        0.0,
        "adds this times (r_chosen + r_rejected)^2 per pair, keeping rewards centred on 0 (TRL's "
        "center_rewards_coefficient; 0: off)",
        bound=(lambda v: v >= 0, "must be >= 0"),
    )


@dataclass
class RewardEvalConfig(EvalConfig):
    samples: int = key(
        0,
        "a reward model writes no replies: must be 0",
        bound=(lambda v: v == 0, "must be 0: a reward model scores replies and writes none"),
    )


@dataclass
class WholeRowParallelConfig(ParallelConfig):
    """For a recipe that runs every packed row whole on each rank (reward, KTO): no context parallelism."""

    context: int = key(
        1,
        "must be 1: this recipe runs every packed row whole on each rank",
        bound=(lambda v: v == 1, "must be 1: this recipe does not split packed rows across ranks"),
    )


@dataclass
class RewardConfig(PreferenceConfig):
    """The keys of `recipes/reward.py` (defaults: configs/reward/tiny.yaml, which builds on sft/tiny)."""

    output_dir: str = key("outputs/reward-tiny", "where checkpoints, metrics and the HF export go", resume="free")
    eval: RewardEvalConfig = section(RewardEvalConfig, "no sample replies: a reward model scores", resume="free")
    parallel: WholeRowParallelConfig = section(
        WholeRowParallelConfig, "how ranks share the work beyond FSDP's sharding"
    )
    data: DPODataConfig = section(DPODataConfig)
    loss: RewardLossConfig = section(RewardLossConfig)
    optimizer: OptimizerConfig = section(
        lambda: OptimizerConfig(lr=1e-3), "instantiated with the trainable parameters", recipe_passes=(1, ())
    )


@dataclass
class KTODataConfig(DPODataConfig):
    train: list[Any] = key(
        factory=lambda: [{"path": "${demo_asset:preference_train.jsonl}", "format": "preference"}],
        help="unpaired examples ({prompt, completion, label}) or preference pairs (two examples each)",
    )
    eval: list[Any] | None = key(
        factory=lambda: [{"path": "${demo_asset:preference_eval.jsonl}", "format": "preference"}],
        help="held-out examples or pairs",
        resume="free",
    )
    overlong: str = key(
        "drop", "an example (with its mismatched sequence) over the budget: drop | error", choices=OVERLONG_DPO
    )


@dataclass
class KTOLossConfig(LossConfig):
    beta: float = key(0.1, "KTO's inverse temperature", bound=(lambda v: v > 0, "must be positive"))
    desirable_weight: float = key(
        1.0, "the weight of desirable examples' losses (TRL's)", bound=(lambda v: v > 0, "must be positive")
    )
    undesirable_weight: float = key(
        1.0, "the weight of undesirable examples' losses (TRL's)", bound=(lambda v: v > 0, "must be positive")
    )


@dataclass
class KTOConfig(PreferenceConfig):
    """The keys of `recipes/kto.py` (defaults: configs/kto/tiny.yaml, which builds on sft/tiny)."""

    output_dir: str = key("outputs/kto-tiny", "where checkpoints, metrics and the HF export go", resume="free")
    parallel: WholeRowParallelConfig = section(
        WholeRowParallelConfig, "how ranks share the work beyond FSDP's sharding"
    )
    data: KTODataConfig = section(KTODataConfig)
    loss: KTOLossConfig = section(KTOLossConfig)
    optimizer: OptimizerConfig = section(
        lambda: OptimizerConfig(lr=5e-4), "instantiated with the trainable parameters", recipe_passes=(1, ())
    )
    reference: ReferenceConfig = section(ReferenceConfig, "the frozen reference of KTO's log-ratios")


@dataclass
class RolloutConfig:
    """How the GRPO recipe samples: P prompts a step, G completions of each, from the policy being trained."""

    prompts_per_step: int = key(
        16, "prompts sampled each rollout, over all data-parallel ranks (P; a multiple of their number)", at_least=1
    )
    completions_per_prompt: int = key(
        8, "completions sampled of each prompt (G): the group whose rewards its advantages compare", at_least=2
    )
    steps_per_rollout: int = key(
        1,
        "optimizer steps on each rollout (mu); above 1 the old policy's log-probs are computed once, after sampling",
        at_least=1,
    )
    temperature: float = key(
        1.0,
        "sampling temperature (the policy's logits are divided by it in the loss too)",
        bound=(lambda v: v > 0, "must be positive (a policy gradient samples)"),
    )
    top_p: float = key(1.0, "nucleus sampling's mass (1: none)", bound=(lambda v: 0 < v <= 1, "must be in (0, 1]"))
    top_k: int = key(0, "sample among the k most probable tokens (0: no limit)", at_least=0)
    min_p: float = key(
        0.0,
        "drop tokens below this times the most probable one's probability (0: none)",
        bound=(lambda v: 0 <= v < 1, "must be in [0, 1)"),
    )
    max_new_tokens: int = key(32, "the longest completion, in tokens", at_least=1)
    stop_strings: list[str] = key(
        factory=list, help="texts that end a completion besides the chat template's end of turn"
    )
    chat_template_kwargs: dict[str, Any] = key(
        factory=dict, help="passed to the chat template with the prompt (e.g. {enable_thinking: false} for Qwen3)"
    )
    skip_uniform_groups: bool = key(
        False, "leave out of the step the groups whose rewards are all equal (counted), as DAPO's dynamic sampling"
    )
    is_correction: str = key(
        "truncate",
        "truncate: each token's loss weighed by min(p_policy / p_sampled, rollout.is_cap), the sampled distribution "
        "being the truncated one (top-k, top-p, min-p) | none",
        choices=IS_CORRECTIONS,
    )
    is_cap: float = key(2.0, "the cap of the truncated importance weight", bound=(lambda v: v >= 1, "must be >= 1"))
    on_policy_share: float = key(
        1.0,
        "loss.type=gkd: the share of rollouts sampled from the policy (GKD's lambda); the others train on the data's "
        "own replies (rollout.reply_field), one per prompt",
        bound=(lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    )
    reply_field: str = key(
        "reply",
        "the prompt records' field holding their own reply (an assistant message's text), for gkd's "
        "off-policy rollouts (rollout.on_policy_share < 1)",
    )
    engine: str = key(
        "hf",
        "what samples: hf (transformers' generate on the sharded policy) | vllm (not yet)",
        choices=ROLLOUT_ENGINES,
    )


@dataclass
class RewardFunctionsConfig:
    functions: list[Any] = key(
        factory=lambda: [
            {"_target_": "chattune.rl.demo_task.sorted_numbers", "weight": 1.0},
            {"_target_": "chattune.rl.rewards.answer_check", "weight": 0.0, "name": "solved"},
        ],
        help="reward functions, each {_target_, weight, name, its arguments}: called on a rollout's completions, "
        "their weighted sum the reward (docs/grpo.md)",
    )
    on_error: str = key(
        "error",
        "a reward function that raises or returns no number: error (names it and the record) | skip (the prompt's "
        "completions left out, counted, logged)",
        choices=REWARD_ON_ERROR,
    )


@dataclass
class AdvantageConfig:
    scale: str = key(
        "std",
        "std: (reward - group mean) / (group std + 1e-4) | none: reward - group mean (Dr. GRPO)",
        choices=ADVANTAGE_SCALES,
    )


@dataclass
class PolicyLossConfig(LossConfig):
    type: str = key(
        "dapo",
        "grpo | dapo | dr_grpo | gspo | cispo | reverse_kl | gkd (the last two: on-policy distillation from "
        "teacher.path; docs/grpo.md: what each averages over)",
        choices=POLICY_LOSSES,
    )
    epsilon_low: float | None = key(
        None,
        "the ratio's clip below 1 (null: the loss's paper's: 0.2, gspo 3e-4)",
        bound=(lambda v: v is None or 0 <= v < 1, "must be in [0, 1)"),
    )
    epsilon_high: float | None = key(
        None,
        "the ratio's clip above 1 (null: the loss's paper's: 0.2, dapo 0.28, gspo 4e-4)",
        bound=(lambda v: v is None or v >= 0, "must be >= 0"),
    )
    beta: float = key(
        0.0,
        "the KL penalty to the reference (k3 estimator; 0: none, no reference built)",
        bound=(lambda v: v >= 0, "must be >= 0"),
    )
    kl_ratio: bool = key(
        True,
        "each token's KL term weighed by its importance ratio (DeepSeek-V3.2; TRL's use_bias_correction_kl): the KL "
        "gradient unbiased, on-policy too",
    )
    cispo_max_ratio: float = key(
        5.0,
        "cispo: the cap of its detached importance weight (TRL's epsilon_high for cispo)",
        bound=(lambda v: v > 0, "must be positive"),
    )
    jsd_beta: float = key(
        0.5,
        "gkd: the generalised JSD's beta (TRL's convention: 0 the forward KL(teacher||policy), 1 the reverse "
        "KL(policy||teacher))",
        bound=(lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    )


@dataclass
class GRPODataConfig(DataConfig):
    train: list[Any] = key(
        factory=lambda: [{"path": "${demo_asset:sort_prompts.jsonl}", "format": "prompt"}],
        help="prompt sources (format: prompt): {prompt} or {messages}, with the fields the rewards read",
    )
    eval: list[Any] | None = key(
        None,
        "held-out prompt sources (format: prompt), answered and rewarded at every evaluation (eval_every); null: none",
        resume="free",
    )
    overlong: str = key(
        "drop", "a prompt whose tokens and rollout.max_new_tokens exceed the budget: drop | error", choices=OVERLONG_DPO
    )
    microbatches_per_step: int | None = key(
        None,
        "must be null: a rollout's completions make the step's rows",
        bound=(lambda v: v is None, "must be null"),
    )


@dataclass
class GRPOReferenceConfig:
    path: str | None = key(
        None, "the frozen reference of the KL penalty (loss.beta > 0; null: the initial policy, model.path)"
    )


@dataclass
class TeacherConfig:
    path: str | None = key(
        None,
        "on-policy distillation (loss.type=reverse_kl or gkd): the teacher's model directory, with the student's "
        "tokenizer; frozen, sharded like the policy, scoring every sampled token",
    )


@dataclass
class GRPOConfig(RunConfig):
    """The keys of `recipes/grpo.py` (defaults: configs/grpo/tiny.yaml, which builds on sft/tiny)."""

    output_dir: str = key("outputs/grpo-tiny", "where checkpoints, metrics and the HF export go", resume="free")
    max_steps: int = key(60, "optimizer steps", at_least=1, resume="horizon")
    grad_accum_steps: int = key(
        1, "must be 1: a rollout's completions make each step's rows", bound=(lambda v: v == 1, "must be 1")
    )
    save_every: int = key(
        30, "steps between sharded checkpoints (0: never)", at_least=0, hint=" (0: never)", resume="free"
    )
    eval_every: int = key(
        0,
        "steps between rewarding the held-out prompts (data.eval), and at the end (0: never)",
        at_least=0,
        hint=" (0: never)",
        resume="free",
    )
    eval: EvalConfig = section(lambda: EvalConfig(samples=0), "sample replies at every evaluation", resume="free")
    model: ModelConfig = section(lambda: ModelConfig(path="outputs/sft-tiny/hf"))
    parallel: WholeRowParallelConfig = section(
        WholeRowParallelConfig, "how ranks share the work beyond FSDP's sharding"
    )
    data: GRPODataConfig = section(GRPODataConfig)
    loss: PolicyLossConfig = section(PolicyLossConfig)
    optimizer: OptimizerConfig = section(
        lambda: OptimizerConfig(lr=5e-4, weight_decay=0.0),
        "instantiated with the trainable parameters",
        recipe_passes=(1, ()),
    )
    scheduler: SchedulerConfig = section(
        lambda: SchedulerConfig(num_warmup_steps=0),
        "instantiated with the optimizer",
        recipe_passes=(1, ("num_training_steps",)),
    )
    rollout: RolloutConfig = section(RolloutConfig, "how completions are sampled from the policy")
    reward: RewardFunctionsConfig = section(RewardFunctionsConfig, "what scores the completions")
    advantage: AdvantageConfig = section(AdvantageConfig, "each completion's reward against its group's")
    reference: GRPOReferenceConfig = section(GRPOReferenceConfig, "the frozen reference of the KL penalty")
    teacher: TeacherConfig = section(TeacherConfig, "on-policy distillation's teacher")


SCHEMAS: dict[str, type] = {
    "sft": SFTConfig,
    "dpo": DPOConfig,
    "reward": RewardConfig,
    "kto": KTOConfig,
    "grpo": GRPOConfig,
}


# --- reading the schema: its keys, their types and metadata ---


@cache
def schema_fields(section: type) -> dict[str, tuple[Any, Mapping[str, Any]]]:
    """A schema section's keys: name -> (type hint, metadata)."""
    hints = typing.get_type_hints(section)
    return {f.name: (hints[f.name], f.metadata) for f in dataclasses.fields(section)}


def type_options(hint: Any) -> tuple[list[Any], bool]:
    """The types a hint allows, and whether it allows null (`X | None`)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        return [a for a in args if a is not type(None)], type(None) in args
    return [hint], False


def section_type(hint: Any) -> type | None:
    """The schema section a hint holds (`Section` or `Section | None`), None for a plain value."""
    return next((o for o in type_options(hint)[0] if isinstance(o, type) and dataclasses.is_dataclass(o)), None)


def schema_items(section: type, prefix: str = ""):
    """(dotted key, metadata) of every key of a schema in schema order, sections included (a section
    that may be null, by its own type)."""
    for name, (hint, metadata) in schema_fields(section).items():
        key = f"{prefix}.{name}" if prefix else name
        yield key, metadata
        nested = section_type(hint)
        if nested is not None:
            yield from schema_items(nested, key)


def keys_with(section: type, metadata_key: str):
    """(dotted key, metadata) of every key whose metadata sets `metadata_key`, in schema order."""
    return [(key, metadata) for key, metadata in schema_items(section) if metadata.get(metadata_key) is not None]


def keys_resumed_as(change: str) -> tuple[str, ...]:
    """The keys (a section: everything under it) of every recipe whose `resume` metadata is `change`, in schema order."""
    keys = [
        key
        for schema in SCHEMAS.values()
        for key, metadata in keys_with(schema, "resume")
        if metadata["resume"] == change
    ]
    return tuple(dict.fromkeys(keys))


# The same schedule under another name: a resume does not count a change between them (chattune.checkpoint.resume).
SAME_SCHEDULE_AS = {"chattune.train.schedule.cosine_with_warmup": "transformers.get_cosine_schedule_with_warmup"}


def schedule_name(target: object) -> object:
    """A schedule's `_target_` under the name resumes compare (its equivalent's, where it has one)."""
    return SAME_SCHEDULE_AS.get(target, target) if isinstance(target, str) else target
