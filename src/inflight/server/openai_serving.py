"""The two generation endpoints: OpenAI request -> engine requests -> OpenAI
response, whole or as server-sent events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from inflight.core.sampling_params import SamplingParams
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.output import CompletionOutput, Logprob, RequestOutput
from inflight.server import protocol as p


class InvalidRequest(ValueError):
    """A request the API refuses: 400, naming the offending parameter."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_text(value: Any, param: str = "body") -> None:
    """Refuse strings that are not valid Unicode (lone surrogates from \\u escapes)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(f"{param} contains an invalid Unicode escape (lone surrogate)",
                                 param) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(item, f"{param}.{key}" if param != "body" else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_text(item, f"{param}[{i}]")


def sampling_params(req: p.CompletionRequest | p.ChatCompletionRequest, *, max_tokens: int | None,
                    logprobs: int | None, best_of: int | None = None) -> SamplingParams:
    if req.logit_bias:
        raise InvalidRequest("logit_bias is not supported", "logit_bias")
    options: dict[str, Any] = dict(
        n=req.n, best_of=best_of, max_tokens=max_tokens, stop=req.stop, seed=req.seed, logprobs=logprobs,
        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens)
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
                 "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            options[name] = value
    try:
        return SamplingParams(**options)
    except ValueError as e:
        field = next((f for f in options if str(e).startswith(f)), None)
        raise InvalidRequest(str(e), field) from e


@dataclass
class _Choice:
    """How much of one generated sequence a stream has sent."""

    index: int
    sent_text: int = 0
    sent_tokens: int = 0
    finish_reason: str | None = None

    def advance(self, c: CompletionOutput) -> tuple[str, int, int] | None:
        """What to send now: (new text, index of its first token, text offset),
        or None when there is nothing new."""
        if self.finish_reason is not None:
            return None
        delta = c.text[self.sent_text:]
        if not delta and c.finish_reason is None:
            return None
        first_token, offset = self.sent_tokens, self.sent_text
        self.sent_text, self.sent_tokens = len(c.text), len(c.token_ids)
        self.finish_reason = c.finish_reason
        return delta, first_token, offset


def scheduling(req: p.CompletionRequest | p.ChatCompletionRequest) -> dict[str, Any]:
    """The request's scheduling options; ``user`` is the tenant."""
    return {"priority": req.priority, "tenant": req.user, "deadline_ms": req.deadline_ms,
            "expected_output_tokens": req.expected_output_tokens, "cache_salt": req.cache_salt}


