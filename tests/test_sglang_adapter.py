"""The SGLang adapter's parts that need no sglang: the pinned install list, the one-line refusals without sglang,
the torchvision shim, the packing arithmetic, the node map's coverage of the graph and its written table, and the
wheelhouse's sglang pins. (The adapter against SGLang itself: tests/sglang, ``make test-sglang``.)"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from h3gate.adapters.sglang import capture, runtime
from h3gate.adapters.sglang.inputs import packing
from h3gate.errors import InputError
from h3gate.graph.model import build_model_graph
from h3gate.manifests.model_config import load_config

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "tools" / "sglang-requirements.txt"


def _pins() -> dict[str, str]:
    lines = [line.split("#", 1)[0].strip() for line in REQUIREMENTS.read_text(encoding="utf-8").splitlines()]
    pins = [line.split("==") for line in lines if line]
    assert all(len(p) == 2 and re.fullmatch(r"[A-Za-z0-9._-]+", p[0]) and p[1] for p in pins), pins
    names = [re.sub(r"[-_.]+", "-", n).lower() for n, _ in pins]
    assert len(set(names)) == len(names), "a distribution pinned twice"
    return dict(zip(names, (v for _, v in pins), strict=True))


def test_the_sglang_requirements_are_exact_pins_beside_h3gates_own():
    pins = _pins()
    assert pins["sglang"] == runtime.SGLANG_VERSION
    own = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    own = {re.split(r"[<>=!~;\[\s]", d, maxsplit=1)[0].lower() for d in own}
    assert not own & set(pins), f"h3gate's own dependencies are not the sglang list's business: {own & set(pins)}"
    assert not {"torch", "triton", "torchvision"} & set(pins)  # the installed torch's, never sglang's pins


def test_without_sglang_every_entry_point_says_how_to_get_it(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(runtime.importlib.metadata, "version", missing)
    with pytest.raises(InputError, match=r"^--candidate sglang: needs sglang 0\.5\.23: make install-sglang$"):
        runtime.require_sglang()
    monkeypatch.setattr(runtime.importlib.metadata, "version", lambda name: "0.5.22")
    with pytest.raises(InputError, match=r"sglang 0\.5\.22 is installed, h3gate is tested with 0\.5\.23"):
        runtime.init_runtime()

    # the DiT's import failing inside a CUDA extension's loader (no module name, a message opening with a newline):
    # the error names its first line, never an empty "needs )"
    monkeypatch.setattr(runtime.importlib.metadata, "version", lambda name: "0.5.23")
    monkeypatch.setattr(runtime, "ensure_torchvision", lambda: None)

    def broken(name):
        raise ImportError("\n[sgl_kernel] CRITICAL: Could not load any common_ops library!\n\nAttempted: ...")

    monkeypatch.setattr(runtime.importlib, "import_module", broken)
    with pytest.raises(
        InputError, match=r"does not import \(needs \[sgl_kernel\] CRITICAL: Could not load any common_"
    ):
        runtime.require_sglang()


SHIM_PROBE = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "torchvision":
            {fail}
sys.meta_path.insert(0, Block())
from h3gate.adapters.sglang.tvshim import SHIM_VERSION, ensure_torchvision
print(ensure_torchvision())
import torchvision
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as tvF
assert torchvision.__version__ == SHIM_VERSION and "shim" in repr(InterpolationMode.BICUBIC)
class Resize(tvF.Resize): pass
for call in (lambda: tvF.resize(None), lambda: Resize()):
    try:
        call()
    except RuntimeError as exc:
        print(exc)
"""


@pytest.mark.parametrize(
    ("fail", "record"),
    [
        ("raise ModuleNotFoundError(\"No module named 'torchvision'\", name='torchvision')", "shim: not installed"),
        ("raise RuntimeError('operator torchvision::nms does not exist')", "shim: installed build does not import "
         "(RuntimeError: operator torchvision::nms does not exist)"),
    ],
)  # fmt: skip
def test_the_torchvision_shim_imports_and_refuses_to_compute(fail, record):
    code = SHIM_PROBE.replace("{fail}", fail)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == record
    assert lines[1].startswith("torchvision.transforms.v2.functional.resize: torchvision is not installed here")
    assert lines[2] == "Resize: needs torchvision, which is not installed here (h3gate shim)"


def test_packing_pads_to_the_alignment_and_unpacks():
    pack = packing(3, 84, torch.arange(24), align=64)
    assert (pack.total, pack.cu_seqlens, pack.trusted_layout) == (256, (0, 84, 168, 252, 256), False)
    assert packing(1, 128, torch.arange(24)).cu_seqlens == (0, 128, 128)
    assert packing(1, 84, torch.arange(24)).trusted_layout and not packing(1, 84, torch.arange(1, 25)).trusted_layout
    rows = torch.arange(256.0)[:, None]
    assert torch.equal(pack.unpack(rows)[2, :, 0], torch.arange(168.0, 252.0))
    with pytest.raises(InputError, match="direct path refines one request's text per forward"):
        packing(2, 84, torch.arange(24), serving=False)


