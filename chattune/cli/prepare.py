"""`chattune prepare`: build the token caches of a config's sources before a big job, in this one process with
`data.num_workers` tokenizing processes (`chattune prepare sft/mine data.num_workers=16`). Launches, resumes,
sweep jobs and `chattune inspect` then find them (`chattune.data.token_cache`) and start without tokenizing."""

from __future__ import annotations

import time
from pathlib import Path

from chattune.cli.inspect_data import load_config
from chattune.data.ingest.cached_sources import open_documents
from chattune.data.ingest.records import source_specs
from chattune.data.templates.tokenizer import load_tokenizer
from chattune.data.token_cache import cache_root
from chattune.errors import UserError


def run_prepare(config_name: str, overrides: list[str], config_path: Path, config_dir: Path | None = None) -> str:
    """Build (or find) the token cache of every training and held-out source; one line per source."""
    cfg, kind = load_config(config_name, overrides, config_path, config_dir)
    if cache_root(cfg.data.cache) is None:
        raise UserError(
            "data.cache=off: the sources are tokenized as they are read, there is nothing to prepare "
            "(data.cache=auto, or a directory, keeps a token cache)"
        )
    tokenizer = load_tokenizer(cfg.tokenizer)
    lines = []
    for section in ("train", "eval"):
        specs = source_specs(getattr(cfg.data, section))
        started = time.perf_counter()
        documents = open_documents(kind.name, specs, tokenizer, cfg.data, cfg.parallel.context)
        elapsed = time.perf_counter() - started
        for spec, source in zip(specs, documents.sources):
            manifest = source.manifest
            size = sum(f.stat().st_size for f in source.directory.rglob("*") if f.is_file())
            lines.append(
                f"data.{section} {spec.path}: {manifest['records']} records -> {manifest['documents']} documents, "
                f"{manifest['tokens']} tokens, {manifest['skipped']} skipped; {size / 2**20:.1f} MiB in "
                f"{source.directory}"
            )
        if specs:
            lines.append(f"  ({elapsed:.1f} s)")
    return "\n".join(lines)
