"""The SGLang candidate's tests (marker ``sglang``): SGLang 0.5.23's MiniMax-H3 DiT at the tiny config on the CPU.

Every test here needs sglang (``make install-sglang``): without it they skip with the adapter's own one-line reason,
and under ``H3GATE_REQUIRE_SGLANG=1`` (``make test-sglang``, CI) they fail instead. SGLang's process groups and the
torchvision shim are process-wide, so ``make test`` leaves these tests out and ``make test-sglang`` runs them in a
pytest of their own. The model is built once (the package fixture ``tiny``): SGLang's loader on the tiny config's
synthetic weights (seed 0), one intra-op thread. This folder has no ``__init__.py`` on purpose: a package named
``sglang`` under ``tests/`` (on ``sys.path``) would shadow the real one.
"""

from __future__ import annotations

import os

import pytest
import torch

from h3gate.errors import InputError
from h3gate.graph.model import build_model_graph, load_model_params
from h3gate.manifests.model_config import load_config
from h3gate.synth import SyntheticSource
from tests.sglang.helpers import REQUIRE, Tiny


@pytest.fixture(scope="package")
def tiny():
    try:
        from h3gate.adapters.sglang.runtime import require_sglang

        require_sglang("tests/sglang")
    except InputError as exc:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{exc} ({REQUIRE}=1)")
        pytest.skip(str(exc))
    from h3gate.adapters.sglang.build import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = load_config("tiny").config
    source = SyntheticSource(cfg, 0)
    yield Tiny(cfg, source, load_model_params(source, cfg), build_model_graph(cfg), build_model(source))
    torch.set_num_threads(threads)
