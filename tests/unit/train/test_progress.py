"""The console progress: a bar on a terminal, the metric lines of before everywhere else."""

from __future__ import annotations

import io
import logging
import re

import pytest

from chattune.log import EACH_RANK
from chattune.train.metrics import MetricLogger
from chattune.train.progress import Pace, Progress, TaskProgress, wants_bar


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def console(monkeypatch):
    """Make `stream` sys.stdout and root logging's console, as chattune.log sets it up; yield a function that
    returns everything written to it."""

    def install(stream: io.StringIO):
        monkeypatch.setattr("sys.stdout", stream)
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("LOG %(message)s"))
        root = logging.getLogger()
        monkeypatch.setattr(root, "handlers", [handler])
        monkeypatch.setattr(root, "level", logging.INFO)
        return stream

    return install


def step_metrics(step: int) -> dict:
    return {"step": step, "loss": 2.5 - 0.1 * step, "num_tokens": 1000, "tokens_per_sec": 4321.0, "lr": 1e-3}


def run_steps(tmp_path, stream: io.StringIO, mode: str = "auto", log_every: int = 2) -> list[int]:
    """A fake training loop with the hooks of chattune.train.loop: 5 of 10 steps, an eval line at step 4,
    a warning at step 3. Returns the bar's count after each step (empty without a bar)."""
    metric_logger = MetricLogger(str(tmp_path), is_main=True)
    progress = Progress(0, 10, mode, is_main=True, stream=stream)
    metric_logger.step_lines = not progress.shows_bar
    counts = []
    for step in range(1, 6):
        if step % log_every == 0:
            metric_logger.log({**step_metrics(step), **({"eval_loss": 1.75} if step == 4 else {})})
        if step == 3:
            logging.getLogger("chattune.train.loop").warning("a warning at step %d", step)
        progress.update(step, metric_logger.last)
        if progress.shows_bar:
            counts.append(progress.bar.n)
    progress.close()
    return counts


def test_a_terminal_gets_a_bar_with_step_loss_tokens_per_second_and_eta(tmp_path, console):
    out = console(FakeTerminal())
    assert run_steps(tmp_path, out) == [1, 2, 3, 4, 5]  # every step moves the bar, not only logged ones
    text = out.getvalue()
    frames = [frame for frame in re.split(r"[\r\n]", text) if frame.startswith("step ")]
    assert frames, text
    last = frames[-1]
    assert "step 5/10" in last and "50%" in last
    assert "loss 2.1" in last and "4.32k tok/s" in last  # the step-4 line: the last one logged
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d\]", last), last  # elapsed < ETA


def test_log_lines_print_above_the_bar_and_only_eval_metric_lines(tmp_path, console):
    out = console(FakeTerminal())
    run_steps(tmp_path, out)
    lines = out.getvalue().split("\n")
    logged = [line.split("LOG ", 1)[1] for line in lines if "LOG " in line]
    assert logged[0] == "a warning at step 3"
    assert logged[1].startswith("step 4 |") and "eval_loss 1.75" in logged[1]
    assert len(logged) == 2  # the step-2 metrics are in the bar and metrics.jsonl, not a line
    for line in lines:  # tqdm.write clears the bar first: no line holds both a bar frame and a log line
        assert "LOG " not in line or line.rsplit("\r", 1)[-1].startswith("LOG ")
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("stream, mode", [(io.StringIO(), "auto"), (FakeTerminal(), "lines")])
def test_off_a_terminal_or_with_lines_the_metric_lines_are_as_before(tmp_path, console, stream, mode):
    out = console(stream)
    assert run_steps(tmp_path, out, mode) == []
    text = out.getvalue()
    assert "\r" not in text and "|#" not in text and "/10" not in text  # nothing bar-like
    assert text.splitlines() == [
        "LOG step 2 | loss 2.3 | num_tokens 1000 | tokens_per_sec 4321 | lr 1.00e-03",
        "LOG a warning at step 3",
        "LOG step 4 | loss 2.1 | num_tokens 1000 | tokens_per_sec 4321 | lr 1.00e-03 | eval_loss 1.75",
    ]


def test_modes():
    assert wants_bar("bar", io.StringIO()) and not wants_bar("lines", FakeTerminal())
    assert wants_bar("auto", FakeTerminal()) and not wants_bar("auto", io.StringIO())
    with pytest.raises(ValueError, match="progress must be one of auto, bar, lines"):
        Progress(0, 10, "tqdm", is_main=False)
    assert not Progress(0, 10, "bar", is_main=False, stream=FakeTerminal()).shows_bar  # only rank 0 shows it


def test_a_resumed_run_starts_the_bar_at_its_step(console):
    out = console(FakeTerminal())
    progress = Progress(40, 100, "auto", stream=out)
    progress.update(41, {"loss": 1.0, "tokens_per_sec": 10.0})
    progress.close()
    assert "step 41/100" in out.getvalue().split("\r")[-1]


def _screen(written: str) -> list[str]:
    """The lines a terminal shows for `written`: a carriage return goes back to the line's start and ESC[K
    erases from the cursor to the line's end (what rank 0's bar and the other ranks' lines use)."""
    lines, line, cursor = [], [], 0
    for token in re.findall(r"\x1b\[K|\r|\n|[^\r\n\x1b]", written):
        if token == "\n":
            lines.append("".join(line))
            line, cursor = [], 0
        elif token == "\r":
            cursor = 0
        elif token == "\x1b[K":
            del line[cursor:]
        else:
            line[cursor : cursor + 1] = [token]
            cursor += 1
    return lines + ["".join(line)]


