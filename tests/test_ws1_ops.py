"""``h3gate run ws1-ops`` and ``h3gate bench --op`` on CPU: evidence that validates, promises that can fail.

The gate is exercised both ways: the real kernels pass; a kernel perturbed by one ulp breaks its provider-bitwise
promise, and a kernel whose bytes depend on the batch size breaks batch-row invariance - each exits 1 with the
failure named in the evidence.
"""

from __future__ import annotations

import json

import pytest
import torch

from h3gate.evidence.schema import validate_document
from h3gate.kernels import elementwise
from h3gate.manifests.model_config import load_config
from h3gate.ops import registry

FAST_OPS = ("adaln_row_gather", "conditioning_noise_mix", "h3_rmsnorm")


def _evidence(folder) -> dict:
    doc = json.loads((folder / "ws1-ops.json").read_text())
    validate_document(doc, "ws1-ops")
    return doc


def test_ws1_ops_cli_tiny_cpu(run_cli, tmp_path):
    args = ["run", "ws1-ops", "--device", "cpu", "--out", tmp_path]
    for op in FAST_OPS:
        args += ["--op", op]
    code, out, err = run_cli(*args)
    assert code == 0, out + err
    doc = _evidence(tmp_path)
    assert doc["verdict"] == "pass" and doc["failures"] == []
    assert doc["layouts"] == [{"name": "tiny", "rows": 264}] and doc["config"] == "tiny"
    assert doc["device_rules"]["rms_norm_rounding"]
    by_op = {o["op"]: o for o in doc["operators"]}
    assert sorted(by_op) == sorted(FAST_OPS)
    for op, o in by_op.items():
        assert o["binding"]["actual"] == "triton" and o["binding"]["label"] == "row"
        assert o["binding"]["kernel_id"] == registry.spec(op).kernel_id and o["binding"]["kernel_id"].startswith(
            "triton."
        )
        (r,) = o["results"]
        inv = r["invariance"]
        assert inv["repeat"]["forward"] and inv["repeat"]["backward"]
        assert len(inv["batch"]) == (0 if op == "adaln_row_gather" else 5)  # the table gather has no batch axis
        assert all(p["forward"] and p["backward"] is not False for p in inv["batch"])
        assert inv["mutation"]["forward"]
        assert r["forward"]["accuracy_ok"] and r["tolerance_source"] == "contract"
    assert by_op["conditioning_noise_mix"]["results"][0]["forward"]["provider_bitwise"]
    assert by_op["adaln_row_gather"]["results"][0]["forward"]["kernel_vs_golden"]["rel_l2"] == 0.0


def _patch_kernel(monkeypatch, fn):
    monkeypatch.setattr(elementwise, "conditioning_noise_mix", fn)


def test_broken_bitwise_promise_fails(monkeypatch, run_cli, tmp_path):
    real = elementwise.conditioning_noise_mix

    def one_ulp_off(sample, t, noise):
        out = real(sample, t, noise)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    _patch_kernel(monkeypatch, one_ulp_off)
    code, out, err = run_cli("run", "ws1-ops", "--device", "cpu", "--op", "conditioning_noise_mix", "--out", tmp_path)
    assert code == 1
    doc = _evidence(tmp_path)
    assert doc["verdict"] == "fail"
    assert any("promised provider-bitwise forward" in f for f in doc["failures"])
    assert doc["operators"][0]["results"][0]["forward"]["accuracy_ok"]  # accurate, yet not the provider's bytes


def test_batch_dependent_kernel_fails_invariance(monkeypatch, run_cli, tmp_path):
    real = elementwise.conditioning_noise_mix

    def batch_aware(sample, t, noise):
        out = real(sample, t, noise)
        return out if sample.shape[0] == 1 else out * (1 + 2**-20)

    _patch_kernel(monkeypatch, batch_aware)
    code, out, err = run_cli(
        "run", "ws1-ops", "--device", "cpu", "--op", "conditioning_noise_mix", "--out", tmp_path, "--json"
    )
    assert code == 1
    summary = json.loads(out)
    assert summary["verdict"] == "fail"
    assert any("invariance batch2@0.forward not bitwise" in f for f in summary["failures"])
    assert not any("provider-bitwise" in f for f in summary["failures"])  # batch of 1 is still the provider's bytes


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--op", "nope"], "h3gate: error: operator 'nope': not declared in manifests/operators/"),
        (["--layouts", "huge"], "h3gate: error: layout 'huge': unknown"),
        (["--config", "giant"], "h3gate: error: config 'giant': unknown"),
    ],
)
def test_bad_input_exits_2(run_cli, tmp_path, args, message):
    code, out, err = run_cli("run", "ws1-ops", "--device", "cpu", "--out", tmp_path, *args)
    assert code == 2 and err.startswith(message), err
    assert not (tmp_path / "ws1-ops.json").exists()


