"""chattune.errors: a user error printed once, by one rank, and the other ranks waiting for that rank's report
before they exit (their exit makes torchrun end it)."""

from __future__ import annotations

import threading
import time

from chattune import errors


def test_a_rank_leaving_the_report_to_rank_0_waits_until_rank_0_has_reported(tmp_path, monkeypatch):
    """Before the process group a config or data error is reported by rank 0; rank 1 used to wait a fixed 3 s and
    exit, and under load (rank 0 a few seconds slower to start) torchrun then killed rank 0 before it printed: the
    error was never shown. Rank 1 now waits for rank 0's torchrun error file (written after its print), here
    slower than the fixed grace; and a rank 0 that never reports holds it no longer than the bound."""
    attempt = tmp_path / "attempt_0"
    (attempt / "0").mkdir(parents=True)
    (attempt / "1").mkdir()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "1" / "error.json"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setattr(errors, "_GRACE_S", 0.1)
    monkeypatch.setattr(errors, "_REPORTER_WAIT_S", 30.0)
    reported = threading.Event()

    def rank0_reports() -> None:
        time.sleep(1.0)  # ten times the fixed grace
        (attempt / "0" / "error.json").write_text("{}")
        reported.set()

    threading.Thread(target=rank0_reports, daemon=True).start()
    errors._wait_for_the_reporter(None)
    assert reported.is_set()

    (attempt / "0" / "error.json").unlink()
    monkeypatch.setattr(errors, "_REPORTER_WAIT_S", 0.5)
    started = time.monotonic()
    errors._wait_for_the_reporter(None)  # rank 0 never reports: bounded
    assert 0.5 <= time.monotonic() - started < 5
