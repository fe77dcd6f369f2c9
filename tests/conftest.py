"""Shared test helpers (keep minimal: several suites use this file), and two pieces of test plumbing that decide
how fast the suite runs and nothing about what it asserts: every test on a fresh Python data-stack chunk
(:func:`pytest_runtest_protocol`) and the xdist work units (:func:`pytest_collection_modifyitems`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def strict_numerics_for_every_test():
    """Every test runs as the command line runs a verb: inside the one numerics switch (h3gate.numerics)."""
    from h3gate.numerics import strict_numerics

    with strict_numerics():
        yield


# ---- every test on a fresh data-stack chunk ------------------------------------------------------------------------
# CPython keeps frames on a chunked per-thread stack (16 KiB chunks) and, before the fix for python/cpython#142183
# (3.13 and 3.14 maintenance releases; the venv runs 3.11), frees a chunk as soon as the frame that opened it returns.
# A hot loop whose calls straddle a chunk boundary then maps and unmaps a chunk on every call. Where the boundaries
# fall depends on how deep the test runs, i.e. on pytest's and xdist's own frames: measured here, ``run ws1-model
# --no-backward`` in a module fixture spent 11 s of 22 s in mmap/munmap (1.6 million page faults) and the same run in
# the test body none; under xdist the save-tensors fixture and both ws1-model --checkpoint runs were hit. So each
# test's setup, call and teardown start at the head of a chunk with ~70 KiB free (a frame of 7200 slots makes CPython
# allocate a 128 KiB chunk for it), wherever pytest stands. Nothing about the test changes.
_FRESH_CHUNK_SLOTS = 7200  # 8 * (7200 + 1000 overhead slots) bytes > 64 KiB: CPython rounds the chunk up to 128 KiB
_FRESH_CHUNK_SRC = (
    "def on_fresh_chunk(fn, args, kwargs):\n"
    f"    {' = '.join(f'_{i}' for i in range(_FRESH_CHUNK_SLOTS))} = None\n"
    "    return fn(*args, **kwargs)\n"
)
_fresh_chunk_ns: dict = {}
exec(compile(_FRESH_CHUNK_SRC, "<conftest fresh chunk>", "exec"), _fresh_chunk_ns)
on_fresh_chunk = _fresh_chunk_ns["on_fresh_chunk"]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """pytest's own protocol (``_pytest.runner.pytest_runtest_protocol``), called through :func:`on_fresh_chunk`."""
    from _pytest.runner import runtestprotocol

    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    on_fresh_chunk(runtestprotocol, (item,), {"nextitem": nextitem})
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


# ---- xdist work units (pyproject: ``--dist loadgroup``) ------------------------------------------------------------
# A test that uses a module-scoped fixture (one rollout, one gate run, one checkpoint shared by several tests) is
# scheduled together with the other tests of its module that use one, so that fixture is made once, on one worker;
# every other test is handed out on its own, so both workers stay busy to the end. ``one_thread`` is exempt: it only
# sets the thread count, once per worker anyway. An explicit ``xdist_group`` mark still names its own unit.
#
# xdist's own ``loadgroup`` cannot carry this on pytest >= 9.2 (it appends the group to ``item._nodeid``, which pytest
# no longer reads: pytest-dev/pytest-xdist#1386), so the workers write each test's unit to a file when they have
# collected (the controller collects nothing) and the controller's scheduler, a LoadScopeScheduling, reads it.
# Order: tests marked ``slow`` that share nothing first, then the shared units (the longest first: LONG_UNITS, each
# a default command run once for its module, 0.5-2 minutes on two cores), then the rest, in collection order, so no
# long test is among the last ones handed out.
PER_WORKER_MODULE_FIXTURES = {"one_thread"}
LONG_UNITS = ("tests/test_ws1_model.py", "tests/test_gate_trust.py", "tests/test_ws1_trajectory.py")
SHARED_SCOPES = {"module", "package", "class"}
UNITS_ENV = "H3GATE_TEST_XDIST_UNITS"