def test_bench_needs_cuda(run_cli):
    code, out, err = run_cli("bench", "--op", "h3_swiglu", "--device", "cpu")
    assert code == 2 and err.strip() == "h3gate: error: bench needs --device cuda"


def test_bench_record_shape_and_criteria(monkeypatch, tmp_path):
    """bench_op's record and the bench body validate against the schema (timings faked: no GPU here); the
    declared criteria decide the verdict."""
    from h3gate.bench import ops as bench_ops
    from h3gate.commands.bench_cmd import bench_body
    from h3gate.evidence.writer import write_evidence

    def fake(fns, iters=50, warmup=5, head_start_us=0.0):
        assert head_start_us == bench_ops.HEAD_START_US > 0  # the host's launch cost is never timed
        for fn in fns.values():
            fn()  # both executions really run (forward, or forward + backward)
        ms = {"kernel": 1.0, "provider": 2.0}
        return {k: {"median_ms": ms[k], "min_ms": ms[k], "max_ms": ms[k], "iters": iters} for k in fns}

    monkeypatch.setattr(bench_ops, "side_by_side", fake)
    cfg = load_config("tiny").config
    rec = bench_ops.bench_op("h3_swiglu", 33, cfg, "cpu", copy_gbs=1.0)
    assert rec["forward"]["speedup"] == 2.0 and rec["checks"] == {"not_slower": True, "bandwidth": None}
    assert rec["verdict"] == "pass" and rec["forward_backward"] is not None
    assert rec["backward"]["speedup"] == 2.0 and "baseline" not in rec["backward"]  # no declared baseline
    body = bench_body("tiny", "tiny", 33, "cuda", 1.0, [rec])
    assert body["timing"]["head_start_us"] == bench_ops.HEAD_START_US
    write_evidence(tmp_path, "bench-ops.json", "bench", body, command=["test"], device="cpu")
    slow = dict(rec, checks={"not_slower": False, "bandwidth": None}, verdict="fail")
    assert bench_body("tiny", "tiny", 33, "cuda", 1.0, [rec, slow])["verdict"] == "fail"


def _fake_timer(ms: dict[str, float]):
    def fake(fns, iters=50, warmup=5, head_start_us=0.0):
        for fn in fns.values():
            fn()  # every execution (kernel, provider, baseline) really runs
        got = {k: ms.get(k, ms["kernel"]) for k in fns}  # bench variants (kernel.<label>) time as the kernel
        return {k: {"median_ms": t, "min_ms": t, "max_ms": t, "iters": iters} for k, t in got.items()}

    return fake


