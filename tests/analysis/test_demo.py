"""``ringpack demo`` in a log (stderr not a terminal): plain progress lines, no bar frames."""

from __future__ import annotations

import ringpack.progress
from ringpack.cli import main


def test_demo_progress_in_a_log_is_plain_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ringpack.progress, "LOG_INTERVAL_S", 0.0)  # every count logs: the test sees the lines
    assert main(["demo", "--quick", "--no-ring-check", "--out", str(tmp_path / "demo")]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err and "█" not in err, err[:300]
    lines = err.splitlines()
    assert lines and all(line.startswith("ringpack demo: ") for line in lines), lines[:5]
    assert any("stages (" in line for line in lines) and "12/12 stages (100%)" in lines[-1]


def test_quiet_demo_prints_no_progress(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ringpack.progress, "LOG_INTERVAL_S", 0.0)
    assert main(["demo", "--quick", "--no-ring-check", "--quiet", "--out", str(tmp_path / "demo")]) == 0
    assert capsys.readouterr().err == ""
