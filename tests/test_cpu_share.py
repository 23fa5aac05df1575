"""The CPU kernels' threads follow the cores other processes leave free
(worker.cpu_share), and no token depends on how many there are."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight import LLM, SamplingParams
from inflight.config import EngineConfig
from inflight.engine.factory import build_engine_core
from inflight.worker.cpu_share import (FREE_CORE_MIN, SHARED_CORE_MAX, SharedCores,
                                      read_busy_seconds)


class Host:
    """A fake host: seconds on the clock, busy seconds of its CPUs, and this
    process's CPU seconds, advanced by hand."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = 0.0

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += seconds * own_cores
        self.busy += seconds * (own_cores + other_cores)

    def cores(self, max_threads: int, num_cpus: int | None = None,
              interval: float = 0.1) -> SharedCores:
        return SharedCores(max_threads, num_cpus=num_cpus or max_threads, interval=interval,
                           busy=lambda: self.busy, own=lambda: self.own,
                           clock=lambda: self.now)


def test_a_busy_core_elsewhere_takes_one_thread_and_gives_it_back_when_free() -> None:
    host = Host()
    cores = host.cores(2)
    assert cores.current() == 2
    host.run(0.125, own_cores=1.3, other_cores=0.7)
    assert cores.current() == 1  # (the first look is the average)
    assert cores.others == pytest.approx(0.7)
    # The thread comes back once the average leaves three quarters of its
    # core free: 0.7 x 0.8 ** 5 = 0.23 ...
    for _ in range(4):
        host.run(0.125, own_cores=1.0, other_cores=0.0)
        assert cores.current() == 1
    host.run(0.125, own_cores=1.0, other_cores=0.0)
    assert cores.current() == 2
    assert cores.load == pytest.approx(0.7 * 0.8 ** 5)
    # ... one busier window does not take it away (0.28), the average
    # passing 0.3 of a core does (0.33).
    host.run(0.125, own_cores=1.5, other_cores=0.5)
    assert cores.current() == 2
    host.run(0.125, own_cores=1.5, other_cores=0.5)
    assert cores.current() == 1
    assert cores.others == pytest.approx(0.5)


def test_the_host_is_looked_at_once_an_interval() -> None:
    host = Host()
    cores = host.cores(2, interval=0.1)
    host.run(0.05, own_cores=0.2, other_cores=1.8)
    assert cores.current() == 2  # (too soon to look)
    host.run(0.05, own_cores=0.2, other_cores=1.8)
    assert cores.current() == 1


def test_a_look_after_an_idle_spell_only_starts_a_new_window() -> None:
    host = Host()
    cores = host.cores(2, interval=0.1)
    host.run(0.125, own_cores=1.0, other_cores=0.9)
    assert cores.current() == 1
    host.run(5.0, own_cores=0.0, other_cores=0.1)  # (a quiet spell)
    assert cores.current() == 1
    assert cores.load == pytest.approx(0.9)  # (not averaged in)
    for _ in range(7):  # (0.1 + 0.8 x 0.8 ** 7 = 0.27)
        host.run(0.125, own_cores=1.0, other_cores=0.1)
        assert cores.current() == 1
    host.run(0.125, own_cores=1.0, other_cores=0.1)
    assert cores.current() == 2
    host.run(3.0, own_cores=0.0, other_cores=1.0)  # (a client starting, say)
    assert cores.current() == 2


@pytest.mark.parametrize("others, expected", [(0.0, 8), (0.3, 8), (0.35, 7), (1.8, 6),
                                               (2.6, 5), (2.8, 5), (7.9, 1), (12.0, 1)])
def test_threads_are_the_cores_others_leave_mostly_free_at_least_one(others: float,
                                                                     expected: int) -> None:
    host = Host()
    cores = host.cores(8)
    host.run(0.2, own_cores=1.0, other_cores=others)
    assert cores.current() == expected


@settings(max_examples=200, deadline=None)
@given(max_threads=st.integers(1, 16), extra_cpus=st.integers(0, 16),
       loads=st.lists(st.floats(0.0, 40.0), min_size=1, max_size=30))
def test_after_each_look_the_threads_sit_between_the_mostly_free_and_the_busy_cores(
        max_threads: int, extra_cpus: int, loads: list[float]) -> None:
    host = Host()
    num_cpus = max_threads + extra_cpus
    cores = host.cores(max_threads, num_cpus=num_cpus)
    for others in loads:
        host.run(0.125, own_cores=1.0, other_cores=others)
        threads = cores.current()
        if max_threads == 1:  # (never looks)
            assert threads == 1 and cores.load is None
            continue
        assert cores.load is not None
        free = min(max_threads, num_cpus - cores.load)
        assert 1 <= threads <= max_threads
        assert max(1, math.floor(free + 1.0 - FREE_CORE_MIN + 1e-6)) <= threads
        assert threads <= max(1, math.floor(free + SHARED_CORE_MAX + 1e-6))


def test_threads_are_capped_by_the_cpus_less_the_load_not_by_the_threads_less_it() -> None:
    # 16 CPUs (8 cores, two hardware threads each), 8 threads: a front end on
    # one CPU leaves 15, and the 8 threads stay.
    host = Host()
    cores = host.cores(8, num_cpus=16)
    host.run(0.125, own_cores=8.0, other_cores=1.0)
    assert cores.current() == 8
    host = Host()
    cores = host.cores(8, num_cpus=16)
    host.run(0.125, own_cores=8.0, other_cores=9.5)
    assert cores.current() == 6