@pytest.mark.parametrize(
    ("rows", "kernel_ms", "bucket", "min_ratio", "verdict"),
    [
        (264, 1.2, "rows < 1024", 0.8, "pass"),  # 0.83x cuBLAS: meets the small-M bound
        (264, 1.3, "rows < 1024", 0.8, "fail"),  # 0.77x
        (1023, 1.2, "rows < 1024", 0.8, "pass"),  # the last row count of the small-M bucket
        (1024, 1.04, "rows >= 1024", 0.95, "pass"),  # 0.96x: slower than cuBLAS yet meets the declared target
        (3160, 1.06, "rows >= 1024", 0.95, "fail"),  # 0.94x
    ],
)
def test_bench_declared_gemm_target(monkeypatch, tmp_path, rows, kernel_ms, bucket, min_ratio, verdict):
    """A block GEMM is gated by its manifest target (issue #5's ratios to cuBLAS by row bucket), not by the default
    not-slower/bandwidth criteria; the record carries the target, its source and the measured ratio."""
    from h3gate.bench import ops as bench_ops
    from h3gate.commands.bench_cmd import bench_body
    from h3gate.evidence.writer import write_evidence

    real_case = bench_ops.build_case
    small_case = lambda op, rows, cfg, device, seed: real_case(op, 9, cfg, device, seed)  # noqa: E731
    monkeypatch.setattr(bench_ops, "build_case", small_case)
    monkeypatch.setattr(bench_ops, "side_by_side", _fake_timer({"kernel": kernel_ms, "provider": 1.0}))
    rec = bench_ops.bench_op("h3_qkv_gemm", rows, load_config("tiny").config, "cpu", copy_gbs=1.0)
    target = rec["target"]
    assert (target["baseline"], target["rows_bucket"], target["min_ratio"]) == ("provider", bucket, min_ratio)
    assert target["ratio"] == pytest.approx(1.0 / kernel_ms) and "issue #5" in target["source"]
    assert rec["checks"] == {"not_slower": None, "bandwidth": None, "target": verdict == "pass"}
    assert rec["verdict"] == verdict and rec["memory_bound"] is False
    write_evidence(tmp_path, "bench-ops.json", "bench", bench_body("tiny", "t", rows, "cuda", 1.0, [rec]),
                   command=["test"], device="cpu")  # fmt: skip
    # The schema ties the gate to the record: a target without its check, or no target and no not_slower, is invalid.
    for bad in (dict(rec, checks={"not_slower": None, "bandwidth": None}), dict(rec, target=None)):
        body = bench_body("tiny", "t", rows, "cuda", 1.0, [bad])
        with pytest.raises(RuntimeError, match="fails its own schema"):
            write_evidence(tmp_path / "bad", "bench-ops.json", "bench", body, command=["test"], device="cpu")
    assert not (tmp_path / "bad" / "bench-ops.json").exists()


def test_bench_times_the_grouped_qkv_call_beside_one_by_one_and_concatenated(monkeypatch, tmp_path):
    """The qkv GEMM's strict entry groups sibling calls: the bench times the grouped call on three weights next to
    the kernel and the provider once a weight and the provider on the concatenated weights, records the ratios and
    whether the outputs equal the one-by-one kernel's, and gates nothing with it. Other GEMMs record no group."""
    from h3gate.bench import ops as bench_ops
    from h3gate.commands.bench_cmd import bench_body
    from h3gate.evidence.writer import write_evidence

    real_case = bench_ops.build_case
    monkeypatch.setattr(bench_ops, "build_case", lambda op, rows, cfg, dev, seed: real_case(op, 9, cfg, dev, seed))
    ms = {"kernel": 1.0, "provider": 1.0, "kernel.grouped": 2.5, "kernel.one_by_one": 3.0,
          "provider.one_by_one": 2.75, "provider.concatenated": 2.5}  # fmt: skip
    monkeypatch.setattr(bench_ops, "side_by_side", _fake_timer(ms))
    cfg = load_config("tiny").config
    rec = bench_ops.bench_op("h3_qkv_gemm", 3160, cfg, "cpu", copy_gbs=1.0)
    g = rec["grouped"]
    assert g["weights"] == 3 and g["bitwise_one_by_one"] is True
    assert (g["speedup"], g["vs_provider_concatenated"], g["vs_kernel_one_by_one"]) == (1.1, 1.0, 1.2)
    assert rec["checks"]["target"] is True  # the single product's target, as before
    write_evidence(tmp_path, "bench-ops.json", "bench", bench_body("tiny", "t", 3160, "cuda", 1.0, [rec]),
                   command=["test"], device="cpu")  # fmt: skip
    assert "grouped" not in bench_ops.bench_op("h3_attention_o_gemm", 3160, cfg, "cpu", copy_gbs=1.0)


