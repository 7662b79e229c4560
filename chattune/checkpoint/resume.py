"""Exact resume: whether a checkpoint can continue the run that asks to (`check_resumable`), and restoring
the run state from it (`resume_training`), with the changes the resume accepted taking effect.

A run's fingerprint is its resolved config (the chat template it names with a hash of its text), and a
fingerprint of each training data file and of the tokenizer files. A resumed run may change (README, "What
chattune promises"):

- freely: where and how often it logs, saves and evaluates (`RUNTIME_KEYS`);
- with a warning that gives the learning rate at the resume step under the old and the new schedule:
  its horizon (`HORIZON_KEYS`);
- with a note: how the same numbers are computed (`NUMERICS_KEYS`: activation checkpointing, compile, loss
  chunks and implementation, loader workers);
- only when named in `resume_allow_changes` (a list of config keys or sections, data files, or single
  records `FILE:N`; `true` accepts anything): everything else, the data, tokenizer, seed and model
  included. A data file edited in place is compared record by record, so a fixed record is named and
  can be accepted alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import torch
from omegaconf import ListConfig

from chattune.checkpoint.checkpoint import load_checkpoint, load_sharded, rank_states, read_manifest
from chattune.checkpoint.run_state import OptimizerState, RunState
from chattune.config.schema import RunConfig, keys_resumed_as, schedule_name
from chattune.config.typed import config_dict
from chattune.data.feed import merge_states
from chattune.data.ingest.fingerprint import data_file_fingerprints, record_files, record_hashes, saved_record_hashes
from chattune.data.templates.template_choice import KEY as TEMPLATE_KEY
from chattune.data.templates.template_choice import template_fingerprint
from chattune.distributed import world_rank
from chattune.errors import UserError

logger = logging.getLogger(__name__)

# What a resumed run may change, as each key's `resume` metadata in the schema says (`chattune.config.schema`):
RUNTIME_KEYS = keys_resumed_as("free")  # freely: they do not change the training trajectory
HORIZON_KEYS = keys_resumed_as("horizon")  # the run's length: the schedule is recomputed (warned, with both rates)
NUMERICS_KEYS = keys_resumed_as("numerics")  # how, not what, is computed: the same updates up to rounding (noted)
_MAX_LISTED = 10  # changed records named in a message


class ResumeError(UserError, RuntimeError):
    """The checkpoint cannot continue this run exactly."""


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        flat = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: tree}


def trajectory_keys(config: dict) -> dict:
    """A config's keys (flattened, dotted) that decide what its run trains: all but the free ones (`RUNTIME_KEYS`)."""
    return {k: v for k, v in _flatten(config).items() if not _under(k, RUNTIME_KEYS)}


def run_fingerprint(cfg: RunConfig) -> dict:
    config = trajectory_keys(config_dict(cfg))
    # The chat template as its text: a template file (or a shipped one) edited under the same name renders other
    # documents. (null: the tokenizer's own, among the tokenizer files below.)
    config[TEMPLATE_KEY] = template_fingerprint(cfg.tokenizer.chat_template)
    return {
        "config": config,
        "files": data_file_fingerprints(cfg.data.train, cfg.tokenizer.path),
        "record_files": record_files(cfg.data.train),
    }


def _under(key: str, sections) -> bool:
    return any(key == s or key.startswith(s + ".") for s in sections)


# --- what changed, and what a resume accepts ---


@dataclass(frozen=True)
class Difference:
    kind: str  # "config" or "file"
    key: str  # a dotted config key, or a file path
    text: str  # what changed, for messages
    records: tuple[int, ...] | None = None  # a data file edited in place: its changed records (1-based)


