"""``h3gate bench``: ``--op NAME`` times strict kernels next to their provider ops (:mod:`h3gate.bench.ops`);
``ws1-block`` times the strict block next to the provider block (:mod:`h3gate.bench.block`); ``ws1-model`` the whole
strict model next to its provider replay, forward and forward + backward (:mod:`h3gate.bench.model`). CUDA only: on
CPU the verb exits 2 ("bench needs --device cuda"). Exit 0 when every declared criterion held, 1 otherwise (evidence
written), 2 for bad input.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from h3gate.commands.console import print_verdict, progress, stdout_console
from h3gate.errors import EXIT_FAIL, EXIT_PASS, InputError
from h3gate.evidence.runfolder import check_out, enter_run, run_scope
from h3gate.merge_order import DEFAULT_MERGE_ORDER
from h3gate.paths import LOCAL_EVIDENCE, MANIFESTS, display

KIND = "bench"


def check_bench_merge(target: str | None, merge: str | None) -> str:
    """``--merge-order`` (None: the default order): single or seg8, given only for the block and the model (an
    operator is named itself). The order the block and the model time beside the single walk."""
    from h3gate.ops.registry import check_merge

    if merge is not None and target not in ("ws1-block", "ws1-model"):
        raise InputError("--merge-order: applies to bench ws1-block and ws1-model (operators: --op NAME_seg8)")
    return check_merge(DEFAULT_MERGE_ORDER if merge is None else merge)


@dataclass(frozen=True)
class BenchCommand:
    """``bench``'s settings: a ``target`` (ws1-block, ws1-model) or operators ``ops``, the layout giving the row
    count, the config giving widths and dtypes, and ``merge`` (None: the default order; seg8: a third arm for the block
    and the model, beside the single walk)."""

    target: str | None = None
    ops: tuple[str, ...] = ()
    layout: str = "medium"
    config: str = "real"
    merge: str | None = None
    device: str = "cuda"
    out: Path | None = None
    json: bool = False
    force: bool = False


@run_scope
def bench_command(settings: BenchCommand) -> int:
    """Time what ``settings`` names, write its evidence and print it; 0 every criterion held, 1 otherwise."""
    target, ops, layout, config = settings.target, list(settings.ops), settings.layout, settings.config
    device, out, json_, merge = settings.device, settings.out, settings.json, settings.merge
    merge = check_bench_merge(target, merge)
    if not device.startswith("cuda"):
        raise InputError("bench needs --device cuda")
    check_out(out, settings.force)
    if target == "ws1-block":
        if ops:
            raise InputError("bench ws1-block: --op does not apply (time one operator with `bench --op NAME`)")
        return _bench_block(
            layout, config, device, _folder(out, "ws1-block", config, layout, settings.force), json_, merge
        )
    if target == "ws1-model":
        if ops:
            raise InputError("bench ws1-model: --op does not apply (time one operator with `bench --op NAME`)")
        return _bench_model(
            layout, config, device, _folder(out, "ws1-model", config, layout, settings.force), json_, merge
        )
    if target is not None:
        raise InputError(f"bench {target!r}: unknown target (ws1-block, ws1-model, or none with --op NAME)")
    if not ops:
        raise InputError("bench: give a target (ws1-block, ws1-model) or at least one --op NAME")
    return _bench_ops(list(dict.fromkeys(ops)), layout, config, device, out, json_, settings.force)


def _folder(out: Path | None, what: str, config: str, layout: str, force: bool) -> Path:
    """The run folder: ``--out``, or a new one under ``bench/<what>-<config>-<layout>/``."""
    from h3gate.manifests.model_config import load_config

    name = load_config(config).name if out is None else ""
    return enter_run(out, LOCAL_EVIDENCE / KIND / f"{what}-{name}-{layout}", force)


def _bench_block(layout: str, config: str, device: str, folder: Path, json_: bool, merge: str) -> int:
    """Time the strict block next to the provider block; write ``bench-ws1-block.json`` and print it."""
    from h3gate.bench.block import KIND as BLOCK_KIND
    from h3gate.bench.block import bench_block
    from h3gate.evidence.writer import write_evidence

    with progress("bench ws1-block", 4) as step:
        body, manifests = bench_block(layout, config, device, progress=step, merge=merge)
    path = write_evidence(folder, f"{BLOCK_KIND}.json", BLOCK_KIND, body, manifests=manifests, device=device)
    return _print_phases("ws1-block", body, path, json_)


def _bench_model(layout: str, config: str, device: str, folder: Path, json_: bool, merge: str) -> int:
    """Time the strict model next to the provider model; write ``bench-ws1-model.json`` and print it."""
    from h3gate.bench.model import KIND as MODEL_KIND
    from h3gate.bench.model import bench_model
    from h3gate.evidence.writer import write_evidence

    with progress("bench ws1-model", 5) as step:
        body, manifests = bench_model(layout, config, device, progress=step, merge=merge)
    path = write_evidence(
        folder, f"{MODEL_KIND}.json", MODEL_KIND, body, command=["h3gate", *sys.argv[1:]], manifests=manifests,
        device=device,
    )  # fmt: skip
    return _print_phases("ws1-model", body, path, json_)


def _print_phases(target: str, body: dict, path: Path, json_: bool) -> int:
    """The evidence document (``--json``) or a table of the phases' medians (and peak memory when recorded)."""
    if json_:
        print(path.read_text(encoding="utf-8"), end="")
        return EXIT_PASS
    lay = body["layout"]
    title = f"bench {target} {body['config']} / {lay['name']} (S={lay['seq_len']}) on {body['device']}"
    table = Table(title=title)
    memory = all("max_memory_allocated_bytes" in r for r in body["results"].values())
    seg8 = all("strict_seg8" in r for r in body["results"].values())
    for col in ("phase", "provider ms", "strict ms", "strict / provider"):
        table.add_column(col)
    if seg8:
        table.add_column("strict seg8 ms (/ strict)")
    one = any("strict_one_by_one" in r for r in body["results"].values())
    if one:
        table.add_column("q/k/v one by one ms (/ strict)")
    if memory:
        table.add_column("peak GiB provider / strict")
    host = all("host_ms" in r["strict"] for r in body["results"].values())
    if host:
        table.add_column("host enqueue ms provider / strict")
    for phase, r in body["results"].items():
        cells = [phase, f"{r['provider']['median_ms']:.3f}", f"{r['strict']['median_ms']:.3f}"]
        cells.append(f"{r['strict_over_provider']:.2f}x")
        if seg8:
            cells.append(f"{r['strict_seg8']['median_ms']:.3f} ({r['strict_seg8_over_strict']:.3f}x)")
        if one:
            alone = r.get("strict_one_by_one")
            cells.append(
                "-" if alone is None else f"{alone['median_ms']:.3f} ({r['strict_one_by_one_over_strict']:.3f}x)"
            )
        if memory:
            peak = r["max_memory_allocated_bytes"]
            cells.append(f"{peak['provider'] / 2**30:.1f} / {peak['strict'] / 2**30:.1f}")
        if host:
            cells.append(f"{r['provider']['host_ms']['median_ms']:.3f} / {r['strict']['host_ms']['median_ms']:.3f}")
        table.add_row(*cells)
    console = stdout_console()
    console.print(table)
    clocks = _clock_table(body["results"])
    if clocks is not None:
        console.print(clocks)
    if "forward_nodes" in body:
        console.print(_node_table(body["forward_nodes"]))
    if "forward_stages" in body:
        console.print(_stage_table(body["forward_stages"]))
    if "sustained" in body:
        console.print(_sustained_table(body["sustained"]))
    console.print(f"evidence: {display(path)}")
    explain = [f"timed: h3gate's strict {target} next to the provider's (medians of CUDA-event timings); recorded, "
               "not judged."]  # fmt: skip
    if body.get("gemm_launch"):  # H3GATE_GEMM_LAUNCH: knobs set for this measurement
        knobs = ", ".join(f"{k}={int(v)}" for k, v in body["gemm_launch"].items())
        explain.append(f"GEMM launch knobs set by H3GATE_GEMM_LAUNCH (measurement only): {knobs}.")
    print_verdict("complete", f"{len(body['results'])} phases timed", explain, console)
    return EXIT_PASS


