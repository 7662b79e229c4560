"""`chattune export CHECKPOINT [--to DIR]`: a checkpoint's model as the end of its run would have exported it.

A run that stopped (preempted, `stop_after_step`, a crash) has checkpoints but no `hf/`; a run that finished
has the last step's export only. This writes any committed checkpoint's weights the way the run's end does
(`chattune.model.io.export.export_run`): the Hugging Face directory `hf/` in export.dtype (auto: the source's),
and with LoRA the adapter directory `adapter/` (plus the merged `hf/` with export.merge), into DIR
(default: OUTPUT_DIR/exports/step_N). Bit for bit what the run's own end would write at that step.

The model is rebuilt from the run's own `config.yaml` (in its output_dir, beside `checkpoints/`) as its
recipe built it, in one process, and only the model's weights are read from the checkpoint (DCP reshards
them from any number of ranks). CHECKPOINT may also be a run's output_dir: its newest committed checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from chattune.errors import UserError

logger = logging.getLogger(__name__)

RUN_CONFIG = "config.yaml"  # what a run writes into its output_dir: its resolved config


@dataclasses.dataclass(frozen=True)
class Exported:
    """What an export wrote, by name ("hf", "adapter"), and what can be done with it."""

    written: dict[str, Path]
    scores: bool  # a reward model: it scores conversations and writes no reply
    base_saved: bool  # False: adapters on a random-init base, which nothing can load again (unless merged)

    def next_step(self) -> str:
        """What to do with the export, as the end of its run says it (`chattune.train.loop.done_line`)."""
        exported = self.written.get("hf", self.written.get("adapter"))
        if not self.base_saved and "hf" not in self.written:
            return (
                "its base is a random-init model saved nowhere, so nothing can load this adapter (a run with "
                "export.merge=true writes the merged model)"
            )
        if self.scores:
            return "a reward model: it scores conversations, with AutoModelForSequenceClassification (docs/reward.md)"
        return f"talk to it: chattune chat {exported}"


def export_checkpoint(checkpoint: Path, to: Path | None = None) -> Exported:
    """Export `checkpoint` (a `step_N` directory, or a run's output_dir: its newest) into `to`."""
    from chattune.checkpoint.checkpoint import damage, load_sharded, read_manifest
    from chattune.checkpoint.run_state import ModelWeights, RunState
    from chattune.config.typed import typed_config
    from chattune.distributed import init_distributed, shutdown_distributed
    from chattune.launch.recipe_kinds import REWARD
    from chattune.model.build import build_trained_model
    from chattune.model.head.kinds import CAUSAL_LM_HEAD, SCORE_HEAD
    from chattune.model.io.export import export_run

    checkpoint = _checkpoint_of(Path(checkpoint))
    problems = damage(checkpoint)
    if problems:
        raise UserError(f"the checkpoint {checkpoint} is damaged: {'; '.join(problems)}")
    step = int(read_manifest(checkpoint)["step"])
    output_dir = checkpoint.parent.parent
    config_file = output_dir / RUN_CONFIG
    if not config_file.is_file():
        raise UserError(
            f"{config_file} is missing: chattune export rebuilds the model from the config its run wrote beside "
            f"checkpoints/ (a checkpoint copied without its output_dir's {RUN_CONFIG} cannot be exported)"
        )
    saved = OmegaConf.load(config_file)
    kind = recipe_kind_of(saved, config_file)
    saved.parallel.context = 1  # one process: the weights do not depend on how a row was split
    # Checked when its run launched; read as it is: the data, which an export does not read, may be gone.
    cfg = typed_config(saved, kind.schema)
    to = Path(to) if to is not None else output_dir / "exports" / checkpoint.name
    dims = init_distributed(cfg.device)  # every degree 1: one process
    try:
        from chattune.data.templates.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.tokenizer)
        head = SCORE_HEAD if kind is REWARD else CAUSAL_LM_HEAD
        # no training memory table: an export holds the model alone, without gradients, states or activations
        built = build_trained_model(cfg, tokenizer, dims, head=head, log_memory=False)
        weights = RunState()
        weights.add("model", ModelWeights(built.model), sharded=True)
        load_sharded(checkpoint, weights)  # the model's part alone; DCP reshards it to this one process
        logger.info("read the weights of step %d from %s", step, checkpoint)
        written = export_run(cfg, built, tokenizer, to, dims.is_main)
        return Exported(written, scores=kind is REWARD, base_saved=cfg.peft is None or cfg.model.path is not None)
    finally:
        shutdown_distributed()


def _checkpoint_of(path: Path) -> Path:
    """`path` itself where it is a committed checkpoint, else the newest committed one of the run at `path`."""
    from chattune.checkpoint.checkpoint import find_latest
    from chattune.checkpoint.layout import MANIFEST_FILE

    if (path / MANIFEST_FILE).is_file():
        return path
    if (path / "checkpoints").is_dir():
        latest = find_latest(path / "checkpoints")
        if latest is None:
            raise UserError(f"{path}/checkpoints holds no committed checkpoint to export")
        return latest
    raise UserError(
        f"{path} is neither a checkpoint (a checkpoints/step_N directory with its chattune.json) nor a run's "
        "output_dir with checkpoints/"
    )


def recipe_kind_of(saved: DictConfig, config_file: Path):
    """The recipe that wrote `saved` (a run's config.yaml): the kind whose schema has exactly its loss keys
    (each recipe's loss section is its own) and every one of its sections."""
    from chattune.launch.recipe_kinds import RECIPE_KINDS

    loss_keys = set(saved.get("loss") or {})
    for kind in RECIPE_KINDS.values():
        sections = typing.get_type_hints(kind.schema)
        if set(saved) <= set(sections) and {f.name for f in dataclasses.fields(sections["loss"])} == loss_keys:
            return kind
    raise UserError(
        f"{config_file} is not the config of a shipped recipe (sft, dpo, kto, reward): a recipe of your own exports "
        "its model at the end of its run"
    )