def differences(saved: dict, current: dict, saved_hashes: dict[str, np.ndarray] | None = None) -> list[Difference]:
    """What differs between two run fingerprints; a JSON/JSONL data file with the same number of records
    as its saved hashes is compared record by record."""
    found = []
    before, now = saved.get("config", {}), current.get("config", {})
    for key in sorted(set(before) | set(now)):
        if key == "scheduler._target_" and schedule_name(before.get(key)) == schedule_name(now.get(key)):
            continue  # one schedule under two names (chattune.train.schedule)
        if before.get(key, "<absent>") != now.get(key, "<absent>"):
            found.append(
                Difference(
                    "config", key, f"config {key}: {before.get(key, '<absent>')!r} -> {now.get(key, '<absent>')!r}"
                )
            )
    before, now = saved.get("files", {}), current.get("files", {})
    for key in sorted(set(before) | set(now)):
        if before.get(key, "<absent>") == now.get(key, "<absent>"):
            continue
        old_hashes = (saved_hashes or {}).get(key)
        hashed = record_hashes(Path(key)) if old_hashes is not None else None
        if hashed is not None and old_hashes is not None and len(hashed[0]) == len(old_hashes):
            changed = np.flatnonzero(hashed[0] != old_hashes)
            lines = hashed[1]
            named = [
                f"record {i + 1}" + (f" (line {lines[i]})" if lines is not None else "") for i in changed[:_MAX_LISTED]
            ]
            more = f" and {len(changed) - _MAX_LISTED} more" if len(changed) > _MAX_LISTED else ""
            text = (
                f"data file {key}: {', '.join(named)}{more} changed"
                if len(changed)
                else f"data file {key}: edited (same records)"
            )
            found.append(Difference("file", key, text, tuple(int(i) + 1 for i in changed)))
        elif old_hashes is not None and hashed is not None:
            found.append(
                Difference(
                    "file",
                    key,
                    f"data file {key}: {len(old_hashes)} -> {len(hashed[0])} records (records "
                    "added or removed change every epoch's order)",
                )
            )
        else:
            found.append(
                Difference("file", key, f"files {key}: {before.get(key, '<absent>')!r} -> {now.get(key, '<absent>')!r}")
            )
    return found


def allowed_changes(value) -> tuple[bool, list[str]]:
    """`resume_allow_changes`: (accept anything, the keys / files / FILE:N records it names)."""
    if value is True:
        return True, []
    if value is None or value is False:
        return False, []
    if isinstance(value, (list, tuple, ListConfig)) and all(isinstance(v, str) for v in value):
        return False, list(value)
    raise ResumeError(
        f"resume_allow_changes must be true, false or a list of config keys, data files or FILE:N "
        f"records, got {value!r}"
    )


def _accepts(entries: list[str], difference: Difference) -> bool:
    if difference.kind == "config":
        return _under(difference.key, entries)
    path = Path(difference.key).resolve()
    records: set[int] = set()
    for entry in entries:
        file, _, number = entry.rpartition(":")
        if Path(entry).resolve() == path:
            return True  # the whole file
        if number.isdigit() and file and Path(file).resolve() == path:
            records.add(int(number))
    return difference.records is not None and bool(records) and set(difference.records) <= records


def _accept_hint(difference: Difference) -> str:
    """What resume_allow_changes entry accepts exactly this difference."""
    if difference.records:
        return ",".join(f"{difference.key}:{r}" for r in difference.records)
    return difference.key


@dataclass
class AcceptedChanges:
    """What a resume accepted: lines to log at the start, the changed horizon and the other config keys."""

    notes: list[str] = field(default_factory=list)
    horizon: list[str] = field(default_factory=list)  # the changed horizon keys, as "key: old -> new"
    changed_keys: list[str] = field(default_factory=list)  # every accepted config key that changed
    layout_changed: bool = False  # another number of ranks or context size: the data position is merged over ranks

    @property
    def optimizer_changed(self) -> bool:
        return any(_under(key, ("optimizer",)) for key in self.changed_keys)

    @property
    def schedule_changed(self) -> bool:
        return bool(self.horizon) or any(_under(key, ("scheduler", "optimizer.lr")) for key in self.changed_keys)


