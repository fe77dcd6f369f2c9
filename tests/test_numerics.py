"""The one numerics switch: TF32 off and a thread count inside, everything restored on exit; the engines use it."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from h3gate.numerics import strict_numerics
from h3gate.runs import ws1_block, ws1_ops

PACKAGE = Path(__file__).resolve().parents[1] / "h3gate"


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


@pytest.mark.parametrize(("module", "engine", "inner"), [
    (ws1_block, lambda: ws1_block.run_block_gate(SimpleNamespace(device="cpu")), "_run_block_gate"),
    (ws1_ops, lambda: ws1_ops.run_case("rms_norm", 4, None, "cpu", 0), "_run_case"),
])  # fmt: skip
def test_engines_run_under_the_switch(tf32_on, monkeypatch, module, engine, inner):
    seen = []
    monkeypatch.setattr(module, inner, lambda *a, **k: seen.append(_tf32()) or "result")
    assert engine() == "result"
    assert seen == [(False, False)]
    assert _tf32() == (True, True)


def test_no_module_flips_tf32_but_the_switch():
    sites = {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if re.search(r"allow_tf32\s*=", p.read_text(encoding="utf-8"))
    }
    assert sites == {"numerics.py"}
