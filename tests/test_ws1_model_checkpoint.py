"""``h3gate run ws1-model --checkpoint``: a sharded diffusers checkpoint (h3gate's own writer, tiny config) runs the
gate; a checkpoint missing a block is refused in one line (exit 2, nothing written) unless ``--layers`` leaves that
block out; weights are read one stage at a time (the ``block.0`` stage reads block 0's tensors and nothing else).
"""

from __future__ import annotations

import json

import pytest
import torch

from h3gate.checkpoint import INDEX_NAME
from h3gate.inventory import expected_inventory
from h3gate.manifests.model_config import load_config
from h3gate.synth import SyntheticSource, write_checkpoint

TINY = load_config("tiny").config
SHARD = 1 << 20  # 1 MiB: the tiny config's ~4.3 MiB of weights in several shards
BLOCK_1 = "transformer_blocks.1."


class WithoutBlock1:
    """The seed-0 synthetic weights with every ``transformer_blocks.1.`` tensor left out."""

    def __init__(self) -> None:
        self._inner = SyntheticSource(TINY, 0)

    def names(self) -> list[str]:
        return [n for n in self._inner.names() if not n.startswith(BLOCK_1)]

    def meta(self, name):
        return self._inner.meta(name)

    def load(self, name, device="cpu", check_finite=False):
        return self._inner.load(name, device, check_finite)

    def config(self):
        return TINY


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(complete, without block 1): both sharded, written by ``h3gate.synth.write_checkpoint``."""
    root = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(TINY, 0, root / "complete", shard_size=SHARD)
    write_checkpoint(WithoutBlock1(), None, root / "no-block-1", shard_size=SHARD)
    for name in ("complete", "no-block-1"):
        index = json.loads((root / name / INDEX_NAME).read_text(encoding="utf-8"))
        assert len(set(index["weight_map"].values())) > 1, name  # really sharded
    index = json.loads((root / "no-block-1" / INDEX_NAME).read_text(encoding="utf-8"))
    assert not any(n.startswith(BLOCK_1) for n in index["weight_map"])
    return root / "complete", root / "no-block-1"


def _doc(folder) -> dict:
    return json.loads((folder / "ws1-model.json").read_text(encoding="utf-8"))


def _ws1_model(run_cli, *args):
    return run_cli("--quiet", "run", "ws1-model", "--no-backward", "--device", "cpu", *args)


@pytest.mark.slow  # 9 s on two cores: make test-slow (.ci/run runs both); make test's budget
def test_a_sharded_checkpoint_runs_the_gate(run_cli, checkpoints, tmp_path):
    complete, _ = checkpoints
    code, _, err = _ws1_model(run_cli, "--checkpoint", complete, "--layers", "0:1", "--out", tmp_path / "ev")
    assert code == 0, err
    doc = _doc(tmp_path / "ev")
    assert doc["checkpoint"]["kind"] == "checkpoint" and doc["checkpoint"]["path"] == str(complete)
    assert doc["config"]["name"] == "tiny"  # the checkpoint's config.json is the tiny config
    assert doc["verdict"] == "pass" and doc["model"]["layers"] == [0, 1]


def test_a_checkpoint_missing_a_block_is_exit_2_in_one_line(run_cli, checkpoints, tmp_path):
    _, partial = checkpoints
    out = tmp_path / "ev"
    code, stdout, err = _ws1_model(run_cli, "--checkpoint", partial, "--out", out)
    assert code == 2 and stdout == ""
    assert err.count("\n") == 1 and err.startswith("h3gate: error: --checkpoint "), err
    assert BLOCK_1 in err and ": missing (layer 1)" in err, err
    assert "Traceback" not in err
    assert not out.exists()


@pytest.mark.slow
def test_layers_that_skip_the_missing_block_run(run_cli, checkpoints, tmp_path):
    _, partial = checkpoints
    code, _, err = _ws1_model(run_cli, "--checkpoint", partial, "--layers", "0:1", "--out", tmp_path / "ev")
    assert code == 0, err
    doc = _doc(tmp_path / "ev")
    assert doc["checkpoint"]["kind"] == "checkpoint" and doc["verdict"] == "pass"
    assert doc["model"]["layers"] == [0, 1] and not doc["model"]["complete"]


def test_a_stage_reads_its_own_tensors_and_nothing_else(checkpoints, monkeypatch):
    from h3gate.runs.setup import ModelNeeds, RunSpec, prepare

    complete, _ = checkpoints
    setup = prepare(RunSpec("model", "micro", checkpoint=str(complete)), ModelNeeds(backward=False))
    source = setup.weights.source
    read: list[str] = []
    real_load = source.load

    def recording_load(name, *args, **kwargs):
        read.append(name)
        return real_load(name, *args, **kwargs)

    monkeypatch.setattr(source, "load", recording_load)
    stage = next(s for s in setup.stages if s.label == "block.0")
    params = setup.weights.load(stage)
    inventory = [s.name for s in expected_inventory(TINY)]
    block_0 = [n for n in inventory if n.startswith("transformer_blocks.0.")]
    per_block = sum(n.startswith("transformer_blocks.") for n in inventory) // TINY.num_layers
    assert sorted(read) == sorted(params) == sorted(block_0)
    assert len(read) == len(set(read)) == per_block
    synthetic = SyntheticSource(TINY, 0)
    for name, tensor in params.items():  # the checkpoint holds the synthetic weights, dtype for dtype
        assert torch.equal(tensor, synthetic.load(name)) and tensor.dtype == synthetic.load(name).dtype, name