def test_the_node_map_covers_the_graph_and_is_written_down():
    cfg = load_config("tiny").config
    points = capture.node_map(cfg)
    assert [p.node for p in points] == [n.name for n in build_model_graph(cfg).nodes]  # one point a node, in order
    rows = {tuple(line.split()[:2]) for line in capture.__doc__.splitlines() if line.startswith("    ")}
    for p in points:
        node = re.sub(r"^block\.\d+\.", "block.i.", re.sub(r"^refiner\.\d+\.", "refiner.r.", p.node))
        module = re.sub(r"^token_refiner\.blocks\.\d+", "token_refiner.blocks.r", p.module)
        module = re.sub(r"^blocks\.\d+", "blocks.i", module) if p.node.startswith("block.") else module
        assert (node, module or "model") in rows, f"{p.node}: ({node}, {module}) is not a row of capture.py's table"


def _wheelhouse():
    spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "tools" / "wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wheelhouse_carries_the_sglang_pins_as_pinned():
    wheelhouse = _wheelhouse()
    pins = wheelhouse.sglang_pins()
    assert dict(pins) == _pins()
    merged = dict(wheelhouse.merge_pins([("packaging", "25.0"), ("rich", "15.0.0")], pins))
    assert merged["packaging"] == _pins()["packaging"] and merged["rich"] == "15.0.0"


def test_the_slim_sglang_wheel_drops_its_unimported_subtrees_and_their_record_lines(tmp_path):
    """``--slim-sglang``: members under SLIM_DROP leave the wheel and its RECORD; every other member keeps its bytes;
    a member whose name only begins like a dropped folder stays."""
    import zipfile

    wheelhouse = _wheelhouse()
    kept = {"sglang/__init__.py": b"x = 1\n", "sglang/multimodal_gen/runtime/a.py": b"y = 2\n",
            "sglang/testing.py": b"z = 3\n"}  # fmt: skip
    dropped = {"sglang/srt/rust_extensions/_server.so": b"\0" * 4096, "sglang/multimodal_gen/test/t.py": b"t\n"}
    members = {**kept, **dropped}
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in members.items())
    wheel = tmp_path / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr("sglang-0.5.23.dist-info/RECORD", record + "sglang-0.5.23.dist-info/RECORD,,\n")
    before, after = wheelhouse.slim_wheel(wheel)
    assert after < before
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert names == {*kept, "sglang-0.5.23.dist-info/RECORD"}
        assert all(z.read(name) == data for name, data in kept.items())
        lines = z.read("sglang-0.5.23.dist-info/RECORD").decode().splitlines()
    assert [line.split(",")[0] for line in lines] == [*kept, "sglang-0.5.23.dist-info/RECORD"]


def test_forcing_writes_back_exactly_what_the_capture_reads():
    """Teacher forcing inverts the capture's transforms: values recorded at points in SGLang's layout, assembled into
    h3gate's, then forced into blank tensors of SGLang's layout give back the request rows bit for bit (re-fused q/k/v
    columns, fc1 halves swapped back, the BF16 rows widened into the FP32 copy, packed rows, text rows call by call),
    padding rows untouched."""
    from h3gate.adapters.sglang.capture import Point, Recorder, collect, point_key
    from h3gate.adapters.sglang.forcing import Forcing

    cfg = load_config("tiny").config
    nd, f, h = cfg.num_attention_heads * cfg.attention_head_dim, cfg.ffn_dim, cfg.hidden_size
    pack = packing(2, 84, torch.arange(24))
    g = torch.Generator().manual_seed(0)
    bf16 = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    points = [
        *(Point(f"{w}_proj", "attn.qkv_proj", "out", w) for w in "qkv"),
        Point("ffn_gate_up", "mlp.fc1", "out", "swap"),
        Point("norm_out", "video_out", "in", "bf16"),
        Point("embed.text", "condition_proj", "out"),
        Point("adaln_projection", "adaln_proj.linear", "out"),
    ]
    rows = {"embed.text": "text", "adaln_projection": "timestep"}
    rows = {p.node: rows.get(p.node, "packed") for p in points}
    calls = {
        "attn.qkv_proj": [bf16(pack.total, 3 * nd)],
        "mlp.fc1": [bf16(pack.total, 2 * f)],
        "video_out": [bf16(pack.total, h).float()],
        "condition_proj": [bf16(24, h), bf16(24, h)],  # one refiner call per request
        "adaln_proj.linear": [bf16(3, 18 * h)],
    }
    rec = Recorder()
    for p in points:
        if point_key(p) not in rec.calls:
            for value in calls[p.module]:
                rec.put(point_key(p), value)
    values, uncovered = collect(points, rec, rows, pack, cfg)
    assert uncovered == {} and values["norm_out"].dtype == torch.bfloat16 and values["embed.text"].shape == (2, 24, h)
    forcing = Forcing(points, values, rows, cfg)
    for module, sources in calls.items():
        key = point_key(next(p for p in points if p.module == module))
        for source in sources:
            blank = torch.zeros_like(source)
            forcing(key, blank)
            used = source.shape[0] if module in ("condition_proj", "adaln_proj.linear") else 2 * 84
            assert torch.equal(blank[:used], source[:used]) and not blank[used:].any()
    assert all(forcing.complete(p.node) for p in points)
    wrong = {**values, "norm_out": values["norm_out"].float()}
    with pytest.raises(InputError, match=r"norm_out: the provider's value \(\(2, 84, 192\) torch.float32\) does not"):
        Forcing(points, wrong, rows, cfg)(point_key(points[4]), torch.zeros(pack.total, h))
