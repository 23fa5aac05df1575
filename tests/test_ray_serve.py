"""The Ray Serve deployment on a real local Ray: two replicas of a tiny model
behind one OpenAI endpoint. Prefix affinity and spill-over, streams in order,
client disconnects, /metrics over both replicas, the API key, and a replica
killed mid-stream (its streams end with an error event, a request that had
received nothing is answered by the other replica, later requests succeed).

Starting Ray and the deployment takes 10-20 s; the module shares one."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from inflight.config import EngineConfig  # noqa: E402
from inflight.ray.app import (APP_NAME, ENGINE_DEPLOYMENT, DeploymentOptions,  # noqa: E402
                              ReplicaOptions, build_app)

pytestmark = pytest.mark.ray
API_KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
SYSTEM = "paged attention stores keys and values in blocks " * 6


@pytest.fixture(scope="module")
def deployment(tiny_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=200 * 2**20,
             logging_level="ERROR", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = EngineConfig(model=str(tiny_model("llama-gqa")), dtype="float32",
                              kv_cache_memory="8MiB", num_threads=1)
        serve.run(build_app(config, DeploymentOptions(replicas=2, router="prefix",
                                                      imbalance_threshold=3, load_cost_tokens=8,
                                                      api_key=API_KEY),
                            ReplicaOptions(stream_interval_s=0.005)),
                  name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(url: str, prompt: str | list[str], **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", headers=HEADERS, timeout=120,
                   json={"prompt": prompt, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` with these labels."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(r"([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


def in_flight(text: str) -> dict[str, float]:
    """The router's requests in flight by replica id."""
    return {rid: float(value) for rid, value in re.findall(
        r'inflight:router_requests_in_flight\{replica="([^"]+)"\}\s+(\S+)', text)}


def scrape(url: str) -> str:
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200
    return r.text


def test_the_dashboard_feed_answers_before_any_request(deployment):
    """The ingress learns the replicas when it starts (its first call to them
    asks for their description), so the feed needs no request routed first."""
    from test_dashboard import read_feed

    hello = read_feed(f"{deployment}/dashboard/feed", 0.3, HEADERS)["hello"][0]
    assert len(hello["replicas"]) == 2 and hello["next_step"] == 0