def check_resumable(directory: Path, identity: dict, cfg: RunConfig) -> AcceptedChanges:
    """Whether the checkpoint at `directory` can continue this run (`identity`: its `run_identity`): the changes
    it accepts, or a ResumeError that lists every refused difference and the exact `resume_allow_changes` that
    would accept them."""
    saved = read_manifest(directory)
    world_size_changed = identity["world_size"] is not None and saved["world_size"] != identity["world_size"]
    fingerprint = dict(saved["fingerprint"])
    if "data.num_workers" not in fingerprint.get("config", {}) and "num_workers" in saved:  # older checkpoints
        fingerprint["config"] = {**fingerprint.get("config", {}), "data.num_workers": saved["num_workers"]}
    # Keys added since: what a checkpoint written before them ran with (one context rank, the tokenizer's own
    # template, no held-out split).
    fingerprint["config"] = {
        "parallel.context": 1,
        TEMPLATE_KEY: None,
        "data.eval_split": None,
        **fingerprint.get("config", {}),
    }
    saved_context = fingerprint["config"]["parallel.context"]
    context_changed = saved_context != cfg.parallel.context
    invariant = cfg.data.microbatches_per_step is not None
    if world_size_changed and not invariant:
        raise ResumeError(
            f"{directory} was written by {saved['world_size']} rank(s), this run has {identity['world_size']}: each "
            "rank's data position is a place in its own share of the epoch, which another number of ranks would split "
            f"differently. Relaunch with --nproc_per_node {saved['world_size']} (runs with "
            "data.microbatches_per_step resume on any number of ranks that divides it)."
        )
    if context_changed and not invariant:
        raise ResumeError(
            f"{directory} was written with parallel.context={saved_context}, this run has {cfg.parallel.context}: the "
            "data-parallel ranks (ranks / parallel.context) each hold a place in their own share of the epoch, and "
            f"another context size would share it differently. Relaunch with parallel.context={saved_context} (runs "
            "with data.microbatches_per_step resume with any layout of ranks)."
        )
    if cfg.max_steps < saved["step"]:
        raise ResumeError(
            f"max_steps={cfg.max_steps}, but this run continues from {directory} at step {saved['step']}: the horizon is "
            "behind the checkpoint. Raise max_steps, resume an earlier checkpoint with resume=PATH, or start over with "
            "overwrite=true."
        )
    if cfg.stop_after_step is not None and cfg.stop_after_step <= saved["step"]:
        raise ResumeError(
            f"stop_after_step={cfg.stop_after_step}, but this run continues from {directory} at step {saved['step']}: "
            "there is no step left to stop after. Raise stop_after_step or drop it, or resume an earlier checkpoint "
            "with resume=PATH."
        )
    anything, entries = allowed_changes(cfg.resume_allow_changes)
    online_mixing = cfg.data.mixing.mode == "online"
    accepted, refused = AcceptedChanges(), []
    if world_size_changed:
        accepted.notes.append(
            f"world size {saved['world_size']} -> {identity['world_size']} (world-size-invariant "
            "steps: the same documents per step; every rank continues the one data stream)"
        )
    accepted.layout_changed = world_size_changed or context_changed
    saved_budget = fingerprint["config"].get("data.max_tokens_per_microbatch")
    same_rows = saved_budget is not None and saved_budget * saved_context == (
        cfg.data.max_tokens_per_microbatch * cfg.parallel.context
    )
    for difference in differences(fingerprint, identity["fingerprint"], saved_record_hashes(directory)):
        key = difference.key if difference.kind == "config" else None
        if key in ("parallel.context", "data.max_tokens_per_microbatch") and context_changed and same_rows:
            # (world-size-invariant steps, checked above) packing reads the row budget, which is unchanged
            if key == "parallel.context":
                accepted.notes.append(f"{difference.text}: the same row budget, the same packed rows split another way")
            else:
                accepted.notes.append(
                    f"{difference.text} with parallel.context {saved_context} -> "
                    f"{cfg.parallel.context}: the same row budget"
                )
            continue
        if key is not None:
            accepted.changed_keys.append(key)  # (a refused one raises below)
        if key in HORIZON_KEYS:
            accepted.horizon.append(difference.text.removeprefix("config "))
        elif key == "data.share_prompts":  # the pairs' rows change length: the remaining ones may pack otherwise
            accepted.notes.append(
                f"{difference.text} (the same pairs and losses, computed with the prompt once or once per reply; "
                "the pairs not yet trained may pack into other microbatches where the budget binds)"
            )
        elif key in NUMERICS_KEYS and not (key == "data.num_workers" and online_mixing):
            accepted.notes.append(f"{difference.text} (the same documents and updates, computed differently)")
        elif anything or _accepts(entries, difference):
            accepted.notes.append(f"{difference.text} (accepted by resume_allow_changes)")
        else:
            refused.append(difference)
    if refused:
        why = (
            "\n  (online mixing applies a new probability from the furthest draw the loaders have prefetched, "
            "which depends on data.num_workers)"
            if any(d.key == "data.num_workers" for d in refused)
            else ""
        )
        raise ResumeError(
            f"{directory} cannot continue this run: what it trains changed since the checkpoint was written:\n  "
            + "\n  ".join(d.text for d in refused)
            + why
            + f"\nIf that is what you want, resume with resume_allow_changes=[{','.join(map(_accept_hint, refused))}] "
            "(accepts only these changes; true accepts any). Or start over with overwrite=true, or choose another output_dir."
        )
    return accepted


