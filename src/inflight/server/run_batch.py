"""``inflight run-batch -i in.jsonl -o out.jsonl``: a batch input file run
offline, through the same endpoint code as the server's batch lines (so the
answers are the ones the Batch API gives), with an in-process engine and no
HTTP. Lines may mix the two endpoints. Every line gets one output line, in
input order: the endpoint's answer (its status and body), or, for a line that
could not run, an error."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from tqdm import tqdm

from inflight.batch.formats import InputLine, answer_line, check_upload, error_line, parse_input
from inflight.batch.service import LineExecutor
from inflight.config import EngineConfig
from inflight.engine.async_engine import AsyncEngine
from inflight.model.loader import model_display_name
from inflight.server.batches import batch_executor
from inflight.server.openai_serving import OpenAIServing

logger = logging.getLogger(__name__)


def run_batch(config: EngineConfig, input_path: Path, output_path: Path, *,
              max_in_flight: int | None = None, served_model_name: str | None = None,
              use_tqdm: bool = True) -> dict[str, float]:
    """Answer every line of ``input_path`` into ``output_path`` (written whole
    at the end); returns counts and seconds. ValueError for a file the Batch
    API would refuse."""
    data = Path(input_path).read_bytes()
    check_upload(data)
    lines = parse_input(data, None)
    engine = AsyncEngine(config)
    try:
        name = served_model_name or model_display_name(config.model)
        execute = batch_executor(OpenAIServing(engine, name))
        start = time.perf_counter()
        results = asyncio.run(_answer_all(execute, lines, max_in_flight or config.max_num_seqs,
                                          use_tqdm))
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    tmp = Path(output_path).with_suffix(".part")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in results))
    tmp.rename(output_path)
    answered = sum(r["response"] is not None and r["response"]["status_code"] == 200
                   for r in results)
    return {"lines": len(results), "completed": answered, "failed": len(results) - answered,
            "seconds": seconds}


async def _answer_all(execute: LineExecutor, lines: list[InputLine], max_in_flight: int,
                      use_tqdm: bool) -> list[dict]:
    places = asyncio.Semaphore(max_in_flight)
    bar = tqdm(total=len(lines), unit="line", disable=not use_tqdm)

    async def answer(line: InputLine) -> dict:
        if line.error is not None:
            result = error_line(line.custom_id, line.error["code"], line.error["message"],
                                line.line_no)
        else:
            async with places:
                request_id = f"run-batch-{line.line_no}"
                status, body = await execute(line.url, line.body, request_id)
            result = answer_line(line.custom_id, status, request_id, body)
        bar.update()
        return result

    try:
        return await asyncio.gather(*(answer(line) for line in lines))
    finally:
        bar.close()
