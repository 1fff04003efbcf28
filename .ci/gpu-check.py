"""The prepared device check (issue 57): run the moment a session is lent a GPU.

Here (``just gpu-check``): download the wheels the device image lacks into ``.gpu-wheels/``
(ignored), check that they and the image's packages cover what hylinker and its tests import,
and print the one command line a session passes to the device tool. ``--dry-run`` also runs
every stage below on this CPU (the same code, small sizes, the CPU fallbacks), so the script is
known to start. On the device machine (``--run``) the stages run in turn, each in its own
process under its own deadline (8 minutes in all), and ``gpu-check.json`` (every figure) and
``gpu-check.log`` are written to ``--out`` (the device tool's ``$OUT``):

* ``tests``: every ``cuda``-marked test under tests/ (the data plane's device copies, device
  checksum and device integrity, CUDA events, the vLLM connector's page transfers over CUDA
  pages laid out as vLLM allocates them), then the device test files in full (their fakes too);
* ``demo``: the reference hybrid model on the device, at a real checkpoint's cache geometry
  (qwen3_next: Qwen3-Next-80B's 48 layers, hidden size shrunk), through a ``Linker`` over
  pools on the device: restored logprobs bit-equal to recompute, the negative controls above
  their margin;
* ``bench``: the device data path: offload and load through pinned staging (``DataPlane`` over
  device pools, integrity ``checksum``) against a plain ``torch`` copy of the same bytes (D2H,
  H2D GB/s), the device checksum's GB/s against a device-to-device copy, event-loop lag p99
  while the loop waits on device events.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ".gpu-wheels"
#: what the device image holds (/work/.library/device/KINDS.md, read 2026-11-17), normalized names
IMAGE = frozenset((
    "torch", "numpy", "anyio", "attrs", "xxhash", "prometheus-client", "pytest", "hypothesis",
    "pytest-timeout", "transformers", "huggingface-hub", "tokenizers", "safetensors", "regex",
    "pyyaml", "packaging", "tqdm", "filelock", "fsspec", "typing-extensions", "iniconfig",
    "pluggy", "sortedcontainers", "pygments", "jinja2", "networkx", "sympy", "triton", "idna",
    "httpx", "requests", "typer", "rich", "click", "shellingham", "hf-xet", "pytest-xdist",
    "execnet", "h11", "httpcore", "certifi", "markupsafe", "mpmath", "urllib3", "charset-normalizer",
    "pyyaml", "six", "python-dateutil", "psutil",
))
#: carried as wheels: absent from the image, or older there than what this project tests with
#: (the image's transformers 5.17 is below the reference extra's >= 5.20; 5.x above it needs a
#: newer huggingface-hub, which needs httpx2)
CARRIED = ("structlog", "pytest-asyncio", "transformers", "huggingface-hub", "kernels", "httpx2", "httpcore2",
           "truststore", "tomlkit")
#: the image's versions where the device tool's notes record them (KINDS.md's pip list row)
IMAGE_VERSIONS = {"huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "numpy": "2.5.2", "safetensors": "0.8.0",
                  "transformers": "5.17.0", "torch": "2.11.0", "triton": "3.6.0"}
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
DEVICE_PYTHON = "3.12"
CARRY_LIMIT = 64 << 20
STAGES = {"tests": 240, "demo": 150, "bench": 60}  # seconds each, 450 s in all (< 8 minutes)
DEVICE_TEST_FILES = ("tests/integrations/test_vllm_device_pages.py", "tests/runtime/test_device_suites.py", "tests/runtime/test_device_copies.py",
                     "tests/runtime/test_device_integrity.py", "tests/stores/test_device_checksum.py", "tests/runtime/test_events.py")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---- here: wheels and the command ---------------------------------------------------------------
def prepare(log: list[str]) -> list[Path]:
    """Download each carried package at the version installed here (the one CI tests) unless
    its wheel is there already; return the wheel files."""
    folder = ROOT / WHEELS
    folder.mkdir(exist_ok=True)
    try:
        pins = [f"{name}=={metadata.version(name)}" for name in CARRIED]
    except metadata.PackageNotFoundError as exc:
        raise SystemExit(f"gpu-check: {exc.name} is not installed here; the wheels carry the versions "
                         "installed here (run `just setup`)") from None
    wanted = {_norm(p.split("==")[0]): p.split("==")[1] for p in pins}
    for wheel in folder.glob("*.whl"):  # one version of each: two stop the whole install there
        name = _norm(wheel.name.split("-")[0])
        if name not in wanted or wheel.name.split("-")[1] != wanted[name]:
            wheel.unlink()
    missing = [p for p in pins if not any(f"-{p.split('==')[1]}-" in w.name for w in folder.glob(
        f"{p.split('==')[0].replace('-', '_')}-*.whl"))]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", DEVICE_PYTHON, "--implementation", "cp", "-d", str(folder), *missing]
        for p in WHEEL_PLATFORMS:
            cmd[5:5] = ["--platform", p]
        log.append("downloading " + " ".join(missing))
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"gpu-check: pip could not download {' '.join(missing)} into {folder} "
                             "(is the package registry reachable?)")
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != len(CARRIED):
        raise SystemExit(f"gpu-check: {folder} holds {[w.name for w in wheels]}, want one wheel each of {CARRIED}")
    return wheels


#: where the wheels run: Python 3.12 on x86-64 Linux (requirement markers are read for it)
DEVICE_ENV = {"python_version": DEVICE_PYTHON, "python_full_version": f"{DEVICE_PYTHON}.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def needs(lines: list[str], by: str) -> list[tuple[str, Any, str]]:
    """(name, specifier, by) of each requirement line that applies on the device (no extras)."""
    from packaging.requirements import Requirement

    out = []
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(DEVICE_ENV):
            out.append((_norm(req.name), req.specifier, by))
    return out


def requirements(wheel: Path) -> list[str]:
    """A wheel's requirement lines (its METADATA's Requires-Dist)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def check_resolves(wheels: list[Path], log: list[str]) -> None:
    """Every requirement of hylinker (pyproject) and of each wheel is carried or in the image, at
    a version its specifier allows where the image's version is recorded."""
    carried = {_norm(w.name.split("-")[0]): w.name.split("-")[1] for w in wheels}
    needed = needs(metadata.requires("hylinker") or [], "hylinker")
    for w in wheels:
        needed += needs(requirements(w), w.name)
    problems = []
    for name, spec, by in needed:
        version = carried.get(name, IMAGE_VERSIONS.get(name))
        if name not in carried and name not in IMAGE:
            problems.append(f"{name} (for {by}): not in the image")
        elif version is not None and not spec.contains(version, prereleases=True):
            problems.append(f"{name} {version} (for {by}, which wants {spec})")
    if problems:
        raise SystemExit("gpu-check: the wheel list does not resolve: " + "; ".join(problems)
                         + f"; carry them (CARRIED in {Path(__file__).name})")
    size = sum(w.stat().st_size for w in wheels)
    if size > CARRY_LIMIT:
        raise SystemExit(f"gpu-check: the wheels take {size >> 20} MiB, over the 64 MiB the device tool carries")
    log.append(f"wheel list resolves: {', '.join(w.name for w in wheels)} ({size / 2**20:.1f} MiB); with the "
               f"image's packages they cover all {len(needed)} requirements")