def test_a_host_of_many_cpus_is_looked_at_less_often() -> None:
    assert SharedCores(2, num_cpus=2, busy=lambda: 0.0).interval == 0.1
    assert SharedCores(64, num_cpus=64, busy=lambda: 0.0).interval == pytest.approx(0.32)


def test_a_host_that_cannot_be_read_now_keeps_the_threads() -> None:
    host = Host()
    cores = host.cores(2)
    host.run(0.125, own_cores=1.0, other_cores=1.0)
    assert cores.current() == 1
    broken = []

    def busy() -> float:
        if broken:
            raise OSError("gone")
        return host.busy

    cores._busy = busy
    broken.append(True)
    host.run(0.125, own_cores=1.0, other_cores=0.0)
    assert cores.current() == 1
    broken.clear()
    host.run(0.125, own_cores=1.0, other_cores=0.0)
    cores.current()
    assert cores.others == 0.0  # (read again)


def test_a_busy_time_below_our_own_counts_as_no_other_load() -> None:
    # (/proc/stat counts whole ticks; the process's own time is exact.)
    host = Host()
    cores = host.cores(2)
    host.run(0.1, own_cores=2.0, other_cores=0.0)
    host.busy -= 0.02
    assert cores.current() == 2
    assert cores.others == 0.0


def test_one_thread_at_most_never_looks() -> None:
    calls = []
    cores = SharedCores(1, busy=lambda: calls.append(1) or 0.0, own=lambda: 0.0,
                        clock=lambda: 10.0 * len(calls))
    calls.clear()
    assert cores.current() == 1 and cores.current() == 1
    assert calls == []
    with pytest.raises(ValueError, match="max_threads"):
        SharedCores(0)


def test_busy_seconds_count_only_the_cpus_asked_for(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  400 0 100 900 7 0 0 5 0 0\n"
                    "cpu0 100 10 20 300 3 1 2 5 0 0\n"
                    "cpu1 300 0 80 600 4 0 0 0 0 0\n"
                    "intr 12345 0 0\n"
                    "ctxt 999\n")
    hz = __import__("os").sysconf("SC_CLK_TCK")
    assert read_busy_seconds({0}, str(stat)) == pytest.approx(133 / hz)
    assert read_busy_seconds({0, 1}, str(stat)) == pytest.approx(513 / hz)
    assert read_busy_seconds({5}, str(stat)) == 0.0


def test_this_host_can_be_read() -> None:
    cores = SharedCores.of_host(2)
    if cores is None:
        pytest.skip("no /proc/stat here")
    assert 1 <= cores.current() <= 2


class Alternating:
    """Stands in for SharedCores: 1, 2, 1, 2, ... threads, one per step."""

    def __init__(self) -> None:
        self.calls = 0

    def current(self) -> int:
        self.calls += 1
        return 1 + self.calls % 2


@pytest.mark.parametrize("dtype, async_scheduling", [("float32", False), ("bfloat16", False),
                                                     ("float32", True)])
def test_tokens_and_logprobs_do_not_depend_on_the_threads_of_each_step(
        tiny_model, dtype: str, async_scheduling: bool) -> None:
    """(With async scheduling the steps compute on a thread of their own,
    whose thread count is its own.)"""
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 370 + 5 for j in range(4 + 29 * i)]}
               for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = []
    before = torch.get_num_threads()
    try:
        for alternate in (False, True):
            llm = LLM(str(tiny_model("llama-gqa")), dtype=dtype, num_threads=2,
                      max_num_seqs=4, max_num_batched_tokens=64,
                      async_scheduling=async_scheduling)
            runner = llm.engine.runner
            runner.cores = Alternating() if alternate else None
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
            if alternate:
                assert runner.cores.calls >= 10
    finally:
        torch.set_num_threads(before)
    assert results[0] == results[1]


def test_only_an_engine_process_of_its_own_lets_the_threads_follow_the_host(tiny_model) -> None:
    """In-process (``LLM``) the computing thread is the caller's, whose thread
    count stays as it set it."""
    before = torch.get_num_threads()
    model = str(tiny_model("llama-gqa"))
    try:
        assert LLM(model, dtype="float32").engine.runner.cores is None
        own = build_engine_core(EngineConfig(model=model, dtype="float32"), share_cores=True)
        expected = SharedCores if SharedCores.of_host(1) is not None else type(None)
        assert isinstance(own.runner.cores, expected)
        # ... and lends the spare core while it gives threads up (test_spare_core).
        assert (own.runner._lend_spare_core is None) == (own.runner.cores is None)
        # PyTorch's kernels: their sums depend on their threads.
        torch_kernels = build_engine_core(EngineConfig(model=model, dtype="float32",
                                                       kernel_backend="torch"),
                                          share_cores=True)
        assert torch_kernels.runner.cores is None
        assert torch_kernels.runner._lend_spare_core is None
        fixed = build_engine_core(EngineConfig(model=model, dtype="float32", num_threads=1),
                                  share_cores=True)
        assert fixed.runner.cores is None
    finally:
        torch.set_num_threads(before)