def test_side_by_side_spins_the_device_before_each_timed_call(monkeypatch):
    """With a head start, each timed call is flush -> calibrated device spin -> start event -> call -> end event, so
    the device reaches the start event only after the host has enqueued the call (CUDA faked: the order is checked)."""
    from h3gate.bench import timing

    log: list = []

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            log.append("event")

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 2.0  # ms: the calibration's 1e6-cycle spin takes 2 ms -> 500 cycles per us

    class Flush:
        def zero_(self):
            log.append("flush")

    monkeypatch.setattr(timing.torch, "empty", lambda *a, **k: Flush())
    monkeypatch.setattr(timing.torch.cuda, "Event", Event)
    monkeypatch.setattr(timing.torch.cuda, "_sleep", lambda cycles: log.append(("spin", cycles)))
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    stats = timing.side_by_side({"a": lambda: log.append("a"), "b": lambda: log.append("b")}, iters=3, warmup=1,
                                warmup_s=0.0, head_start_us=300.0)  # fmt: skip
    timed = log[log.index(("spin", 150_000)) - 1 :]  # from the first timed call's flush on
    assert timed == ["flush", ("spin", 150_000), "event", "a", "event", "flush", ("spin", 150_000), "event", "b",
                     "event"] * 3  # fmt: skip
    assert stats["a"] == {"median_ms": 2.0, "min_ms": 2.0, "max_ms": 2.0, "iters": 3}
    log.clear()
    timing.side_by_side({"a": lambda: log.append("a")}, iters=1, warmup=1, warmup_s=0.0)  # no head start: no spin
    assert not any(isinstance(entry, tuple) for entry in log)


def test_gemm_bench_row_bucket_is_the_tilings_small_m():
    """The block GEMMs' bench bucket (0.8x below it) is the bound under which their tilings take the small-M buckets."""
    from h3gate.kernels.gemm_configs import SMALL_M

    for op in ("h3_qkv_gemm", "h3_attention_o_gemm", "h3_ffn_gate_up_gemm", "h3_ffn_down_gemm"):
        assert registry.spec(op).bench.small_rows.below == SMALL_M, op


def test_bench_attention_target_is_sdpa_flash(monkeypatch):
    """Attention's declared baseline is the provider with SDPA pinned to flash, timed in the same run; the
    provider (cuDNN on the H200) is recorded next to it and does not gate."""
    from h3gate.bench import ops as bench_ops

    monkeypatch.setattr(bench_ops, "side_by_side", _fake_timer({"kernel": 1.0, "provider": 0.7, "baseline": 1.25}))
    rec = bench_ops.bench_op("h3_full_attention", 12, load_config("tiny").config, "cpu", copy_gbs=1.0)
    assert rec["target"]["baseline"] == "sdpa_flash" and rec["target"]["baseline_timing"]["median_ms"] == 1.25
    assert rec["forward"]["speedup"] == pytest.approx(0.7) and rec["target"]["ratio"] == pytest.approx(1.25)
    assert rec["checks"]["target"] is True and rec["verdict"] == "pass"
    # the backward alone and forward + backward are timed next to flash's too (recorded, not gated)
    assert rec["forward_backward"]["baseline"]["median_ms"] == 1.25
    bwd = rec["backward"]
    assert bwd["speedup"] == pytest.approx(0.7) and bwd["baseline_speedup"] == pytest.approx(1.25)
    monkeypatch.setattr(bench_ops, "side_by_side", _fake_timer({"kernel": 1.0, "provider": 2.0, "baseline": 0.99}))
    rec = bench_ops.bench_op("h3_full_attention", 12, load_config("tiny").config, "cpu", copy_gbs=1.0)
    assert rec["checks"]["target"] is False and rec["verdict"] == "fail"  # faster than the provider, not than flash


