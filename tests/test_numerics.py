"""The one numerics switch: TF32 off and a thread count inside, everything restored on exit; the engines use it."""

from __future__ import annotations

import re

import pytest
import torch

from h3gate.numerics import strict_numerics
from tests.package_sources import relative, sources


def _tf32() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.fixture
def tf32_on():
    """Both TF32 flags on for the test (torch's backend flags are properties: set and restored by hand)."""
    before = _tf32()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_switch_turns_tf32_off_and_restores_flags_and_threads(tf32_on):
    threads = torch.get_num_threads()
    with strict_numerics("cpu", threads=1):
        assert _tf32() == (False, False)
        assert torch.get_num_threads() == 1
        with strict_numerics("cpu"):  # nested: the thread count is left alone
            assert torch.get_num_threads() == 1
        assert _tf32() == (False, False)
    assert _tf32() == (True, True)
    assert torch.get_num_threads() == threads


def test_switch_restores_on_an_exception(tf32_on):
    threads = torch.get_num_threads()
    with pytest.raises(RuntimeError), strict_numerics("cpu", threads=1):
        raise RuntimeError("boom")
    assert _tf32() == (True, True)
    assert torch.get_num_threads() == threads


def test_the_command_line_runs_every_verb_under_the_switch(tf32_on, monkeypatch):
    """The CLI's boundary enters the switch around the verb (here ``schedule``, its command replaced by a probe) and
    restores the flags when it returns."""
    from h3gate import cli
    from h3gate.commands import schedule_cmd

    seen = []
    monkeypatch.setattr(schedule_cmd, "schedule_command", lambda *a, **k: seen.append(_tf32()) or 0)
    with pytest.raises(SystemExit) as done:
        cli.main(["schedule", "--steps", "4"])
    assert done.value.code == 0 and seen == [(False, False)]
    assert _tf32() == (True, True)


def test_the_switch_is_entered_at_the_boundary_and_in_the_adapter_only():
    """``with strict_numerics(`` appears in the CLI's boundary and in the strict adapters that bind h3gate into a
    user's own module (``h3gate.strict`` and its SGLang twin), nowhere else (engines run inside it; no second site
    turns deterministic algorithms on)."""
    entries = {
        relative(p)
        for p in sources().values()
        if p.name != "numerics.py" and re.search(r"^\s*with strict_numerics\(", p.read_text(encoding="utf-8"), re.M)
    }
    assert entries == {"h3gate/cli/__init__.py", "h3gate/strict.py", "h3gate/adapters/sglang/strict_bind.py"}
    deterministic = {
        relative(p) for p in sources().values() if "use_deterministic_algorithms(" in p.read_text(encoding="utf-8")
    }
    assert deterministic == {"h3gate/numerics.py"}


def test_deterministic_algorithms_on_inside_and_restored():
    before = torch.are_deterministic_algorithms_enabled()
    with strict_numerics(deterministic=True):
        assert torch.are_deterministic_algorithms_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before


def test_no_module_flips_tf32_but_the_switch():
    sites = {relative(p) for p in sources().values() if re.search(r"allow_tf32\s*=", p.read_text(encoding="utf-8"))}
    assert sites == {"h3gate/numerics.py"}
