#!/usr/bin/env python3
"""Prepare an offline install of h3gate for a GPU host: the wheels it needs there, beyond torch and triton.

    python3 tools/wheelhouse.py [--python-version 3.12] [--platform TAG ...] [--with-diffusers] [--with-sglang]
                                [--host-has tools/gpu-host-packages.txt] [--dest .whl]

1. resolves h3gate's ``[project].dependencies`` without torch and triton (the host has its own CUDA builds) and the
   ``clocks`` extra (NVML, for the bench's clock samples), plus the test extra's ``diffusers`` pin with
   ``--with-diffusers`` (the parity oracle), for the target Python and platforms (``pip install --dry-run
   --report``: nothing is installed);
2. leaves out every distribution named in ``--host-has`` (default: the GPU host image's list; ``--host-has ''``
   keeps everything);
3. with ``--with-sglang``, adds every pin of ``tools/sglang-requirements.txt`` (sglang 0.5.23 and exactly what its
   MiniMax-H3 DiT imports, ``make install-sglang``'s list) as it stands, without resolving their dependencies (the
   list is closed; sglang's own metadata asks for torch 2.14.1 and CUDA packages) and whatever the host holds: the
   wheelhouse's site folder then shadows the host's copies with the tested versions (torch, triton and torchvision
   stay the host's). sglang's wheels carry compiled extensions built for ``manylinux_2_34`` (glibc 2.34 or newer on
   the host), which this option adds to the platform tags;
4. downloads the rest as binary wheels and builds h3gate's own wheel, into ``--dest`` (its old wheels removed first,
   so that it holds one version of each).

Within the device tool's 64 MiB (the working tree and the wheels together), ``--sglang-host-first`` leaves out the
sglang pins the host already holds (its versions are then the ones that run: the evidence records them), and
``--slim-sglang`` repacks sglang's wheel without the subtrees the DiT never imports (:data:`SLIM_DROP`: the Rust
server extensions, the test suites, the benchmarks; 37 -> 18 MiB), its RECORD rewritten to match.
``--sgl-kernel-sm90`` adds the CUDA kernel package sglang's DiT imports on a GPU (:data:`SGL_KERNEL_PIN`, sglang
0.5.23's own pin; 356 MiB, built for torch 2.14.1) cut to its Python files and its Hopper (sm90) ``common_ops``
library: its FlashAttention-3, FlashMLA and InfLLM libraries (1.2 GB unpacked) are left behind, so that SGLang
resolves its attention backend without them (the evidence records the backend it resolved).

On the host: ``python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl``
(docs/guides/offline-gpu-host.md).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
HOST_PROVIDES = ("torch", "triton")  # always the host's own (CUDA) builds
SGLANG_REQUIREMENTS = ROOT / "tools" / "sglang-requirements.txt"
SGLANG_PLATFORM = "manylinux_2_34_x86_64"  # sglang 0.5.23's cp311/cp312 wheels
# Subtrees of sglang's wheel that no module of sglang.multimodal_gen.runtime (nor sglang.kernels) imports.
SLIM_DROP = ("sglang/srt/rust_extensions/", "sglang/test/", "sglang/multimodal_gen/test/", "sglang/benchmark/")
SGL_KERNEL_PIN = "sglang-kernel==0.4.10"
SGL_KERNEL_DROP = ("sgl_kernel/flash_ops", "sgl_kernel/flashmla_ops", "sgl_kernel/infllm_ops", "sgl_kernel/sm100/")


def norm(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return norm(re.split(r"[<>=!~;\[\s]", req.strip(), maxsplit=1)[0])


def requirements(with_diffusers: bool) -> list[str]:
    """h3gate's runtime requirements (torch/triton excluded), and the test extra's diffusers pin on request."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = [r for r in project["dependencies"] if requirement_name(r) not in HOST_PROVIDES]
    reqs += project["optional-dependencies"]["clocks"]  # bench's NVML clock sampler (bench/clocks.py)
    if with_diffusers:
        reqs += [r for r in project["optional-dependencies"]["test"] if requirement_name(r) == "diffusers"]
    return reqs


def sglang_pins(path: Path = SGLANG_REQUIREMENTS) -> list[tuple[str, str]]:
    """(name, version) of every ``name==version`` line of the sglang requirements (comments and blanks skipped)."""
    pins = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep or not version or requirement_name(name) != norm(name):
                sys.exit(f"wheelhouse: {path}: {line!r} is not a name==version pin")
            pins.append((norm(name), version.strip()))
    return pins


