"""`python scripts/gpu_check [--out DIR] [--budget S] [--only ITEM ...] ...`: the arguments and main. The checks,
their rows and bounds: the package's docstring (scripts/gpu_check/__init__.py)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

STARTED = time.monotonic()  # --budget counts from here: torch's import is part of it

# Run as `python scripts/gpu_check`, Python puts this folder first on sys.path, where its modules would be
# importable by their bare names (plan, memory, ...) beside the package's: they are imported as the package
# gpu_check, from scripts/, only.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

import gpu_check  # noqa: E402  (first: it puts this checkout and scripts/bench/ on sys.path)

# isort: split
import bench_gpu  # noqa: E402
import torch  # noqa: E402
from bench_gpu import Budget, add_budget_arguments, rerun_command  # noqa: E402

from chattune.config.paths import DEMO_ASSETS  # noqa: E402
from gpu_check.context import SHAPES, Context, Row  # noqa: E402
from gpu_check.plan import plan, plan_text, run_items, watchdog  # noqa: E402
from gpu_check.report import ComputeLines, environment, find_assets, write_report  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=gpu_check.__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("gpu_check_results"))
    parser.add_argument("--work", type=Path, default=None, help="models, data and runs (default: OUT/work)")
    parser.add_argument("--assets", type=Path, default=None, help="../shared/assets (the Qwen3 tokenizer, real chats)")
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        choices=sorted(SHAPES),
        help="throughput shapes (default: 0.6b 1.7b on CUDA, tiny on the CPU)",
    )
    parser.add_argument("--steps", type=int, default=None, help="throughput steps (default: 12 on CUDA, 4 on the CPU)")
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run only these items (names as in the table's NOT RUN "
        "rows and the header; `throughput` for every throughput and TRL launch)",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the items in order with their estimates for --device (cuda: the priced work; no GPU needed) "
        "and whether issue 68's first ten fit in 8 minutes, and run nothing",
    )
    add_budget_arguments(
        parser,
        "the items in priority order, each only where its estimate fits what is left, the "
        "one running stopped when it runs out, every item in the table and the command for "
        "the rest",
    )
    args = parser.parse_args()
    torch.set_float32_matmul_precision("highest")  # what chattune must leave as it is (tf32_scope)
    out = args.out.resolve()
    work = (args.work or out / "work").resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    assets = find_assets(args.assets) if args.device == "cuda" and not args.plan else None
    if assets is not None:
        chats = bench_gpu.make_corpora(assets, work / "data")["short"]
        tokenizer_dir = assets / "tokenizers" / "qwen3"
    else:
        chats, tokenizer_dir = DEMO_ASSETS / "chat_train.jsonl", DEMO_ASSETS / "tokenizer"
    ctx = Context(
        torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu"),
        out,
        work,
        tokenizer_dir,
        chats,
        assets is not None,
        Budget(args.budget, started=STARTED, scale=args.estimate_scale),
    )
    shapes = args.shapes or (["0.6b", "1.7b"] if ctx.cuda else ["tiny"])
    items = plan(ctx, shapes, args.steps or (12 if ctx.cuda else 4))
    names = [item.name for item in items]
    if args.only:
        aliases = {"throughput": [n for n in names if n.startswith(("throughput_", "trl_"))]}
        unknown = [name for name in args.only if name not in names and name not in aliases]
        if unknown:
            parser.error(f"--only {' '.join(unknown)}: the items are {', '.join(names)} (and `throughput`)")
        wanted = {n for name in args.only for n in aliases.get(name, [name])}
        items = [item for item in items if item.name in wanted]
    if args.plan:
        print(plan_text(items, time.monotonic() - STARTED, ctx.budget.scale, args.device))
        return 0
    handler = ComputeLines(ctx)
    build_logger = logging.getLogger("chattune.model.build")
    build_logger.addHandler(handler)
    build_logger.setLevel(logging.INFO)
    print(f"[gpu_check] {environment(ctx)}", flush=True)
    print(
        f"[gpu_check] items in order: {', '.join(f'{i.name} (~{i.estimate * ctx.budget.scale:.0f} s)' for i in items)}"
        + (f"; budget {args.budget:.0f} s" if args.budget is not None else ""),
        flush=True,
    )

    def rerun(not_run: list[str]) -> str | None:
        if not not_run:
            return None
        return rerun_command(
            str(HERE), sys.argv[1:], {"--only": not_run, "--out": [f"{out}-rest"], "--work": [str(work)]}
        )

    def report(final: bool = False) -> bool:
        """The report so far; the items not done yet in it as NOT RUN rows (what the files say if the process
        is killed from outside), which the next report replaces."""
        with ctx.lock:
            rows, not_run = list(ctx.rows), list(ctx.not_run)
        provisional = [
            Row(
                item.name,
                "NOT RUN",
                "not finished (gpu_check stopped while it ran)"
                if item is ctx.current
                else "not run (gpu_check stopped before it)",
            )
            for item in list(ctx.pending)
        ]
        not_run += [row.check for row in provisional]
        return write_report(ctx, environment(ctx), rows + provisional, not_run, rerun(not_run), final)

    ctx.pending = []
    watchdog(ctx, report)
    try:
        run_items(ctx, items, report)
    finally:  # a crash or an interrupt still leaves the report, every item in it
        for item in list(ctx.pending):
            ctx.add_not_run(item.name, "not run (gpu_check stopped before it)")
        ctx.pending.clear()
        passed = report(final=True)
        if ctx.not_run:
            print(f"[gpu_check] the second call, for what did not run:\n  {rerun(list(ctx.not_run))}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
