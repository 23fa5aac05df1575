"""The dashboard: the engine's step log (slots, histories, summaries) over every
policy and option, the feed's coalescing, its routes and API key, and the page
itself in headless Chromium against a live server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import given, settings
from browser_helpers import screenshot, wait_for
from hypothesis import strategies as st
from selenium.webdriver.support.ui import Select
from server_helpers import start_server
from test_sim import make_config, make_trace, options, request_spec, run_engine_loop

from inflight.config import EngineConfig
from inflight.engine.llm_engine import LLMEngine
from inflight.engine.step_log import StepLog
from inflight.server.dashboard import coalesce
from inflight.sim.runner import VirtualClock


def run_logged(config, trace, aborts: list[tuple[int, int]]) -> tuple[StepLog, list, LLMEngine]:
    """test_sim's plain engine loop with a StepLog fed as AsyncEngine feeds it;
    ``aborts``: (step, request index) pairs."""
    clock = VirtualClock()
    log = StepLog(max_steps=100_000, clock=clock)
    stats = []

    def submitted(prepared, r) -> None:
        log.submitted(prepared.request_id, prepared.core.sequence_ids,
                      len(prepared.core.prompt_token_ids), r.arrival, r.tenant, r.priority)

    def abort(step: int, core: LLMEngine) -> None:
        for at, index in aborts:
            sequences = core.core.sequence_ids(str(index))
            if at == step and sequences:
                core.abort_request(str(index))
                log.ended(str(index), sequences, "aborted")

    def stepped(core: LLMEngine) -> None:
        log.stepped(core.last_step)
        stats.append(core.last_step)

    _, _, core = run_engine_loop(config, trace, clock=clock, idle_step=0.01,
                                 on_submit=submitted, before_step=abort, on_step=stepped)
    return log, stats, core


@settings(max_examples=200, deadline=None)
@given(o=options, specs=st.lists(request_spec, min_size=1, max_size=10),
       aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=3))
def test_slots_follow_the_running_batch_under_every_policy_and_option(o, specs, aborts):
    """Each step: one cell per slot, a prompt or decode cell for every sequence
    computed, slots below max_num_seqs and held by running sequences only; a
    slot freed is the lowest taken next; at the end every slot is free and
    every request's history is whole."""
    config = make_config(o)
    trace = make_trace(specs)
    log, stats, core = run_logged(config, trace, aborts)
    records = log.steps_since(0, 100_000)
    assert len(records) == len(stats)
    capacity = config.engine.max_num_seqs
    slot_of: dict[str, int] = {}
    for record, step in zip(records, stats):
        slots = [c[0] for c in record["cells"]]
        assert len(slots) == len(set(slots)), record
        assert all(0 <= s < capacity for s in slots), (record, capacity)
        kinds = {c[1]: c[2] for c in record["cells"]}
        for seq, prompt in zip(step.request_ids, step.prompt_tokens):
            assert kinds[seq] == ("p" if prompt else "d")
        for seq in step.preempted_ids:
            assert seq not in kinds or kinds[seq] == "x"
        # A sequence keeps its slot from step to step until it ends or is preempted.
        for cell in record["cells"]:
            if cell[1] in slot_of:
                assert cell[0] == slot_of[cell[1]], (cell, slot_of)
        slot_of = {c[1]: c[0] for c in record["cells"] if c[2] != "x"}
        # No more sequences hold slots than the scheduler runs (plus those it
        # finished this step, still shown in their last cell).
        held = sum(1 for c in record["cells"] if c[2] != "x")
        assert held <= step.num_running + len(step.finished_ids)
    assert not log._holders and not log._live
    # Every preemption is reported, also in a step that computes nothing.
    assert sum(s.num_preempted for s in stats) == core.scheduler.stats.num_preemptions
    for i in range(len(trace)):
        history = log.history(str(i))
        if history is None:  # refused at submission
            continue
        events = [e["event"] for e in history["events"]]
        assert events[0] == "queued"
        assert history["state"] in ("finished", "aborted"), history
        if history["state"] == "finished":
            assert events.count("finished") == len(history["sequences"])
            assert history["output_tokens"] > 0 or "deadline" in history["finish_reasons"]
            first = history["events"].index(next(e for e in history["events"]
                                                 if e["event"] == "finished"))
            assert "scheduled" in events[:first] or "deadline" in history["finish_reasons"]