def test_the_api_key_is_required(deployment):
    r = httpx.post(f"{deployment}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{deployment}/health").status_code == 200
    r = httpx.post(f"{deployment}/v1/completions", headers=HEADERS,
                   json={"prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_requests_sharing_a_prefix_stick_to_one_replica(deployment):
    before = scrape(deployment)
    cached = []
    for i in range(4):
        usage = complete(deployment, f"{SYSTEM} question {i}", max_tokens=4)["usage"]
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    # The first computes the prefix, every later one finds it where it was sent.
    assert cached[0] == 0 and min(cached[1:]) >= 48
    after = scrape(deployment)
    assert (metric(after, "inflight:router_decisions_total", reason="prefix")
            - metric(before, "inflight:router_decisions_total", reason="prefix")) >= 3


def test_a_loaded_replica_spills_over(deployment):
    """Eight long requests with one prefix at once: past the imbalance
    threshold (3) the router sends some to the other replica."""
    async def burst() -> list[str]:
        async with httpx.AsyncClient(timeout=120, headers=HEADERS) as http:
            async def one(i: int) -> str:
                r = await http.post(f"{deployment}/v1/completions", json={
                    "prompt": f"{SYSTEM} burst {i}", "max_tokens": 200, "temperature": 0,
                    "ignore_eos": True})
                return r.json()["choices"][0]["finish_reason"]

            async def watch() -> dict[str, float]:
                seen: dict[str, float] = {}
                for _ in range(200):
                    now = in_flight((await http.get(f"{deployment}/metrics")).text)
                    seen = {rid: max(seen.get(rid, 0), n) for rid, n in now.items()}
                    if len(seen) == 2 and all(seen.values()):
                        break
                    await asyncio.sleep(0.02)
                return seen

            return await asyncio.gather(watch(), *(one(i) for i in range(8)))

    seen, *reasons = asyncio.run(burst())
    assert reasons == ["length"] * 8
    assert len(seen) == 2 and all(v > 0 for v in seen.values()), seen
    assert metric(scrape(deployment), "inflight:router_decisions_total",
                  reason="fallback-imbalance") >= 1


def test_a_completion_of_several_prompts(deployment):
    """Its prompts are routed concurrently from one HTTP request."""
    body = complete(deployment, ["one prompt", "another prompt", "a third"], max_tokens=5,
                    ignore_eos=True)
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 15


def test_streams_arrive_in_order(deployment):
    whole = complete(deployment, "the quick brown fox", max_tokens=40, ignore_eos=True)
    text, count = "", 0
    with httpx.stream("POST", f"{deployment}/v1/completions", headers=HEADERS, timeout=60,
                      json={"prompt": "the quick brown fox", "max_tokens": 40, "temperature": 0,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(c["text"] for c in chunk["choices"])
                if chunk.get("usage"):
                    count = chunk["usage"]["completion_tokens"]
    assert text == whole["choices"][0]["text"] and count == 40


def test_metrics_count_both_replicas(deployment):
    text = scrape(deployment)
    replicas = set(re.findall(r'inflight:num_requests_running\{[^}]*replica="([^"]+)"', text))
    assert len(replicas) == 2 and replicas == set(in_flight(text))
    assert metric(text, "inflight:request_success_total", finished_reason="length") >= 10
    assert metric(text, "inflight:prefix_cache_hits_total") > 0
    assert metric(text, "inflight:router_prompt_tokens_total") > 0


def test_the_dashboard_follows_each_replica(deployment):
    from test_dashboard import read_feed

    assert httpx.get(f"{deployment}/dashboard", timeout=30).status_code == 200
    assert httpx.get(f"{deployment}/dashboard/feed", timeout=30).status_code == 401
    hello = read_feed(f"{deployment}/dashboard/feed", 0.5, HEADERS)["hello"][0]
    assert len(hello["replicas"]) == 2
    served = 0
    for rid in hello["replicas"]:
        events = read_feed(f"{deployment}/dashboard/feed?replica={rid}", 1.5, HEADERS)
        assert events["hello"][0]["replica"] == rid
        # The backlog: the steps this replica ran for the tests before this one.
        columns = [c for frame in events.get("steps", []) for c in frame["columns"]]
        recent = events["summary"][0]["recent"]
        served += len(recent)
        if recent:
            assert columns
            history = httpx.get(f"{deployment}/dashboard/requests/{recent[0]['request_id']}",
                                params={"replica": rid}, headers=HEADERS, timeout=30)
            assert history.status_code == 200 and history.json()["events"][0]["event"] == "queued"
    assert served >= 10
    response = httpx.get(f"{deployment}/dashboard/feed?replica=nope", headers=HEADERS, timeout=30)
    assert response.status_code == 404


def test_the_dashboard_page_follows_the_replica_picked(deployment, browser, tmp_path):
    from browser_helpers import screenshot, wait_for
    from selenium.webdriver.support.ui import Select

    browser.get(f"{deployment}/dashboard#refresh=0.5")
    wait_for(browser, "return !document.getElementById('key-form').hidden")
    browser.find_element("id", "key").send_keys(API_KEY)
    browser.find_element("css selector", "#key-form button").click()
    hello = wait_for(browser, "return window.inflightDashboard.hello")
    assert len(hello["replicas"]) == 2
    assert browser.find_element("id", "replica-pick").is_displayed()
    other = next(rid for rid in hello["replicas"] if rid != hello["replica"])
    Select(browser.find_element("id", "replica")).select_by_value(other)
    # The page reloads on the chosen replica's feed and keeps the period.
    wait_for(browser, "return window.inflightDashboard.hello && "
                      f"window.inflightDashboard.hello.replica === '{other}'")
    assert f"replica={other}" in browser.execute_script("return location.hash")
    assert browser.execute_script("return window.inflightDashboard.hello.interval") == 0.5
    # Both replicas served the tests before this one: its strip and requests show.
    wait_for(browser, "return window.inflightDashboard.columns.length > 0")
    wait_for(browser, "return document.querySelectorAll('#requests tbody tr').length > 0")
    browser.find_element("css selector", "#requests tbody tr").click()
    wait_for(browser, "return document.querySelectorAll('#history li b').length >= 3")
    events = [e.text for e in browser.find_elements("css selector", "#history li b")]
    assert events[0] == "queued" and "finished" in events, events
    screenshot(browser, tmp_path, "dashboard-ray.png")


def test_a_disconnect_aborts_the_request(deployment):
    before = metric(scrape(deployment), "inflight:request_success_total", finished_reason="abort")
    with httpx.stream("POST", f"{deployment}/v1/completions", headers=HEADERS, timeout=60,
                      json={"prompt": "continuous batching", "max_tokens": 450,
                            "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    # The front end counts the abort when the client leaves; the running gauge
    # follows when the engine core has ended the request and reported its load.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = scrape(deployment)
        if (metric(text, "inflight:request_success_total", finished_reason="abort") > before
                and metric(text, "inflight:num_requests_running") == 0):
            break
        time.sleep(0.1)
    assert metric(text, "inflight:request_success_total", finished_reason="abort") == before + 1
    assert metric(text, "inflight:num_requests_running") == 0


def test_a_killed_replica(deployment):
    """Streams on the killed replica end with an error event; a request that had
    received nothing is answered by the other; later requests succeed."""
    prompt = "keys values paged blocks " * 12  # a prefix of its own, so that it has one home
    complete(deployment, prompt, max_tokens=2)  # the prefix now has a home

    async def scenario() -> tuple[list[str], dict]:
        async with httpx.AsyncClient(timeout=120, headers=HEADERS) as http:
            async def stream() -> list[str]:
                events = []
                async with http.stream("POST", f"{deployment}/v1/completions", json={
                        "prompt": prompt, "max_tokens": 450, "ignore_eos": True,
                        "stream": True}) as r:
                    assert r.status_code == 200, await r.aread()
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            started.set()
                return events

            async def whole() -> dict:
                await started.wait()
                r = await http.post(f"{deployment}/v1/completions", json={
                    "prompt": prompt, "max_tokens": 450, "ignore_eos": True})
                return r.json()

            async def kill() -> None:
                await started.wait()
                # the stream and the waiting request, once the router has the second
                for _ in range(300):
                    loads = in_flight((await http.get(f"{deployment}/metrics")).text)
                    home = max(loads, key=loads.__getitem__)
                    if loads[home] == 2:
                        break
                    await asyncio.sleep(0.1)
                assert loads[home] == 2, loads
                actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{ENGINE_DEPLOYMENT}#{home}",
                                      namespace="serve")
                ray.kill(actor, no_restart=True)

            started = asyncio.Event()
            events, answer, _ = await asyncio.wait_for(
                asyncio.gather(stream(), whole(), kill()), timeout=60)
            return events, answer

    events, answer = asyncio.run(scenario())
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead" and "died" in error["message"]
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 450
    assert complete(deployment, "after the failure", max_tokens=3)["usage"]["completion_tokens"] == 3


def test_a_replica_stopped_gracefully_stops_its_engine(tiny_model, tmp_path, monkeypatch):
    """What Ray Serve calls as it stops a replica gracefully (``__del__``) stops
    the replica's engine process and removes its sockets' directory."""
    import tempfile

    from inflight.ray.replica import EngineReplica

    from test_engine_process import gone, sockets_dirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    replica = EngineReplica(EngineConfig(model=str(tiny_model("llama-gqa")), dtype="float32",
                                         kv_cache_memory="8MiB"), ReplicaOptions())
    pid = replica.engine.pid
    assert len(sockets_dirs(tmp_path)) == 1
    replica.__del__()
    assert gone(pid, 10) and sockets_dirs(tmp_path) == []