def merge_pins(resolved: list[tuple[str, str]], pins: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``resolved`` with the sglang ``pins`` added; a distribution in both takes the pin's version."""
    pinned = dict(pins)
    for name, version in resolved:
        if name in pinned and pinned[name] != version:
            print(f"wheelhouse: {name} {version} (h3gate's resolution) -> {pinned[name]} (sglang pin)")
    return sorted([(n, v) for n, v in resolved if n not in pinned] + pins)


def target_args(python_version: str, platforms: list[str]) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for tag in platforms:
        args += ["--platform", tag]
    return args


def resolve(reqs: list[str], target: list[str]) -> list[tuple[str, str]]:
    """(name, version) of every distribution pip would install for ``reqs`` on the target, dependencies included."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-"]
        done = subprocess.run([*cmd, *target, "--target", tmp, *reqs], capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"wheelhouse: pip could not resolve {reqs} for {target}:\n{done.stderr.strip()}")
    report = json.loads(done.stdout)
    return sorted((norm(i["metadata"]["name"]), i["metadata"]["version"]) for i in report["install"])


def host_has(path: str) -> set[str]:
    if not path:
        return set()
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return {norm(line.strip()) for line in lines if line.strip() and not line.startswith("#")}


def slim_wheel(wheel: Path, drop: tuple[str, ...] = SLIM_DROP) -> tuple[int, int]:
    """Rewrite ``wheel`` in place without the members under ``drop`` (and their RECORD lines); (bytes before,
    bytes after)."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if info.filename.startswith(drop):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(drop)).encode()
            out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(wheel)
    return before, wheel.stat().st_size


def build_own_wheel(dest: Path) -> None:
    """h3gate's wheel, built from a copy of the source tree (a stale ``build/`` in the checkout cannot leak in)."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        if listed.returncode == 0:
            for rel in filter(None, listed.stdout.decode().split("\0")):
                if (ROOT / rel).is_file():
                    (src / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / rel, src / rel)
        else:  # a copied tree without git
            junk = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "evidence", ".whl*")
            shutil.copytree(ROOT, src, ignore=junk)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(src)], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python-version", default="3.12", help="the host's Python, e.g. 3.12 (the H200 image) or 3.11")
    ap.add_argument("--platform", action="append", help=f"wheel platform tag, repeatable (default: {PLATFORMS})")
    ap.add_argument("--with-diffusers", action="store_true", help="add diffusers (the parity oracle) and its needs")
    ap.add_argument("--with-sglang", action="store_true", help="add sglang 0.5.23 and its DiT's pinned imports")
    ap.add_argument("--sglang-host-first", action="store_true", help="leave out sglang pins the host holds")
    ap.add_argument("--sgl-kernel-sm90", action="store_true", help=f"add {SGL_KERNEL_PIN}, Python and sm90 only")
    ap.add_argument("--slim-sglang", action="store_true", help=f"repack sglang's wheel without {SLIM_DROP}")
    ap.add_argument("--host-has", default=str(ROOT / "tools" / "gpu-host-packages.txt"), help="names to leave out")
    ap.add_argument("--dest", default=str(ROOT / ".whl"), help="output folder (default ./.whl)")
    args = ap.parse_args()
    platforms = args.platform or list(PLATFORMS)
    if args.with_sglang and SGLANG_PLATFORM not in platforms:
        platforms = [SGLANG_PLATFORM, *platforms]
    target = target_args(args.python_version, platforms)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    resolved = resolve(requirements(args.with_diffusers), target)
    pins = sglang_pins() if args.with_sglang else []
    on_host = host_has(args.host_has)
    skip = (on_host if args.sglang_host_first else on_host - {n for n, _ in pins}) | set(HOST_PROVIDES)
    resolved = merge_pins(resolved, pins)
    wanted = [f"{name}=={version}" for name, version in resolved if name not in skip]
    kept = [name for name, _ in resolved if name in skip]
    print(f"wheelhouse: {len(wanted)} to carry, {len(kept)} on the host already: {' '.join(kept)}")
    pip = [sys.executable, "-m", "pip"]
    if wanted:
        subprocess.run([*pip, "download", "-q", "--no-deps", *target, "-d", str(dest), *wanted], check=True)
    if args.sgl_kernel_sm90:
        subprocess.run([*pip, "download", "-q", "--no-deps", *target, "-d", str(dest), SGL_KERNEL_PIN], check=True)
        for wheel in dest.glob("sglang_kernel-*.whl"):
            before, after = slim_wheel(wheel, SGL_KERNEL_DROP)
            print(f"wheelhouse: {wheel.name} cut to sm90 {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    if args.slim_sglang:
        for wheel in dest.glob("sglang-*.whl"):
            before, after = slim_wheel(wheel)
            print(f"wheelhouse: {wheel.name} slimmed {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    build_own_wheel(dest)
    wheels = sorted(p.name for p in dest.glob("*.whl"))
    names = [norm(w.split("-")[0]) for w in wheels]
    if len(set(names)) != len(names):
        sys.exit(f"wheelhouse: two versions of one distribution in {dest}: {wheels}")
    size = sum(p.stat().st_size for p in dest.glob("*.whl")) / 2**20
    print("\n".join(wheels))
    print(f"wheelhouse: {len(wheels)} wheels, {size:.1f} MiB in {dest} (python {args.python_version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
