"""A recipe's sources read through their token caches (`data.cache`), the missing ones built first by every
rank together: the one place that decides, for the recipes, `chattune prepare` and `chattune inspect`,
whether documents come from a cache or are tokenized as they are read (`chattune.data.token_cache`).

Collective under torch.distributed: rank 0 hashes each source (a 10 GB file is read once, not once per rank)
and every rank builds a contiguous share of the records (with `data.num_workers` loader processes), so the
first launch's tokenizing is spread over the whole job. All ranks agree on every outcome (found, built, a bad
record's error) before they go on, so none waits in a collective another has left.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from chattune.config.schema import DataConfig
from chattune.data.ingest.formats import DataError, SourceSpec
from chattune.data.ingest.sources import RECIPE_DATA, MixedDocuments, document_settings
from chattune.data.token_cache import (
    BuildShard,
    CachedDocuments,
    build_source_cache,
    cache_name,
    cache_root,
    is_complete,
    source_key,
    staging_directory,
    tokenizer_digest,
)
from chattune.distributed import broadcast_from_main, world_rank, world_size
from chattune.errors import UserError

logger = logging.getLogger(__name__)


def _rank_world() -> tuple[int, int]:
    return world_rank(), world_size()  # one rank for `chattune prepare` and `chattune inspect`


def _every_rank(value) -> list:
    """`value` of every rank, in rank order (one all-gather; no communication on one rank)."""
    ranks = world_size()
    if ranks == 1:
        return [value]
    values = [None] * ranks
    dist.all_gather_object(values, value)
    return values


def open_documents(
    recipe: str,
    specs: list[SourceSpec],
    tokenizer: PreTrainedTokenizerBase,
    data: DataConfig,
    context: int = 1,
    build: bool = True,
) -> MixedDocuments:
    """The documents of `specs` for recipe kind `recipe` (`chattune.data.ingest.sources.RECIPE_DATA`), each source from
    its token cache: found by its key, else built here (`build`; collective) or else tokenized as read. With
    data.cache=off every source is tokenized as read."""
    recipe_data = RECIPE_DATA[recipe]
    root = cache_root(data.cache)
    if root is None or not specs:
        return recipe_data.read(specs, tokenizer, data, context)
    rank, _ = _rank_world()
    tokenizer_hash = broadcast_from_main(tokenizer_digest(tokenizer) if rank == 0 else None)
    sources = []
    for spec in specs:
        key = broadcast_from_main(
            source_key(recipe, spec, document_settings(spec, data, context), tokenizer_hash) if rank == 0 else None
        )
        final = root / cache_name(recipe, spec, key)
        found = _every_rank(is_complete(final))
        if any(found) and not all(found):
            raise UserError(
                f"data.cache: the token cache {final} is found by ranks {[r for r, f in enumerate(found) if f]} "
                f"only: set data.cache to a directory every machine of the job sees (or build it on each "
                "with chattune prepare), or data.cache=off"
            )
        if not found[0] and build:
            _build(recipe, spec, tokenizer, data, context, final, key)  # every rank sees the cache after it
        if not found[0] and not build:
            documents = recipe_data.source(spec, tokenizer, data, context)
        else:
            documents = CachedDocuments(final)
            if found[0] and rank == 0:
                logger.info(
                    "data source %s: token cache %s (%d records, %d tokens)",
                    spec.path,
                    final,
                    len(documents),
                    documents.num_tokens,
                )
        sources.append((spec.display_name, documents))
    return MixedDocuments(sources, [recipe_data.examples_per_record(spec) for spec in specs])


def _build(
    recipe: str,
    spec: SourceSpec,
    tokenizer: PreTrainedTokenizerBase,
    data: DataConfig,
    context: int,
    final: Path,
    key: str,
) -> None:
    """Every rank tokenizes its share of `spec`'s records into one staging directory; rank 0 commits it."""
    rank, world = _rank_world()
    if rank == 0:
        logger.info(
            "data source %s: building its token cache %s (%d rank(s), %d worker(s) each)",
            spec.path,
            final,
            world,
            data.num_workers,
        )
    staging = Path(broadcast_from_main(str(staging_directory(final.parent, final.name)) if rank == 0 else None))
    documents = RECIPE_DATA[recipe].source(spec, tokenizer, data, context)

    def agree(error: Exception | None) -> None:
        """Every rank raises the first shard's error (the records' order), or none does."""
        errors = _every_rank(None if error is None else str(error))
        first = next((e for e in errors if e is not None), None)
        if first is None:
            return
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise error if error is not None and str(error) == first else DataError(first)

    build_source_cache(
        documents, final, recipe, spec, key, data.num_workers, BuildShard(rank, world, Path(staging), agree)
    )
    if dist.is_initialized():
        dist.barrier()  # rank 0 has committed (or found another launch's commit)
    if not all(_every_rank(is_complete(final))):
        raise UserError(
            f"data.cache: the token cache {final} that rank 0 committed is not seen by every rank: set "
            "data.cache to a directory every machine of the job sees, or data.cache=off"
        )
