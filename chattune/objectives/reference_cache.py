"""Reference log-probs computed once, before training, and kept on disk.

A frozen reference model costs a forward per microbatch and its weights in memory for the whole run.
With `reference.cache=true` the recipe instead runs the reference once over every record (each rank
its share, packed as in training), all-reduces the per-record table and drops the model. The table is
stored as `<cache_dir>/<key>.pt`, where the key hashes everything the numbers depend on: the data
files and source settings, the tokenizer, the packing budget and overlong policy, the reference
weights (their full content) and the precision. A later run (or a resumed one) with the same key
loads the table instead of recomputing it; a change anywhere gives another key, so a stale table is
never used. Loading the same file makes a resumed run see exactly the numbers the first run saw.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from chattune.config.schema import DPOConfig, KTOConfig
from chattune.config.typed import config_dict
from chattune.data.ingest.fingerprint import data_file_fingerprints
from chattune.data.packing import PackedBatch, empty_batch
from chattune.data.templates.template_choice import template_fingerprint
from chattune.distributed import ParallelDims, all_reduce_max, all_reduce_sum
from chattune.hub import local_directory
from chattune.objectives.dpo import pair_logps
from chattune.parallel.fsdp import reshard

logger = logging.getLogger(__name__)

_HASH_BLOCK = 1 << 24


def weights_fingerprint(model_dir: Path, memo_path: Path) -> dict[str, str]:
    """sha256 of every file of a model directory. Weights fine-tuned in place keep their size, so the
    whole content is hashed; the hashes are memoized by (size, mtime) in `memo_path`, so a large model
    is read once, not at every start."""
    memo = json.loads(memo_path.read_text()) if memo_path.is_file() else {}
    digests = {}
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        stat = path.stat()
        stamp = f"{stat.st_size}:{stat.st_mtime_ns}"
        entry = memo.get(str(path.resolve()))
        if entry is None or entry["stamp"] != stamp:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while block := f.read(_HASH_BLOCK):
                    digest.update(block)
            entry = memo[str(path.resolve())] = {"stamp": stamp, "sha256": digest.hexdigest()}
        digests[str(path.relative_to(model_dir))] = entry["sha256"]
    text = json.dumps(memo, indent=1)
    if not memo_path.is_file() or memo_path.read_text() != text:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(memo_path, lambda f: f.write(text.encode()))
    return digests


def cache_fingerprint(
    cfg: DPOConfig | KTOConfig, split: str, device_type: str, context: int, documents: str = "dpo"
) -> dict:
    """What the reference log-probs of `cfg.data.<split>` depend on, under context parallelism over `context`
    ranks (the run's `ParallelDims.cp`). `documents`: the recipe kind whose documents
    the table holds (KTO's examples of a pair file are not DPO's pairs of it); DPO's keys stay what they were."""
    reference_dir = cfg.reference.path or cfg.model.path
    if reference_dir is not None:  # a hub id: its cached snapshot (collective: every rank asks, in the same order)
        directory = local_directory(reference_dir, "reference.path" if cfg.reference.path else "model.path")
        weights = weights_fingerprint(directory, Path(cfg.reference.cache_dir) / "weight_hashes.json")
    else:  # built from config: the seed fixes the initial weights
        weights = {"config": config_dict(cfg.model.config), "seed": cfg.seed}
    sources = getattr(cfg.data, split) or []
    fingerprint = {
        "sources": config_dict(sources),
        "files": data_file_fingerprints(sources, cfg.tokenizer.path),
        "max_tokens_per_microbatch": cfg.data.max_tokens_per_microbatch,
        "context": context,  # the row budget, and how rows are split
        "overlong": cfg.data.overlong,
        "reference_weights": weights,
        "fsdp": config_dict(cfg.model.fsdp),  # precision changes the numbers
        "device": device_type,
    }
    if documents != "dpo":
        fingerprint["documents"] = documents
    template = cfg.tokenizer.chat_template
    if template is not None:  # in place of the tokenizer's own (which is among its files): by its text
        fingerprint["chat_template"] = template_fingerprint(template)
    if cfg.data.eval_split is not None:  # which records of data.train each table holds (the eval one: its held-out)
        fingerprint["eval_split"] = {
            "eval_split": cfg.data.eval_split,
            "seed": cfg.seed,
            "train": config_dict(cfg.data.train),
            "files": data_file_fingerprints(cfg.data.train, cfg.tokenizer.path),
        }
    return fingerprint


def cache_key(fingerprint: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:20]


@torch.no_grad()
def compute_reference_table(
    reference: nn.Module, batches: Iterable[PackedBatch], num_records: int, dims: ParallelDims, pad_token_id: int
) -> torch.Tensor:
    """Collective: (num_records, 2) float64 table of (chosen, rejected) reference log-probs, each rank
    computing its own share's rows from `batches`. Ranks with fewer batches run empty ones (every FSDP
    forward is a collective). Rows of records that never reach training (skipped) stay NaN."""
    was_training = reference.training
    reference.eval()
    table = torch.zeros(num_records, 2, dtype=torch.float64)
    filled = torch.zeros(num_records, dtype=torch.float64)
    batches = iter(batches)
    # context parallelism: the group's ranks compute the same rows, and its first one fills them
    fills, device = dims.reports_rows, dims.device
    while True:
        batch = next(batches, None)
        if all_reduce_max(int(batch is not None), device) == 0:
            break
        batch = (batch or empty_batch(pad_token_id)).to(device)
        chosen, rejected, _, _ = pair_logps(reference(batch), batch)
        if fills:
            rows = torch.tensor(batch.doc_ids, dtype=torch.long)
            table[rows] = torch.stack([chosen, rejected], dim=1).double().cpu()
            filled[rows] = 1.0
    reference.train(was_training)
    reshard(reference)  # a view of the policy (LoRA) would otherwise start training with its root gathered
    together = all_reduce_sum(torch.cat([table, filled[:, None]], dim=1).to(device)).cpu()
    table = together[:, :2]
    table[together[:, 2] == 0] = float("nan")
    return table


def load_or_build(
    cache_dir: Path,
    fingerprints: dict[str, dict],
    num_records: dict[str, int],
    make_reference: Callable[[], nn.Module],
    make_batches: Callable[[str], Iterable[PackedBatch]],
    dims: ParallelDims,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """Collective: the reference table of each named split (e.g. "train", "eval"), loaded from
    `cache_dir` where a valid one is stored, else computed with one reference model (built only if some
    table is missing, sharded on `dims`) and stored by rank 0."""
    tables: dict[str, torch.Tensor] = {}
    device = dims.device
    for split, fingerprint in fingerprints.items():
        path = cache_dir / f"{split}-{cache_key(fingerprint)}.pt"
        table = _load(path, fingerprint, num_records[split])
        # Every rank must agree to build (it is collective): build unless every rank could load.
        if all_reduce_max(int(table is None), device) == 0:
            logger.info("reference log-probs of %s: loaded from %s", split, path)
            tables[split] = table
    missing = [split for split in fingerprints if split not in tables]
    if not missing:
        return tables
    reference = make_reference()
    for split in missing:
        path = cache_dir / f"{split}-{cache_key(fingerprints[split])}.pt"
        logger.info(
            "reference log-probs of %s: computing %d records (one pass) into %s", split, num_records[split], path
        )
        tables[split] = compute_reference_table(reference, make_batches(split), num_records[split], dims, pad_token_id)
        if dims.is_main:
            cache_dir.mkdir(parents=True, exist_ok=True)
            content = {"fingerprint": fingerprints[split], "table": tables[split]}
            _write_atomically(path, lambda f, content=content: torch.save(content, f))
    del reference  # the point of the cache: training holds no reference weights
    return tables


def _load(path: Path, fingerprint: dict, num_records: int) -> torch.Tensor | None:
    if not path.is_file():
        return None
    content = torch.load(path, weights_only=True)
    if content["fingerprint"] != fingerprint or content["table"].shape != (num_records, 2):
        # Same key, other content: a hash collision or a hand-edited file. Never use it.
        logger.warning("%s does not match this run's data and reference; recomputing it", path)
        return None
    return content["table"]


def _write_atomically(path: Path, write: Callable) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # ranks may write the same file
    with open(partial, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
