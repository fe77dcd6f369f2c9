"""Phase 1 of ``run ws1-model --stream`` split by lane over torch's launcher's ranks: each rank runs its lanes
(:func:`h3gate.runs.model_stream.lane_ranks`), writes their files, and rank 0 joins each boundary's sidecar. The
files' bytes, the sidecars' lanes and the merged record are those one process gives; every sidecar names the
seconds each lane spent reaching it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from h3gate.runs import stream_files
from h3gate.runs.model_stream import GOLDEN_WEIGHT, lane_ranks, lane_weight
from tests.test_ws1_model_stream import BACKWARD, _cli, _doc, assert_same_record


def _lane(name: str, golden: bool = False, batch: tuple[int, int] | None = None) -> SimpleNamespace:
    return SimpleNamespace(name=name, golden=golden, batch=batch)


LANES = [_lane("golden", golden=True), *(_lane(f"provider {i}") for i in range(6)), _lane("candidate"),
         _lane("candidate repeat"), _lane("candidate batch 2@1", batch=(2, 1)),
         _lane("candidate batch 3@2", batch=(3, 2)), _lane("candidate batch 3@0", batch=(3, 0))]  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 16])
def test_every_lane_has_one_rank_and_the_loads_are_balanced(world) -> None:
    ranks = lane_ranks(LANES, world)
    assert list(ranks) != [] and set(ranks) == {lane.name for lane in LANES}
    assert set(ranks.values()) <= set(range(world))
    loads = [sum(lane_weight(lane) for lane in LANES if ranks[lane.name] == r) for r in range(world)]
    heaviest = max(lane_weight(lane) for lane in LANES)
    # the greedy's bound: no rank carries more than the mean plus one lane
    assert max(loads) <= sum(loads) / world + heaviest
    assert len({r for r in ranks.values()}) == min(world, len(LANES))
    assert lane_ranks(list(LANES), world) == ranks  # a function of the lanes and the world alone
    assert lane_weight(LANES[0]) == GOLDEN_WEIGHT and lane_weight(LANES[-1]) == 3


def test_a_rank_names_its_device_as_the_plain_run_does() -> None:
    """Ranks sharing or splitting GPUs: a bare ``cuda`` stays ``cuda`` (the rank's current device), so the merged
    record's ``device`` is the plain run's (on an H100 the two records differed in this field alone before);
    an explicit index or the CPU is the rank's own device."""
    from h3gate.commands.model_stream_cmd import spec_device

    assert spec_device("cuda", "cuda:1") == "cuda"
    assert spec_device("cuda:0", "cuda:1") == "cuda:1"
    assert spec_device("cpu", "cpu") == "cpu"


def test_joined_parts_are_the_sidecar_one_process_writes(tmp_path) -> None:
    tensors = {"golden": {"x": torch.arange(4.0, dtype=torch.float64)}, "provider": {"x": torch.ones(3)},
               "candidate": {"x": torch.zeros(2, dtype=torch.bfloat16)}}  # fmt: skip
    refused = {"golden": None, "provider": "variant refused", "candidate": None}
    seconds = {"golden": 2.0, "provider": 1.0, "candidate": 0.5}
    one, two = tmp_path / "one", tmp_path / "two"
    stream_files.write_boundary(one, 3, "forward", tensors, refused, seconds)
    split = [["candidate", "golden"], ["provider"]]  # the ranks' own lanes, in another order than the plan's
    for rank, names in enumerate(split):
        mine = {key: {n: table[n] for n in names} for key, table in (("t", tensors), ("r", refused), ("s", seconds))}
        stream_files.write_boundary_part(two, 3, "forward", mine["t"], mine["r"], mine["s"], rank)
    assert not stream_files.stored(two, 3, "forward")  # parts alone are not a stored boundary
    stream_files.join_boundary(two, 3, "forward", 2, list(tensors))
    side = {p: json.loads((p / "boundaries" / "before-block-3" / "forward.json").read_text()) for p in (one, two)}
    for key in ("lanes", "refused", "seconds"):
        assert side[one][key] == side[two][key] and list(side[two][key]) == list(tensors), key
    assert not list((two / "boundaries" / "before-block-3").glob("*.part"))
    got, _ = stream_files.read_boundary(two, 3, "forward", "cpu")
    assert all(torch.equal(got[n]["x"], tensors[n]["x"]) for n in tensors)
    # control: a lane missing from the parts is missing from the sidecar
    stream_files.write_boundary_part(tmp_path / "three", 3, "forward", {"golden": tensors["golden"]},
                                     {"golden": None}, {"golden": 1.0}, 0)  # fmt: skip
    stream_files.join_boundary(tmp_path / "three", 3, "forward", 1, list(tensors))
    three = json.loads((tmp_path / "three" / "boundaries" / "before-block-3" / "forward.json").read_text())
    assert list(three["lanes"]) == ["golden"] != list(side[one]["lanes"])


def _sidecars(folder: Path) -> dict[str, dict]:
    return {str(p.relative_to(folder)): json.loads(p.read_text()) for p in (folder / "boundaries").rglob("*.json")}


@pytest.mark.slow  # mode off with the backward: one process, then three gloo ranks sharing phase 1 (~15 s)
def test_three_ranks_write_the_boundaries_one_process_writes(tmp_path) -> None:
    from h3gate.ranks import run_ranks

    code, _ = _cli("--quiet", "run", "ws1-model", *BACKWARD, "--stream", "--out", tmp_path / "one")
    args = ["--quiet", "run", "ws1-model", *BACKWARD, "--stream", "--out", str(tmp_path / "three")]
    assert run_ranks("h3gate", 3, tmp_path / "launch", 1, 1200, args=args) == []
    one, three = _sidecars(tmp_path / "one"), _sidecars(tmp_path / "three")
    assert sorted(one) == sorted(three) and len(one) == 3  # before block 1 (forward, backward), end (forward)
    for name, side in one.items():
        assert three[name]["lanes"] == side["lanes"], name  # every file's sha256, lanes in the plan's order
        assert set(three[name]["seconds"]) == set(side["seconds"]) == set(side["lanes"])
    assert not list((tmp_path / "three").rglob("*.part"))
    plan = json.loads((tmp_path / "three" / "plan.json").read_text())
    assert plan["phase1"]["ranks"] == 3 and plan["phase1"]["calls"] == 1
    assert_same_record(_doc(tmp_path / "one"), _doc(tmp_path / "three"))
    assert code in (0, 1)
    # control: another seed writes other bytes, so the comparison above can fail
    _cli("--quiet", "run", "ws1-model", *BACKWARD, "--seed", "1", "--stream", "--out", tmp_path / "seed1")
    other = _sidecars(tmp_path / "seed1")
    assert any(other[n]["lanes"] != one[n]["lanes"] for n in one)