def run_identity(world_size: int, fingerprint: dict) -> dict:
    """The run's identity, what a checkpoint it continues must match (`check_resumable`), written into every
    checkpoint's manifest: its number of ranks and its fingerprint."""
    return {"world_size": world_size, "fingerprint": fingerprint}


def resume_training(directory: Path, accepted: AcceptedChanges, state: RunState) -> int:
    """Collective: restore the run state (`chattune.checkpoint.run_state.training_state`) from the checkpoint at
    `directory`, checked by `check_resumable`, and make the changes it accepted take effect; returns its step."""
    optimizer = cast(OptimizerState, state["optimizer"]).optimizer
    scheduler = cast(torch.optim.lr_scheduler.LRScheduler, state["scheduler"])
    # The optimizer's hyperparameters as this run's config sets them (the checkpoint's state replaces them).
    configured = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]
    if not accepted.layout_changed:
        step = load_checkpoint(directory, state)
    else:  # world-size-invariant steps on another number of ranks or context size
        # The step, schedule and counters are every rank's alike, read from rank 0's state; the data position is
        # the one stream's, with the sums of all ranks moved (`merge_states`). The RNG is not restored: each
        # microbatch seeds its own (StepFeed's seeds), so the ranks' saved generators are not needed.
        load_sharded(directory, state)
        saved = rank_states(directory)
        rank = world_rank()
        state.load_state_dict({**saved[0], "data": merge_states([s["data"] for s in saved], rank)}, skip=("rng",))
        step = saved[0]["step"]
    for note in accepted.notes:
        logger.warning("resuming despite a change: %s", note)
    if accepted.optimizer_changed:  # an accepted change of the optimizer's settings takes effect
        for group, settings in zip(optimizer.param_groups, configured):
            group.update(settings)
        scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    if accepted.schedule_changed:
        old, new = follow_new_schedule(scheduler, optimizer)
        logger.warning(
            "resuming with another learning-rate schedule (%s): the LR at step %d is %s (it was %s under "
            "the checkpoint's schedule)",
            "; ".join(
                accepted.horizon + [k for k in accepted.changed_keys if _under(k, ("scheduler", "optimizer.lr"))]
            ),
            step + 1,  # the first step the resumed run trains (the scheduler holds its rate: build_scheduler)
            _rates(new),
            _rates(old),
        )
    return step


def follow_new_schedule(scheduler, optimizer) -> tuple[list, list]:  # (rates: floats, or tensors for torchao)
    """After loading a checkpoint's scheduler state into a scheduler built for another horizon, schedule
    or base rate: the rates at the resume step under the old and the new schedule, the optimizer set to
    the new ones (which a LambdaLR, e.g. transformers' warmup + cosine, computes in closed form from the
    step). Other schedulers keep the checkpoint's rate and follow their own rule from the next step."""
    old = list(scheduler.get_last_lr())
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return old, old
    new = [base * rule(scheduler.last_epoch) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, new):
        group["lr"] = lr
    scheduler._last_lr = list(new)  # what get_last_lr() reports; LRScheduler keeps it in this attribute
    return old, new


def _rates(rates: list[float]) -> str:
    return ", ".join(f"{r:.3g}" for r in rates)
