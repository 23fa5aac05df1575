"""``inflight bench dashboard``: what an open dashboard costs the engine.

One ``inflight serve`` in a subprocess serves the same closed-loop load
(chat-shaped requests from two tenants) after a round to warm up, several
times, alternately with no viewer and with one (in the order off, on, on, off,
... so that a drift of the machine falls on both alike): either a reader of
``/dashboard/feed`` that parses every frame as the page does (``sse``: what the
server pays), or the page itself in headless Chromium (``chromium``: the
server's cost plus the browser's, on the same cores here). It reports each
round's output tokens per second and the ratio of the means and, for the page,
the CPU its browser used (all of Chromium's processes, from /proc: a figure far
steadier than a throughput ratio on a busy machine); it can save a screenshot
of the page under load.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import httpx

from inflight.bench import serving
from inflight.workload import arrivals
from inflight.bench.server_process import ServerProcess
from inflight.config import EngineConfig
from inflight.engine.step_stats import StepStats
from inflight.engine.step_log import StepLog
from inflight.server.dashboard import (BACKLOG_STEPS, FEED_COLUMNS, FEED_INTERVAL_S,
                                       SUMMARY_EVERY_S, coalesce, event)

VIEWERS = ("sse", "chromium")
PAGE_REFRESH_S = (0.25, 0.5, 1, 2, 5)  # the page's refresh picker (dashboard.html)


def feed_reader(url: str, stop: threading.Event, counts: dict[str, int]) -> None:
    """Read the feed until ``stop``, decoding every event as the page does."""
    with httpx.stream("GET", f"{url}/dashboard/feed", timeout=30) as response:
        buffer = ""
        for chunk in response.iter_text():
            buffer += chunk
            *blocks, buffer = buffer.split("\n\n")
            for block in blocks:
                name, data = block.split("\n", 1)
                json.loads(data.removeprefix("data: "))
                counts[name] = counts.get(name, 0) + 1
            if stop.is_set():
                return


@contextmanager
def sse_viewer(url: str) -> Iterator[dict[str, int]]:
    stop, counts = threading.Event(), {}
    thread = threading.Thread(target=feed_reader, args=(url, stop, counts), daemon=True)
    thread.start()
    try:
        yield counts
    finally:
        stop.set()
        thread.join(timeout=10)


def process_tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of process ``root`` and of all its
    descendants, by pid (Linux: /proc)."""
    parent, cpu = {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        # After the command name: state, ppid, ..., utime and stime (fields 14 and 15).
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    tree, grew = {root}, True
    while grew:
        found = {pid for pid, ppid in parent.items() if ppid in tree} - tree
        tree |= found
        grew = bool(found)
    return {pid: cpu[pid] for pid in tree if pid in cpu}


def cpu_spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds between two ``process_tree_cpu`` readings (a process that
    ended in between loses its last part)."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


@contextmanager
def page_viewer(driver: Any, url: str, refresh: float | None, screenshot: str | None,
                after: float) -> Iterator[dict[str, Any]]:
    """The dashboard open in ``driver`` (at its own refresh period unless
    ``refresh``); a screenshot ``after`` seconds in. The dict it yields gets
    ``browser_cpu``: the cores the browser used meanwhile (on average)."""
    driver.get(f"{url}/dashboard" + (f"#refresh={refresh:g}" if refresh is not None else ""))
    time.sleep(1.0)
    timer = threading.Timer(after, driver.save_screenshot, (screenshot,)) if screenshot else None
    if timer is not None:
        timer.start()
    browser = driver.service.process.pid
    before, start = process_tree_cpu(browser), time.monotonic()
    measured: dict[str, Any] = {}
    try:
        yield measured
    finally:
        measured["browser_cpu"] = (cpu_spent(before, process_tree_cpu(browser))
                                   / (time.monotonic() - start))
        if timer is not None:
            timer.join()
        driver.get("about:blank")


def chromium_driver() -> Any:
    """Headless Chromium through Selenium (the test extra), or a clear error."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        raise ValueError("headless Chromium (--viewer chromium) needs selenium "
                         "(pip install selenium)") from None
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if browser is None or driver_path is None:
        raise ValueError("headless Chromium (--viewer chromium) needs chromium and chromedriver "
                         "on PATH (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1500,1100"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver_path), options=options)


class SyntheticDecode:
    """Decode steps of ``sequences`` sequences into a StepLog on a virtual
    clock (``step_seconds`` a step), one finishing and one admitted every 16."""

    def __init__(self, sequences: int, step_seconds: float) -> None:
        self.now = 0.0
        self.step_seconds = step_seconds
        self.log = StepLog(clock=lambda: self.now)
        self.ids = [f"seq-{i}" for i in range(sequences)]
        self.fresh = sequences
        for seq in self.ids:
            self.log.submitted(seq, [seq], 100, 0.0, tenant="t" + seq[-1])

    def run(self, steps: int) -> None:
        n = len(self.ids)
        for step in range(steps):
            self.now += self.step_seconds
            stats = StepStats(num_requests=n, num_tokens=n, request_ids=list(self.ids),
                              new_tokens=[1] * n, prompt_tokens=[0] * n,
                              computed_before=[100] * n, generation_tokens=n,
                              inter_token_latencies=[self.step_seconds] * n, num_running=n)
            ends = self.log.next_step % 16 == 15
            if ends:
                stats.finished, stats.finished_ids = [("length", 1.0, 100, 50)], [self.ids[0]]
            self.log.stepped(stats)
            if ends:
                self.ids = self.ids[1:] + [f"seq-{self.fresh}"]
                self.log.submitted(self.ids[-1], [self.ids[-1]], 100, self.now)
                self.fresh += 1


def recording_cost(sequences: int, steps: int = 2000) -> float:
    """Seconds ``StepLog.stepped`` takes per decode step of ``sequences``
    sequences: the whole of what the engine loop pays per step."""
    decode = SyntheticDecode(sequences, 0.05)
    start = time.perf_counter()
    decode.run(steps)
    return (time.perf_counter() - start) / steps


def feed_cost(sequences: int, steps_per_frame: int, frames: int = 480) -> float:
    """CPU seconds the server spends per second of an open feed at its default
    rates (a frame every 0.25 s holding ``steps_per_frame`` new steps, a
    summary every 2 s): reading the log, merging, encoding."""
    decode = SyntheticDecode(sequences, FEED_INTERVAL_S / steps_per_frame)
    decode.run(BACKLOG_STEPS)
    spent = 0.0
    for i in range(frames):
        decode.run(steps_per_frame)
        start = time.process_time()
        event("steps", {"columns": coalesce(
            decode.log.steps_since(decode.log.next_step - steps_per_frame, BACKLOG_STEPS),
            FEED_COLUMNS)})
        if i % round(SUMMARY_EVERY_S / FEED_INTERVAL_S) == 0:
            event("summary", decode.log.summary())
        spent += time.process_time() - start
    return spent / (frames * FEED_INTERVAL_S)


def run(config: EngineConfig, *, requests: int, concurrency: int, rounds: int, viewer: str,
        max_tokens: int | None, screenshot: str | None, refresh: float | None = None
        ) -> dict[str, Any]:
    if viewer not in VIEWERS:
        raise ValueError(f"--viewer must be one of {', '.join(VIEWERS)}")
    if rounds < 1 or requests < 1 or concurrency < 1:
        raise ValueError("--rounds, --num-requests and --concurrency must be >= 1")
    if screenshot is not None and viewer != "chromium":
        raise ValueError("--screenshot needs --viewer chromium")
    if refresh is not None and (viewer != "chromium" or refresh not in PAGE_REFRESH_S):
        raise ValueError("--refresh needs --viewer chromium and one of the page's periods: "
                         + ", ".join(f"{s:g}" for s in PAGE_REFRESH_S))
    # The chat scenario's shapes, from two tenants (so that the page has shares to show).
    chat = arrivals.SCENARIOS["chat"][0]
    # (Arrival times do not matter in a closed loop: a high rate over a short
    # span, lengthened by build_requests until it holds enough requests.)
    specs = arrivals.build_requests([replace(chat, name=f"tenant-{t}", user=f"tenant-{t}",
                                            rate=100.0) for t in "ab"], 0.1, 0, requests)
    if max_tokens is not None:
        specs = [replace(s, max_tokens=max_tokens) for s in specs]
    order = [on for pair in range(rounds) for on in ((False, True) if pair % 2 == 0
                                                      else (True, False))]
    driver = chromium_driver() if viewer == "chromium" else None
    results: list[dict[str, Any]] = []
    try:
        with ServerProcess(config) as url:
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            serving.run(url, model, specs, concurrency, None, None)  # a round to warm up
            last_on = max(i for i, on in enumerate(order) if on)
            for i, on in enumerate(order):
                if not on:
                    viewing = nullcontext({})
                elif driver is None:
                    viewing = sse_viewer(url)
                else:  # the screenshot halfway through the last round with the page
                    shot = screenshot if i == last_on else None
                    viewing = page_viewer(driver, url, refresh, shot,
                                          results[-1]["wall_seconds"] / 2)
                with viewing as seen:
                    data = serving.run(url, model, specs, concurrency, None, None)
                overall = data["overall"]
                tokens = overall["output_tokens_per_second"]
                browser_cpu = seen.pop("browser_cpu", None)
                results.append({"viewer": on, "output_tokens_per_second": tokens,
                                "wall_seconds": data["wall_seconds"], "frames": dict(seen),
                                "browser_cpu": browser_cpu, "failed": overall["failed"]})
                detail = (f", frames {seen}" if seen else "") + (
                    f", browser {browser_cpu:.3f} of a core" if browser_cpu is not None else "")
                print(f"  round {i + 1}/{len(order)}  {'with' if on else 'without'} "
                      f"{viewer:<8} {tokens:8.1f} output tok/s  "
                      f"({data['wall_seconds']:.1f} s{detail})", flush=True)
    finally:
        if driver is not None:
            driver.quit()
    off = [r["output_tokens_per_second"] for r in results if not r["viewer"]]
    on_ = [r["output_tokens_per_second"] for r in results if r["viewer"]]
    ratio = statistics.fmean(on_) / statistics.fmean(off)
    print(f"\nwithout a viewer {statistics.fmean(off):.1f} tok/s, with {viewer} "
          f"{statistics.fmean(on_):.1f} tok/s: ratio {ratio:.3f}")
    browser = [r["browser_cpu"] for r in results if r["browser_cpu"] is not None]
    if browser:
        print(f"the browser used {statistics.fmean(browser):.3f} of a core on average "
              f"({os.cpu_count()} here)")
    return {"viewer": viewer, "rounds": results, "ratio": ratio, "requests": requests,
            "concurrency": concurrency, "refresh": refresh,
            "browser_cpu": statistics.fmean(browser) if browser else None}


def component_costs() -> dict[str, dict[str, float]]:
    """The recording and feed microbenchmarks, printed."""
    recording = {f"{n} sequences": recording_cost(n) for n in (32, 128)}
    print("recording a step in the StepLog (the engine loop's share): " + ", ".join(
        f"{seconds * 1e6:.0f} us at {what}" for what, seconds in recording.items()))
    # Steps per frame: about this engine's decode rate (here), and a tiny model's.
    feed = {f"{n} sequences, {k} steps a frame": feed_cost(n, k) for n in (32, 128)
            for k in (4, 60)}
    print("serving an open feed (the server's share, % of a core): " + ", ".join(
        f"{100 * share:.2f} at {what}" for what, share in feed.items()))
    return {"recording_seconds_per_step": recording, "feed_cpu_share": feed}


def command(args: Any, config: EngineConfig) -> int:
    costs = component_costs()
    data = run(config, requests=args.num_requests, concurrency=args.concurrency,
               rounds=args.rounds, viewer=args.viewer, max_tokens=args.max_tokens,
               screenshot=args.screenshot, refresh=args.refresh)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({**costs, **data}, indent=2))
    return 0
