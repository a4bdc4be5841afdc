import logging
import sys

import pytest
from tqdm.auto import tqdm

from tasks.tracking import bar_safe_console, work_bar
from tasks.tracking.progress import bar_is_drawn


def _line_after_bar(capsys: pytest.CaptureFixture, safe: bool) -> tuple[str, str, logging.Handler]:
    """A console handler (on the captured stderr), a drawn bar, one log line; the output before and after it."""
    log = logging.getLogger("tests.progress")
    handler = logging.StreamHandler(sys.stderr)
    log.addHandler(handler)
    log.propagate = False
    try:
        bar = tqdm(total=10, desc="training", file=sys.stderr)
        bar.update(3)
        if safe:
            with bar_safe_console():
                log.warning("a log line")
        else:
            log.warning("a log line")
        bar.close()
    finally:
        log.removeHandler(handler)
    before, after = capsys.readouterr().err.split("a log line\n")
    return before, after, handler


def test_a_log_line_is_written_above_the_bar_not_through_it(capsys) -> None:
    before, after, handler = _line_after_bar(capsys, safe=True)
    assert before.endswith("\r") and before.rstrip("\r ").endswith("it/s]")  # the bar cleared first
    assert "training:  30%" in after  # and drawn again below the line
    assert "emit" not in vars(handler)  # the handler is left as it was


def test_without_it_the_line_would_share_the_bar_s_line(capsys) -> None:
    before, _, _ = _line_after_bar(capsys, safe=False)
    assert before.rstrip().endswith("it/s]")  # glued to the bar: what bar_safe_console prevents


def test_no_work_bar_under_quiet_inside_another_bar_or_for_nothing(monkeypatch) -> None:
    with work_bar(0, "nothing") as advance:
        assert advance is None
    with bar_safe_console(), work_bar(10, "inside") as advance:
        assert advance is None
    monkeypatch.setenv("GRPOFLOW_CONSOLE", "quiet")
    with work_bar(10, "quiet") as advance:
        assert advance is None


def test_a_work_bar_counts_units_grows_past_its_total_and_leaves_no_bar_behind(capsys) -> None:
    with work_bar(4, "evaluate base", "item") as advance:
        assert advance is not None and bar_is_drawn()
        (bar,) = [each for each in tqdm._instances if each.desc.startswith("evaluate base")]
        advance(3)
        assert (bar.n, bar.total) == (3, 4)
        advance(3)  # more work than announced: the bar grows
        assert (bar.n, bar.total) == (6, 6)
    assert not bar_is_drawn()