def _node_table(nodes: dict) -> Table:
    """The forward node by node: each arm's median milliseconds and strict / provider, with the sums."""
    arms = nodes["arms"]
    table = Table(title="forward node by node (median ms)")
    for col in ("node", *(f"{arm} ms" for arm in arms), "strict / provider"):
        table.add_column(col)
    for name in arms["strict"]["nodes"]:
        ms = [arms[arm]["nodes"][name] for arm in arms]
        prov = arms["provider"]["nodes"][name]
        ratio = arms["strict"]["nodes"][name] / prov if prov > 0 else float("nan")
        table.add_row(name, *(f"{t:.3f}" for t in ms), f"{ratio:.2f}x")
    sums = [arms[arm]["sum_ms"] for arm in arms]
    table.add_row("sum (whole)", *(f"{arms[a]['sum_ms']:.3f} ({arms[a]['whole_ms']:.3f})" for a in arms),
                  f"{sums[list(arms).index('strict')] / arms['provider']['sum_ms']:.2f}x")  # fmt: skip
    return table


def _sustained_table(steady: dict) -> Table:
    """The steady state (each arm back to back): ms and joules per call and mean watts, the forward and each node."""
    rows = {"forward": steady["forward"], **steady.get("forward_nodes", {}).get("nodes", {})}
    arms = list(steady["forward"]["arms"])
    table = Table(title="sustained, each arm back to back: ms / J per call (mean W)")
    for col in ("", *arms, "strict / provider ms (J)"):
        table.add_column(col)
    for label, rec in rows.items():
        cells = []
        for arm in arms:
            a = rec["arms"].get(arm)
            joules = f" / {a['j_per_call']:.4g} J ({a['mean_w']:.0f} W)" if a and "j_per_call" in a else ""
            bound = " host-bound" if a and a.get("host_bound") else ""
            cells.append("-" if a is None else f"{a['ms_per_call']:.4g}{joules}{bound}")
        ratio = rec.get("strict_over_provider_ms")
        j = rec.get("strict_over_provider_j")
        table.add_row(label, *cells, "-" if ratio is None else f"{ratio:.3f}x" + (f" ({j:.3f}x)" if j else ""))
    if "forward_nodes" in steady:
        sums = steady["forward_nodes"]["sums"]
        table.add_row("nodes, sum", *(
            "-" if arm not in sums else f"{sums[arm]['ms_per_call']:.4g}"
            + (f" / {sums[arm]['j_per_call']:.4g} J" if "j_per_call" in sums[arm] else "") for arm in arms
        ), "")  # fmt: skip
    if "unavailable" in steady["forward"]["energy"]:
        table.caption = escape(steady["forward"]["energy"]["unavailable"])
    return table


