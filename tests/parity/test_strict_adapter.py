"""``h3gate.strict(model)``: h3gate's kernels inside the user's own diffusers MiniMaxH3Transformer3DModel.

Off mode is diffusers' forward bitwise; strict mode is h3gate's candidate graph bitwise, batch-row invariant, with
gradients on the module's own parameters that repeat bitwise; on exit the module is plain diffusers again; modules
the binding does not cover are refused, naming what.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel

import h3gate.strict
from h3gate.errors import InputError
from h3gate.graph.execute import run_chained, without_grouped
from h3gate.graph.executions import bind_graph, candidate_table
from h3gate.graph.model import OUTPUTS, build_model_graph
from h3gate.kernels import attention
from h3gate.layout import build_layout
from h3gate.manifests.layouts import load_layout
from h3gate.manifests.model_config import load_config
from h3gate.runs.model_stages import model_inputs
from h3gate.synth import SyntheticSource

pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_thread")]
CFG = load_config("tiny").config


def _model(cfg=CFG) -> MiniMaxH3Transformer3DModel:
    source = SyntheticSource(cfg, 0)
    kwargs = {k: v for k, v in cfg.diffusers_config().items() if not k.startswith("_")}
    model = MiniMaxH3Transformer3DModel(**kwargs)
    model.load_state_dict({n: source.load(n) for n in source.names()}, strict=True, assign=True)
    return model.eval()


def _args(item: int = 0, cfg=CFG) -> tuple[dict, dict]:
    layout = build_layout(load_layout("micro"), "micro")
    x, extra = model_inputs(layout, cfg, 0, "cpu", item)
    raw = extra["raw"]
    args = {
        "hidden_states": x["video_rows"], "audio_hidden_states": x["audio_rows"], "encoder_hidden_states": x["text"],
        "timestep": raw.timestep, "timestep_indices": raw.timestep_indices, "token_tags": raw.token_tags,
        "position_ids": raw.position_ids, "video_indices": raw.video_indices, "audio_indices": raw.audio_indices,
        "text_indices": raw.text_indices, "return_dict": False,
    }  # fmt: skip
    return args, x


@pytest.fixture(scope="module")
def model():
    return _model()


def _same(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_off_mode_is_diffusers_bitwise_and_exit_restores_it(model) -> None:
    args, _ = _args()
    with torch.no_grad():
        plain = model(**args)
        with h3gate.strict(model, mode="off") as session:
            bound = model(**args)
            out = model(**{**args, "return_dict": True})
        after = model(**args)
    assert _same(plain, bound) and _same(plain, after)
    assert torch.equal(out.sample, plain[0]) and torch.equal(out.audio_sample, plain[1])
    assert "forward" not in vars(model) and session.calls == 2
    assert {r["actual"] for r in session.trace} == {"provider"}


def test_strict_mode_runs_the_strict_kernels_bitwise_as_the_gates_do(model) -> None:
    args, x = _args()
    graph = build_model_graph(CFG)
    with torch.no_grad():
        plain = model(**args)
        with h3gate.strict(model) as session:
            bound = model(**args)
        ours = run_chained(
            graph, x, dict(model.named_parameters()), candidate_table(bind_graph(graph, "strict", "cpu"))
        )
        after = model(**args)
    assert _same(bound, (ours[OUTPUTS[0]], ours[OUTPUTS[1]]))
    assert not _same(bound, plain) and _same(after, plain)  # strict differs from the provider; exit restores it
    assert {r["node"] for r in session.trace} == {n.name for n in graph.nodes}
    assert all(r["actual"] == "triton" for r in session.trace if r["op"] in ("h3_qkv_gemm", "h3_full_attention"))
    assert session.record()["bindings"]["block.0.attention"]["actual"] == "triton"
    # the session names the schedule each kernel launched, node by node (interpreted pointer walks on the CPU)
    (att,) = session.record()["launches"]["block.0.attention"]["h3_full_attention"]
    assert att["forward"] == att["backward"] == "triton_pointer" and att["interpreted"] == attention.INTERPRET
    # the default merge order (seg8) binds O's twin: its launches are noted under the twin's name
    assert session.record()["merge_order"] == "seg8"
    assert set(session.record()["launches"]["block.0.o_proj"]) == {"h3_attention_o_gemm_seg8"}


def test_strict_mode_groups_each_blocks_q_k_v_into_one_call_traced_per_node(model, monkeypatch) -> None:
    """As the graph executor, the adapter hands a block's q, k and v to the strict GEMM's grouped call (one Gluon
    launch on an H200 at 1024-8191 rows; here it runs them one by one, the same bytes): one call a block, one trace
    record a node, the outputs those of the ungrouped graph."""
    from h3gate.kernels import gemm, tp_layers

    calls: list[int] = []
    real = gemm.linear_grouped

    def counted(x, weights, *, op="linear"):
        calls.append(len(weights))
        return real(x, weights, op=op)

    monkeypatch.setattr(gemm, "linear_grouped", counted)
    monkeypatch.setattr(tp_layers, "linear_grouped", counted)  # the Q/K/V twin's (the default merge order)
    args, x = _args()
    graph = build_model_graph(CFG)
    with torch.no_grad():
        with h3gate.strict(model) as session:
            bound = model(**args)
        table = candidate_table(bind_graph(graph, "strict", "cpu"))
        ours = run_chained(graph, x, dict(model.named_parameters()), without_grouped(table, ["h3_qkv_gemm"]))
    assert _same(bound, (ours[OUTPUTS[0]], ours[OUTPUTS[1]]))
    assert calls == [3] * CFG.num_layers + [3] * CFG.num_refiner_layers  # every transformer and refiner block
    qkv = [r["node"] for r in session.trace if r["op"] == "h3_qkv_gemm"]
    assert sorted(qkv) == sorted(n.name for n in graph.nodes if n.ops == ("h3_qkv_gemm",))
    assert len(qkv) == len(set(qkv))


def test_the_session_writes_its_trace_as_evidence(model, tmp_path) -> None:
    import json

    args, _ = _args()
    with torch.no_grad(), h3gate.strict(model, mode="off") as session:
        model(**args)
    doc = json.loads(session.write(tmp_path).read_text(encoding="utf-8"))
    assert doc["kind"] == "strict-session" and doc["calls"] == 1 and len(doc["trace"]) == len(session.trace) > 60
    assert "launches" not in doc  # mode "off": diffusers' own arithmetic, no strict kernel launched
    with torch.no_grad(), h3gate.strict(model) as strict_session:
        model(**args)
    doc = json.loads(strict_session.write(tmp_path / "strict").read_text(encoding="utf-8"))  # schema-validated
    assert doc["launches"]["block.0.attention"]["h3_full_attention"][0]["forward"] == "triton_pointer"


def test_strict_rows_do_not_depend_on_the_rest_of_the_batch(model) -> None:
    args, _ = _args(0)
    other, _ = _args(1)
    batched = dict(args)
    for key in ("hidden_states", "audio_hidden_states", "encoder_hidden_states"):
        batched[key] = torch.cat([other[key], args[key]])
    with torch.no_grad(), h3gate.strict(model):
        alone = model(**args)
        both = model(**batched)
    assert _same(alone, (both[0][1:], both[1][1:]))


@pytest.mark.slow  # ~15 s on two cores: make test-slow (.ci/run runs both)
def test_training_gradients_reach_the_modules_own_parameters_and_repeat_bitwise() -> None:
    """The second pass runs with the module's gradient checkpointing on: every block under torch.utils.checkpoint,
    recomputed in the backward (traced as such); the gradients are bitwise those of the first pass."""
    model = _model()
    args, _ = _args()
    grads, sessions = [], []
    for checkpointing in (False, True):
        model.gradient_checkpointing = False
        if checkpointing:
            model.enable_gradient_checkpointing()
        model.zero_grad(set_to_none=True)
        with h3gate.strict(model) as session:
            video, audio = model(**args)
            (video.float().square().mean() + audio.float().square().mean()).backward()
        sessions.append(session)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert len(grads[0]) == len(list(model.parameters()))
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    blocks = CFG.num_layers + CFG.num_refiner_layers
    assert sessions[0].checkpointed == 0 and sessions[1].checkpointed == blocks
    phases = {(r["node"].split(".")[0], r.get("phase")) for r in sessions[1].trace}
    assert ("block", "recompute") in phases and ("embed", "recompute") not in phases
    assert all(r.get("phase") == "forward" for r in sessions[0].trace)


def _lora_model(**config):
    """The tiny module with a diffusers/PEFT LoRA adapter on the block projections, lora_B drawn non-zero."""
    from peft import LoraConfig

    from h3gate.strict_lora import LORA_TARGETS

    model = _model()
    model.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=config.pop("targets", list(LORA_TARGETS)), **config))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_lora_off_mode_is_peft_bitwise_and_strict_runs_the_lora_operator() -> None:
    model = _lora_model()
    args, _ = _args()
    with torch.no_grad():
        plain = model(**args)
        with h3gate.strict(model, mode="off") as off:
            replay = model(**args)
        with h3gate.strict(model) as session:
            model(**args)
        model.disable_adapters()
        without = model(**args)
    assert _same(plain, replay) and not _same(plain, without)  # the adapter changes the output; off replays PEFT
    updates = [r for r in session.trace if r["op"] == "h3_lora_update"]
    blocks = CFG.num_layers + CFG.num_refiner_layers
    assert len(updates) == 6 * blocks and {r["actual"] for r in updates} == {"triton"}
    assert {r["actual"] for r in off.trace if r["op"] == "h3_lora_update"} == {"provider"}
    lora = session.record()["lora"]
    assert len(lora) == 6 * blocks and lora["transformer_blocks.0.attn.to_q"][0]["rank"] == 2


def test_lora_layers_the_binding_cannot_replay_are_refused() -> None:
    _refused(_lora_model(targets=["proj_out"]), "LoRA layer proj_out: not covered")
    model = _lora_model(lora_dropout=0.1).train()
    _refused(model, r"adapter 'default' has dropout p=0.1 in training mode")
    _refused(_lora_model(use_dora=True), "is a variant")


def test_any_size_of_the_architecture_is_accepted() -> None:
    cfg = CFG.model_copy(update={"num_layers": 1, "num_refiner_layers": 2})
    model = _model(cfg)
    args, _ = _args(0, cfg)
    with torch.no_grad(), h3gate.strict(model, mode="off"):
        assert model(**args)[0].shape == args["hidden_states"].shape


def _refused(model, match: str) -> None:
    with pytest.raises(InputError, match=match), h3gate.strict(model):
        pass
    assert "forward" not in vars(model)


def test_what_the_binding_does_not_cover_is_refused_naming_it() -> None:
    _refused(torch.nn.Linear(2, 2), "h3gate.strict: Linear: not a MiniMaxH3Transformer3DModel")
    model = _model()
    model.proj_out.weight.data = model.proj_out.weight.data.to(torch.bfloat16)
    _refused(model, r"parameter proj_out.weight: \(96, 192\) bfloat16, expected \(96, 192\) float32")
    model = _model()
    model.extra = torch.nn.Identity()
    _refused(model, r"submodule extra \(Identity\): not in the architecture")
    model = _model()
    handle = model.transformer_blocks[1].register_forward_pre_hook(lambda *a: None)
    _refused(model, "submodule transformer_blocks.1: has forward_pre_hooks")
    handle.remove()
    model.transformer_blocks[0].attn.processor = object()
    _refused(model, r"transformer_blocks.0.attn.processor: object \(only MiniMaxH3AttnProcessor\)")


def test_attention_kwargs_are_refused_at_call_time(model) -> None:
    args, _ = _args()
    with h3gate.strict(model), pytest.raises(InputError, match="attention_kwargs"):
        model(**args, attention_kwargs={"scale": 0.5})


def test_a_bound_scheduler_steps_bitwise_as_diffusers_and_is_traced(model) -> None:
    from diffusers import MiniMaxH3Scheduler

    def loop(scheduler) -> torch.Tensor:
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(2, 5, 7, generator=gen)
        for t in scheduler.timesteps:
            x = scheduler.step(torch.randn(2, 5, 7, generator=gen), t, x).prev_sample
        return x

    plain, bound = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=12.0)
    plain.set_timesteps(9)
    bound.set_timesteps(9)
    with h3gate.strict(model, mode="off", scheduler=bound) as session:
        got = loop(bound)
    assert torch.equal(got, loop(plain)) and "step" not in vars(bound)
    assert [r["node"] for r in session.trace] == [f"scheduler.step[{i}]" for i in range(8)]
    with pytest.raises(InputError, match="no MiniMaxH3Scheduler"), h3gate.strict(model, scheduler=object()):
        pass
