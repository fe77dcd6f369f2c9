"""``h3gate.kernels.launches``: kernels note their schedules only while an engine records, under the node that ran
them, each distinct record once."""

from __future__ import annotations

from h3gate.kernels import launches


def test_nothing_is_described_outside_a_recording() -> None:
    calls = []
    launches.note("op", lambda: calls.append(1) or {"interpreted": True})
    assert calls == []


def test_records_go_to_the_current_node_once_each() -> None:
    with launches.recording() as log:
        with launches.node("a"):
            launches.note("op", lambda: {"tiling": "x", "interpreted": True})
            launches.note("op", lambda: {"tiling": "x", "interpreted": True})
            launches.note("op", lambda: {"tiling": "y", "interpreted": True})
        with launches.node("b"):
            launches.note("other", lambda: {"interpreted": True})
        launches.note("outside", lambda: {"interpreted": False})  # no node: the empty name
    assert log == {
        "a": {"op": [{"tiling": "x", "interpreted": True}, {"tiling": "y", "interpreted": True}]},
        "b": {"other": [{"interpreted": True}]},
        "": {"outside": [{"interpreted": False}]},
    }
    launches.note("op", lambda: {"interpreted": True})  # after the block: not recorded anywhere
    assert "op" not in log.get("", {})
