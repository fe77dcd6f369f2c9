"""``h3gate fingerprint``: the manifest fingerprint and header-only checkpoint checks (exit 0 / 1 / 2)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from h3gate.checkpoint import INDEX_NAME, WEIGHTS_NAME, materialize, open_checkpoint
from h3gate.fingerprint import canonical_sha256, check_checkpoint, manifest_fingerprint
from h3gate.inventory import expected_inventory
from h3gate.manifests.checkpoint_manifest import load_checkpoint_manifest
from h3gate.manifests.model_config import load_config
from h3gate.synth import write_checkpoint

MANIFEST = load_checkpoint_manifest("minimax-h3-42ed227")
TINY = load_config("tiny").config


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("fp", "tiny", 5)


@pytest.fixture(scope="module")
def tiny_state(tiny_dir) -> dict[str, torch.Tensor]:
    return materialize(open_checkpoint(tiny_dir))


def _save(folder: Path, state: dict[str, torch.Tensor], config_from: Path) -> Path:
    folder.mkdir()
    shutil.copy(config_from / "config.json", folder / "config.json")
    save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    return folder


def _fingerprint(run_cli, tmp_path: Path, *args) -> tuple[int, dict | None, str]:
    ev = tmp_path / f"ev-{len(list(tmp_path.glob('ev-*')))}"  # a new folder per run: --out is never overwritten
    code, _, err = run_cli("fingerprint", "--out", ev, *args)
    doc = json.loads((ev / "fingerprint.json").read_text()) if (ev / "fingerprint.json").exists() else None
    return code, doc, err


def test_manifest_fingerprint_real_counts():
    fp = manifest_fingerprint(MANIFEST)
    inv = fp["inventory"]
    assert inv["tensors"] == 638
    assert inv["parameters"] == 33_122_992_896
    assert {g: v["tensors"] for g, v in inv["groups"].items()} == {
        "boundary": 10,
        "refiner": 21,
        "block": 600,
        "head": 7,
    }
    assert sum(v["parameters"] for v in inv["groups"].values()) == inv["parameters"]
    f32, bf16 = inv["dtypes"]["float32"], inv["dtypes"]["bfloat16"]
    assert (f32["tensors"], bf16["tensors"]) == (12, 626)
    assert f32["bytes"] == 4 * f32["parameters"] and bf16["bytes"] == 2 * bf16["parameters"]
    assert fp["precision"]["fp32_tensors"][:2] == ["proj_in.weight", "proj_in.bias"]
    assert (
        len(fp["precision"]["fp32_tensors"]) == 12 and "context_embedder.weight" not in fp["precision"]["fp32_tensors"]
    )
    assert fp["derived"] == {"inner_dim": 7168, "rotary_dim": 96, "video_patch_dim": 96, "adaln_width": 96768}
    assert fp["upstream"]["revision"] == "42ed227ee7df40d41602854ae760620d6eb651fe"
    body = {k: v for k, v in fp.items() if k != "content_sha256"}
    assert fp["content_sha256"] == canonical_sha256(body) == manifest_fingerprint(MANIFEST)["content_sha256"]
    shifted = MANIFEST.model_copy(update={"scheduler": MANIFEST.scheduler.model_copy(update={"video_shift": 5.0})})
    assert manifest_fingerprint(shifted)["content_sha256"] != fp["content_sha256"]


def test_manifest_only_cli(run_cli, tmp_path):
    code, doc, _ = _fingerprint(run_cli, tmp_path)
    assert code == 0
    assert doc["kind"] == "fingerprint" and doc["mode"] == "manifest"
    assert doc["checkpoint"] is None and doc["match"] is None
    assert doc["manifest"]["inventory"]["parameters"] == 33_122_992_896
    assert any(p.endswith("minimax-h3-42ed227.yaml") for p in doc["provenance"]["manifests"])


def test_synthetic_checkpoint_matches(run_cli, tmp_path, tiny_dir):
    code, doc, _ = _fingerprint(run_cli, tmp_path, "--checkpoint", tiny_dir, "--hash-tensors")
    assert code == 0
    r = doc["checkpoint"]
    assert doc["match"] is True and r["match"] is True
    assert r["expected"] == r["found"] == {"tensors": 52, "parameters": 2_111_840}
    assert (r["missing"], r["unexpected"], r["mismatched"]) == ([], [], [])
    assert r["precision_boundary"]["ok"] and r["precision_boundary"]["fp32_tensors_found"] == 12
    assert r["config_matches_manifest"] is False  # tiny is not the released config; informational only
    assert {d["field"] for d in r["config_differences"]} >= {"hidden_size", "num_layers"}
    ckpt = open_checkpoint(tiny_dir)
    raw = b"".join(ckpt.iter_raw("norm_out.linear.weight"))
    assert r["tensor_sha256"]["tensors"]["norm_out.linear.weight"] == hashlib.sha256(raw).hexdigest()
    assert len(r["tensor_sha256"]["tensors"]) == 52
    # The same checkpoint checked against the released config: every block tensor has the wrong shape.
    code, doc, _ = _fingerprint(run_cli, tmp_path, "--checkpoint", tiny_dir, "--config", "real")
    r = doc["checkpoint"]
    assert code == 1 and len(r["missing"]) == 638 - 52 and r["unexpected"] == []  # every tiny name exists in real
    real = {t.name: t.shape for t in expected_inventory(MANIFEST.config)}
    differ = sorted(t.name for t in expected_inventory(TINY) if real[t.name] != t.shape)
    assert len(differ) == 44  # all but q/k norms (head_dim 128 in both) and the two output-head biases
    assert sorted(m["name"] for m in r["mismatched"]) == differ and r["config_matches_manifest"] is True


def test_value_change_keeps_headers_but_changes_hashes(tmp_path, tiny_dir, tiny_state):
    state = dict(tiny_state)
    state["proj_out.bias"] = state["proj_out.bias"].clone()
    state["proj_out.bias"][0] += 1.0
    changed = _save(tmp_path / "changed", state, tiny_dir)
    a = check_checkpoint(tiny_dir, manifest=MANIFEST, hash_tensors=True)["tensor_sha256"]
    b = check_checkpoint(changed, manifest=MANIFEST, hash_tensors=True)
    assert b["match"] is True
    diff = [n for n in a["tensors"] if a["tensors"][n] != b["tensor_sha256"]["tensors"][n]]
    assert diff == ["proj_out.bias"] and a["combined"] != b["tensor_sha256"]["combined"]


def _mutations(state: dict[str, torch.Tensor]) -> dict[str, tuple[dict, str, str]]:
    s = dict(state)
    cases: dict[str, tuple[dict, str, str]] = {}
    missing = dict(s)
    del missing["transformer_blocks.1.attn.norm_k.weight"]
    cases["missing"] = (missing, "missing", "transformer_blocks.1.attn.norm_k.weight")
    cases["unexpected"] = ({**s, "transformer_blocks.0.attn.to_qkv.weight": torch.zeros(3, 2)}, "unexpected", "")
    cases["shape"] = ({**s, "norm_out.norm.weight": torch.ones(191, dtype=torch.bfloat16)}, "mismatched", "shape")
    cases["dtype"] = (
        {**s, "transformer_blocks.0.ff.net.2.weight": s["transformer_blocks.0.ff.net.2.weight"].half()},
        "mismatched",
        "dtype",
    )
    cases["boundary"] = ({**s, "audio_proj_in.weight": s["audio_proj_in.weight"].bfloat16()}, "boundary", "fp32")
    cases["boundary_default"] = (
        {**s, "context_embedder.bias": s["context_embedder.bias"].float()},
        "boundary",
        "default",
    )
    return cases


@pytest.mark.parametrize("case", ["missing", "unexpected", "shape", "dtype", "boundary", "boundary_default"])
def test_fingerprint_detects(run_cli, tmp_path, tiny_dir, tiny_state, case):
    state, where, detail = _mutations(tiny_state)[case]
    folder = _save(tmp_path / case, state, tiny_dir)
    code, doc, _ = _fingerprint(run_cli, tmp_path, "--checkpoint", folder)
    assert code == 1
    assert doc is not None and doc["match"] is False
    r = doc["checkpoint"]
    if where == "missing":
        assert r["missing"] == [detail] and not r["unexpected"] and not r["mismatched"]
    elif where == "unexpected":
        assert r["unexpected"] == [
            {"name": "transformer_blocks.0.attn.to_qkv.weight", "shape": [3, 2], "dtype": "float32"}
        ]
    elif where == "mismatched":
        assert len(r["mismatched"]) == 1 and r["mismatched"][0]["problems"] == [detail]
        assert r["precision_boundary"]["ok"]  # float16 for bfloat16 is a wrong dtype, not a boundary move
        if detail == "dtype":
            m = r["mismatched"][0]
            assert (m["name"], m["expected_dtype"], m["found_dtype"]) == (
                "transformer_blocks.0.ff.net.2.weight",
                "bfloat16",
                "float16",
            )
    else:
        (v,) = r["precision_boundary"]["violations"]
        assert not r["precision_boundary"]["ok"] and v["side"] == detail
        name = "audio_proj_in.weight" if detail == "fp32" else "context_embedder.bias"
        assert v["name"] == name and r["mismatched"][0]["name"] == name


def _truncate(folder: Path) -> None:
    f = folder / WEIGHTS_NAME
    f.write_bytes(f.read_bytes()[:-100])


def _corrupt_header(folder: Path) -> None:
    f = folder / WEIGHTS_NAME
    data = bytearray(f.read_bytes())
    data[8:20] = b"#not-json###"
    f.write_bytes(bytes(data))


def _bad_config(folder: Path) -> None:
    (folder / "config.json").write_text('{"hidden_size": 192,')


def _wrong_config_field(folder: Path) -> None:
    body = json.loads((folder / "config.json").read_text())
    body["hidden_size"] = -4
    (folder / "config.json").write_text(json.dumps(body))


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (
            _truncate,
            r"diffusion_pytorch_model\.safetensors: tensor audio_proj_out\.bias: data ends at byte \d+ but the "
            r"file has \d+ bytes \(truncated\)",
        ),
        (_corrupt_header, r"diffusion_pytorch_model\.safetensors: header is not valid UTF-8 JSON"),
        (_bad_config, r"config\.json: malformed JSON \(line 1, column 21: Expecting property name"),
        (_wrong_config_field, r"config\.json: hidden_size: must be > 0"),
        (lambda f: shutil.rmtree(f), r"no such checkpoint folder"),
        (lambda f: (f / WEIGHTS_NAME).unlink(), r"neither diffusion_pytorch_model\.safetensors nor"),
    ],
    ids=["truncated", "corrupt_header", "bad_config", "config_field", "missing_dir", "no_weights"],
)
def test_unreadable_checkpoint_exits_2(run_cli, tmp_path, tiny_dir, break_it, message):
    folder = tmp_path / "ck"
    shutil.copytree(tiny_dir, folder)
    break_it(folder)
    code, doc, err = _fingerprint(run_cli, tmp_path, "--checkpoint", folder)
    assert code == 2 and doc is None
    assert err.count("\n") == 1 and err.startswith("h3gate: error: ")
    assert re.search(message, err), err


def test_index_naming_missing_shard_exits_2(run_cli, tmp_path):
    folder = tmp_path / "sharded"
    write_checkpoint(TINY, 0, folder, shard_size=1_000_000)
    index = json.loads((folder / INDEX_NAME).read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (folder / gone).unlink()
    code, doc, err = _fingerprint(run_cli, tmp_path, "--checkpoint", folder)
    assert code == 2 and doc is None
    assert err.strip().endswith(f"index.json: weight_map names shard {gone}, which is missing")


def test_usage_errors(run_cli, tmp_path):
    code, _, err = run_cli("fingerprint", "--out", tmp_path, "--config", "tiny")
    assert code == 2 and "--config tiny: only used with --checkpoint" in err
    code, _, err = run_cli("fingerprint", "--out", tmp_path, "--manifest", "nope")
    assert code == 2 and "checkpoint manifest 'nope': unknown (known: minimax-h3-42ed227)" in err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    code, _, err = run_cli("synth-checkpoint", "--out", tmp_path / "busy", "--config", "tiny")
    assert code == 2 and "busy: already exists and is not an empty folder" in err
    code, _, err = run_cli("synth-checkpoint", "--out", tmp_path / "new", "--shard-size", "-1")
    assert code == 2 and "--shard-size -1: must be a positive number of bytes" in err
    assert not (tmp_path / "new").exists()


def test_synth_cli_then_fingerprint_json(run_cli, tmp_path):
    out = tmp_path / "ck"
    code, stdout, _ = run_cli(
        "synth-checkpoint", "--out", out, "--config", "tiny", "--seed", "9", "--shard-size", "2000000"
    )
    assert code == 0 and "52 tensors, 2,111,840 parameters" in stdout
    code, stdout, _ = run_cli("fingerprint", "--checkpoint", out, "--out", tmp_path / "ev", "--json")
    assert code == 0
    doc = json.loads(stdout)
    assert doc["match"] is True and doc["checkpoint"]["layout"] == "sharded"
    shard_files = set(json.loads((out / INDEX_NAME).read_text())["weight_map"].values())
    assert {s["file"] for s in doc["checkpoint"]["shards"]} == shard_files and len(shard_files) > 1
    assert struct.unpack("<Q", (out / doc["checkpoint"]["shards"][0]["file"]).read_bytes()[:8])[0] % 8 == 0


def test_real_scale_checkpoint_is_checked_from_headers_only(tmp_path, monkeypatch):
    """A 66 GB checkpoint of the released config (a sparse file: real header, unwritten data) is checked in full
    without reading a single tensor."""
    from h3gate.checkpoint import CheckpointDir
    from h3gate.synth import SyntheticSource, safetensors_header

    src = SyntheticSource(MANIFEST.config, 0)
    folder = tmp_path / "real"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MANIFEST.config.diffusers_config()))
    head, data_size = safetensors_header(src, src.names(), {"format": "pt"})
    with (folder / WEIGHTS_NAME).open("wb") as fh:
        fh.write(head)
        fh.truncate(len(head) + data_size)

    def no_reads(*args, **kwargs):
        raise AssertionError("fingerprint read tensor data")

    monkeypatch.setattr(CheckpointDir, "load", no_reads)
    monkeypatch.setattr(CheckpointDir, "iter_raw", no_reads)
    monkeypatch.setattr(SyntheticSource, "load", no_reads)
    r = check_checkpoint(folder, manifest=MANIFEST)
    assert r["match"] is True and r["config_matches_manifest"] is True
    assert r["found"] == {"tensors": 638, "parameters": 33_122_992_896}
    assert r["shards"][0]["bytes"] == len(head) + 66_280_430_080


def test_explicit_config_needs_no_config_json(run_cli, tmp_path, tiny_dir):
    folder = tmp_path / "noconfig"
    shutil.copytree(tiny_dir, folder)
    (folder / "config.json").unlink()
    code, doc, err = _fingerprint(run_cli, tmp_path, "--checkpoint", folder)
    assert code == 2 and "noconfig/config.json: missing" in err
    code, doc, _ = _fingerprint(run_cli, tmp_path, "--checkpoint", folder, "--config", "tiny")
    assert code == 0 and doc["checkpoint"]["config_source"] == "tiny"
    assert any(p.endswith("configs/tiny.yaml") for p in doc["provenance"]["manifests"])