def check_installs(wheels: list[Path], log: list[str]) -> None:
    """The device command's install, for the device's Python and platform, into a scratch folder."""
    with tempfile.TemporaryDirectory() as target:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--only-binary=:all:", "--python-version", DEVICE_PYTHON, "--implementation", "cp",
               *[a for p in WHEEL_PLATFORMS for a in ("--platform", p)], "--target", target, *map(str, wheels)]
        subprocess.run(cmd, check=True)
        installed = sorted(p.name for p in Path(target).iterdir() if p.name.endswith(".dist-info"))
    log.append(f"the wheels install for Python {DEVICE_PYTHON} x86-64: {len(installed)} distributions")


def device_command() -> str:
    """The one command line for the device tool (run from the repository root, carry .gpu-wheels)."""
    line = (f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
            f"--target /tmp/site {WHEELS}/*.whl || exit 1; mkdir -p /tmp/pp && ln -sfn \"$PWD\" /tmp/pp/hylinker; "
            f"PYTHONPATH=/tmp/pp:/tmp/site PYTHONUNBUFFERED=1 timeout 470 python3 .ci/gpu-check.py --run --out \"$OUT\"")
    assert len(line) <= 2000
    return line


# ---- stages -------------------------------------------------------------------------------------
def stage_tests(device: str, out: dict[str, Any]) -> bool:
    """On CUDA every cuda-marked test, then the device test files in full; on CPU (the dry run)
    the cuda-marked tests of those files are collected and skip (CI runs the files anyway)."""
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    runs = ([("cuda_marked", ["-m", "cuda", "tests"]), ("device_files", list(DEVICE_TEST_FILES))]
            if device == "cuda" else [("cuda_marked", ["-m", "cuda", *DEVICE_TEST_FILES])])
    ok = True
    for name, args in runs:
        t0 = time.perf_counter()
        proc = subprocess.run([*base, "-rs", *args], cwd=ROOT, capture_output=True, text=True)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        print("\n".join(lines), flush=True)
        summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", line)), "")
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
        # on a GPU nothing may skip but what needs Mooncake (not in the device image)
        skips = [line for line in lines if line.startswith("SKIPPED") and "mooncake" not in line.lower()]
        out[name] = {"rc": proc.returncode, "counts": counts, "seconds": time.perf_counter() - t0,
                     "skips": skips}
        ok = ok and proc.returncode == 0 and (device != "cuda" or not skips)
    return ok