def _clock_table(results: dict) -> Table | None:
    """Per phase and arm, the device's SM clock and power during its timed calls (None: nothing recorded)."""
    rows = [(phase, r["device_clocks"]) for phase, r in results.items() if "device_clocks" in r]
    if not rows:
        return None
    table = Table(title="device clocks during the timed calls (NVML samples)")
    for col in ("phase", "arm", "samples", "SM MHz median (min)", "power W median (max)", "clock-event reasons"):
        table.add_column(col)
    for phase, rec in rows:
        if "unavailable" in rec:
            table.add_row(phase, "-", "0", "-", "-", escape(rec["unavailable"]))
            continue
        for arm, a in rec["arms"].items():
            if not a["samples"]:
                table.add_row(phase, arm, "0", "-", "-", "-")
                continue
            mhz, watts = a["sm_mhz"], a["power_w"]
            reasons = ", ".join(f"{k} {n}" for k, n in a["reasons"].items()) or "none"
            table.add_row(phase, arm, str(a["samples"]), f"{mhz['median']:.0f} ({mhz['min']:.0f})",
                          f"{watts['median']:.0f} ({watts['max']:.0f})", reasons)  # fmt: skip
    return table


def _stage_table(stages: dict) -> Table:
    """The model's forward stage by stage, summarised: the blocks' spread and the other stages, per arm."""
    arms = stages["arms"]
    table = Table(title="forward stage by stage (median ms)")
    for col in ("", *(f"{arm} ms" for arm in arms), "strict / provider"):
        table.add_column(col)

    def row(label: str, get) -> None:
        ms = [get(arms[arm]) for arm in arms]
        prov = get(arms["provider"])
        table.add_row(label, *(f"{t:.3f}" for t in ms), f"{get(arms['strict']) / prov:.2f}x" if prov > 0 else "-")

    n = arms["strict"]["blocks"]["count"]
    row(f"block median ({n} blocks)", lambda a: a["blocks"]["median_ms"])
    row("block min", lambda a: a["blocks"]["min_ms"])
    row("block max", lambda a: a["blocks"]["max_ms"])
    row("blocks, sum", lambda a: a["blocks"]["sum_ms"])
    row("other stages, sum", lambda a: a["other_ms"])
    row("whole forward", lambda a: a["whole_ms"])
    return table


