"""Structured outputs in ``inflight bench throughput``: which requests of a
workload carry a JSON schema (``--json-schema-fraction``), and how long the
engine takes to get a grammar ready: the grammar backend's first start (the
first constrained request of a process pays it), a schema's first compile,
and a compile found in the cache."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from inflight.core.sampling_params import StructuredOutputsParams
from inflight.engine.llm_engine import LLMEngine

# The default schema: a list of records long enough that a request's whole
# output follows it (the grammar is at work at every step, not done early).
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {"records": {"type": "array", "minItems": 64, "items": {
        "type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
            "status": {"enum": ["active", "inactive", "pending"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}},
        "required": ["id", "name", "status"]}}},
    "required": ["records"]}


def schema_params(path: str | None) -> StructuredOutputsParams:
    """The JSON schema of ``path`` (a file), else ``BENCH_SCHEMA``."""
    schema = BENCH_SCHEMA if path is None else json.loads(Path(path).read_text())
    return StructuredOutputsParams(json=schema)


def constrained(num_requests: int, fraction: float,
                params: StructuredOutputsParams) -> list[StructuredOutputsParams | None]:
    """Per request, ``params`` or None: ``fraction`` of them constrained, spread
    evenly over the workload (request i when floor((i + 1) f) > floor(i f))."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"--json-schema-fraction values must be in [0, 1], got {fraction}")
    return [params if int((i + 1) * fraction) > int(i * fraction) else None
            for i in range(num_requests)]


def compile_seconds(engine: LLMEngine, params: StructuredOutputsParams) -> dict[str, float]:
    """On the engine's own manager: the backend's start with the schema's first
    compile, then the same schema again (a cache hit). The engine keeps the
    compiled grammar, so timed runs do not compile it."""
    manager = engine.core.structured
    if manager is None:
        raise ValueError("--json-schema-fraction needs the model's tokenizer")
    start = time.perf_counter()
    manager.compile(params).result()
    first = time.perf_counter() - start
    start = time.perf_counter()
    manager.compile(params).result()
    hit = time.perf_counter() - start
    # A schema of the same size the backend has not seen: a compile alone.
    fresh = StructuredOutputsParams(json={**params.json, "title": "uncached"}
                                    if isinstance(params.json, dict) else params.json + " ")
    start = time.perf_counter()
    manager.compile(fresh).result()
    compile_only = time.perf_counter() - start
    return {"first_use_seconds": first, "compile_seconds": compile_only,
            "cache_hit_seconds": hit}