def stage_demo(device: str, out: dict[str, Any]) -> bool:
    import anyio

    from hylinker.stores.embedded import EmbeddedStore
    from hylinker.tools.demo import CHUNK_TOKENS, DEFAULT_SHAPE, ConversationShape, run_demo
    from hylinker.tools.harness.reference import (
        ReferenceEngine,
        build_draft_model,
        build_model,
        cache_geometry,
    )
    from hylinker.tools.harness.shapes import transformers_overrides

    arch = "qwen3_next"
    real = device == "cuda"  # the real geometry where a GPU runs it; the tiny one on CPU (dry run)
    model = build_model(arch, seed=0, **(transformers_overrides(arch) if real else {})).to(device)
    draft = build_draft_model(seed=1).to(device) if cache_geometry(model).kv is not None else None
    engine = ReferenceEngine(model, draft, chunk_tokens=CHUNK_TOKENS)
    # on CPU: two short turns, the second restoring a checkpoint (the dry run must stay short)
    shape = DEFAULT_SHAPE if real else ConversationShape(64, (48, 72), 4, 2)

    async def main() -> dict[str, Any]:
        store = EmbeddedStore((2048 if real else 256) << 20)
        try:
            return await run_demo(arch, shape, store=store, engine=engine, warmup=real,
                                  out=lambda s: print(s, flush=True))
        finally:
            await store.close()

    report = anyio.run(main)
    out.update(arch=arch, real_geometry=real, layers=len(engine.geometry.linear) + len(engine.geometry.full_layers),
               passed=report["passed"], turns=report["turns"], negative_controls=report["negative_controls"],
               ttft_ratio_recompute_over_restore=report["ttft_ratio_recompute_over_restore"])
    return bool(report["passed"])