def _unit(item) -> str | None:
    """The xdist work unit ``item`` must share, or None when it can run anywhere."""
    marks = sorted(
        {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    )
    if marks:
        return "@" + "_".join(marks)
    info = getattr(item, "_fixtureinfo", None)
    if info is not None and any(
        defs and defs[-1].scope in SHARED_SCOPES and name not in PER_WORKER_MODULE_FIXTURES
        for name, defs in info.name2fixturedefs.items()
    ):
        return item.nodeid.split("::", 1)[0]
    return None


def _share_the_cores() -> None:
    """An xdist worker takes its share of the machine's cores as intra-op threads (torch here, ``OMP_NUM_THREADS``
    for the command-line subprocesses it starts): two workers of two threads each on two cores spin against each
    other (measured: a 42 s gate run took 65 s). Runs at any thread count are among the provider variants the
    gates already judge (``threads-1``)."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if "PYTEST_XDIST_WORKER" not in os.environ or count < 2:
        return
    share = str(max(1, (os.cpu_count() or 1) // count))
    os.environ["OMP_NUM_THREADS"] = share
    import torch

    torch.set_num_threads(int(share))


def pytest_configure(config):
    worker = hasattr(config, "workerinput")
    if worker:
        _share_the_cores()
    if not worker and config.getoption("dist", "no") == "loadgroup" and config.getoption("tx", None):
        import tempfile

        config._h3gate_units_dir = tempfile.mkdtemp(prefix="h3gate-xdist-units-")
        os.environ[UNITS_ENV] = config._h3gate_units_dir  # the workers, started after this, inherit it


def pytest_unconfigure(config):
    folder = getattr(config, "_h3gate_units_dir", None)
    if folder is not None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(UNITS_ENV, None)


@pytest.hookimpl(trylast=True)  # after deselection: the items that will run
def pytest_collection_modifyitems(config, items):
    folder = os.environ.get(UNITS_ENV)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if folder is None or worker is None or not hasattr(config, "workerinput"):
        return
    import json

    units = {id(item): _unit(item) for item in items}
    slow = [i for i in items if units[id(i)] is None and i.get_closest_marker("slow") is not None]
    shared = [i for i in items if units[id(i)] is not None]
    shared.sort(key=lambda i: next((k for k, u in enumerate(LONG_UNITS) if units[id(i)] == u), len(LONG_UNITS)))
    rest = [i for i in items if units[id(i)] is None and i.get_closest_marker("slow") is None]
    items[:] = slow + shared + rest
    body = json.dumps({i.nodeid: units[id(i)] for i in items if units[id(i)] is not None})
    tmp = Path(folder) / f".{worker}.json"
    tmp.write_text(body, encoding="utf-8")
    tmp.replace(Path(folder) / f"{worker}.json")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    folder = getattr(config, "_h3gate_units_dir", None)
    if folder is None:
        return None
    import json

    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        """LoadScopeScheduling whose scopes are the units the workers wrote (a test's own nodeid when it has none),
        handed out in collection order."""

        units: dict[str, str] | None = None

        def schedule(self) -> None:
            if self.collection is None:  # the first call: every worker has collected and written its file
                files = sorted(Path(folder).glob("gw*.json"))
                self.units = json.loads(files[0].read_text(encoding="utf-8")) if files else None
                self.config.option.loadscopereorder = False
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:  # no file: whole modules, as --dist loadfile
                return nodeid.split("::", 1)[0]
            return self.units.get(nodeid, nodeid)

    return SharedFixtureScheduling(config, log)


@pytest.fixture
def run_cli(capsys):
    """Run ``h3gate.cli.main(args)``; returns ``(exit_code, stdout, stderr)``."""

    def run(*args: str) -> tuple[int, str, str]:
        from h3gate.cli import main

        with pytest.raises(SystemExit) as exc:
            main([str(a) for a in args])
        captured = capsys.readouterr()
        return exc.value.code, captured.out, captured.err

    return run


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a whole module, as ``h3gate ablate`` runs on CPU (tiny shapes; no OpenMP spinning on
    shared cores). Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_params():
    """Every tensor of the tiny config's synthetic weights (seed 0), checked against the inventory, once per module."""
    from h3gate.graph.model import load_model_params
    from h3gate.manifests.model_config import load_config
    from h3gate.synth import SyntheticSource

    cfg = load_config("tiny").config
    return load_model_params(SyntheticSource(cfg, 0), cfg)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """``write(parent, name, seed, **kw)``: the tiny config's synthetic checkpoint written to a fresh temp folder."""
    from h3gate.manifests.model_config import load_config
    from h3gate.synth import write_checkpoint

    def write(parent: str, name: str, seed: int, **kwargs) -> Path:
        out = tmp_path_factory.mktemp(parent) / name
        write_checkpoint(load_config("tiny").config, seed, out, **kwargs)
        return out

    return write
