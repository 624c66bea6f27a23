"""How a tool call reads to a person: its label, its elapsed time, the status line and what a stop
makes of it."""

from __future__ import annotations

import json

import pytest

from gateway.core.cancellation import GATEWAY_RESTART, STOPPED_BY_USER
from gateway.core.transcript import ToolCall
from platforms.tool_progress import ToolProgress, elapsed_text, label, preview, summary


@pytest.mark.parametrize(("name", "args", "shown"), [
    ("sleep", {"seconds": 30.0}, "sleep 30"),
    ("shell", {"command": "ls -la\n  /tmp", "background": True}, "shell ls -la /tmp"),
    ("search", {"query": "switchboard", "limit": 5}, "search switchboard"),
    ("resize", {"width": 10, "height": 20}, "resize width=10, height=20"),
    ("noargs", {}, "noargs"),
])
def test_a_call_is_labelled_by_its_name_and_the_gist_of_its_arguments(name: str, args: dict[str, object],
                                                                      shown: str) -> None:
    assert label(ToolCall("c1", name, json.dumps(args))) == shown


def test_a_long_or_broken_argument_is_cut_short() -> None:
    assert summary(json.dumps({"command": "x" * 200})).endswith("…")
    assert len(summary(json.dumps({"command": "x" * 200}))) == 60
    assert summary("{not json") == "{not json"
    assert preview("y" * 1000, 10) == "y" * 9 + "…"


def test_elapsed_time_reads_in_seconds_minutes_and_hours() -> None:
    assert [elapsed_text(s) for s in (0.4, 12.9, 60, 125, 3725)] == ["0 s", "12 s", "1 min", "2 min 5 s", "1 h 2 min"]


def test_the_status_line_follows_the_calls_and_what_a_stop_makes_of_them() -> None:
    now = [100.0]
    progress = ToolProgress(clock=lambda: now[0])
    assert progress.line(has_text=False) == ""
    progress.start(ToolCall("a", "sleep", '{"seconds": 30}'))
    now[0] += 12.4
    assert progress.line(has_text=True) == "⏳ running `sleep 30` · 12 s"
    progress.start(ToolCall("b", "shell", '{"command": "make"}'))
    assert progress.line(has_text=False) == "⏳ running `sleep 30`, `shell make` · 12 s"  # the oldest's time
    assert progress.cut_short(STOPPED_BY_USER) == "⏹ `sleep 30`, `shell make` stopped after 12 s"
    assert progress.cut_short(GATEWAY_RESTART) == (
        "⏹ `sleep 30`, `shell make` interrupted after 12 s: gateway restart")
    assert progress.end("b") == 0.0 and progress.end("nope") is None
    now[0] += 18
    assert progress.end("a") == pytest.approx(30.4)
    assert progress.line(has_text=False) == "✓ ran `sleep 30` · 30 s"  # until the answer's text comes
    assert progress.line(has_text=True) == ""
    assert progress.cut_short(STOPPED_BY_USER) == ""