def stats_of(**fields) -> SimpleNamespace:
    """A StepStats-shaped record for the log's unit tests."""
    base = dict(request_ids=[], new_tokens=[], prompt_tokens=[], computed_before=[],
                preempted_ids=[], first_token_ids=[], first_tokens=[], finished_ids=[],
                finished=[], inter_token_latencies=[], seconds=0.01, num_waiting=0,
                num_running=0, kv_cache_usage=0.0, num_tokens=0, num_prompt_tokens=0,
                generation_tokens=0, num_preempted=0, prefix_cache_queries=0,
                prefix_cache_hits=0, ended_beam_ids=[], end_time=0.0)
    return SimpleNamespace(**{**base, **fields})


def decode(*seqs: str, **fields) -> SimpleNamespace:
    return stats_of(request_ids=list(seqs), new_tokens=[1] * len(seqs),
                    prompt_tokens=[0] * len(seqs), computed_before=[5] * len(seqs), **fields)


def test_a_freed_slot_is_refilled_lowest_first_and_a_preempted_slot_in_the_same_step():
    now = [100.0]
    log = StepLog(clock=lambda: now[0])
    for rid in "abcd":
        log.submitted(rid, [rid], 5, now[0], tenant="t1" if rid < "c" else None)
    log.stepped(stats_of(request_ids=["a", "b", "c"], new_tokens=[5, 5, 5],
                         prompt_tokens=[5, 5, 5], computed_before=[0, 0, 0]))
    log.stepped(decode("a", "b", "c", finished_ids=["b"], finished=[("stop", 1.0, 5, 2)]))
    log.stepped(decode("a", "c", "d"))  # d takes b's slot, the lowest free
    log.stepped(decode("a", "d", preempted_ids=["c"]))
    records = log.steps_since(0, 10)
    # context: cached + new tokens; pairs: n * (cached + (n + 1) / 2) per sequence
    assert [(r["context"], r["pairs"]) for r in records] == [(15, 45.0), (18, 18.0), (18, 18.0),
                                                             (12, 12.0)]
    assert [sorted(c[:3] for c in r["cells"]) for r in records] == [
        [[0, "a", "p"], [1, "b", "p"], [2, "c", "p"]],
        [[0, "a", "d"], [1, "b", "d"], [2, "c", "d"]],
        [[0, "a", "d"], [1, "d", "d"], [2, "c", "d"]],
        [[0, "a", "d"], [1, "d", "d"], [2, "c", "x"]]]
    log.submitted("e", ["e"], 5, now[0])
    # e is admitted in the step that preempts d: it takes d's slot at once.
    log.stepped(stats_of(request_ids=["a", "e"], new_tokens=[1, 5], prompt_tokens=[0, 5],
                         computed_before=[5, 0], preempted_ids=["d"]))
    cells = sorted(log.steps_since(4, 10)[0]["cells"])
    assert cells == [[0, "a", "d", 1], [1, "e", "p", 5, "d"]]
    # A running sequence that is not computed keeps its slot, shown as held.
    log.stepped(decode("e"))
    assert sorted(log.steps_since(5, 10)[0]["cells"]) == [[0, "a", "h", 0], [1, "e", "d", 1]]
    history = log.history("d")
    assert [e["event"] for e in history["events"]] == ["queued", "scheduled", "preempted"]
    assert history["state"] == "running"
    log.ended("d", ["d"], "aborted")
    assert log.history("d")["state"] == "aborted"
    assert log.history("zzz") is None
    summary = log.summary()
    # a: a prompt and four decodes, b: a prompt and one; c: a prompt and two,
    # d: two decodes, e: a prompt and one.
    assert summary["tenant_tokens"] == {"t1": 9 + 6, "": 7 + 2 + 6}
    assert summary["aborted_total"] == 1


