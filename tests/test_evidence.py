"""Provenance, schema validation and the atomic evidence writer."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest

import h3gate
from h3gate.errors import InputError
from h3gate.evidence import provenance as prov
from h3gate.evidence import schema
from h3gate.evidence.writer import to_json, write_evidence
from h3gate.paths import CHECKOUT, ROOT, SCHEMAS

PROBE = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "probe.schema.json",
    "type": "object",
    "additionalProperties": False,
    "required": ["kind", "schema_version", "provenance", "verdict", "agreement", "bindings", "shape"],
    "properties": {
        "kind": {"const": "probe"},
        "schema_version": {"const": 1},
        "provenance": {"$ref": "common.schema.json#/$defs/provenance"},
        "verdict": {"$ref": "common.schema.json#/$defs/verdict"},
        "agreement": {"$ref": "common.schema.json#/$defs/agreement"},
        "bindings": {"type": "array", "items": {"$ref": "common.schema.json#/$defs/binding"}},
        "shape": {"type": "array", "items": {"type": "integer"}},
    },
}


@pytest.fixture
def probe_schemas(tmp_path, monkeypatch):
    """The repository's schemas plus a test-only ``probe`` kind that $refs every common definition."""
    folder = tmp_path / "schemas"
    shutil.copytree(SCHEMAS, folder)
    (folder / "probe.schema.json").write_text(json.dumps(PROBE))
    monkeypatch.setattr(schema, "SCHEMAS", folder)
    return folder


def _body(**over):
    body = {
        "verdict": "pass",
        "agreement": {
            "bitwise": False,
            "first_row": 3,
            "first_modality": "video",
            "max_abs": 0.5,
            "rel_l2": 1e-3,
            "rows_differing": 2,
        },
        "bindings": [],
        "shape": (2, 3),
    }
    body.update(over)
    return body


def test_provenance_fields_and_manifest_hashes(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    manifest = ROOT / "manifests" / "configs" / "tiny.yaml"
    p = prov.provenance(command=["h3gate", "validate"], manifests=[manifest], device="cpu")
    required = json.loads((SCHEMAS / "common.schema.json").read_text())["$defs"]["provenance"]["required"]
    optional = ["code_sha256", "revision_source", "dirty_files", "gemm_launch", "cuda_alloc_conf", "intra_op_threads"]
    assert sorted(p) == sorted([*required, *optional])
    assert p["code_sha256"] == prov.code_sha256() and re.fullmatch(r"[0-9a-f]{64}", p["code_sha256"])
    assert p["h3gate_version"] == h3gate.__version__
    assert p["manifests"] == {"manifests/configs/tiny.yaml": hashlib.sha256(manifest.read_bytes()).hexdigest()}
    assert p["command"] == ["h3gate", "validate"]
    assert p["triton_interpret"] == "1"
    # the environment that picks kernels or places memory is recorded, null when unset
    monkeypatch.setenv("H3GATE_GEMM_LAUNCH", "rows_dw_gluon")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    q = prov.provenance(command=["h3gate"], device="cpu")
    assert q["gemm_launch"] == "rows_dw_gluon" and q["cuda_alloc_conf"] is None
    # the intra-op thread count (on the CPU the provider's bytes can depend on it) as torch has it
    import torch

    from h3gate.numerics import threads

    with threads(1):
        assert prov.provenance(command=["h3gate"], device="cpu")["intra_op_threads"] == 1
    assert p["intra_op_threads"] == torch.get_num_threads()
    assert p["device"] == "cpu" and p["device_name"]
    assert p["python"] == ".".join(map(str, sys.version_info[:3]))
    assert p["time_utc"].endswith("Z")
    assert isinstance(p["allow_tf32_matmul"], bool) and isinstance(p["allow_tf32_cudnn"], bool)
    if (prov._CODE_ROOT / ".git").exists():  # a checkout: the revision is the full 40-hex commit id
        assert re.fullmatch(r"[0-9a-f]{40}", p["git_revision"]), p["git_revision"]
    else:
        assert p["git_revision"] == "unknown"
    assert prov.provenance()["command"] == sys.argv


def test_provenance_without_git(tmp_path, monkeypatch):
    monkeypatch.setattr(prov, "_CODE_ROOT", tmp_path)  # not a git checkout
    prov.git_state.cache_clear()
    try:
        p = prov.provenance(command=[])
    finally:
        prov.git_state.cache_clear()
    assert p["git_revision"] == "unknown" and p["git_dirty"] is None


def test_missing_manifest_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="nope.yaml: cannot read"):
        prov.provenance(manifests=[tmp_path / "nope.yaml"])


