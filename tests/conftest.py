"""Shared test helpers (keep minimal: several suites use this file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def run_cli(capsys):
    """Run ``h3gate.cli.main(args)``; returns ``(exit_code, stdout, stderr)``."""

    def run(*args: str) -> tuple[int, str, str]:
        from h3gate.cli import main

        with pytest.raises(SystemExit) as exc:
            main([str(a) for a in args])
        captured = capsys.readouterr()
        return exc.value.code, captured.out, captured.err

    return run


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a whole module, as ``h3gate ablate`` runs on CPU (tiny shapes; no OpenMP spinning on
    shared cores). Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_params():
    """Every tensor of the tiny config's synthetic weights (seed 0), checked against the inventory, once per module."""
    from h3gate.graph.model import load_model_params
    from h3gate.manifests.model_config import load_config
    from h3gate.synth import SyntheticSource

    cfg = load_config("tiny").config
    return load_model_params(SyntheticSource(cfg, 0), cfg)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """``write(parent, name, seed, **kw)``: the tiny config's synthetic checkpoint written to a fresh temp folder."""
    from h3gate.manifests.model_config import load_config
    from h3gate.synth import write_checkpoint

    def write(parent: str, name: str, seed: int, **kwargs) -> Path:
        out = tmp_path_factory.mktemp(parent) / name
        write_checkpoint(load_config("tiny").config, seed, out, **kwargs)
        return out

    return write
