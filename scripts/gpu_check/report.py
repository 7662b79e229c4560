"""The report: the environment, gpu_check.json and gpu_check.md, the assets."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
from bench_gpu import BUDGET_MARGIN_S

from . import ROOT
from .context import Context, Row

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
