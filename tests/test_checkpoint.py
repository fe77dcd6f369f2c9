"""Header-first checkpoint reading, seeded synthetic weights and the streaming checkpoint writer (CPU, tiny)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3gate.checkpoint import (
    INDEX_NAME,
    WEIGHTS_NAME,
    CheckpointDir,
    WeightSource,
    open_checkpoint,
    read_safetensors_header,
)
from h3gate.errors import InputError
from h3gate.inventory import block_tensor_names, expected_inventory
from h3gate.manifests.model_config import load_config
from h3gate.synth import SyntheticSource, open_weights, plan_shards, synth_tensor, tensor_seed, write_checkpoint

TINY = load_config("tiny").config
REAL = load_config("real").config


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("ckpt", "single", 7)


@pytest.fixture(scope="module")
def sharded_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("ckpt", "sharded", 7, shard_size=1_000_000)


def test_synthetic_source_matches_inventory_and_protocol():
    src = SyntheticSource(TINY, 0)
    assert isinstance(src, WeightSource)
    specs = expected_inventory(TINY)
    assert src.names() == [s.name for s in specs]
    for s in specs:
        t = src.load(s.name)
        assert src.meta(s.name) == (s.shape, s.dtype)
        assert tuple(t.shape) == s.shape and t.dtype == getattr(torch, s.dtype), s.name
        assert bool(torch.isfinite(t).all()), s.name
    assert src.load("proj_in.weight").dtype == torch.float32
    assert src.load("context_embedder.weight").dtype == torch.bfloat16
    with pytest.raises(InputError, match=r"^nope\.weight: no such tensor in the synthetic weights$"):
        src.load("nope.weight")


def test_synthetic_init_statistics():
    """Norms 1 + 0.1 z (not all one), small biases, linear weights z / sqrt(fan_in)."""
    src = SyntheticSource(TINY, 0)
    norm = src.load("transformer_blocks.0.norm1.weight").float()
    assert abs(norm.mean().item() - 1.0) < 0.03 and 0.07 < norm.std().item() < 0.13
    bias = src.load("transformer_blocks.0.adaln_proj.linear.bias").float()
    assert bias.abs().max().item() < 0.15 and bias.std().item() > 0.01
    w = src.load("transformer_blocks.1.ff.net.2.weight").float()
    assert abs(w.std().item() * TINY.ffn_dim**0.5 - 1.0) < 0.05
    # Different names and different seeds draw different streams.
    assert tensor_seed(0, "a") != tensor_seed(0, "b") != tensor_seed(1, "a")
    assert not torch.equal(synth_tensor(0, "x.weight", (4, 4)), synth_tensor(1, "x.weight", (4, 4)))


def test_synthetic_real_block0_is_lazy_and_deterministic():
    """Block 0 of the 33B config without generating the rest: right shapes/dtypes, same bytes on every call."""
    a, b = SyntheticSource(REAL, 11), SyntheticSource(REAL, 11)
    names = block_tensor_names(REAL, 0)
    assert len(names) == 12
    h, inner, ffn = REAL.hidden_size, REAL.inner_dim, REAL.ffn_dim
    expected = {
        "norm1.weight": (h,),
        "attn.to_q.weight": (inner, h),
        "attn.to_k.weight": (inner, h),
        "attn.to_v.weight": (inner, h),
        "attn.norm_q.weight": (128,),
        "attn.norm_k.weight": (128,),
        "attn.to_out.0.weight": (h, inner),
        "norm2.weight": (h,),
        "ff.net.0.proj.weight": (2 * ffn, h),
        "ff.net.2.weight": (h, ffn),
        "adaln_proj.linear.weight": (96768, 2688),
        "adaln_proj.linear.bias": (96768,),
    }
    assert {n.removeprefix("transformer_blocks.0."): a.meta(n) for n in names} == {
        k: (v, "bfloat16") for k, v in expected.items()
    }
    # Materialise the small ones and one 38.5M-element projection; twice, from two sources.
    for name in [n for n in names if len(a.meta(n)[0]) == 1] + ["transformer_blocks.0.attn.to_q.weight"]:
        x, y = a.load(name), b.load(name)
        assert tuple(x.shape) == a.meta(name)[0] and x.dtype == torch.bfloat16
        assert torch.equal(x.view(torch.int16), y.view(torch.int16)), name
    assert not torch.equal(SyntheticSource(REAL, 12).load(names[0]), a.load(names[0]))


@pytest.mark.parametrize("fixture", ["tiny_dir", "sharded_dir"])
def test_written_checkpoint_roundtrips_bitwise(fixture, request):
    path: Path = request.getfixturevalue(fixture)
    ckpt = open_checkpoint(path)
    src = SyntheticSource(TINY, 7)
    assert ckpt.config() == TINY
    assert sorted(ckpt.names()) == sorted(src.names())
    for name in src.names():
        assert ckpt.meta(name) == src.meta(name)
        got, want = ckpt.load(name, check_finite=True), src.load(name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    if fixture == "sharded_dir":
        index = json.loads((path / INDEX_NAME).read_text())
        assert len(ckpt.files) == len(set(index["weight_map"].values())) > 1
        assert index["metadata"]["total_size"] == sum(e.nbytes for e in map(ckpt.entry, ckpt.names()))
        assert all(s["bytes"] <= 1_000_000 + 4096 for s in ckpt.shards())
    else:
        # Our own writer and the safetensors library agree on the file format.
        theirs = load_file(str(path / WEIGHTS_NAME))
        assert all(torch.equal(theirs[n], ckpt.load(n)) for n in src.names())


def test_raw_bytes_and_hash_come_from_header_offsets(tiny_dir):
    ckpt = open_checkpoint(tiny_dir)
    name = "transformer_blocks.1.attn.to_v.weight"
    raw = b"".join(ckpt.iter_raw(name, chunk=1000))
    assert raw == ckpt.load(name).contiguous().view(torch.uint8).numpy().tobytes()
    import hashlib

    assert ckpt.tensor_sha256(name) == hashlib.sha256(raw).hexdigest()


def test_shard_plan_is_greedy_and_bounded():
    src = SyntheticSource(TINY, 0)
    shards = plan_shards(src, 300_000)
    assert [n for s in shards for n in s] == src.names()
    for shard in shards:
        sizes = [src.load(n).numel() * src.load(n).element_size() for n in shard]
        assert len(shard) == 1 or sum(sizes) <= 300_000
    assert plan_shards(src, None) == [src.names()]
    with pytest.raises(InputError, match=r"^--shard-size 0: must be a positive number of bytes$"):
        plan_shards(src, 0)


def test_writer_refuses_non_empty_folder_and_leaves_nothing_on_error(tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(InputError, match=r"busy: already exists and is not an empty folder$"):
        write_checkpoint(TINY, 0, busy)

    class Broken(SyntheticSource):
        def load(self, name, device="cpu", check_finite=False):
            if name == "norm_out.linear.weight":
                raise InputError(f"{name}: boom")
            return super().load(name, device, check_finite)

    with pytest.raises(InputError, match="boom"):
        write_checkpoint(Broken(TINY, 0), None, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]  # no partial folder, no temp folder
    empty = tmp_path / "empty"
    empty.mkdir()
    write_checkpoint(TINY, 0, empty)  # an existing empty folder is fine
    assert (empty / "config.json").is_file() and (empty / WEIGHTS_NAME).is_file()


def test_rewriting_a_checkpoint_source_preserves_bytes(tiny_dir, tmp_path):
    write_checkpoint(open_checkpoint(tiny_dir), None, tmp_path / "resharded", shard_size=500_000)
    a, b = open_checkpoint(tiny_dir), open_checkpoint(tmp_path / "resharded")
    assert len(b.files) > 1
    assert all(a.tensor_sha256(n) == b.tensor_sha256(n) for n in a.names())


def test_variant_subfolder_and_open_weights(tiny_dir, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(tiny_dir, repo / "transformer_ref")
    assert open_checkpoint(repo, "transformer_ref/").config() == TINY
    with pytest.raises(InputError, match=r"repo/config\.json: missing \(pass .*repo/transformer_ref\)$"):
        open_checkpoint(repo)
    with pytest.raises(InputError, match=r"^subfolder 'vae': must be one of transformer, transformer_ref$"):
        open_checkpoint(repo, "vae")
    assert isinstance(open_weights(tiny_dir), CheckpointDir)
    assert isinstance(open_weights(None, TINY, 3), SyntheticSource)


def test_load_check_finite_rejects_nan(tmp_path):
    class WithNaN(SyntheticSource):
        def load(self, name, device="cpu", check_finite=False):
            t = super().load(name, device, False)
            if name == "transformer_blocks.0.attn.to_k.weight":
                t[0, 3] = float("nan")
            return t

    write_checkpoint(WithNaN(TINY, 0), None, tmp_path / "nan")
    ckpt = open_checkpoint(tmp_path / "nan")
    assert torch.isnan(ckpt.load("transformer_blocks.0.attn.to_k.weight")).any()  # read fine without the check
    with pytest.raises(InputError, match=r"^transformer_blocks\.0\.attn\.to_k\.weight: non-finite values$"):
        ckpt.load("transformer_blocks.0.attn.to_k.weight", check_finite=True)
    ckpt.load("transformer_blocks.0.attn.to_q.weight", check_finite=True)
    with pytest.raises(InputError, match=r"^missing\.weight: no such tensor in .*nan$"):
        ckpt.load("missing.weight")


def _raw_file(path: Path, header: dict, data: bytes) -> Path:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, r"tensor a: data ends at byte"),
        ({"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, r"tensor a: unknown dtype 'Q9'$"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, r"tensor a: data_offsets \[0, 8\]"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}, b"\0" * 8, r"tensor a: shape must be"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, r"tensor a: data_offsets must"),
        ({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, r"tensor a: header entry must be an object"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, r"tensor a: data starts at byte"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, r"4 bytes after the last tensor"),
        ({"__metadata__": {"k": 1}}, b"", r"__metadata__ must map strings to strings$"),
        ([1, 2], b"", r"header must be a JSON object$"),
    ],
)
def test_header_validation(tmp_path, header, data, message):
    f = _raw_file(tmp_path / "w.safetensors", header, data)
    with pytest.raises(InputError, match=message) as exc:
        read_safetensors_header(f)
    assert "\n" not in str(exc.value) and "w.safetensors" in str(exc.value)


def test_header_validation_of_broken_files(tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"\x01\x02")
    with pytest.raises(InputError, match=r"w\.safetensors: not a safetensors file \(2 bytes"):
        read_safetensors_header(f)
    f.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(InputError, match=r"header length 1000 exceeds the file size 10"):
        read_safetensors_header(f)
    f.write_bytes(struct.pack("<Q", 4) + b"\xff{}x")
    with pytest.raises(InputError, match=r"header is not valid UTF-8 JSON"):
        read_safetensors_header(f)
    save_file({"b": torch.ones(3), "a": torch.zeros(2, dtype=torch.bfloat16)}, str(f), metadata={"format": "pt"})
    entries, meta = read_safetensors_header(f)
    assert meta == {"format": "pt"}
    assert {n: (e.shape, e.dtype) for n, e in entries.items()} == {"a": ((2,), "bfloat16"), "b": ((3,), "float32")}


def test_index_errors(sharded_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(sharded_dir, bad)
    index = json.loads((bad / INDEX_NAME).read_text())
    name, shard = next(iter(index["weight_map"].items()))
    other = sorted(set(index["weight_map"].values()) - {shard})[0]
    index["weight_map"][name] = other
    (bad / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(InputError, match=rf"index\.json: tensor {name}: not in its shard {other}$"):
        open_checkpoint(bad)
    index["weight_map"][name] = "../escape.safetensors"
    (bad / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(InputError, match=r"is not a file name in the folder$"):
        open_checkpoint(bad)
    (bad / INDEX_NAME).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(InputError, match=r"index\.json: weight_map: required mapping missing$"):
        open_checkpoint(bad)