def test_write_evidence_round_trip(tmp_path, probe_schemas):
    from h3gate.ops.registry import bind, specs

    record = bind(sorted(specs())[0], "off", "cpu").record()
    path = write_evidence(tmp_path / "out", "probe.json", "probe", _body(bindings=[record]), command=["x"])
    doc = json.loads(path.read_text())
    assert list(doc)[:3] == ["kind", "schema_version", "provenance"]
    assert list(doc)[3:] == ["verdict", "agreement", "bindings", "shape"]  # insertion order kept
    assert doc["shape"] == [2, 3] and doc["bindings"] == [record] and doc["provenance"]["command"] == ["x"]
    schema.validate_document(doc)
    assert sorted(p.name for p in path.parent.iterdir()) == ["probe.json"]  # no temp file left behind


def test_write_evidence_refuses_nan_and_writes_nothing(tmp_path, probe_schemas):
    body = _body()
    body["agreement"]["max_abs"] = math.nan
    with pytest.raises(RuntimeError, match=r"\$\.agreement\.max_abs: non-finite float nan"):
        write_evidence(tmp_path / "out", "probe.json", "probe", body)
    with pytest.raises(RuntimeError, match=r"\$\.shape\[1\]: non-finite float inf"):
        write_evidence(tmp_path / "out", "probe.json", "probe", _body(shape=[1, math.inf]))
    assert not (tmp_path / "out").exists()


def test_write_evidence_schema_failure_is_a_bug(tmp_path, probe_schemas):
    with pytest.raises(RuntimeError, match=r"fails its own schema: evidence probe.json: \$\.verdict: 'maybe'"):
        write_evidence(tmp_path, "probe.json", "probe", _body(verdict="maybe"))
    bad_binding = {**_body()["agreement"], "extra": 1}
    with pytest.raises(RuntimeError, match="agreement"):
        write_evidence(tmp_path, "probe.json", "probe", _body(agreement=bad_binding))
    with pytest.raises(RuntimeError, match="must not set kind"):
        write_evidence(tmp_path, "probe.json", "probe", {**_body(), "kind": "probe"})
    with pytest.raises(RuntimeError, match="relative path ending in .json"):
        write_evidence(tmp_path, "../probe.json", "probe", _body())
    assert list(tmp_path.iterdir()) == [tmp_path / "schemas"]


def test_write_evidence_into_a_file_is_an_input_error(tmp_path, probe_schemas):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    with pytest.raises(InputError, match="blocker: exists and is not a folder"):
        write_evidence(blocker, "probe.json", "probe", _body())


def test_validate_document_errors(probe_schemas):
    with pytest.raises(InputError, match=r"evidence document: \$\.kind: missing"):
        schema.validate_document({})
    with pytest.raises(InputError, match=r"kind 'nosuch': no schema \S*schemas/nosuch.schema.json \(known: ") as exc:
        schema.validate_document({"kind": "nosuch"})
    assert {"common", "probe", "seal"} <= set(str(exc.value).split("(known: ")[1].rstrip(")").split(", "))
    with pytest.raises(InputError, match=r"f.json: \$: 'provenance' is a required property"):
        schema.validate_document({"kind": "seal", "schema_version": 1, "files": [], "root": "0" * 64}, source="f.json")


def test_to_json_conversions():
    import torch

    assert to_json({1: (1.5, Path("a")), "t": torch.tensor(2.0)}) == {"1": [1.5, "a"], "t": 2.0}
    with pytest.raises(RuntimeError, match=r"\$\.x: Tensor is not JSON data"):
        to_json({"x": torch.zeros(2)})