def stage_bench(device: str, out: dict[str, Any]) -> bool:
    import anyio
    import torch

    from hylinker.components.layout import PoolKind
    from hylinker.components.pool_view import PoolSet, kv_view
    from hylinker.runtime.dataplane.events import record_fence
    from hylinker.runtime.dataplane.plane import DataPlane, Transfer
    from hylinker.stores.device_checksum import device_checksums
    from hylinker.stores.embedded import EmbeddedStore

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    # one object: every layer's page; 32 layers x 16 tokens x 8 heads x 128 dims bf16 = 1 MiB
    objects, layers, page, heads, dim = (256, 32, 16, 8, 128) if cuda else (8, 4, 4, 2, 16)
    obj_bytes = layers * page * heads * dim * 2
    total = objects * obj_bytes

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def timed(fn: Any, reps: int = 5) -> float:
        fn()
        sync()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    def pools(fill: bool) -> tuple[list[torch.Tensor], PoolSet]:
        ks = [(torch.randint(-100, 100, (2 * objects * page, heads, dim), device=dev).to(torch.bfloat16) if fill
               else torch.zeros((2 * objects * page, heads, dim), dtype=torch.bfloat16, device=dev))
              for _ in range(layers)]
        return ks, PoolSet([kv_view(ks, layer_ids=list(range(layers)), page_size=page)])

    def rows(first: int) -> torch.Tensor:
        return (torch.arange(objects)[:, None] + first) * page + torch.arange(page)

    lags: list[float] = []

    async def ticker(stop: anyio.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append(max(0.0, time.perf_counter() - t0 - 0.001))

    async def paths() -> tuple[float, float, bool]:
        store = EmbeddedStore(2 * total + (64 << 20))
        src, views = pools(True)
        dst, views2 = pools(False)
        off_s = load_s = float("inf")
        try:
            async with DataPlane(views, store) as dp, DataPlane(views2, store) as dp2, anyio.create_task_group() as tg:
                stop = anyio.Event()
                tg.start_soon(ticker, stop)
                for rep in range(3):
                    keys = [f"r{rep}-{i}" for i in range(objects)]
                    t0 = time.perf_counter()
                    ticket = await dp.offload([Transfer(PoolKind.FULL, keys, rows(0))], fence=record_fence(dev))
                    assert (await ticket.wait()).ok, "offload failed"
                    off_s = min(off_s, time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    ticket2 = await dp2.load([Transfer(PoolKind.FULL, keys, rows(objects))])
                    assert (await ticket2.wait()).ok, "load failed"
                    load_s = min(load_s, time.perf_counter() - t0)
                stop.set()
        finally:
            await store.close()
        n = objects * page
        exact = all(torch.equal(a[:n], b[n:2 * n]) for a, b in zip(src, dst))
        return off_s, load_s, exact

    off_s, load_s, exact = anyio.run(paths)
    flat = torch.randint(0, 256, (total,), dtype=torch.uint8, device=dev)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    back = torch.empty_like(flat)
    d2h = timed(lambda: host.copy_(flat, non_blocking=True))
    h2d = timed(lambda: back.copy_(host, non_blocking=True))
    frames = flat.view(objects, obj_bytes)
    copy_dst = torch.empty_like(frames)
    sum_s = timed(lambda: device_checksums(frames))
    d2d = timed(lambda: copy_dst.copy_(frames))
    lags.sort()

    def gbs(seconds: float) -> float:
        return total / seconds / 1e9

    figures = {
        "bytes": total, "objects": objects, "object_bytes": obj_bytes, "exact": exact,
        "offload_GBps": gbs(off_s), "load_GBps": gbs(load_s),
        "torch_d2h_pinned_GBps": gbs(d2h), "torch_h2d_pinned_GBps": gbs(h2d),
        "offload_vs_torch_d2h": d2h / off_s, "load_vs_torch_h2d": h2d / load_s,
        "device_checksum_GBps": gbs(sum_s), "device_d2d_copy_GBps": gbs(d2d),
        "checksum_vs_pcie": (d2h / sum_s) if cuda else None,
        "loop_lag_ms_p99": 1e3 * lags[int(0.99 * (len(lags) - 1))] if lags else None,
        "loop_lag_ms_max": 1e3 * lags[-1] if lags else None, "loop_lag_samples": len(lags),
        "goals": {"offload_and_load_vs_torch": 0.8, "checksum_vs_pcie": 10.0, "loop_lag_ms_p99": 10.0},
    }
    # the vLLM connector's page transfers at Qwen3-Next-80B's object shape (12 pages of 2.16 MB),
    # measured by the lab's shapes bench (run from a checkout: the device call runs in one)
    from hylinker.tools.lab.shapes import measure

    vllm = measure(1, 8 if cuda else 1, 2, device)
    figures["vllm_pages"] = vllm
    out.update(figures)
    print(json.dumps(figures, indent=1), flush=True)
    return exact


def run_stage(name: str, device: str, path: Path) -> int:
    out: dict[str, Any] = {}
    ok = {"tests": stage_tests, "demo": stage_demo, "bench": stage_bench}[name](device, out)
    path.write_text(json.dumps({"ok": ok, **out}, indent=1, default=str))
    return 0 if ok else 1


def run_all(device: str, out_dir: Path, budget: dict[str, int]) -> int:
    """Every stage in its own process under its deadline; the JSON and log to ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": device, "host": host_facts(device), "stages": {}}
    log_path = out_dir / "gpu-check.log"
    ok = True
    with log_path.open("w") as log, tempfile.TemporaryDirectory() as tmp:
        for name, limit in budget.items():
            frag = Path(tmp) / f"{name}.json"
            t0 = time.perf_counter()
            print(f"== {name} (at most {limit} s)", flush=True)
            log.write(f"== {name} (at most {limit} s)\n")
            log.flush()
            try:
                proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--stage", name, "--device", device,
                                       "--fragment", str(frag)], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, timeout=limit)
                text, rc = proc.stdout, proc.returncode
            except subprocess.TimeoutExpired as exc:
                text = (exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or "")
                rc = 124
            log.write(text)
            print(text[-4000:], flush=True)
            stage: dict[str, Any] = json.loads(frag.read_text()) if frag.exists() else {"ok": False}
            stage.update(rc=rc, seconds=round(time.perf_counter() - t0, 2))
            if rc == 124:
                stage["error"] = f"past its deadline of {limit} s"
            report["stages"][name] = stage
            ok = ok and rc == 0 and bool(stage.get("ok"))
            print(f"== {name}: {'ok' if rc == 0 else f'FAILED (rc {rc})'} in {stage['seconds']} s", flush=True)
            (out_dir / "gpu-check.json").write_text(json.dumps({**report, "passed": ok}, indent=1, default=str))
    return 0 if ok else 1


def host_facts(device: str) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                             "cpus": os.cpu_count(), "machine": platform.machine()}
    if device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return facts


def main() -> int:
    ap = argparse.ArgumentParser(prog=".ci/gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="prepare, then run every stage on this CPU")
    ap.add_argument("--run", action="store_true", help="on the device machine: run every stage on CUDA")
    ap.add_argument("--out", default=None, help="where gpu-check.json and gpu-check.log go")
    ap.add_argument("--stage", choices=sorted(STAGES), help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--fragment", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage:
        return run_stage(args.stage, args.device, Path(args.fragment))
    if args.run:
        import torch

        if not torch.cuda.is_available():
            print("gpu-check --run: torch sees no CUDA device here; use --dry-run on a CPU", file=sys.stderr)
            return 2
        if not args.out:
            print("gpu-check --run: --out is required (the device tool's $OUT)", file=sys.stderr)
            return 2
        return run_all("cuda", Path(args.out), STAGES)
    log: list[str] = []
    wheels = prepare(log)
    check_resolves(wheels, log)
    print("\n".join(log))
    print("plan (device, within 8 minutes): " + "; ".join(f"{n} <= {s} s" for n, s in STAGES.items()))
    print("device tool call: run(carry=[\".gpu-wheels\"], timeout_s=540, command=the line below)")
    print(device_command())
    if not args.dry_run:
        return 0
    log.clear()
    check_installs(wheels, log)
    print("\n".join(log))
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    print(f"dry run on this CPU (the same stages, small sizes, CPU fallbacks); results in {out}")
    rc = run_all("cpu", out, {n: 120 for n in STAGES})
    print(f"dry run {'passed' if rc == 0 else 'FAILED'}: {shlex.quote(str(out / 'gpu-check.json'))}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
