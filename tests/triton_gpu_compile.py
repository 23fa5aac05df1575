"""Recorded Triton launches (tests/triton_launches.py) compiled for an NVIDIA
GPU on any machine: Triton's wheel ships the NVIDIA backend and ptxas, so a
launch's configuration goes through the compiler a GPU's first launch would
use, down to a cubin, without a GPU or a driver. The interpreter the CPU tests
use runs a kernel's Python with NumPy and checks nothing that only the
compiler checks (one name bound to blocks of two shapes, a constexpr used as a
tensor, shared memory past the device's).

Run as a script (``python triton_gpu_compile.py ARCH SPECS RESULTS``) it
compiles the specs in the JSON file SPECS for ``sm_ARCH`` into the JSON file
RESULTS, in a process without ``TRITON_INTERPRET``, where ``triton.jit``
gives compilable kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TIMEOUT_S = 600


def ptxas_available() -> bool:
    """Whether this Triton has the NVIDIA backend and its ptxas runs here."""
    try:
        from triton import knobs

        path = knobs.nvidia.ptxas.path
        return subprocess.run([path, "--version"], capture_output=True).returncode == 0
    except (ImportError, AttributeError, RuntimeError, OSError):  # (OSError: it cannot run)
        return False


def compile_for_gpus(specs: list[dict[str, Any]], archs: list[int], work_dir: Path
                     ) -> dict[int, list[dict[str, Any]]]:
    """``specs`` compiled for each ``sm_<arch>``, one process per arch running
    at the same time (Triton's cache under ``work_dir``): per arch, per spec in
    order, ``{"error": None or the compiler's message, "shared": bytes}``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "TRITON_OVERRIDE_ARCH")}
    env["TRITON_CACHE_DIR"] = str(work_dir / "cache")
    (work_dir / "specs.json").write_text(json.dumps(specs))
    jobs = {arch: subprocess.Popen(
        [sys.executable, __file__, str(arch), str(work_dir / "specs.json"),
         str(work_dir / f"sm_{arch}.json")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        for arch in archs}
    try:
        for arch, job in jobs.items():
            _, err = job.communicate(timeout=TIMEOUT_S)
            if job.returncode != 0:
                raise RuntimeError(f"compiling for sm_{arch} failed:\n{err[-3000:]}")
    finally:
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
                job.wait()
    return {arch: json.loads((work_dir / f"sm_{arch}.json").read_text()) for arch in archs}


def _compile_all(specs: list[dict[str, Any]], arch: int) -> list[dict[str, Any]]:
    """Each spec through Triton's compiler for ``sm_<arch>``; an unknown
    launch option is an error (the compiler would drop it, a launch would
    not)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    results = []
    for spec in specs:
        unknown = set(spec["options"]) - set(CUDAOptions.__dataclass_fields__)
        if unknown:
            results.append({"error": f"unknown launch options {sorted(unknown)}",
                            "shared": None})
            continue
        kernel = getattr(importlib.import_module(spec["module"]), spec["name"])
        source = ASTSource(kernel, spec["signature"], spec["constexprs"],
                           {(i,): [["tt.divisibility", 16]] for i in spec["aligned"]})
        try:
            compiled = triton.compile(source, target=target, options=spec["options"])
            results.append({"error": None, "shared": compiled.metadata.shared})
        except Exception as e:  # reported per spec: the test lists them all
            results.append({"error": f"{type(e).__name__}: {e}"[-2000:], "shared": None})
    return results


if __name__ == "__main__":
    arch, specs_path, results_path = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    results_path.write_text(json.dumps(_compile_all(json.loads(specs_path.read_text()), arch)))
