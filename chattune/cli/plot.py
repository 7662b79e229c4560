"""`chattune plot`: training curves from one or more runs' metrics.jsonl, overlaid, as a PNG.

One panel per metric family: loss (with eval_loss), learning rate, gradient norm, tokens/s, for DPO
runs the reward margins, preference accuracy and chosen/rejected rewards (train and eval), and for GRPO runs the
rollouts' mean reward and completion length (and the held-out prompts'). matplotlib is
an optional dependency (`pip install "chattune[plot]"`), imported only here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from chattune.errors import UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

METRICS_FILE = "metrics.jsonl"
# (panel title, metrics drawn in it); a panel is drawn when any run logged any of its metrics.
PANELS: list[tuple[str, list[str]]] = [
    ("loss", ["loss", "eval_loss"]),
    ("learning rate", ["lr"]),
    ("grad norm", ["grad_norm"]),
    ("tokens/s", ["tokens_per_sec"]),
    ("reward margin", ["rewards/margins", "eval_rewards/margins"]),
    ("preference accuracy", ["rewards/accuracies", "eval_rewards/accuracies"]),
    ("rewards", ["rewards/chosen", "rewards/rejected", "eval_rewards/chosen", "eval_rewards/rejected"]),
    ("rollout reward", ["reward", "eval_reward"]),  # GRPO: each step's completions' mean reward, the held-out's
    ("completion length", ["completion_length", "eval_completion_length"]),
]
LINE_STYLES = ["-", "--", ":", "-."]


class PlotError(UserError):
    """Input that cannot be plotted, or matplotlib missing."""


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metric lines; an error names the file and line of anything unreadable."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise PlotError(f"{path}: not found (is {run_dir} a chattune output_dir?)")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PlotError(f"{path} line {number}: not valid JSON ({error.msg})") from error
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise PlotError(f"{path} line {number}: expected a JSON object with an integer 'step'")
        records.append(record)
    if not records:
        raise PlotError(f"{path}: no metric lines")
    return records


def run_names(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name, or its path where two runs share a name."""
    names = [d.resolve().name for d in run_dirs]
    return [name if names.count(name) == 1 else str(d) for name, d in zip(names, run_dirs)]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def metrics_figure(runs: dict[str, list[dict]]) -> Figure:
    """One panel per metric family present in any run; each run one colour, each metric one line style."""
    figure_class, canvas_class = _matplotlib()
    panels = [
        (title, keys)
        for title, keys in PANELS
        if any(k in r for records in runs.values() for r in records for k in keys)
    ]
    columns = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / columns)
    figure = figure_class(figsize=(6.5 * columns, 3.4 * rows), layout="constrained")
    canvas_class(figure)  # render with Agg: no display, the same PNG everywhere
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for index, (title, keys) in enumerate(panels):
        axes = figure.add_subplot(rows, columns, index + 1)
        drawn = [k for k in keys if any(k in r for records in runs.values() for r in records)]
        for colour, (name, records) in zip(colours, runs.items()):
            for style, key in zip(LINE_STYLES, drawn):
                steps, values = series(records, key)
                if steps:
                    label = name if len(drawn) == 1 else f"{name} {key}"
                    axes.plot(
                        steps,
                        values,
                        linestyle=style,
                        color=colour,
                        label=label,
                        marker="o" if key.startswith("eval_") else None,
                        markersize=3,
                    )
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        if title == "learning rate":
            axes.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        axes.legend(fontsize="small")
    return figure


def plot_runs(run_dirs: list[Path], out: Path) -> Figure:
    """Read every run, draw the figure and write it to `out` as a PNG."""
    runs = dict(zip(run_names(run_dirs), (read_metrics(d) for d in run_dirs)))
    figure = metrics_figure(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=110)
    return figure


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise PlotError(
            "chattune plot needs matplotlib, which chattune does not install itself: pip install matplotlib"
        ) from error
    return Figure, FigureCanvasAgg
