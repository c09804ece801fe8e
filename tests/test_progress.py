"""The progress helper of long offline tools: plain periodic lines off a terminal, a bar on one."""

from __future__ import annotations

import io

from torchtrain.utils.progress import Progress, duration, human


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    with Progress("prepare", total=200, unit="tokens", stream=out, interval=0.0) as bar:
        bar.update(50)
        bar.update(150)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("prepare: 50/200 tokens, 25.0%")
    assert "tokens/s" in lines[0] and "ETA" in lines[0]
    assert lines[-1].startswith("prepare: 200/200 tokens, 100.0%")
    assert "\r" not in out.getvalue()


def test_bar_redrawn_in_place_on_a_terminal():
    out = _Tty()
    bar = Progress("convert", total=4, unit="tensors", stream=out)
    bar.update(2, force=True)
    bar.close(summary="done: 4 tensors")
    text = out.getvalue()
    assert text.count("\r") == 2 and "[##########----------]" in text
    assert text.endswith("\ndone: 4 tensors\n")


def test_unknown_total_reports_elapsed_time():
    out = io.StringIO()
    bar = Progress("search", stream=out, interval=0.0, unit="layouts")
    bar.update(3)
    assert "3 layouts" in out.getvalue() and "elapsed" in out.getvalue()


def test_number_formatting():
    assert human(999) == "999" and human(1234) == "1.23K" and human(12_345_678) == "12.3M"
    assert duration(3725.4) == "1:02:05"


def test_plain_lines_start_after_the_interval_and_are_not_repeated():
    out = io.StringIO()
    with Progress("trace", total=None, unit="traces", stream=out, interval=10.0) as bar:
        bar.update()  # within the first interval: no line yet
        assert out.getvalue() == ""
    assert out.getvalue().count("trace: 1 traces") == 1  # the final line, once
    out = io.StringIO()
    with Progress("trace", total=None, unit="traces", stream=out, interval=0.0) as bar:
        bar.update()
    assert out.getvalue().count("trace: 1 traces") == 1  # drawn by the update, not repeated by close


def test_delay_keeps_short_work_silent():
    import time

    for out in (io.StringIO(), _Tty()):
        with Progress("eval", total=3, stream=out, interval=0.0, delay=60.0) as bar:
            bar.update(3)
        assert out.getvalue() == ""  # done within the delay: no bar, no final line
    out = io.StringIO()
    with Progress("eval", total=2, stream=out, interval=0.0, delay=0.01) as bar:
        time.sleep(0.02)
        bar.update(1)
        bar.update(1)
    assert out.getvalue().splitlines()[-1].startswith("eval: 2/2 items, 100.0%")
