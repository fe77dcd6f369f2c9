"""``h3gate validate``: passes on the repository, and fails (exit 2, breadcrumb) on corrupted copies of it.

Corruption tests run the CLI in a subprocess with ``H3GATE_HOME`` pointing at a temp copy of ``manifests/`` and
``schemas/`` (``h3gate.paths`` reads it at import).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from h3gate.commands.validate_cmd import ValidateCommand, validate_command
from h3gate.paths import ROOT

REPO = Path(__file__).resolve().parents[1]


def test_validate_passes_on_the_repository(capsys):
    assert validate_command(ValidateCommand(json=True)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    kinds = {c["kind"] for c in report["checks"]}
    assert {"config", "checkpoint", "operators", "schema"} <= kinds
    files = {c["file"] for c in report["checks"]}
    assert {"manifests/configs/tiny.yaml", "schemas/common.schema.json", "schemas/seal.schema.json"} <= files
    assert all(c["status"] in ("ok", "not present") for c in report["checks"])


@pytest.fixture
def home(tmp_path) -> Path:
    shutil.copytree(ROOT / "manifests", tmp_path / "manifests")
    shutil.copytree(ROOT / "schemas", tmp_path / "schemas")
    return tmp_path


def _validate(home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "H3GATE_HOME": str(home), "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, "-m", "h3gate", "validate"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("file", "old", "new", "message"),
    [
        (
            "configs/tiny.yaml",
            "  hidden_size:",
            "  hiden_sise: 3\n  hidden_size:",
            "h3gate: error: manifests/configs/tiny.yaml: config.hiden_sise: unknown field",
        ),
        (
            "operators/attention.yaml",
            "baseline: sdpa_flash",
            "baseline: cudnn",
            "h3gate: error: manifests/operators/attention.yaml: operators.h3_full_attention.bench.baseline:",
        ),
    ],
)
def test_bad_yaml_field_fails_with_breadcrumb(home, file, old, new, message):
    path = home / "manifests" / file
    path.write_text(path.read_text().replace(old, new, 1))
    done = _validate(home)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr


def test_malformed_yaml_fails_with_breadcrumb(home):
    path = home / "manifests" / "checkpoints" / "minimax-h3-42ed227.yaml"
    path.write_text(path.read_text() + "\nvariants: [unclosed\n")
    done = _validate(home)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "h3gate: error: manifests/checkpoints/minimax-h3-42ed227.yaml: line" in done.stderr
    assert "malformed YAML" in done.stderr


@pytest.mark.slow  # 9 s on two cores: make test-slow (.ci/run runs both); make test's budget
def test_cross_checks_fail(home):
    """A checkpoint config drifting from configs/real.yaml, a wrong declared seq_len, a broken cross-file $ref."""
    path = home / "manifests" / "checkpoints" / "minimax-h3-42ed227.yaml"
    path.write_text(path.read_text().replace("  num_layers: 50\n", "  num_layers: 48\n", 1))
    done = _validate(home)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        "h3gate: error: manifests/checkpoints/minimax-h3-42ed227.yaml: config: differs from "
        "manifests/configs/real.yaml in num_layers" in done.stderr
    )
    shutil.copy(ROOT / "manifests" / "checkpoints" / path.name, path)

    layouts_file = home / "manifests" / "layouts.yaml"
    layouts = yaml.safe_load(layouts_file.read_text())
    name = sorted(layouts["layouts"])[0]
    layouts["layouts"][name]["seq_len"] = 1  # no layout packs to a single row
    layouts_file.write_text(yaml.safe_dump(layouts))
    done = _validate(home)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"h3gate: error: manifests/layouts.yaml: layouts.{name}" in done.stderr and "seq_len" in done.stderr
    assert done.stdout.splitlines()[-1] == "verdict: fail (manifests/layouts.yaml is invalid; the error follows)"
    shutil.copy(ROOT / "manifests" / "layouts.yaml", layouts_file)

    seal = home / "schemas" / "seal.schema.json"
    seal.write_text(seal.read_text().replace("#/$defs/sha256", "#/$defs/sha265"))
    done = _validate(home)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "h3gate: error: schemas/seal.schema.json: $ref 'common.schema.json#/$defs/sha265' does not" in done.stderr


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (  # a path no kernel module implements
            "size: [8192, null], path: gluon_warp_specialised}",
            "size: [8192, null], path: gluon_hopper}",
            "operators.h3_qkv_gemm.paths.rules[2].path: 'gluon_hopper' is not a forward path of h3gate.kernels.gemm",
        ),
        (  # a path without its tiling: qkv below 1024 rows has swapped Triton tilings only
            "{devices: [cuda-other, cpu-interpreter], size: [0, 1024], path: triton_swapped}",
            "{devices: [cuda-other, cpu-interpreter], size: [0, 1024], path: triton}",
            "h3_qkv_gemm.paths: cpu-interpreter forward at M = 1: 'triton' has no tiling for this layer there",
        ),
        (  # sizes no rule covers
            "        - {devices: [cuda-sm90], size: [1024, 8192], path: triton}\n",
            "",
            "operators.h3_qkv_gemm.paths: rules for cuda-sm90 forward: no path for sizes [1024, 8192)",
        ),
    ],
)
def test_declared_kernel_paths_are_cross_checked_against_the_code(home, old, new, message):
    """Each operator's ``paths`` table: every path exists in its kernel module, runs where it is declared and has its
    tilings, and every (device class, product, size) has exactly one path."""
    path = home / "manifests" / "operators" / "gemm.yaml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    done = _validate(home)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "h3gate: error: manifests/operators/gemm.yaml: " in done.stderr and message in done.stderr, done.stderr


def test_ablation_row_naming_an_unregistered_probe_fails(home):
    """``validate`` checks every ablation row's probe against the registry of its run (not only ``ablate``)."""
    path = home / "manifests" / "ablations.yaml"
    path.write_text(path.read_text().replace("probe: causal_mask\n", "probe: causal_masks\n", 1))
    done = _validate(home)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "h3gate: error: manifests/ablations.yaml: rows.H8.probe: 'causal_masks' is not an arm probe" in done.stderr
