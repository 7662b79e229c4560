"""`chattune inspect`: what training will see, from the same config and overrides as a recipe.

It first runs `chattune validate`'s checks (the config, the tokenizer and its chat template, the first
records of every source), then reads the training sources the way the recipe does (same formats,
template, masking and budget: conversations for an SFT config, preference pairs for a DPO one, as the
config's name says, `chattune.launch.recipe_kinds.kind_of_config`; without the records `data.eval_split`
holds out for eval, which it counts per source) and reports: records read, skipped by reason, documents,
tokens, the trainable-token fraction, a length histogram, the pack fill at the microbatch budget, and a few
documents (a pair: its chosen and its rejected side) with the trained tokens highlighted (terminal colours,
or an HTML page with `--html`).
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
from hydra import compose
from transformers import PreTrainedTokenizerBase

from chattune.config.paths import CONFIG_DIR  # importing chattune.config.paths registers ${demo_asset:...}
from chattune.config.schema import RunConfig
from chattune.config.typed import typed_config
from chattune.data.documents import IGNORE_INDEX, Document, Skipped
from chattune.data.ingest.cached_sources import open_documents
from chattune.data.ingest.held_out import held_out_line, hold_out
from chattune.data.ingest.records import source_specs
from chattune.data.ingest.report import DataReport, count_lines, scan_documents
from chattune.data.ingest.sources import row_budget
from chattune.data.stream import PackedStream, PackingBudget, StreamLayout
from chattune.data.templates.kto_documents import KTO_LABEL
from chattune.data.templates.tokenizer import load_tokenizer
from chattune.launch.compose import hydra_search_path
from chattune.launch.findings import ConfigError
from chattune.launch.recipe_kinds import RecipeKind, kind_of_config
from chattune.launch.validate import validate_command

TRAINED, PLAIN, RESET = "\033[1;32m", "\033[2m", "\033[0m"


def load_config(
    config_name: str, overrides: list[str], config_path: Path = CONFIG_DIR, config_dir: Path | None = None
) -> tuple[RunConfig, RecipeKind]:
    """The config a recipe would compose (typed, `chattune.config.typed`) and its recipe kind (its name's), after
    `chattune validate`'s checks
    (ConfigError: every problem)."""
    findings = validate_command(
        config_name, overrides, (config_path, config_dir), read_data=True, output_dir_checks=False
    )
    if findings.problems:
        raise ConfigError(findings.problems)
    kind = kind_of_config(config_name, config_path, config_dir).kind
    with hydra_search_path(config_path, config_dir):
        return typed_config(compose(config_name, overrides=overrides), kind.schema), kind


def inspect_sources(
    cfg: RunConfig, kind: RecipeKind, tokenizer: PreTrainedTokenizerBase, num_examples: int, limit: int | None
) -> DataReport:
    budget = row_budget(cfg.data, cfg.parallel.context)[0]  # a row's tokens (context parallelism: the group's)
    specs = source_specs(cfg.data.train)  # read as the recipe reads them
    # From the sources' token caches where they are built (data.cache), else tokenized here as read.
    documents = open_documents(kind.name, specs, tokenizer, cfg.data, cfg.parallel.context, build=False)
    # data.eval_split: the records training reads, without those held out for eval (said in the report)
    split = hold_out(documents, cfg.data.eval_split, cfg.seed)
    documents = split.train
    report = scan_documents(
        documents,
        range(min(len(documents), limit or len(documents))),
        num_examples,
        batch_records=cfg.data.buffer_records,
    )
    if split.held_out is not None:
        report.held_out = held_out_line(split, cfg.data.eval_split)
    stream = PackedStream(
        _KnownLengths(report.outcomes),
        StreamLayout(num_epochs=1),
        cfg.seed,
        PackingBudget(budget, 0, cfg.data.pad_to_multiple_of, cfg.data.buffer_records),
    )
    for batch in stream:
        report.microbatches += 1
        report.packed_tokens += batch.num_tokens
    return report


class _KnownLengths:
    """The records already read, as placeholder documents of their lengths: packing (and so the fill)
    depends on lengths alone, so the stream need not tokenize everything a second time."""

    def __init__(self, outcomes: list[int | Skipped]):
        self.outcomes = outcomes

    def __len__(self) -> int:
        return len(self.outcomes)

    def get(self, index: int) -> Document | Skipped:
        outcome = self.outcomes[index]
        if isinstance(outcome, Skipped):
            return outcome
        return Document(doc_id=index, input_ids=[0] * outcome, labels=[IGNORE_INDEX] * outcome)


def sides(document: Document) -> list[tuple[str, Document]]:
    """(title, part) of a document to show: a preference pair's chosen and rejected sides, a KTO example and its
    mismatched sequence (the prompt with its partner's completion, for the reference point), else itself."""
    if len(document.segments) != 2:
        return [("", document)]
    first = document.segments[0]
    if KTO_LABEL not in document.doc_values:
        titles = (" chosen", " rejected")
    else:
        label = "desirable" if document.doc_values[KTO_LABEL] == 1.0 else "undesirable"
        titles = (f" {label} example", " mismatched (its prompt, the next record's completion: KTO's reference point)")
    shared = document.shared_prefix  # data.share_prompts: the second side continues the first side's prompt
    if shared:
        titles = (titles[0], f"{titles[1]} (its first {shared} tokens shared with the chosen side, computed once)")
    ids, labels = document.input_ids, document.labels
    second = Document(
        document.doc_id,
        np.concatenate([ids[:shared], ids[first:]]),  # shown whole: its prompt (untrained), then its own tokens
        np.concatenate([np.full(shared, IGNORE_INDEX), labels[first:]]),
    )
    return [(titles[0], Document(document.doc_id, ids[:first], labels[:first])), (titles[1], second)]


def trained_pieces(tokenizer: PreTrainedTokenizerBase, document: Document) -> list[tuple[str, bool]]:
    """The document as (text, trained) pieces: token j is trained when position j-1 predicts it. Each piece is
    the text its tokens add to the decoded document (token by token, SentencePiece tokenizers such as
    Phi-3's drop the spaces a token carries at its start: `Whoareyou?`)."""
    ids = document.input_ids.tolist()
    trained = [position > 0 and document.labels[position - 1] != IGNORE_INDEX for position in range(len(ids))]
    runs, start = [], 0
    for position in range(1, len(ids) + 1):
        if position == len(ids) or trained[position] != trained[start]:
            runs.append((start, position, trained[start]))
            start = position
    pieces: list[tuple[str, bool]] = []
    decoded = ""
    for start, end, is_trained in runs:
        text = tokenizer.decode(ids[:end], clean_up_tokenization_spaces=False)
        # The prefix's text is that of the document so far, unless a character spans the boundary (bytes of
        # one UTF-8 character in two tokens): then the run alone.
        piece = (
            text[len(decoded) :]
            if text.startswith(decoded)
            else tokenizer.decode(ids[start:end], clean_up_tokenization_spaces=False)
        )
        pieces.append((piece, is_trained))
        decoded = text
    return pieces


def histogram(lengths: list[int], width: int = 40) -> list[str]:
    """Lengths in power-of-two buckets, as text bars."""
    if not lengths:
        return ["(no documents)"]
    buckets: dict[int, int] = {}
    for length in lengths:
        upper = 1 << max(length - 1, 0).bit_length()
        buckets[upper] = buckets.get(upper, 0) + 1
    most = max(buckets.values())
    return [
        f"{upper // 2 + 1:>6}-{upper:<6} {'#' * max(1, round(width * count / most)):<{width}} {count}"
        for upper, count in sorted(buckets.items())
    ]


def summary_lines(report: DataReport, budget: int) -> list[str]:
    fill = report.packed_tokens / (report.microbatches * budget) if report.microbatches else 0.0
    return (
        ([report.held_out] if report.held_out else [])
        + count_lines(report.counts())
        + [f"microbatches at {budget} tokens: {report.microbatches}, fill {fill:.2%}"]
    )


def render_terminal(report: DataReport, tokenizer: PreTrainedTokenizerBase, budget: int, colour: bool) -> str:
    lines = summary_lines(report, budget) + ["", "document lengths (tokens):", *histogram(report.lengths)]
    for document in report.examples:
        for title, part in sides(document):
            lines += [
                "",
                f"--- document {document.doc_id}{title} ({len(part)} tokens; trained tokens "
                + ("in green" if colour else "between [[ ]]")
                + ") ---",
            ]
            parts = []
            for text, trained in trained_pieces(tokenizer, part):
                if colour:
                    parts.append(f"{TRAINED if trained else PLAIN}{text}{RESET}")
                else:
                    parts.append(f"[[{text}]]" if trained else text)
            lines.append("".join(parts))
    return "\n".join(lines)


def render_html(report: DataReport, tokenizer: PreTrainedTokenizerBase, budget: int) -> str:
    documents = []
    for document in report.examples:
        for title, part in sides(document):
            body = "".join(
                f'<span class="trained">{html.escape(text)}</span>' if trained else html.escape(text)
                for text, trained in trained_pieces(tokenizer, part)
            )
            documents.append(f"<h2>document {document.doc_id}{title} ({len(part)} tokens)</h2><pre>{body}</pre>")
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in summary_lines(report, budget))
    bars = html.escape("\n".join(histogram(report.lengths)))
    return (
        "<!doctype html><meta charset='utf-8'><title>chattune inspect</title>"
        "<style>body{font-family:sans-serif;margin:2em}pre{white-space:pre-wrap;background:#f6f6f6;padding:1em}"
        ".trained{background:#c8f7c5;color:#0a5d00;font-weight:bold}</style>"
        f"<h1>What training will see</h1><ul>{summary}</ul><h2>document lengths (tokens)</h2><pre>{bars}</pre>"
        "<p>Trained tokens are <span class='trained'>highlighted</span>.</p>" + "".join(documents)
    )


def run_inspect(
    config_name: str,
    overrides: list[str],
    config_path: Path,
    num_docs: int,
    limit: int | None,
    html_path: Path | None,
    colour: bool,
    config_dir: Path | None = None,
) -> str:
    cfg, kind = load_config(config_name, overrides, config_path, config_dir)
    tokenizer = load_tokenizer(cfg.tokenizer)
    report = inspect_sources(cfg, kind, tokenizer, num_docs, limit)
    if html_path is not None:
        html_path.write_text(
            render_html(report, tokenizer, row_budget(cfg.data, cfg.parallel.context)[0]), encoding="utf-8"
        )
    return render_terminal(report, tokenizer, row_budget(cfg.data, cfg.parallel.context)[0], colour)
