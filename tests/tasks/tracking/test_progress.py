import logging
import sys

import pytest
from tqdm.auto import tqdm

from tasks.tracking import bar_safe_console, prompt_bar
from tasks.tracking.progress import PassCounter, bar_is_drawn


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


def test_no_prompt_bar_under_quiet_inside_another_bar_or_for_nothing(monkeypatch) -> None:
    with prompt_bar(0, "nothing") as progress:
        assert progress is None
    with bar_safe_console(), prompt_bar(10, "inside") as progress:
        assert progress is None
    monkeypatch.setenv("GRPOFLOW_CONSOLE", "quiet")
    with prompt_bar(10, "quiet") as progress:
        assert progress is None


def test_a_prompt_bar_counts_every_pass_and_leaves_no_bar_behind(capsys) -> None:
    with prompt_bar(4, "evaluate base") as progress:
        assert progress is not None and bar_is_drawn()
        (bar,) = [each for each in tqdm._instances if each.desc.startswith("evaluate base")]
        for done in (2, 4):
            progress(done, 4)
        assert (bar.n, bar.total) == (4, 4)
        for done in (2, 4):  # a second pass (greedy, then sampled) grows the bar
            progress(done, 4)
        assert (bar.n, bar.total) == (8, 8)
    assert not bar_is_drawn()


def test_passes_add_up() -> None:
    passes = PassCounter()
    assert [passes.position(d, 3) for d in (3, 1, 3, 3)] == [3, 4, 6, 6]