def test_check_schema_rejects_invalid_and_unresolved(tmp_path):
    shutil.copytree(SCHEMAS, tmp_path / "schemas")
    bad = tmp_path / "schemas" / "bad.schema.json"
    bad.write_text(json.dumps({"$id": "bad.schema.json", "type": "objekt"}))
    with pytest.raises(InputError, match="bad.schema.json: type: not a valid 2020-12 schema"):
        schema.check_schema(bad)
    bad.write_text(json.dumps({"$id": "bad.schema.json", "$ref": "common.schema.json#/$defs/nosuch"}))
    schema.clear_cache()
    with pytest.raises(InputError, match="does not resolve"):
        schema.check_schema(bad)
    bad.write_text(json.dumps({"$id": "other.schema.json"}))
    schema.clear_cache()
    with pytest.raises(InputError, match="must equal the file name"):
        schema.check_schema(bad)
    for path in sorted(SCHEMAS.glob("*.schema.json")):
        schema.check_schema(path)


def test_git_revision_falls_back_to_the_stamp_file(tmp_path, monkeypatch) -> None:
    from h3gate.evidence import provenance as prov

    monkeypatch.setattr(prov, "_git", lambda *args: None)
    monkeypatch.setattr(prov, "_CODE_ROOT", tmp_path)
    prov.git_state.cache_clear()
    try:
        assert prov.git_state() == ("unknown", None, "none", ())
        prov.git_state.cache_clear()
        (tmp_path / ".h3gate-revision").write_text("a" * 40 + "\n")
        assert prov.git_state() == ("a" * 40, None, "stamp", ())
        prov.git_state.cache_clear()
        (tmp_path / ".h3gate-revision").write_text("not-a-sha\n")
        assert prov.git_state() == ("unknown", None, "none", ())
    finally:
        prov.git_state.cache_clear()


def test_a_matching_stamp_wins_over_a_foreign_git_and_a_stale_one_is_ignored(tmp_path, monkeypatch) -> None:
    """A tree copied to a GPU host may carry a .git at another commit: the stamp made from the source names the
    revision while the code still hashes the same; after any code edit it is ignored (git says dirty)."""
    import json

    from h3gate.evidence import provenance as prov

    (tmp_path / "h3gate").mkdir()
    (tmp_path / "h3gate" / "x.py").write_text("a = 1\n")
    monkeypatch.setattr(prov, "_CODE_ROOT", tmp_path)
    answers = {"rev-parse": "b" * 40 + "\n", "status": " M h3gate/x.py\n?? other.txt\n"}
    monkeypatch.setattr(prov, "_git", lambda *args: answers[args[0]])
    stamp = {"revision": "c" * 40, "code_sha256": prov.code_sha256.__wrapped__(tmp_path), "dirty_files": []}
    (tmp_path / ".h3gate-revision").write_text(json.dumps(stamp))
    prov.git_state.cache_clear()
    try:
        assert prov.git_state() == ("c" * 40, False, "stamp", ())
        (tmp_path / "h3gate" / "x.py").write_text("a = 2\n")
        prov.git_state.cache_clear()
        monkeypatch.setattr(prov, "code_sha256", prov.code_sha256.__wrapped__)
        assert prov.git_state() == ("b" * 40, True, "git", ("h3gate/x.py", "other.txt"))
    finally:
        prov.git_state.cache_clear()


def test_code_sha256_covers_code_manifests_and_schemas_only(tmp_path) -> None:
    for rel, text in {
        "h3gate/a.py": "x = 1\n",
        "h3gate/sub/b.py": "y = 2\n",
        "h3gate/data/manifests/m.yaml": "k: 1\n",
        "h3gate/data/schemas/s.json": "{}\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    base = prov.code_sha256.__wrapped__(tmp_path)
    (tmp_path / "h3gate/__pycache__").mkdir()
    (tmp_path / "h3gate/__pycache__/a.cpython-312.pyc").write_bytes(b"\0")
    (tmp_path / "README.md").write_text("docs do not count\n")
    (tmp_path / "manifests").mkdir()
    (tmp_path / "manifests/old.yaml").write_text("k: 0\n")  # the pre-package layout counts only for old commits
    assert prov.code_sha256.__wrapped__(tmp_path) == base
    assert prov.code_sha256.__wrapped__(tmp_path, prov.LEGACY_CODE_GLOBS) != base
    data = tmp_path / "h3gate/data"
    (data / "manifests/m.yaml").write_text("k: 2\n")
    changed = prov.code_sha256.__wrapped__(tmp_path)
    assert changed != base
    (data / "manifests/m.yaml").rename(data / "manifests/n.yaml")  # a rename changes it too
    assert prov.code_sha256.__wrapped__(tmp_path) not in (base, changed)
    (data / "schemas/s.json").write_text("{ }\n")
    assert prov.code_sha256.__wrapped__(tmp_path) not in (base, changed)


def test_code_sha256_tool_prints_the_working_tree_hash() -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, str(CHECKOUT / "tools" / "code_sha256.py")], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == prov.code_sha256.__wrapped__(CHECKOUT)