def test_the_summary_is_over_the_last_window_with_percentiles():
    now = [1000.0]
    log = StepLog(window_s=10, clock=lambda: now[0])
    log.stepped(decode(inter_token_latencies=[9.0] * 5, first_tokens=[(50.0, 0, 1)],
                       first_token_ids=["gone"], num_tokens=1000, preempted_ids=[],
                       num_preempted=3))
    now[0] += 30  # the first second has left the window
    for i in range(10):
        log.stepped(decode(inter_token_latencies=[0.01 * (i + 1)], num_tokens=10,
                           first_tokens=[(0.1 * (i + 1), 0, 1)], first_token_ids=["x"],
                           prefix_cache_queries=10, prefix_cache_hits=i))
        now[0] += 1
    summary = log.summary()
    assert summary["tokens_per_s"] == pytest.approx(100 / 10)
    # Percentiles from 2 %-wide bins: of 0.01 ... 0.1 s, and of 0.1 ... 1 s.
    assert summary["itl_p50"] == pytest.approx(0.05, rel=0.02)
    assert summary["ttft_p99"] == pytest.approx(1.0, rel=0.02)
    assert summary["prefix_hit_rate"] == pytest.approx(45 / 100)
    assert summary["preemptions"] == 0
    assert len(summary["series"]) == 10


def test_steps_since_pages_forward_and_the_ring_forgets_the_oldest():
    log = StepLog(max_steps=5)
    for _ in range(8):
        log.stepped(stats_of())
    assert [r["step"] for r in log.steps_since(0, 100)] == [3, 4, 5, 6, 7]
    assert [r["step"] for r in log.steps_since(6, 100)] == [6, 7]
    assert [r["step"] for r in log.steps_since(0, 2)] == [6, 7]
    assert log.steps_since(8, 100) == []
    log = StepLog(max_requests=3)
    for i in range(5):
        log.submitted(str(i), [str(i)], 1, 0.0)
    assert log.history("0") is None and log.history("4") is not None
    with pytest.raises(ValueError):
        StepLog(max_steps=0)


def record(step: int, cells: list, **fields) -> dict:
    return {"step": step, "time": float(step), "seconds": 0.01, "cells": cells, "waiting": step,
            "running": len(cells), "kv_usage": 0.1, "tokens": 1, "prompt_tokens": 0,
            "generated": 1, "preempted": 0, "context": 10, "pairs": 10.0, **fields}


def test_coalescing_keeps_the_strongest_cell_and_sums_the_rest():
    records = [record(0, [[0, "a", "d", 1], [1, "b", "p", 8]]),
               record(1, [[0, "a", "d", 1], [1, "b", "d", 1]]),
               record(2, [[0, "c", "p", 4, "a"]], preempted=1),
               record(3, [[0, "c", "d", 1], [1, "b", "h", 0]])]
    assert coalesce(records, 10) == [{**r, "steps": [r["step"]] * 2} for r in records]
    merged = coalesce(records, 2)
    assert [m["steps"] for m in merged] == [[0, 1], [2, 3]]
    assert sorted(merged[0]["cells"]) == [[0, "a", "d", 2], [1, "b", "p", 9]]
    assert sorted(merged[1]["cells"]) == [[0, "c", "p", 5, "a"], [1, "b", "h", 0]]
    assert merged[1]["waiting"] == 3 and merged[1]["preempted"] == 1
    assert merged[0]["tokens"] == 2 and merged[0]["context"] == 20 and merged[0]["pairs"] == 20
    assert len(coalesce([record(i, []) for i in range(1000)], 24)) == 24
    assert coalesce([], 5) == []


class TickingLog:
    """A StepLogSource whose engine runs one step per read: each read of the
    feed finds one new step record."""

    def __init__(self) -> None:
        self.next_step = 0
        self.summaries = 0

    async def info(self) -> dict[str, int]:
        return {"capacity": 2, "next_step": self.next_step}

    async def steps_since(self, cursor: int, limit: int) -> list[dict]:
        self.next_step += 1
        return [record(step, [[0, "a", "d", 1]]) for step in range(cursor, self.next_step)]

    async def summary(self) -> dict:
        self.summaries += 1
        return {"n": self.summaries}

    def load(self) -> SimpleNamespace:
        return SimpleNamespace(num_waiting=0, num_running=1, kv_cache_usage=0.1)