def _bench_ops(
    ops: list[str], layout: str, config: str, device: str, out: Path | None, json_: bool, force: bool = False
) -> int:
    import torch

    from h3gate.bench.ops import bench_ops
    from h3gate.evidence.writer import write_evidence
    from h3gate.layout import parse_layouts
    from h3gate.manifests.layouts import LAYOUTS_FILE
    from h3gate.manifests.model_config import load_config
    from h3gate.ops import registry
    from h3gate.ops.cases import CASES

    if not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available on this machine")
    for op in ops:
        registry.spec(op)
        if op not in CASES:
            raise InputError(f"--op {op}: no case builder (known: {', '.join(sorted(CASES))})")
    cfg = load_config(config)
    ((name, rows),) = parse_layouts(layout)
    manifests = [
        MANIFESTS / "configs" / f"{cfg.name}.yaml",
        LAYOUTS_FILE,
        *sorted((MANIFESTS / "operators").glob("*.yaml")),
    ]
    folder = enter_run(out, LOCAL_EVIDENCE / KIND / f"ops-{cfg.name}-{name}", force)
    with progress("bench", len(ops)) as step:
        copy_gbs, records = bench_ops(ops, rows, cfg.config, device, progress=step)
    body = bench_body(cfg.name, name, rows, device, copy_gbs, records)
    path = write_evidence(
        folder, f"{KIND}-ops.json", KIND, body, command=["h3gate", *sys.argv[1:]],
        manifests=[p for p in manifests if p.is_file()], device=device,
    )  # fmt: skip
    if json_:
        print(
            json.dumps(
                {
                    "evidence": display(path),
                    **{k: body[k] for k in ("verdict", "copy_bandwidth_gbs")},
                    "operators": {
                        r["op"]: r["forward"] | {"checks": r["checks"], "target": r["target"]} for r in records
                    },
                },
                indent=1,
            )
        )
    else:
        _table(body, path)
    return EXIT_PASS if body["verdict"] == "pass" else EXIT_FAIL


