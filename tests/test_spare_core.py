"""The spare core (csrc/spare_core.c): where the kernels run on one thread and
the spare core is lent, a helper thread claims blocks of the greedy output
layer whenever it gets a core. The tokens are the same with it or without
it, in every weight format and build; it takes blocks when a core is free;
loops from two threads at once and a forked child each finish with their own
tokens; the runner lends it exactly while it has given threads up."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.ops.cpu_ops import CpuOps, lend_spare_core, load_library
from inflight.ops.quant import FORMAT_CODES, QuantOps

pytestmark = pytest.mark.skipif(load_library() is None, reason="no C compiler to build kernels")

FORMATS = ["float32", *FORMAT_CODES]


def _ops(lib, fmt: str):
    return CpuOps(lib) if fmt == "float32" else QuantOps(lib, fmt)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """This thread's kernels on one thread (where the spare core may join)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", FORMATS)
def test_tokens_and_finiteness_are_the_same_with_the_spare_core_or_without(
        build, one_thread, fmt: str) -> None:
    torch.manual_seed(3)
    ops = _ops(build, fmt)
    n, k = 4099, 96
    w = torch.randn(n, k) * 0.1
    w[n - 3] = w[n - 2] = w[5]  # (ties in other blocks)
    packed = ops.pack_weight(w)
    bias = torch.randn(n) if fmt in ("float32", "bf16", "w8a8", "int8") else None
    if bias is not None:
        bias[n - 3] = bias[n - 2] = bias[5]
    try:
        for m in (1, 2, 9, 20, 64, 70):
            x = torch.randn(m, k)
            x[0] = w[5] * 40
            if m > 2:
                x[1, 3] = float("nan")
                x[2] = 3e37
            lend_spare_core(build, False)
            alone = ops.greedy(x, packed, bias, n)
            lend_spare_core(build, True)
            helped = ops.greedy(x, packed, bias, n)
            assert torch.equal(helped[0], alone[0]) and torch.equal(helped[1], alone[1]), m
            logits = ops.linear(x, packed, bias, n).numpy()
            ok = np.flatnonzero(helped[1].numpy())
            assert helped[0][ok].tolist() == logits[ok].argmax(axis=-1).tolist()
    finally:
        lend_spare_core(build, False)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 80), n=st.integers(1, 6000), k=st.integers(1, 130),
       fmt=st.sampled_from(["float32", "bf16"]), seed=st.integers(0, 2**16))
def test_any_shape_gives_the_same_tokens_with_the_spare_core(m: int, n: int, k: int, fmt: str,
                                                             seed: int) -> None:
    lib = load_library()
    torch.manual_seed(seed)
    ops = _ops(lib, fmt)
    packed = ops.pack_weight(torch.randn(n, k))
    x = torch.randn(m, k)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lend_spare_core(lib, False)
        alone = ops.greedy(x, packed, None, n)
        lend_spare_core(lib, True)
        helped = ops.greedy(x, packed, None, n)
    finally:
        lend_spare_core(lib, False)
        torch.set_num_threads(threads)
    assert torch.equal(helped[0], alone[0]) and torch.equal(helped[1], alone[1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a second CPU")
def test_the_helper_takes_blocks_while_a_core_is_free(one_thread) -> None:
    lib = load_library()
    ops = QuantOps(lib, "bf16")
    packed = ops.pack_weight(torch.randn(16384, 64))
    x = torch.randn(64, 64)
    before = lib.inflight_spare_core_blocks()
    lend_spare_core(lib, True)
    try:
        deadline = time.monotonic() + 30
        while lib.inflight_spare_core_blocks() == before and time.monotonic() < deadline:
            ops.greedy(x, packed, None, 16384)
    finally:
        lend_spare_core(lib, False)
    assert lib.inflight_spare_core_blocks() > before
    # Not lent: none taken.
    before = lib.inflight_spare_core_blocks()
    for _ in range(5):
        ops.greedy(x, packed, None, 16384)
    assert lib.inflight_spare_core_blocks() == before


def test_loops_from_two_threads_at_once_each_get_their_own_tokens() -> None:
    lib = load_library()
    ops = QuantOps(lib, "bf16")
    n = 8192
    packed = ops.pack_weight(torch.randn(n, 64))
    inputs = [torch.randn(40, 64) for _ in range(2)]
    expected = [ops.linear(x, packed, None, n).argmax(dim=-1) for x in inputs]
    failures: list[str] = []

    def run(i: int) -> None:
        torch.set_num_threads(1)
        for call in range(30):
            tokens, _ = ops.greedy(inputs[i], packed, None, n)
            if not torch.equal(tokens, expected[i]):
                failures.append(f"thread {i}, call {call}")

    lend_spare_core(lib, True)
    try:
        workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(60)
        assert not any(t.is_alive() for t in workers), "a loop did not finish"
    finally:
        lend_spare_core(lib, False)
    assert failures == []


def test_a_forked_child_runs_its_loops_without_the_parents_helper(one_thread) -> None:
    lib = load_library()
    ops = QuantOps(lib, "bf16")
    n = 8192
    packed = ops.pack_weight(torch.randn(n, 64))
    x = torch.randn(30, 64)
    expected = ops.linear(x, packed, None, n).argmax(dim=-1)
    lend_spare_core(lib, True)
    try:
        ops.greedy(x, packed, None, n)  # (the helper started)
        pid = os.fork()
        if pid == 0:  # the child: its loops run on it alone, then it may lend again
            ok = torch.equal(ops.greedy(x, packed, None, n)[0], expected)
            lend_spare_core(lib, True)
            ok = ok and torch.equal(ops.greedy(x, packed, None, n)[0], expected)
            os._exit(0 if ok else 1)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's loop hung")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        lend_spare_core(lib, False)


def test_the_runner_lends_the_spare_core_while_it_has_given_threads_up(tiny_model) -> None:
    from inflight.config import EngineConfig
    from inflight.engine.factory import build_engine_core
    from inflight.worker.cpu_share import SharedCores

    config = EngineConfig(model=str(tiny_model("llama-gqa")), dtype="float32")
    runner = build_engine_core(config, share_cores=True).runner
    if runner.cores is None:
        pytest.skip("this host's load cannot be read")
    assert runner._lend_spare_core is not None
    heard: list[bool] = []
    runner._lend_spare_core = heard.append
    clock = [0.0]
    busy = [0.0]
    runner.cores = SharedCores(2, num_cpus=2, busy=lambda: busy[0], own=lambda: 0.0,
                               clock=lambda: clock[0])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for load, lent in ((1.0, True), (0.0, False)):
            for _ in range(12):  # (the load is averaged over looks)
                clock[0] += 0.125
                busy[0] += 0.125 * load
                runner._use_free_cores()
            assert heard and heard[-1] is lent
            assert torch.get_num_threads() == (1 if lent else 2)
    finally:
        torch.set_num_threads(threads)