async def feed_writes(interval: float, ticks: int) -> list[tuple[float, str]]:
    """What ``_frames`` writes in ``ticks`` ticks after its hello, write by
    write, each with the loop time it came."""
    from inflight.server import dashboard

    class Connected:
        async def is_disconnected(self) -> bool:
            return False

    frames = dashboard._frames(Connected(), TickingLog(), {}, interval, 10)
    loop = asyncio.get_running_loop()
    writes = []
    for _ in range(ticks + 1):
        write = await anext(frames)
        writes.append((loop.time(), write))
    await frames.aclose()
    return writes


def test_a_tick_is_one_write_and_summaries_wait_for_the_longer_period(monkeypatch):
    """A tick's steps and summary reach the page in one write (one paint
    there); summaries come every SUMMARY_EVERY_S, or every frame when frames
    are further apart than that."""
    from inflight.server import dashboard

    monkeypatch.setattr(dashboard, "SUMMARY_EVERY_S", 0.1)
    writes = asyncio.run(feed_writes(0.01, 15))
    assert writes[0][1].startswith("event: hello")
    ticks = writes[1:]
    assert all(w.count("event: steps") == 1 for _, w in ticks)
    summaries = [t for t, w in ticks if "event: summary" in w]
    assert "event: summary" in ticks[0][1] and 2 <= len(summaries) < len(ticks)
    assert all(b - a > 0.09 for a, b in zip(summaries, summaries[1:]))  # times of the writes
    writes = asyncio.run(feed_writes(0.15, 3))
    assert all("event: steps" in w and "event: summary" in w for _, w in writes[1:])


# ---------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def tiny_server(tiny_model):
    live = start_server(EngineConfig(model=str(tiny_model("llama-gqa")), kv_cache_memory="64MiB",
                                     max_num_seqs=4), api_key="sekret")
    yield live
    live.stop()


