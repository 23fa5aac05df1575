"""Which build of the C kernels this CPU runs.

The kernels are compiled once per instruction-set target, never for
``-march=native`` of the machine that happens to build them, and the best
target the CPU (and its operating system) supports is chosen when the kernels
load; ``INFLIGHT_CPU_ISA`` names another (for tests and comparisons), and
naming one this CPU cannot run is an error.

Targets, best first:

- ``avx512bf16``: AVX-512 with bf16 dot products (``vdpbf16ps``) and int8 ones
  (``vpdpbusd``): AMD Zen 4 and later, Intel Cooper Lake, Sapphire Rapids;
- ``avx512vnni``: AVX-512 with int8 dot products (Intel Cascade/Ice Lake);
- ``avx512``: AVX-512 F/BW/DQ/VL (the AVX2 kernels with 32 vector registers);
- ``avx2``: AVX2, FMA and F16C (x86-64-v3: Intel Haswell, AMD Zen 1-3 on);
- ``generic``: no flags at all (any CPU, any architecture; slower).

``avx512bf16-emulated`` is the ``avx512bf16`` source built for AVX2 with
SIMDe's portable implementations of its two dot-product instructions (the
``libsimde-dev`` headers): the tests run the AVX-512 kernels' logic with it on
a machine without AVX-512. It is never chosen unless asked for.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from inflight.ops.c_build import build_library, compiler

ENV = "INFLIGHT_CPU_ISA"
PROBE = Path(__file__).with_name("csrc") / "isa_probe.c"

_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
_AVX2_NEEDS = frozenset({"avx", "avx2", "fma", "f16c"})
_AVX512_NEEDS = _AVX2_NEEDS | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Isa:
    name: str
    flags: tuple[str, ...]      # the compiler's target flags
    defines: tuple[str, ...]    # the kernels' own paths (csrc/isa.h)
    needs: frozenset[str]       # CPU features (csrc/isa_probe.c names) it runs on
    native_bf16: bool = False   # bf16 dot products in hardware: dtype "auto" picks bf16
    emulated: bool = False      # a test build: never chosen unless asked for


ISAS = (
    Isa("avx512bf16", (*_AVX512, "-mavx512vnni", "-mavx512bf16"),
        ("INFLIGHT_AVX512_VNNI", "INFLIGHT_AVX512_BF16"),
        _AVX512_NEEDS | {"avx512_vnni", "avx512_bf16"}, native_bf16=True),
    Isa("avx512vnni", (*_AVX512, "-mavx512vnni"), ("INFLIGHT_AVX512_VNNI",),
        _AVX512_NEEDS | {"avx512_vnni"}),
    Isa("avx512", _AVX512, (), _AVX512_NEEDS),
    Isa("avx2", _AVX2, (), _AVX2_NEEDS),
    Isa("generic", (), (), frozenset()),
    Isa("avx512bf16-emulated", _AVX2,
        ("INFLIGHT_AVX512_VNNI", "INFLIGHT_AVX512_BF16", "INFLIGHT_SIMDE"), _AVX2_NEEDS,
        native_bf16=True, emulated=True),
)
BY_NAME = {isa.name: isa for isa in ISAS}


@functools.cache
def host_features() -> frozenset[str]:
    """The CPU features this machine runs (none where the probe cannot be built)."""
    try:
        probe = ctypes.CDLL(str(build_library("isa_probe", [PROBE], [], ["-O1"])))
    except (OSError, RuntimeError):
        return frozenset()
    probe.inflight_cpu_features.restype = ctypes.c_char_p
    return frozenset(probe.inflight_cpu_features().decode().split())


def runnable(features: frozenset[str]) -> list[Isa]:
    """The targets a CPU with ``features`` runs, best first (emulations left out)."""
    return [isa for isa in ISAS if not isa.emulated and isa.needs <= features]


def choose(requested: str | None, features: frozenset[str]) -> Isa:
    """The target named by ``requested`` (``INFLIGHT_CPU_ISA``), else the best
    one ``features`` allow; ValueError for an unknown name or one this CPU
    cannot run."""
    if not requested:
        return runnable(features)[0]
    isa = BY_NAME.get(requested)
    if isa is None:
        raise ValueError(f"{ENV}={requested!r} is not a kernel build; choose from "
                         f"{', '.join(BY_NAME)}")
    missing = isa.needs - features
    if missing:
        raise ValueError(f"{ENV}={requested!r}: this CPU lacks {', '.join(sorted(missing))} "
                         f"(it runs {', '.join(i.name for i in runnable(features))})")
    return isa


def requested() -> str | None:
    return os.environ.get(ENV) or None


@functools.cache
def simde_available() -> bool:
    """Whether the C compiler finds SIMDe's AVX-512 headers (the emulated build's)."""
    cc = compiler()
    if cc is None:
        return False
    source = "#include <simde/x86/avx512/dpbf16.h>\n#include <simde/x86/avx512/dpbusd.h>\n"
    result = subprocess.run([cc, "-E", "-x", "c", "-", "-o", os.devnull], input=source,
                            capture_output=True, text=True, check=False)
    return result.returncode == 0
