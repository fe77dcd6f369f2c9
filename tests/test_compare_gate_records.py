"""tools/compare_gate_records.py: the H200 re-run check of a gate record (candidate hashes, forward, backward)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("compare_gate_records", ROOT / "tools" / "compare_gate_records.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RECORD = {
    "verdict": "pass",
    "nodes": [
        {
            "name": "q_proj",
            "sha256": {"provider": "aa", "candidate": "bb"},
            "launch": {"tiling": "t1"},
            "error": {"candidate": {"rel_l2": 1e-3}},
        }
    ],  # fmt: skip
    "backward": {
        "leaves": {
            "w": {
                "sha256": {"provider": "cc", "candidate": "dd"},
                "error": {"candidate": {"rel_l2": 2e-3}, "bound": {"bound": 4e-3}},
                "repeat": {"bitwise": True},
            }
        }
    },  # fmt: skip
    "summary": {"worst_ratio": 0.5},
    "timing": {"wall_s": 1.0},
}


def _judge(change) -> dict:
    after = copy.deepcopy(RECORD)
    change(after)
    return _tool().compare(RECORD, after, 1e-12)


def test_provider_backward_label_and_golden_last_bits_are_the_same_arithmetic():
    def change(r):
        r["nodes"][0]["launch"]["tiling"] = "t2"
        r["backward"]["leaves"]["w"]["sha256"]["provider"] = "ee"
        r["backward"]["leaves"]["w"]["error"]["bound"]["bound"] = 5e-3
        r["backward"]["leaves"]["w"]["error"]["candidate"]["rel_l2"] = 2e-3 * (1 + 1e-14)
        r["summary"]["worst_ratio"] = 0.4

    out = _judge(change)
    assert out["same_arithmetic"] and out["candidate_sha256"] == {"fields": 2, "identical": 2, "differing": []}
    assert out["forward"]["launch_labels_differing"] == 1 and out["backward"]["provider_sha256_differing"] == 1


def test_a_candidate_hash_a_forward_value_or_a_candidate_flag_that_moves_is_not():
    """Negative controls: each change alone fails the comparison."""
    changes = [
        lambda r: r["backward"]["leaves"]["w"]["sha256"].update(candidate="ff"),
        lambda r: r["nodes"][0]["error"]["candidate"].update(rel_l2=1.5e-3),
        lambda r: r["backward"]["leaves"]["w"]["repeat"].update(bitwise=False),
        lambda r: r["backward"]["leaves"]["w"]["error"]["candidate"].update(rel_l2=2.1e-3),
    ]
    assert [_judge(c)["same_arithmetic"] for c in changes] == [False] * len(changes)


def test_ignored_top_level_keys_are_left_out_of_both_and_only_those(tmp_path):
    """A plain against a streamed record: ``--ignore streamed --ignore memory`` leaves out how each ran; any other
    difference still fails (control)."""
    import json

    tool = _tool()
    plain, streamed = copy.deepcopy(RECORD), copy.deepcopy(RECORD)
    plain["memory"] = {"peak": 1}
    streamed.update(memory={"peak": 2}, streamed={"ranges": [[0, 1]]})
    for name, doc in (("plain", plain), ("streamed", streamed)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc), encoding="utf-8")
    a, b = (tmp_path / "plain.json"), (tmp_path / "streamed.json")
    assert not tool.compare(tool.body(a), tool.body(b), 1e-12)["same_arithmetic"]
    ignore = ("streamed", "memory")
    assert tool.compare(tool.body(a, ignore), tool.body(b, ignore), 1e-12)["same_arithmetic"]
    streamed["nodes"][0]["error"]["candidate"]["rel_l2"] = 2e-3
    b.write_text(json.dumps(streamed), encoding="utf-8")
    out = tool.compare(tool.body(a, ignore), tool.body(b, ignore), 1e-12)
    assert not out["same_arithmetic"] and out["forward"]["other_differing"] == {"$.nodes[].error.candidate.rel_l2": 1}
