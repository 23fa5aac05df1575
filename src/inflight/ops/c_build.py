"""C sources compiled into a shared library with the machine's C compiler,
once, and cached under the inflight cache directory by a hash of the sources,
the headers they include, the flags and the compiler: a build never depends
on the machine that made it beyond what its flags say, so a cache shared by
several machines is safe. Sources compile in parallel, then link."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from inflight.cache import cache_root


class BuildError(RuntimeError):
    """The compiler failed; the message ends with its output."""


def compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` on the path; None if there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_library(name: str, sources: list[Path], headers: list[Path], flags: list[str],
                  link_flags: tuple[str, ...] = ()) -> Path:
    """The path of ``name-<hash>.so`` built from ``sources`` with ``flags``
    (``-shared -fPIC`` added), building it first if it is not cached.
    Raises BuildError if the compiler fails, FileNotFoundError without one."""
    cc = compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler: set CC or install cc")
    parts = [path.read_bytes() for path in [*sources, *headers]]
    key = hashlib.sha256(b"\0".join([*parts, " ".join([*flags, *link_flags]).encode(),
                                     cc.encode()])).hexdigest()[:16]
    library = cache_root() / "kernels" / f"{name}-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as work:
        objects = [Path(work) / f"{i}-{source.stem}.o" for i, source in enumerate(sources)]
        jobs = [subprocess.Popen([cc, *flags, "-fPIC", "-c", "-o", str(obj), str(source)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for source, obj in zip(sources, objects)]
        failures = [output for job in jobs
                    for output, _ in [job.communicate()] if job.returncode != 0]
        if failures:
            raise BuildError(f"building {name} failed:\n" + "\n".join(failures)[-3000:])
        tmp = Path(work) / library.name
        result = subprocess.run([cc, *flags, "-shared", "-o", str(tmp), *map(str, objects),
                                 *link_flags], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise BuildError(f"linking {name} failed:\n{result.stderr[-3000:]}")
        os.replace(tmp, library)  # atomic: a concurrent build of the same key is harmless
    return library