def bench_body(config: str, layout: str, rows: int, device: str, copy_gbs: float, records: list[dict]) -> dict:
    """The ``bench`` evidence body (schema ``schemas/bench.schema.json``)."""
    from h3gate.bench.ops import HEAD_START_US, MEMORY_BOUND_MIN_BYTES, MIN_COPY_FRACTION, NOISE

    return {
        "target": "ops",
        "config": config,
        "layout": {"name": layout, "rows": rows},
        "device": device,
        "copy_bandwidth_gbs": copy_gbs,
        "timing": {
            "method": "h3gate.bench.timing.side_by_side: interleaved CUDA-event medians, 256 MiB L2 flush, then a "
            "device-side spin of head_start_us before each timed call (the host's launch cost is not timed)",
            "head_start_us": HEAD_START_US,
        },
        "criteria": {
            "min_fraction_of_copy": MIN_COPY_FRACTION,
            "memory_bound_min_bytes": MEMORY_BOUND_MIN_BYTES,
            "not_slower_noise": NOISE,
        },
        "operators": records,
        "verdict": "pass" if all(r["verdict"] == "pass" for r in records) else "fail",
    }


def _target_cell(target: dict | None) -> str:
    """``0.93x >= 0.95 (provider)``: the declared target's ratio and bound, or ``-`` under the default criteria."""
    if target is None:
        return "-"
    return f"{target['ratio']:.2f}x >= {target['min_ratio']:g} ({target['baseline']})"


def _table(body: dict, path: Path) -> None:
    console = stdout_console()
    layout, copy = body["layout"], body["copy_bandwidth_gbs"]
    title = f"bench --op @ {layout['name']} (S={layout['rows']}), copy {copy:.0f} GB/s"
    table = Table(title=f"{title}: {body['verdict'].upper()}")
    for col in ("operator", "kernel ms", "provider ms", "speedup", "target", "kernel GB/s", "% copy", "fwd+bwd k/p ms",
                "bwd k/p ms"):  # fmt: skip
        table.add_column(col)
    table.add_column("ok")
    for r in body["operators"]:
        f = r["forward"]
        frac = "-" if f["fraction_of_copy"] is None else f"{100 * f['fraction_of_copy']:.0f}%"
        if not r["memory_bound"] and f["fraction_of_copy"] is not None:
            frac += " (n/a)"
        fb = r["forward_backward"]
        fbs = "-" if fb is None else f"{fb['kernel']['median_ms']:.3f}/{fb['provider']['median_ms']:.3f}"
        bw = r.get("backward")
        bws = "-" if bw is None else f"{bw['kernel']['median_ms']:.3f}/{bw['provider']['median_ms']:.3f}"
        table.add_row(
            escape(r["op"]), f"{f['kernel']['median_ms']:.4f}", f"{f['provider']['median_ms']:.4f}",
            f"{f['speedup']:.2f}x", _target_cell(r["target"]),
            "-" if f["kernel_gbs"] is None else f"{f['kernel_gbs']:.0f}", frac, fbs, bws,
            "yes" if r["verdict"] == "pass" else "[red]NO[/red]",
        )  # fmt: skip
        for label, var in r.get("variants", {}).items():  # recorded next to the kernel, not gated
            vfb, ratio = var["forward_backward"], var["forward_vs_kernel"]
            table.add_row(
                escape(f"  {r['op']} {label}"), f"{var['forward']['median_ms']:.4f}", "-",
                "-" if ratio is None else f"{ratio:.3f}x kernel", "-", "-", "-",
                "-" if vfb is None else f"{vfb['median_ms']:.3f}/-", "-", "-",
            )  # fmt: skip
    console.print(table)
    console.print(f"evidence: {escape(display(path))}")
    failed = [r["op"] for r in body["operators"] if r["verdict"] != "pass"]
    detail = f"{len(body['operators']) - len(failed)}/{len(body['operators'])} operators meet their speed criteria"
    explain = ["timed: each strict kernel next to its provider op, judged against the criteria the evidence records."]
    print_verdict(body["verdict"], detail + (f"; not: {', '.join(failed)}" if failed else ""), explain, console)