async def _merged(engine: AsyncEngine, prompts: list[Any], params: SamplingParams,
                  base_id: str, options: dict[str, Any]
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run one engine request per prompt and yield (prompt index, output) as
    they come; abandoning the iterator aborts whatever still runs."""
    if len(prompts) == 1:
        async with aclosing(engine.generate(prompts[0], params, request_id=base_id,
                                            **options)) as stream:
            async for out in stream:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, prompt: Any) -> None:
        try:
            async with aclosing(engine.generate(prompt, params, request_id=f"{base_id}-{i}",
                                                **options)) as stream:
                async for out in stream:
                    await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, prompt)) for i, prompt in enumerate(prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _history(outputs: list[RequestOutput]) -> dict[str, Any]:
    """The ``inflight`` extension object: scheduling facts per prompt."""
    return {"requests": [{
        "request_id": o.request_id,
        "arrival_time": o.metrics.arrival_time,
        "first_scheduled_time": o.metrics.first_scheduled_time,
        "first_token_time": o.metrics.first_token_time,
        "finished_time": o.metrics.finished_time,
        "num_preemptions": o.metrics.num_preemptions,
        "num_cached_tokens": o.metrics.num_cached_tokens,
        "history": [{"time": t, "event": event, "detail": detail, "sample": i}
                    for t, event, detail, i in o.metrics.history or ()],
    } for o in outputs]}


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.core.tokenizer

    # -------------------------------------------------------- completions
    def completion_inputs(self, req: p.CompletionRequest) -> tuple[list[Any], SamplingParams]:
        if req.suffix:
            raise InvalidRequest("suffix is not supported", "suffix")
        if req.stream and req.best_of is not None and req.best_of > req.n:
            raise InvalidRequest("best_of greater than n cannot be streamed", "best_of")
        if req.echo and req.logprobs is not None:
            raise InvalidRequest("echo with logprobs is not supported", "echo")
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompts = [{"prompt_token_ids": prompt}]
        elif prompt and isinstance(prompt[0], list):
            prompts = [{"prompt_token_ids": ids} for ids in prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise InvalidRequest("prompt must not be empty", "prompt")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        return prompts, sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs,
                                        best_of=req.best_of)

    async def completion(self, req: p.CompletionRequest, request_id: str) -> p.CompletionResponse:
        prompts, params = self.completion_inputs(req)
        finals: dict[int, RequestOutput] = {}
        async with aclosing(_merged(self.engine, prompts, params, request_id, scheduling(req))) as it:
            async for i, out in it:
                if out.finished:
                    finals[i] = out
        outputs = [finals[i] for i in range(len(prompts))]
        choices = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                text = self._echo(out) + c.text if req.echo else c.text
                choices.append(p.CompletionChoice(
                    index=i * req.n + c.index, text=text, finish_reason=c.finish_reason,
                    logprobs=self._completion_logprobs(c, 0, len(c.token_ids), 0, req.logprobs)
                    if req.logprobs is not None else None))
        return p.CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                    usage=_usage(outputs), inflight=_history(outputs))

    async def completion_stream(self, req: p.CompletionRequest, request_id: str
                                ) -> AsyncIterator[str]:
        prompts, params = self.completion_inputs(req)
        created = p.now()
        choices: dict[tuple[int, int], _Choice] = {}
        finals: dict[int, RequestOutput] = {}
        usage_chunk = bool(req.stream_options and req.stream_options.include_usage)
        async with aclosing(_merged(self.engine, prompts, params, request_id, scheduling(req))) as it:
            async for i, out in it:
                parts = []
                for c in out.outputs:
                    state = choices.setdefault((i, c.index), _Choice(i * req.n + c.index))
                    step = state.advance(c)
                    if step is None:
                        continue
                    delta, first_token, offset = step
                    if req.echo and first_token == 0 and offset == 0:
                        delta = self._echo(out) + delta
                    logprobs = (self._completion_logprobs(c, first_token, len(c.token_ids),
                                                          offset, req.logprobs)
                                if req.logprobs is not None else None)
                    parts.append(p.CompletionChoice(index=state.index, text=delta,
                                                    logprobs=logprobs,
                                                    finish_reason=c.finish_reason))
                if out.finished:
                    finals[i] = out
                # The history goes with the last chunk: this one, unless usage follows.
                last = out.finished and len(finals) == len(prompts) and not usage_chunk
                if parts or last:
                    history = _history([finals[k] for k in sorted(finals)]) if last else None
                    yield _sse(p.CompletionChunk(id=request_id, created=created,
                                                 model=self.model_name, choices=parts,
                                                 inflight=history))
        outputs = [finals[i] for i in sorted(finals)]
        if usage_chunk:
            yield _sse(p.CompletionChunk(id=request_id, created=created, model=self.model_name,
                                         choices=[], usage=_usage(outputs),
                                         inflight=_history(outputs)))
        yield "data: [DONE]\n\n"

    def _echo(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer else ""

    @staticmethod
    def _completion_logprobs(c: CompletionOutput, start: int, end: int, text_offset: int,
                             top_n: int) -> p.CompletionLogprobs:
        result = p.CompletionLogprobs()
        offset = text_offset
        for token_id, entry in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            chosen = entry[token_id]
            token = chosen.decoded_token or ""
            result.tokens.append(token)
            result.token_logprobs.append(chosen.logprob)
            result.text_offset.append(offset)
            offset += len(token)
            result.top_logprobs.append({
                (lp.decoded_token or ""): lp.logprob
                for lp in sorted(entry.values(), key=lambda lp: lp.rank)[:top_n]})
        return result

    # --------------------------------------------------------------- chat
    def chat_inputs(self, req: p.ChatCompletionRequest) -> tuple[dict[str, Any], SamplingParams]:
        if req.tools:
            raise InvalidRequest("tools are not supported", "tools")
        if req.response_format is not None and req.response_format.type != "text":
            raise InvalidRequest(f"response_format {req.response_format.type!r} is not supported",
                                 "response_format")
        if self.tokenizer is None:
            raise InvalidRequest("this server has no tokenizer for chat", "messages")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for m in messages:
            if isinstance(m.get("content"), list):
                m["content"] = "".join(part["text"] for part in m["content"])
        text = self.tokenizer.apply_chat_template(messages, req.add_generation_prompt)
        prompt = {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, False)}
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs to be true", "top_logprobs")
        max_tokens = req.max_completion_tokens or req.max_tokens
        return prompt, sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)

    async def chat(self, req: p.ChatCompletionRequest, request_id: str) -> p.ChatCompletionResponse:
        prompt, params = await asyncio.to_thread(self.chat_inputs, req)
        final = None
        async with aclosing(self.engine.generate(prompt, params, request_id=request_id,
                                                 **scheduling(req))) as stream:
            async for out in stream:
                final = out
        assert final is not None and final.finished
        choices = [p.ChatChoice(index=c.index, message=p.ChatMessageOut(content=c.text),
                                finish_reason=c.finish_reason,
                                logprobs=self._chat_logprobs(c, 0, len(c.token_ids),
                                                             req.top_logprobs or 0)
                                if req.logprobs else None)
                   for c in final.outputs]
        return p.ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                        usage=_usage([final]), inflight=_history([final]))

    async def chat_stream(self, req: p.ChatCompletionRequest, request_id: str) -> AsyncIterator[str]:
        prompt, params = await asyncio.to_thread(self.chat_inputs, req)
        created = p.now()
        states = [_Choice(i) for i in range(req.n)]
        final = None
        usage_chunk = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[p.ChatStreamChoice], **extra: Any) -> str:
            return _sse(p.ChatCompletionChunk(id=request_id, created=created,
                                              model=self.model_name, choices=choices, **extra))

        async with aclosing(self.engine.generate(prompt, params, request_id=request_id,
                                                 **scheduling(req))) as stream:
            async for out in stream:
                if final is None:  # after the first output, so errors come before any chunk
                    yield chunk([p.ChatStreamChoice(index=i, delta=p.ChatDelta(role="assistant",
                                                                               content=""))
                                 for i in range(req.n)])
                final = out
                parts = []
                for c in out.outputs:
                    step = states[c.index].advance(c)
                    if step is None:
                        continue
                    delta, first_token, _ = step
                    logprobs = (self._chat_logprobs(c, first_token, len(c.token_ids),
                                                    req.top_logprobs or 0)
                                if req.logprobs else None)
                    parts.append(p.ChatStreamChoice(index=c.index, delta=p.ChatDelta(content=delta),
                                                    logprobs=logprobs,
                                                    finish_reason=c.finish_reason))
                # The history goes with the last chunk: this one, unless usage follows.
                last = out.finished and not usage_chunk
                if parts or last:
                    yield chunk(parts, inflight=_history([out]) if last else None)
        if usage_chunk and final is not None:
            yield chunk([], usage=_usage([final]), inflight=_history([final]))
        yield "data: [DONE]\n\n"

    @staticmethod
    def _chat_logprobs(c: CompletionOutput, start: int, end: int, top_n: int) -> p.ChatLogprobs:
        content = []
        for token_id, entry in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            top = sorted(entry.values(), key=lambda lp: lp.rank)[:top_n]
            content.append(p.TokenLogprob(**_token_fields(entry[token_id]),
                                          top_logprobs=[p.TopLogprob(**_token_fields(lp))
                                                        for lp in top]))
        return p.ChatLogprobs(content=content)


def _token_fields(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}


def _usage(outputs: list[RequestOutput]) -> p.Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.metrics.num_cached_tokens for o in outputs)
    return p.Usage(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached))


def _sse(chunk: Any) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def error_json(message: str, kind: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return p.ErrorResponse(error=p.ErrorInfo(message=message, type=kind, param=param,
                                             code=code)).model_dump()
