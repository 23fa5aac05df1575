"""Triton kernel launches recorded in Triton's interpreter (the CPU tests run
every kernel there), and those launches compiled for an NVIDIA GPU on any
machine: Triton's wheel ships the NVIDIA backend and ptxas, so a launch's
configuration goes through the same compiler a GPU's first launch would use,
down to a cubin, without a GPU or a driver.

The interpreter runs a kernel's Python with NumPy and checks nothing that only
the compiler checks (one name bound to blocks of two shapes, a constexpr used
as a tensor, shared memory beyond the device's), so a kernel can pass every
CPU test and fail on its first GPU launch. Run as a script (``python
triton_launches.py ARCH < specs.json``) it compiles the specs it reads, in a
process without ``TRITON_INTERPRET``, where ``triton.jit`` gives compilable
kernels."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


class LaunchRecorder:
    """Every interpreted kernel launch's configuration, as Triton keys its
    compiles (``keys``), and what compiling that configuration takes
    (``specs``, one per key)."""

    def __init__(self) -> None:
        self.keys: set[tuple] = set()
        self.specs: dict[tuple, dict[str, Any]] = {}

    def record(self, function, args: tuple, kwargs: dict) -> None:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl

        params = list(inspect.signature(function.fn).parameters.values())
        names = [p.name for p in params]
        skip = set(function.kwargs.get("do_not_specialize") or ())
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        options = {k: v for k, v in kwargs.items() if k not in names}
        key_parts, signature, constexprs, aligned = [], {}, {}, []
        for index, param in enumerate(params):
            value = bound[param.name]
            if "constexpr" in str(param.annotation):
                key_parts.append((param.name, value))
                signature[param.name], constexprs[param.name] = "constexpr", value
                continue
            kind, special = native_specialize_impl(BaseBackend, value, False,
                                                   param.name not in skip, True)
            if not isinstance(value, float):
                key_parts.append((param.name, (kind, special)))
            if kind == "constexpr":  # an integer 1, or None
                signature[param.name], constexprs[param.name] = "constexpr", special
            else:
                signature[param.name] = kind
                if special == "D":
                    aligned.append(index)
        key = (function.fn.__name__, tuple(key_parts), tuple(sorted(options.items())))
        self.keys.add(key)
        self.specs.setdefault(key, {
            "module": function.fn.__module__, "name": function.fn.__name__,
            "signature": signature, "constexprs": constexprs, "aligned": aligned,
            "options": options})

    def install(self, monkeypatch, execute: bool = True) -> None:
        """Record every launch from now on; ``execute=False``: record it only
        (what a launch's configuration is depends on the host's arguments,
        not on what earlier kernels computed; the interpreter takes minutes
        over a real head size)."""
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        recorder = self

        def run(function, *args, grid, warmup, **kwargs):
            recorder.record(function, args, kwargs)
            if execute:
                return original(function, *args, grid=grid, warmup=warmup, **kwargs)
            return None

        monkeypatch.setattr(InterpretedFunction, "run", run)


def compile_for_gpus(specs: list[dict[str, Any]], archs: list[int], cache_dir: Path
                     ) -> dict[int, dict[str, Any]]:
    """Compile ``specs`` for each ``sm_<arch>``, one fresh process per arch, at
    once (Triton's cache in ``cache_dir``): per arch ``{"results": [{"error",
    "shared"} per spec], "kernels": every @triton.jit kernel of inflight as
    module.name}``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    jobs = {arch: subprocess.Popen([sys.executable, __file__, str(arch)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=env)
            for arch in archs}
    compiled = {}
    for arch, job in jobs.items():
        out, err = job.communicate(json.dumps(specs))
        if job.returncode != 0:
            raise RuntimeError(f"compiling for sm_{arch} failed:\n{err[-3000:]}")
        compiled[arch] = json.loads(out)
    return compiled


def _inflight_kernels() -> list[str]:
    """Every ``@triton.jit`` kernel in inflight's sources, as module.name."""
    import importlib

    from triton.runtime.jit import JITFunction

    import inflight

    root = Path(inflight.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if "@triton.jit" not in path.read_text():
            continue
        module = importlib.import_module(
            ".".join(("inflight", *path.relative_to(root).with_suffix("").parts)))
        found += [f"{module.__name__}.{name}" for name, value in vars(module).items()
                  if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__]
    return found


def _compile_all(specs: list[dict[str, Any]], arch: int) -> dict[str, Any]:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    results = []
    for spec in specs:
        kernel = getattr(importlib.import_module(spec["module"]), spec["name"])
        source = ASTSource(kernel, spec["signature"], spec["constexprs"],
                           {(i,): [["tt.divisibility", 16]] for i in spec["aligned"]})
        try:
            compiled = triton.compile(source, target=target, options=spec["options"])
            results.append({"error": None, "shared": compiled.metadata.shared})
        except Exception as e:  # reported per spec: the test prints them all
            results.append({"error": f"{type(e).__name__}: {e}"[-2000:], "shared": None})
    return {"results": results, "kernels": _inflight_kernels()}


if __name__ == "__main__":
    json.dump(_compile_all(json.load(sys.stdin), int(sys.argv[1])), sys.stdout)