def read_feed(url: str, seconds: float, headers: dict,
              until: Callable[[dict[str, list]], bool] | None = None) -> dict[str, list]:
    """The feed's events by name, read for ``seconds``, or with ``until`` until
    it holds of them (within 60 s: a loaded machine runs the burst slowly)."""
    events: dict[str, list] = {}
    with httpx.stream("GET", url, headers=headers, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        start, buffer = time.monotonic(), ""
        for chunk in response.iter_text():
            *blocks, buffer = (buffer + chunk).split("\n\n")
            for block in blocks:
                name, data = block.split("\n")
                events.setdefault(name.removeprefix("event: "), []).append(
                    json.loads(data.removeprefix("data: ")))
            elapsed = time.monotonic() - start
            if (until(events) if until else elapsed > seconds) or elapsed > 60:
                break
    return events


def burst(url: str, count: int, headers: dict | None = None, base: int = 40) -> None:
    """``count`` completions at once, of varied lengths."""
    async def go() -> None:
        async with httpx.AsyncClient(timeout=120, headers=headers) as client:
            responses = await asyncio.gather(*(client.post(f"{url}/v1/completions", json={
                "prompt": f"request {i} " + "word " * (i % 7), "max_tokens": base + 11 * (i % 6),
                "ignore_eos": True, "user": f"tenant-{i % 2}"}) for i in range(count)))
        assert all(r.status_code == 200 for r in responses)
    asyncio.run(go())


def test_the_feed_needs_the_key_the_page_does_not(tiny_server):
    url, key = tiny_server.url, {"Authorization": "Bearer sekret"}
    assert httpx.get(f"{url}/dashboard").status_code == 200
    assert "inflight dashboard" in httpx.get(f"{url}/dashboard").text
    for name in ("dashboard.js", "uPlot.iife.min.js", "LICENSE-uPlot"):
        assert httpx.get(f"{url}/dashboard/static/{name}").status_code == 200
    assert httpx.get(f"{url}/dashboard/static/secret.txt").status_code == 404
    for path in ("/dashboard/feed", "/dashboard/requests/x"):
        response = httpx.get(f"{url}{path}")
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    response = httpx.get(f"{url}/dashboard/feed?replica=nope", headers=key)
    assert response.status_code == 404 and response.json()["error"]["param"] == "replica"
    assert httpx.get(f"{url}/dashboard/feed?interval=0", headers=key).status_code == 400
    assert httpx.get(f"{url}/dashboard/requests/nope", headers=key).status_code == 404


def test_the_feed_streams_steps_summaries_and_histories(tiny_server):
    url, key = tiny_server.url, {"Authorization": "Bearer sekret"}
    sender = threading.Thread(target=burst, args=(url, 16, key))
    sender.start()
    events = read_feed(f"{url}/dashboard/feed?interval=0.05&columns=8", 3.0, key,
                       until=lambda e: any(s["finished"] >= 16 for s in e.get("summary", ())))
    sender.join()
    hello = events["hello"][0]
    assert hello["capacity"] == 4 and hello["replicas"] == ["engine"]
    frames = events["steps"]
    assert all(len(f["columns"]) <= 8 for f in frames[1:])  # coalesced after the backlog
    seqs = {c[1] for f in frames for col in f["columns"] for c in col["cells"]}
    assert len(seqs) >= 8
    steps = [col["steps"] for f in frames for col in f["columns"]]
    assert all(a[1] < b[0] for a, b in zip(steps, steps[1:]))  # in order, none twice
    summary = events["summary"][-1]
    assert summary["finished"] >= 16 and summary["ttft_p50"] > 0
    assert set(summary["tenant_tokens"]) == {"tenant-0", "tenant-1"}
    rid = summary["recent"][0]["request_id"]
    history = httpx.get(f"{url}/dashboard/requests/{rid}", headers=key).json()
    assert [e["event"] for e in history["events"]][0] == "queued"
    assert history["events"][-1]["event"] == "finished" and history["state"] == "finished"
    assert tiny_server.wait_idle()


# ---------------------------------------------------------------- in Chromium
def refill_gaps(columns: list[dict]) -> list[int]:
    """For each slot that passed from one sequence to another while requests
    waited: the steps between the old sequence's last column and the new one's first."""
    gaps = []
    last: dict[int, tuple[str, dict]] = {}
    for column in columns:
        for cell in column["cells"]:
            slot, seq = cell[0], cell[1]
            before = last.get(slot)
            if before is not None and before[0] != seq and before[1]["waiting"] > 0:
                gaps.append(column["steps"][0] - before[1]["steps"][1])
            last[slot] = (seq, column)
    return gaps


def test_the_page_shows_slots_refilled_and_the_queue_rising_and_falling(browser, tiny_model,
                                                                       tmp_path):
    live = start_server(EngineConfig(model=str(tiny_model("llama-gqa")), kv_cache_memory="64MiB",
                                     max_num_seqs=4))
    try:
        # Four frames a second: the burst rises and drains within a few seconds.
        browser.get(f"{live.url}/dashboard#refresh=0.25")
        wait_for(browser, "return window.inflightDashboard.hello !== null")
        assert browser.execute_script("return window.inflightDashboard.hello.interval") == 0.25
        assert browser.find_element("id", "status").text == "live"
        sender = threading.Thread(target=burst, args=(live.url, 40, None, 60))
        sender.start()
        waiting = []
        while sender.is_alive():
            waiting.append(int(browser.find_element("id", "waiting").text or 0))
            time.sleep(0.05)
        sender.join()
        wait_for(browser, "return document.getElementById('waiting').textContent === '0'")
        waiting.append(0)
        assert max(waiting) >= 10, waiting  # 40 requests on 4 slots
        columns = browser.execute_script("return window.inflightDashboard.columns")
        sequences = {c[1] for col in columns for c in col["cells"]}
        assert len(sequences) >= 10
        gaps = refill_gaps(columns)
        assert len(gaps) >= 10 and max(gaps) <= 3, gaps
        # The strip is drawn: decode-green and prompt-blue pixels on the canvas.
        colours = browser.execute_script("""
            const c = document.getElementById('strip');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let green = 0, blue = 0;
            for (let i = 0; i < d.length; i += 4) {
              if (d[i] === 0x2e && d[i + 1] === 0x9e && d[i + 2] === 0x5b) green++;
              if (d[i] === 0x3b && d[i + 1] === 0x7d && d[i + 2] === 0xdd) blue++;
            }
            return [green, blue];""")
        assert colours[0] > 500 and colours[1] > 10, colours
        # Hovering a cell names its request; clicking it shows the request's history.
        # (The pointer events go to the cell's page coordinates, computed from
        # the strip's layout in the same script, so a late frame cannot move it.)
        tip, sequence = browser.execute_script("""
            const L = stripLayout();
            const i = L.visible.length - 1 - [...L.visible].reverse().findIndex(
                (col) => col.cells.some((c) => c[2] === 'd'));
            const cell = L.visible[i].cells.find((c) => c[2] === 'd');
            const rect = L.canvas.getBoundingClientRect();
            const at = {clientX: rect.left + L.x0 + i * L.colWidth + L.colWidth / 2,
                        clientY: rect.top + cell[0] * L.rowHeight + L.rowHeight / 2,
                        bubbles: true};
            L.canvas.dispatchEvent(new MouseEvent('mousemove', at));
            const tip = document.getElementById('tip');
            const text = tip.hidden ? '' : tip.textContent;
            L.canvas.dispatchEvent(new MouseEvent('click', at));
            return [text, cell[1]];""")
        assert sequence in tip and "decode" in tip, (sequence, tip)
        wait_for(browser, "return document.querySelectorAll('#history li b').length >= 3")
        events = [e.text for e in browser.find_elements("css selector", "#history li b")]
        assert events[0] == "queued" and "finished" in events, events
        # The summary arrived: latency tiles, tenants and the latest requests.
        wait_for(browser, "return document.querySelectorAll('#requests tbody tr').length >= 20")
        assert "ms" in browser.find_element("id", "ttft").text
        assert "tenant-0" in browser.find_element("id", "tenants").text
        screenshot(browser, tmp_path, "dashboard-tiny.png")
        assert live.wait_idle()
    finally:
        live.stop()


def test_the_refresh_period_is_chosen_on_the_page_and_a_hidden_tab_paints_nothing(
        browser, tiny_server):
    url, key = tiny_server.url, {"Authorization": "Bearer sekret"}
    browser.get(f"{url}/dashboard")
    browser.execute_script("localStorage.clear(); localStorage.setItem('inflight-api-key', 'sekret')")
    browser.refresh()
    hello = "return window.inflightDashboard.hello && window.inflightDashboard.hello.interval"
    assert wait_for(browser, hello) == 1  # the default: a frame a second
    picker = Select(browser.find_element("id", "refresh"))
    assert picker.first_selected_option.text == "1 s"
    columns = "return window.inflightDashboard.columns.length"

    # Paused: the feed is closed and the picture stays as it was.
    picker.select_by_value("0")
    wait_for(browser, "return document.getElementById('status').textContent === 'paused'")
    before = browser.execute_script(columns)
    burst(url, 6, key)
    time.sleep(0.6)
    assert browser.execute_script(columns) == before

    # Another period: a new feed at that rate (its backlog holds the burst),
    # remembered across a reload.
    picker.select_by_value("0.5")
    wait_for(browser, hello + " === 0.5")
    wait_for(browser, columns + " > " + str(before))
    browser.refresh()
    assert wait_for(browser, hello) == 0.5
    assert Select(browser.find_element("id", "refresh")).first_selected_option.text == "0.5 s"

    # A hidden tab keeps reading the feed but paints nothing until it is shown.
    browser.execute_script("""
        Object.defineProperty(document, 'hidden', {configurable: true, get: () => true});
        document.dispatchEvent(new Event('visibilitychange'));""")
    wait_for(browser, "return painted.lastStep >= 0")
    shown = browser.execute_script("return painted.lastStep")
    last = "return window.inflightDashboard.columns.at(-1).steps[1]"
    burst(url, 6, key)
    wait_for(browser, last + " > " + str(shown))
    time.sleep(0.6)
    assert browser.execute_script("return painted.lastStep") == shown
    browser.execute_script("""
        Object.defineProperty(document, 'hidden', {configurable: true, get: () => false});
        document.dispatchEvent(new Event('visibilitychange'));""")
    wait_for(browser, "return painted.lastStep === window.inflightDashboard.columns.at(-1).steps[1]")
    assert tiny_server.wait_idle()


def test_with_an_api_key_the_page_asks_for_it_once(browser, tiny_server, tmp_path):
    browser.get(f"{tiny_server.url}/dashboard")
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    form = browser.find_element("id", "key-form")
    wait_for(browser, "return !document.getElementById('key-form').hidden")
    browser.find_element("id", "key").send_keys("sekret")
    form.find_element("tag name", "button").click()
    wait_for(browser, "return window.inflightDashboard.hello !== null")
    burst(tiny_server.url, 6, {"Authorization": "Bearer sekret"})
    wait_for(browser, "return window.inflightDashboard.columns.length > 0")
    browser.refresh()  # the key is remembered
    wait_for(browser, "return window.inflightDashboard.hello !== null")
    assert browser.find_element("id", "key-form").is_displayed() is False
    screenshot(browser, tmp_path, "dashboard-key.png")


def test_bench_dashboard_alternates_rounds_and_reads_the_feed(capsys):
    """``inflight bench dashboard`` on the default model, one pair of short rounds."""
    from inflight.bench import dashboard_cost

    config = EngineConfig(kv_cache_memory="64MiB", max_num_seqs=4)
    data = dashboard_cost.run(config, requests=6, concurrency=3, rounds=1, viewer="sse",
                              max_tokens=8, screenshot=None)
    assert [r["viewer"] for r in data["rounds"]] == [False, True]
    assert all(r["failed"] == 0 and r["output_tokens_per_second"] > 0
               for r in data["rounds"]), data["rounds"]
    assert data["rounds"][1]["frames"]["event: hello"] == 1  # the reader saw the feed
    assert data["ratio"] > 0 and "ratio" in capsys.readouterr().out
    assert dashboard_cost.recording_cost(8, steps=50) > 0
    assert dashboard_cost.feed_cost(8, 4, frames=16) > 0
    with pytest.raises(ValueError, match="--screenshot needs --viewer chromium"):
        dashboard_cost.run(config, requests=8, concurrency=4, rounds=1, viewer="sse",
                           max_tokens=None, screenshot="x.png")
    from inflight.server.dashboard import STATIC

    periods = re.findall(r'<option value="([\d.]+)">', (STATIC / "dashboard.html").read_text())
    assert {float(p) for p in periods} - {0} == set(dashboard_cost.PAGE_REFRESH_S)
    for viewer, refresh in (("sse", 1.0), ("chromium", 0.3)):
        with pytest.raises(ValueError, match="--refresh needs --viewer chromium and one of"):
            dashboard_cost.run(config, requests=8, concurrency=4, rounds=1, viewer=viewer,
                               max_tokens=None, screenshot=None, refresh=refresh)


def test_the_browsers_cpu_is_read_over_its_whole_process_tree():
    """What the bench counts as the browser's CPU: a process and its
    descendants (a grandchild that spins for 0.3 s is counted)."""
    from inflight.bench.dashboard_cost import cpu_spent, process_tree_cpu

    spin = "import time; t = time.process_time(); exec('while time.process_time() - t < 0.3: pass')"
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                               f"subprocess.run([sys.executable, '-c', {spin!r}])"])
    deadline = time.monotonic() + 30
    while len(before := process_tree_cpu(parent.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    during = process_tree_cpu(parent.pid)
    assert len(during) == 2 and parent.pid in during  # the child and its child
    parent.wait()
    assert cpu_spent(before, during) > 0.02
    assert process_tree_cpu(os.getpid())[os.getpid()] > 0