def test_another_ranks_line_prints_above_the_bar_not_into_it(monkeypatch):
    """Ranks share the terminal: rank 1's warning must not be appended to rank 0's half-drawn bar."""
    from chattune.log import setup_logging

    terminal = FakeTerminal()
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # put back afterwards, with the level, for the tests that follow
    monkeypatch.setattr(root, "level", root.level)
    bar = Progress(0, 10, "bar", is_main=True, stream=terminal)  # rank 0's bar (same terminal)
    bar.update(3, {"loss": 2.0})
    setup_logging(1, stream=terminal)  # rank 1's console: what another process writes to the same terminal
    logging.getLogger("chattune.test").warning(
        "skipped record 7 of /data/chats.jsonl: no assistant turn", extra=EACH_RANK
    )  # (a rank's own finding: another rank prints only those, `test_a_note_of_the_run_is_printed_once_by_rank_0`)
    bar.update(4, {"loss": 1.9})
    bar.close()
    screen = [line for line in _screen(terminal.getvalue()) if line]
    warning = [line for line in screen if "skipped record 7" in line]
    assert len(warning) == 1 and re.fullmatch(
        r"\d\d:\d\d:\d\d \[rank1\] skipped record 7 of /data/chats.jsonl: "
        r"no assistant turn",
        warning[0],
    ), screen
    assert screen[-1].startswith("step 4/10"), screen  # the bar is drawn again, below the line

    logs = io.StringIO()  # off a terminal (a log file, CI) lines are written as they are
    setup_logging(1, stream=logs)
    logging.getLogger("chattune.test").warning("plain", extra=EACH_RANK)
    assert logs.getvalue().endswith("[rank1] plain\n") and "\x1b" not in logs.getvalue()


def test_a_note_of_the_run_is_printed_once_by_rank_0_and_a_ranks_own_by_that_rank(monkeypatch):
    """Every rank finds a resume's accepted changes, the schedule it follows, a step slower than torchrun's grace:
    they were printed once per rank (x4 on 4 ranks). Another rank prints its errors and what it marks as its own."""
    import transformers

    from chattune.log import setup_logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # put back afterwards, with the level, for the tests that follow
    monkeypatch.setattr(root, "level", root.level)
    library = transformers.utils.logging._get_library_root_logger()
    monkeypatch.setattr(library, "handlers", [logging.StreamHandler(io.StringIO())])
    monkeypatch.setattr(library, "propagate", False)  # as in a fresh process (an earlier test may have turned it on)
    printed = {}
    for rank in (0, 1):
        printed[rank] = io.StringIO()
        setup_logging(rank, stream=printed[rank])
        logger = logging.getLogger("chattune.checkpoint.resume")
        logger.info("resumed from outputs/run/checkpoints/step_4 at step 4 (epoch 0)")
        logger.warning("resuming despite a change: config data.num_workers: 0 -> 2")
        logger.warning("skipped (bad_record): chats.jsonl record 9 (line 9): unparseable JSON", extra=EACH_RANK)
        logger.error("writing the snapshot of step 2 failed")
        transformers.logging.get_logger("transformers.modeling_utils").warning("Some weights were not initialized")
    lines = {rank: [line.split("] ", 1)[1] for line in printed[rank].getvalue().splitlines()] for rank in printed}
    assert lines[1] == [
        "skipped (bad_record): chats.jsonl record 9 (line 9): unparseable JSON",
        "writing the snapshot of step 2 failed",
    ]
    assert lines[0] == [
        "resumed from outputs/run/checkpoints/step_4 at step 4 (epoch 0)",
        "resuming despite a change: config data.num_workers: 0 -> 2",
        "skipped (bad_record): chats.jsonl record 9 (line 9): unparseable JSON",
        "writing the snapshot of step 2 failed",
    ]
    library_handler = library.handlers[0]
    assert library_handler.stream.getvalue() == "Some weights were not initialized\n"  # rank 0's alone


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_long_evaluation_says_where_it_is_every_ten_seconds_and_a_short_one_says_nothing(console):
    out = console(io.StringIO())
    clock = FakeClock()
    progress = Progress(0, 10, "auto", stream=out)
    assert not progress.shows_bar
    short = TaskProgress("eval", 3, "batches", stream=out, pace=Pace(clock=clock))
    for done in range(1, 4):
        clock.now += 1.0
        short.update(done)
    short.close()
    assert out.getvalue() == ""  # 3 s: no line

    long = TaskProgress("eval", 400, "batches", stream=out, pace=Pace(clock=clock))
    for done in range(1, 401):
        clock.now += 0.125  # 50 s in all
        long.update(done)
    long.close()
    assert out.getvalue().splitlines() == [
        "LOG eval: 40/400 batches, 5 s",
        "LOG eval: 120/400 batches, 15 s",
        "LOG eval: 200/400 batches, 25 s",
        "LOG eval: 280/400 batches, 35 s",
        "LOG eval: 360/400 batches, 45 s",
        "LOG eval: 400/400 batches done in 50 s",
    ]
    other_rank = Progress(0, 10, "lines", is_main=False, stream=out).task("eval", 400, "batches")
    other_rank.update(400)
    other_rank.close()
    assert len(out.getvalue().splitlines()) == 6  # only rank 0 speaks


def test_on_a_terminal_a_long_evaluation_gets_a_bar_of_its_own(console):
    out = console(FakeTerminal())
    progress = Progress(0, 10, "auto", stream=out)
    evaluation = TaskProgress("eval", 40, "batches", bar=progress.shows_bar, stream=out, pace=Pace(delay_s=0))
    for done in range(1, 41):
        evaluation.update(done)
    evaluation.close()
    progress.close()
    frames = [frame for frame in re.split(r"[\r\n]", out.getvalue()) if frame.startswith("eval")]
    assert frames and "/40" in frames[-1] and "batches" in frames[-1], out.getvalue()
    assert "LOG" not in out.getvalue()  # the bar, not lines
