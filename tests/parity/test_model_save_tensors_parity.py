"""``h3gate run ws1-model --save-tensors``: the saved files are what they say they are (CPU, tiny config, micro).

One forward-only run writes ``inputs.safetensors`` (diffusers' forward arguments) and the provider / candidate /
golden node values. Fed those inputs, diffusers' MiniMaxH3Transformer3DModel (built from the tiny config, loaded
with the same seed-0 synthetic weights the run drew: ``tiny_params`` is ``SyntheticSource(cfg, 0)`` on the CPU,
as ``ws1-model --seed 0 --device cpu`` is) reproduces the provider's saved velocities bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from safetensors import safe_open
from safetensors.torch import load_file

from h3gate.gate.compare import tensor_sha256
from h3gate.graph.model import OUTPUTS, build_model_graph
from h3gate.manifests.model_config import load_config

pytestmark = [pytest.mark.parity, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
CFG = load_config("tiny").config
SAVED = ("output.video", "output.audio")
DIFFUSERS_ARGS = {
    "hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "timestep_indices", "token_tags",
    "position_ids", "video_indices", "audio_indices", "text_indices",
}  # fmt: skip
LANES = ("provider", "candidate", "golden")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One ``ws1-model --no-backward --save-tensors`` run (in process, as a user's ``h3gate`` would run it)."""
    from h3gate.cli import main

    tmp = tmp_path_factory.mktemp("save-tensors")
    args = ["--quiet", "run", "ws1-model", "--no-backward", "--device", "cpu", "--seed", "0"]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--save-tensors", str(tmp / "tensors"), "--out", str(tmp / "ev")])
    return exc.value.code, tmp / "tensors", tmp / "ev"


@pytest.fixture(scope="module")
def oracle(tiny_params):
    kwargs = {k: v for k, v in CFG.diffusers_config().items() if not k.startswith("_")}
    model = MiniMaxH3Transformer3DModel(**kwargs)
    model.load_state_dict(tiny_params, strict=True, assign=True)
    return model.eval()


def test_the_run_passes_and_its_evidence_names_the_saved_tensors(saved):
    code, tensors, ev = saved
    assert code == 0
    doc = json.loads((ev / "ws1-model.json").read_text(encoding="utf-8"))
    assert doc["verdict"] == "pass" and doc["failing_checks"] == []
    assert doc["saved_tensors"] and doc["saved_tensors"].endswith("tensors")
    assert doc["checkpoint"] == {"kind": "synthetic", "path": None, "seed": 0, "variant": "transformer"}
    assert (doc["config"]["name"], doc["layout"]["name"], doc["device"], doc["backward"]) == (
        "tiny", "micro", "cpu", None,
    )  # fmt: skip
    files = sorted(p.name for p in tensors.iterdir())
    assert files == [f"{n}.safetensors" for n in ("candidate", "golden", "inputs", "provider")]


def test_diffusers_on_the_saved_inputs_is_bitwise_the_saved_provider_output(saved, oracle):
    _, tensors, ev = saved
    inputs = load_file(tensors / "inputs.safetensors")
    assert set(inputs) == DIFFUSERS_ARGS
    # the saved request is the one the run judged (its evidence records the graph inputs' digests)
    recorded = json.loads((ev / "ws1-model.json").read_text(encoding="utf-8"))["inputs"]
    for arg, graph_input in (("hidden_states", "video_rows"), ("audio_hidden_states", "audio_rows"),
                             ("encoder_hidden_states", "text")):  # fmt: skip
        assert tensor_sha256(inputs[arg]) == recorded[graph_input]["sha256"], arg
    provider = load_file(tensors / "provider.safetensors")
    with torch.no_grad():
        video, audio = oracle(**inputs, return_dict=False)
    for key, ref in zip(SAVED, (video, audio), strict=True):
        mine = provider[key]
        assert mine.dtype == ref.dtype == torch.float32 and mine.shape == ref.shape, key
        assert torch.equal(mine, ref) and torch.equal(mine.view(torch.int32), ref.view(torch.int32)), key
    # the output keys are copies of the two velocity nodes, nothing else
    for key, node in zip(SAVED, OUTPUTS, strict=True):
        assert torch.equal(provider[key], provider[node])


def test_every_lane_file_holds_exactly_the_graph_nodes_plus_the_two_outputs(saved):
    _, tensors, _ = saved
    expected = {n.name for n in build_model_graph(CFG).nodes} | set(SAVED)
    keys = {}
    for lane in LANES:
        with safe_open(str(tensors / f"{lane}.safetensors"), "pt") as fh:
            keys[lane] = set(fh.keys())
            meta = fh.metadata()
        assert meta["config"] == "tiny" and meta["layout"] == "micro" and meta["seed"] == "0", lane
    assert keys["provider"] == expected
    assert keys["candidate"] == keys["golden"] == keys["provider"]
    provider, candidate = load_file(tensors / "provider.safetensors"), load_file(tensors / "candidate.safetensors")
    for k in expected:
        assert candidate[k].dtype == provider[k].dtype and candidate[k].shape == provider[k].shape, k


def test_golden_tensors_are_float64(saved):
    _, tensors, _ = saved
    golden = load_file(tensors / "golden.safetensors")
    provider = load_file(tensors / "provider.safetensors")
    not_fp64 = {k: v.dtype for k, v in golden.items() if v.dtype != torch.float64}
    assert not_fp64 == {}
    assert all(golden[k].shape == provider[k].shape for k in golden)


def test_golden_time_sinusoid_is_float64(saved):
    """The golden's sinusoid is computed at float64 (``ops.golden.sinusoid_fp64``), not the reference's FP32 cast."""
    _, tensors, _ = saved
    golden = load_file(tensors / "golden.safetensors")
    assert golden["time.sinusoid"].dtype == torch.float64