@pytest.mark.parametrize(
    ("commit", "evidence"),
    [
        ("6d990da", "evidence/h200/bench-ops-gemm-attention-medium/bench-ops.json"),  # manifests/, schemas/ on top
        ("2addd63", "evidence/h200/ws1-block-real-medium-fault-fwd/ws1-block.json"),  # h3gate/data/, a stamped copy
        ("a169940", "evidence/h200/ws1-block-real-small/ws1-block.json"),  # the fault matrix, the attention by TMA
        ("a1d8580", "evidence/h200/ablate-real-medium-a/ablation.json"),
        ("631a468", "evidence/h200/ws1-block-real-medium/ws1-block.json"),  # the gates re-run at session 23's end
        ("1d6f47d", "evidence/h200/ws1-block-real-768p-forward/ws1-block.json"),  # and at 768p, session 24
        ("54f7fd5", "evidence/h200/bench-attention-medium/bench-ops.json"),  # the attention output by TMA, benched
        ("c25ebbd", "evidence/h200/bench-ws1-block-768p/bench-ws1-block.json"),  # sustained: ms and J per call
        ("e65e6b1", "evidence/h200/bench-ops-gemm-tiny/bench-ops.json"),  # the small-M Gluon tilings benched
        ("9410b47", "evidence/h200/bench-ws1-model-medium/bench-ws1-model.json"),  # the sustained forward
        ("9bf7165", "evidence/h200/ws1-block-real-ref2va-768p-forward/ws1-block.json"),  # the streamed forward
        ("e976b6d", "evidence/h200/vae-video-real-strict/vae.json"),  # run vae at the released geometry
        ("d263c02", "evidence/h200/ws1-model-real-medium-calibration/ws1-model.json"),  # whole model, calibration
        ("631a468", "evidence/h200/ws1-model-real-medium/ws1-model.json"),  # whole model, q / k / v grouped
        ("315738a", "evidence/h200/ws1-trajectory-real-medium-A/ws1-trajectory.json"),  # trajectory
        ("98dcd59", "evidence/h200/ws1-trajectory-real-768p-A/ws1-trajectory.json"),  # 768p, across two calls
        ("1d6b27d", "evidence/h200/arms-real-medium-lora/arms.json"),  # run arms
        ("27a0ee9", "evidence/h200/ws2-tp8-real-block-medium/ws2.json"),  # run ws2 at released widths
        ("e0f92a3", "evidence/h200/ws2-tp4cp2sp-real-block-medium/ws2.json"),  # TP x CP x SP, row-segment merge
    ],
)
def test_code_sha256_tool_reproduces_a_hash_named_by_committed_evidence(commit: str, evidence: str) -> None:
    """The code hash committed evidence names is the one ``tools/code_sha256.py COMMIT`` computes from git, in the
    layout of each commit; the stamped revision is that commit, and no path the code hash covers was dirty (a stamp
    may list dirty paths outside the hash, such as an untracked probe file: the generated
    evidence/h200/PROVENANCE.md lists every record's)."""
    import subprocess

    if subprocess.run(["git", "-C", str(CHECKOUT), "cat-file", "-e", f"{commit}^{{commit}}"], check=False).returncode:
        pytest.skip(f"not a git checkout holding {commit} (a shallow clone)")
    tool = str(CHECKOUT / "tools" / "code_sha256.py")
    done = subprocess.run([sys.executable, tool, commit], capture_output=True, text=True, check=True)
    doc = json.loads((CHECKOUT / evidence).read_text())
    assert done.stdout.strip() == doc["provenance"]["code_sha256"]
    if doc["provenance"].get("revision_source") == "stamp":
        assert doc["provenance"]["git_revision"].startswith(commit)
        assert not [f for f in doc["provenance"]["dirty_files"] if f.startswith("h3gate/")], doc["provenance"]
