"""How many threads the CPU kernels should use now: the cores this process may
run on, less those that other processes keep busy.

An OpenMP parallel region needs all of its threads on cores at once. When
another process (the API server and its clients, on a small host) keeps a
core busy, a region's second thread waits for that core or takes the first
thread's, and every region of a step pays a hand-off between them: with a
tiny model behind the server on two cores, steps on two threads took 1.4x
the wall time of their CPU time, and the same steps on one thread ran at
their offline speed (docs/benchmarks.md, "The engine's threads and the front
end's cores"). So where the number of threads is not fixed (``num_threads``
unset), the runner asks ``SharedCores`` before each step; it looks at the
host at most every ``interval`` seconds (0.1 s, longer on a host of many
CPUs: ``/proc/stat`` counts each CPU's time in whole ticks, whose rounding
adds up over CPUs). A look more than ``stale`` seconds
after the one before (the engine was idle meanwhile: a client starting, say)
only starts a new window: the load of a quiet spell says nothing of the
next burst's, and the first steps of a burst (its prompts) keep the threads
the last burst ended with. While threads are given up, the runner lends the
kernels a spare core instead (``ops.cpu_ops.lend_spare_core``: a helper that
takes blocks of the output layer only while it gets a core, never waited for).

The load of the other processes is read from ``/proc/stat`` (the busy time
of this process's CPUs) less this process's own CPU time. A thread goes on a
core only while the others keep that core mostly free: waking a region's
worker is a system call, on the way out of which the kernel can hand the core
to whatever else waits for it. Beside a tiny model's front end (0.7 of the
second core) a two-thread region started a third of a millisecond late; with
the front end and its client on 0.34-0.42 of that core two threads served
5-26 % slower than one (a tiny model at ``--stream-interval 4``, a 16M one),
on 0.22-0.24 of it faster (a 38M one), on 0.05 much faster (the default
model): "Who takes the engine's core" in docs/benchmarks.md. Where it cannot
be read (not Linux), the number of threads stays fixed. In a container whose
``/proc/stat`` numbers CPUs its own way (LXCFS), or that is held to a CPU
quota, the other load reads as none and the threads stay as many as
configured. The C kernels' results do not depend on their number of threads
(each output element is computed by one thread, in the same order), so a
change between steps changes no token; the loader shares cores only with
them.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

# /proc/stat's per-CPU fields that count as busy: user, nice, system, irq,
# softirq (not idle, iowait, or steal: time the hypervisor kept from us).
_BUSY_FIELDS = (0, 1, 2, 5, 6)

# The most of a core that other processes may keep busy for a thread to stay
# on it (above it, the thread goes) ...
SHARED_CORE_MAX = 0.3
# ... and the least of it they must leave free for a thread to come back.
FREE_CORE_MIN = 0.75
# The others' load is averaged over looks, each look weighing this much (about
# half a second of them at 0.1 s): one window's figure jitters by a tenth or
# two, its ticks rounded, against thresholds a tenth of a core apart.
SMOOTHING = 0.2


def read_busy_seconds(cpus: set[int], path: str = "/proc/stat") -> float:
    """The busy time, in seconds since boot, of the CPUs ``cpus`` together."""
    ticks = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.startswith(b"cpu") or line[3:4] == b" ":
                continue
            name, *fields = line.split()
            if int(name[3:]) in cpus:
                ticks += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return ticks / os.sysconf("SC_CLK_TCK")


class SharedCores:
    """The number of threads to use: at most ``max_threads``, and no more
    than the ``num_cpus`` this process may run on of which other processes
    keep at most ``SHARED_CORE_MAX`` of a core busy (at least one); a thread
    given up comes back once ``FREE_CORE_MIN`` of its core is free. The
    others' load is looked at every ``interval`` seconds and averaged over
    looks (``SMOOTHING``). ``busy``
    (the busy seconds of those CPUs), ``own`` (this process's CPU seconds)
    and ``clock`` are the host's by default."""

    def __init__(self, max_threads: int, *, num_cpus: int | None = None,
                 interval: float | None = None, stale: float = 1.0,
                 busy: Callable[[], float] | None = None,
                 own: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_threads < 1:
            raise ValueError("max_threads must be >= 1")
        cpus = os.sched_getaffinity(0) if busy is None or num_cpus is None else set()
        self.max_threads = max_threads
        self.num_cpus = len(cpus) if num_cpus is None else num_cpus
        # (Each CPU's ticks round by up to one in a window: ~0.04 of a core
        # per CPU at 0.1 s, adding up as the square root of their number.)
        self.interval = max(0.1, 0.005 * self.num_cpus) if interval is None else interval
        self.stale = max(stale, 2 * self.interval)
        if busy is None:
            busy = lambda: read_busy_seconds(cpus)  # noqa: E731
        self._busy, self._own, self._clock = busy, own, clock
        self.threads = max_threads
        self.others = 0.0  # cores the other processes kept busy, at the last look
        self.load: float | None = None  # ... and averaged over the looks
        self._last = self._look()

    @classmethod
    def of_host(cls, max_threads: int) -> SharedCores | None:
        """One for this host, or None where its load cannot be read."""
        try:
            return cls(max_threads)  # (its first look reads the host)
        except (OSError, ValueError, AttributeError):
            return None

    def _look(self) -> tuple[float, float, float]:
        return self._clock(), self._busy(), self._own()

    def current(self) -> int:
        """The number of threads for the next step (the last ones, where the
        host cannot be read now)."""
        now = self._clock()
        if now - self._last[0] < max(self.interval, 1e-9) or self.max_threads == 1:
            return self.threads
        try:
            look = self._look()
        except (OSError, ValueError):
            return self.threads
        then, self._last = self._last, look
        now, busy, own = look
        if now - then[0] > self.stale:
            return self.threads
        others = ((busy - then[1]) - (own - then[2])) / (now - then[0])
        self.others = max(0.0, others)
        self.load = self.others if self.load is None else (
            self.load + SMOOTHING * (self.others - self.load))
        free = min(self.max_threads, self.num_cpus - self.load)
        kept = math.floor(free + SHARED_CORE_MAX + 1e-9)
        if kept < self.threads:
            self.threads = max(1, kept)
        else:  # (free is at most max_threads)
            self.threads = max(self.threads, math.floor(free + 1.0 - FREE_CORE_MIN + 1e-9))
        return self.threads