def test_bench_attention_times_the_walk_order_next_to_the_kernel(monkeypatch, tmp_path):
    """The attention bench times the strict operator with an identity and a permuted walk order in the same run as
    the plain kernel (recorded with their ratio to it, never gated); the record is valid bench evidence."""
    from h3gate.bench import ops as bench_ops
    from h3gate.commands.bench_cmd import bench_body
    from h3gate.evidence.writer import write_evidence

    ms = {"kernel": 1.0, "provider": 2.0, "baseline": 1.5, "kernel.order_identity": 1.0, "kernel.order_permuted": 1.1}
    monkeypatch.setattr(bench_ops, "side_by_side", _fake_timer(ms))
    rec = bench_ops.bench_op("h3_full_attention", 12, load_config("tiny").config, "cpu", copy_gbs=1.0)
    assert set(rec["variants"]) == {"order_identity", "order_permuted"} and rec["verdict"] == "pass"
    assert rec["variants"]["order_permuted"]["forward_vs_kernel"] == pytest.approx(1.1)
    assert rec["variants"]["order_identity"]["forward_backward"]["median_ms"] == 1.0
    case = bench_ops.build_case("h3_full_attention", 12, load_config("tiny").config, "cpu", seed=0)
    order = case.bench_variants["order_permuted"]["order"]
    assert not torch.equal(order, torch.arange(12)) and torch.equal(order.sort().values, torch.arange(12))
    body = bench_body("tiny", "tiny", 12, "cuda", 1.0, [rec])
    write_evidence(tmp_path, "bench.json", "bench", body, command=["test"], device="cpu")  # validates the record
    qkv = bench_ops.bench_op("h3_qkv_gemm", 12, load_config("tiny").config, "cpu", copy_gbs=1.0)
    assert "variants" not in qkv
    # what ran is named: the attention's schedule and tiling, the GEMM's tiling per product (M = 12: the small bucket)
    from h3gate.kernels import attention, gemm_configs

    (att,) = rec["launch"]
    assert att["forward"] == att["backward"] == "triton_pointer"
    assert att["tiling"] == attention.attn_config(128, torch.bfloat16, 12).tag
    cfg = load_config("tiny").config
    fwd_tag = gemm_configs.gemm_config("fwd", cfg.inner_dim, cfg.hidden_size, torch.bfloat16, 12).tag
    (mm,) = qkv["launch"]
    assert mm["forward"] == {"tiling": fwd_tag, "tma": False, "kernel": "triton"}
    assert set(mm) == {"forward", "dx", "dw", "interpreted"}
    write_evidence(tmp_path / "gemm", "bench.json", "bench", bench_body("tiny", "tiny", 12, "cuda", 1.0, [qkv]),
                   command=["test"], device="cpu")  # fmt: skip


def test_baseline_names_declared_once_each_place_agrees():
    """The manifest's baseline names, the bench's implementations and the evidence schema's enum are one set."""
    import typing

    from h3gate.bench.baselines import BASELINES
    from h3gate.manifests.operators import BenchTarget
    from h3gate.paths import ROOT

    declared = set(typing.get_args(BenchTarget.model_fields["baseline"].annotation))
    schema = json.loads((ROOT / "schemas" / "bench.schema.json").read_text())
    enum = schema["$defs"]["operator"]["properties"]["target"]["oneOf"][1]["properties"]["baseline"]["enum"]
    assert declared == set(BASELINES) | {"provider"} == set(enum)


@pytest.mark.filterwarnings("ignore:.*(Flash attention kernel not used|do not support non-zero dropout).*:UserWarning")
def test_sdpa_flash_baseline_runs_flash_only():
    """The baseline wrapper pins SDPA to the flash backend: the math backend is disabled inside it, and a call flash
    cannot run raises instead of silently taking another backend."""
    import torch.nn.functional as F

    from h3gate.bench.baselines import sdpa_flash
    from h3gate.ops.reference import attention

    seen = []
    q = torch.randn(1, 5, 2, 128, dtype=torch.bfloat16)

    def probe(*args):
        seen.append(torch._C._get_flash_sdp_enabled() and not torch._C._get_math_sdp_enabled())
        return attention(*args)

    out = sdpa_flash(probe)(q, q, q)
    assert seen == [True] and torch.equal(out, attention(q, q, q))
    assert torch._C._get_math_sdp_enabled()  # restored on exit

    def with_dropout(q, k, v):  # flash has no dropout path: no kernel is left to run it
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)

    with pytest.raises(RuntimeError, match="No available kernel"):
        sdpa_flash(with_dropout)(q, q, q)


def test_bench_backward_alone_is_the_same_vjp_as_forward_backward():
    """The backward-only timing runs one forward outside the timing and the retained graph's VJP per call: the
    gradients equal those of a fresh forward + backward, call after call."""
    from h3gate.bench import ops as bench_ops

    case = bench_ops.build_case("h3_swiglu", 9, load_config("tiny").config, "cpu", seed=0)
    ref = registry.reference("h3_swiglu")
    gout = torch.randn(case.call(ref).shape, generator=torch.Generator().manual_seed(3))
    alone = bench_ops._backward(case, ref, gout)
    fresh = bench_ops._forward_backward(case, ref, gout)()
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(alone(), fresh, strict=True))
