"""The two generation endpoints: OpenAI request -> engine requests -> OpenAI
response, whole or as server-sent events. Everything goes through the
EngineClient: a whole response waits for the one final output of each engine
request; a stream relays the deltas. A request's structured outputs and tools
are read by ``constraints``; tool calls in the output by ``tool_parsers``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from inflight.core.beam_search import BeamSearchParams
from inflight.core.sampling_params import SamplingParams, StructuredOutputsParams
from inflight.engine.client import EngineClient
from inflight.engine.output import CompletionOutput, Logprob, RequestOutput
from inflight.server import protocol as p
from inflight.server.constraints import ToolPlan, structured_outputs, tool_plan
from inflight.server.invalid_request import InvalidRequest
from inflight.server.tool_parsers import TOOL_PARSERS, ToolCallDelta, ToolCallStream, extract

# OpenAI's bodies cannot hold -inf: a token a grammar forbids reports this.
MIN_LOGPROB = -9999.0

# A stream's last event.
DONE = b"data: [DONE]\n\n"


# Deepest nesting of arrays and objects a request body may have (OpenAI's
# bodies need fewer than ten levels).
MAX_JSON_DEPTH = 64


def check_body(body: Any) -> None:
    """Refuse bodies nested deeper than MAX_JSON_DEPTH, and strings that are not
    valid Unicode (lone surrogates from \\u escapes). Iterative: no recursion
    limit to hit, whatever the body."""
    stack: list[tuple[Any, str, int]] = [(body, "body", 0)]
    while stack:
        value, param, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest(f"{param} contains an invalid Unicode escape "
                                     "(lone surrogate)", param) from None
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise InvalidRequest(f"the request body is nested more than {MAX_JSON_DEPTH} "
                                 "levels deep")
        # Only strings and containers need a look (not, say, each token id).
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, (str, dict, list)):
                    stack.append((item, f"{param}.{key}" if param != "body" else str(key),
                                  depth + 1))
        else:
            for i, item in enumerate(value):
                if isinstance(item, (str, dict, list)):
                    stack.append((item, f"{param}[{i}]", depth + 1))


def sampling_params(req: p.CompletionRequest | p.ChatCompletionRequest, *, max_tokens: int | None,
                    logprobs: int | None, best_of: int | None = None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    if req.logit_bias:
        raise InvalidRequest("logit_bias is not supported", "logit_bias")
    options: dict[str, Any] = dict(
        n=req.n, best_of=best_of, max_tokens=max_tokens, stop=req.stop, seed=req.seed, logprobs=logprobs,
        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, speculative=req.speculative,
        structured_outputs=structured)
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
class _Delta:
    """What one stream chunk carries for one choice."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    text_offset: int
    finish_reason: str | None


@dataclass
class _Choice:
    """One generated sequence of a stream: what it has sent, and the tokens
    received whose text is still held back (they go out with the next text)."""

    index: int
    sent_text: int = 0
    num_tokens: int = 0
    finish_reason: str | None = None
    echoed: bool = False  # the prompt went out (completions with echo)
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[dict[int, Logprob]] = field(default_factory=list)

    def advance(self, c: CompletionOutput) -> _Delta | None:
        """Take in one delta output; what to send now, or None."""
        if self.finish_reason is not None:
            return None
        self.pending_ids += c.token_ids
        self.pending_logprobs += c.logprobs or []
        self.num_tokens += len(c.token_ids)
        if not c.text and c.finish_reason is None:
            return None
        delta = _Delta(c.text, self.pending_ids, self.pending_logprobs, self.sent_text,
                       c.finish_reason)
        self.pending_ids, self.pending_logprobs = [], []
        self.sent_text += len(c.text)
        self.finish_reason = c.finish_reason
        return delta


def beam_search_params(req: p.CompletionRequest, max_tokens: int,
                       structured: StructuredOutputsParams | None) -> BeamSearchParams:
    """A completion's beam search: width ``beam_width`` (else ``n``), of which
    the best ``n`` are returned; every beam follows ``structured``. Options
    that beam search would ignore are refused rather than dropped."""
    if req.stream:
        raise InvalidRequest("beam search cannot be streamed", "stream")
    width = req.n if req.beam_width is None else req.beam_width
    if req.n > width:
        raise InvalidRequest(f"n ({req.n}) must be <= beam_width ({width})", "n")
    for name in ("best_of", "logprobs", "stop", "seed", "top_p", "top_k", "min_p",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                 "stop_token_ids", "min_tokens"):
        if getattr(req, name):
            raise InvalidRequest(f"{name} is not supported with beam search", name)
    if req.temperature:
        raise InvalidRequest("beam search is greedy: temperature must be 0 or omitted",
                             "temperature")
    try:
        return BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                ignore_eos=req.ignore_eos, length_penalty=req.length_penalty,
                                structured_outputs=structured)
    except ValueError as e:
        raise InvalidRequest(str(e)) from e


def scheduling(req: p.CompletionRequest | p.ChatCompletionRequest,
               background: bool = False) -> dict[str, Any]:
    """The request's scheduling options; ``user`` is the tenant; ``background``
    for the lines of a batch."""
    options = {"priority": req.priority, "tenant": req.user, "deadline_ms": req.deadline_ms,
               "expected_output_tokens": req.expected_output_tokens, "cache_salt": req.cache_salt}
    if background:
        options["background"] = True
    return options


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                  param: str) -> None:
    """An explicit ``max_tokens`` must fit in the context with the prompt (an
    omitted one means "up to the context"). A prompt that alone is too long is
    the engine's to refuse (``engine.input.InputProcessor.prepare``)."""
    if max_tokens is not None and num_prompt_tokens <= max_model_len < (num_prompt_tokens
                                                                          + max_tokens):
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} in the completion). Reduce the length of the prompt or "
            f"{param}.", param)


async def _merged(engine: EngineClient, prompts: list[Any], params: SamplingParams,
                  base_id: str, options: dict[str, Any], stream: bool
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run one engine request per prompt and yield (prompt index, output) as
    they come; abandoning the iterator aborts whatever still runs."""
    if len(prompts) == 1:
        async with aclosing(engine.generate(prompts[0], params, request_id=base_id,
                                            stream=stream, **options)) as outputs:
            async for out in outputs:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, prompt: Any) -> None:
        try:
            async with aclosing(engine.generate(prompt, params, request_id=f"{base_id}-{i}",
                                                stream=stream, **options)) as outputs:
                async for out in outputs:
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
    def __init__(self, engine: EngineClient, model_name: str, *,
                 tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False) -> None:
        """``tool_call_parser`` (a name of ``tool_parsers.TOOL_PARSERS``) reads
        the calls of ``tool_choice: "auto"``, which needs
        ``enable_auto_tool_choice`` (vLLM's options)."""
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, "
                             f"got {tool_call_parser!r}")
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        self.engine = engine
        self.model_name = model_name
        self.auto_tool_parser = tool_call_parser if enable_auto_tool_choice else None

    @property
    def max_model_len(self) -> int:
        return self.engine.model_info.max_model_len

    # -------------------------------------------------------- completions
    def completion_inputs(self, req: p.CompletionRequest
                          ) -> tuple[list[Any], SamplingParams | BeamSearchParams]:
        """Engine prompts (tokenized here, so that the context check sees their
        length) and sampling parameters; runs off the event loop."""
        if req.suffix:
            raise InvalidRequest("suffix is not supported", "suffix")
        if req.stream and req.best_of is not None and req.best_of > req.n:
            raise InvalidRequest("best_of greater than n cannot be streamed", "best_of")
        if req.echo and req.logprobs is not None:
            raise InvalidRequest("echo with logprobs is not supported", "echo")
        prompt = req.prompt
        if isinstance(prompt, str):
            texts: list[Any] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            texts = [prompt]
        else:
            texts = list(prompt)
        if not texts:
            raise InvalidRequest("prompt must not be empty", "prompt")
        prompts = []
        for item in texts:
            if isinstance(item, str):
                if not item:
                    raise InvalidRequest("prompt must not be empty", "prompt")
                if not self.engine.has_tokenizer:
                    raise InvalidRequest("this server has no tokenizer: send token ids",
                                         "prompt")
                prompts.append({"prompt": item, "prompt_token_ids": self.engine.encode(item)})
            else:
                prompts.append({"prompt_token_ids": item})
            check_context(len(prompts[-1]["prompt_token_ids"]), req.max_tokens,
                          self.max_model_len, "max_tokens")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        structured = structured_outputs(req)
        if req.use_beam_search:
            return prompts, beam_search_params(req, max_tokens, structured)
        if req.beam_width is not None:
            raise InvalidRequest("beam_width needs use_beam_search", "beam_width")
        return prompts, sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs,
                                        best_of=req.best_of, structured=structured)

    async def completion(self, req: p.CompletionRequest, request_id: str,
                         background: bool = False) -> p.CompletionResponse:
        prompts, params = await asyncio.to_thread(self.completion_inputs, req)
        finals: dict[int, RequestOutput] = {}
        async with aclosing(_merged(self.engine, prompts, params, request_id,
                                    scheduling(req, background), stream=False)) as it:
            async for i, out in it:
                finals[i] = out
        outputs = [finals[i] for i in range(len(prompts))]
        choices = []
        for i, out in enumerate(outputs):
            for c in out.outputs[:req.n]:  # (a beam search has beam_width)
                text = self._echo(out) + c.text if req.echo else c.text
                choices.append(p.CompletionChoice(
                    index=i * req.n + c.index, text=text, finish_reason=c.finish_reason,
                    logprobs=_completion_logprobs(c.token_ids, c.logprobs or [], 0, req.logprobs)
                    if req.logprobs is not None else None))
        return p.CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                    usage=_usage(outputs, sum(len(c.token_ids) for o in outputs
                                                              for c in o.outputs[:req.n])),
                                    inflight=_history(outputs))

    async def completion_stream(self, req: p.CompletionRequest, request_id: str
                                ) -> AsyncIterator[bytes]:
        prompts, params = await asyncio.to_thread(self.completion_inputs, req)
        created = p.now()
        choices: dict[tuple[int, int], _Choice] = {}
        finals: dict[int, RequestOutput] = {}
        usage_chunk = bool(req.stream_options and req.stream_options.include_usage)
        async with aclosing(_merged(self.engine, prompts, params, request_id, scheduling(req),
                                    stream=True)) as it:
            async for i, out in it:
                parts = []
                for c in out.outputs:
                    state = choices.setdefault((i, c.index), _Choice(i * req.n + c.index))
                    delta = state.advance(c)
                    if delta is None:
                        continue
                    text = delta.text
                    if req.echo and not state.echoed:
                        text = self._echo(out) + text
                        state.echoed = True
                    logprobs = (_completion_logprobs(delta.token_ids, delta.logprobs,
                                                     delta.text_offset, req.logprobs)
                                if req.logprobs is not None else None)
                    parts.append(p.CompletionStreamChoice(index=state.index, text=text,
                                                          logprobs=logprobs,
                                                          finish_reason=delta.finish_reason))
                if out.finished:
                    finals[i] = out
                # The history goes with the last chunk: this one, unless usage follows.
                last = out.finished and len(finals) == len(prompts) and not usage_chunk
                if parts or last:
                    history = _history([finals[k] for k in sorted(finals)]) if last else None
                    yield p.encode_chunk(p.CompletionChunk(
                        id=request_id, created=created, model=self.model_name, choices=parts,
                        inflight=history))
        outputs = [finals[i] for i in sorted(finals)]
        if usage_chunk:
            completion_tokens = sum(c.num_tokens for c in choices.values())
            yield p.encode_chunk(p.CompletionChunk(
                id=request_id, created=created, model=self.model_name, choices=[],
                usage=_usage(outputs, completion_tokens), inflight=_history(outputs)))
        yield DONE

    def _echo(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.engine.decode(out.prompt_token_ids) if self.engine.has_tokenizer else ""

    # --------------------------------------------------------------- chat
    def chat_inputs(self, req: p.ChatCompletionRequest
                    ) -> tuple[dict[str, Any], SamplingParams, ToolPlan]:
        """The prompt, sampling parameters and tool plan of a chat request."""
        if not self.engine.has_tokenizer:
            raise InvalidRequest("this server has no tokenizer for chat", "messages")
        plan = tool_plan(req, self.auto_tool_parser)
        structured = structured_outputs(req)
        if plan.structured is not None:
            if structured is not None:
                raise InvalidRequest(f"tool_choice {req.tool_choice!r} is enforced by a "
                                     "grammar of its own: drop response_format, "
                                     "structured_outputs and guided_*", "tool_choice")
            structured = plan.structured
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for m in messages:
            if isinstance(m.get("content"), list):
                m["content"] = "".join(part["text"] for part in m["content"])
        text = self.engine.apply_chat_template(messages, req.add_generation_prompt, plan.tools)
        prompt = {"prompt": text, "prompt_token_ids": self.engine.encode(text, False)}
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs to be true", "top_logprobs")
        max_tokens = req.max_completion_tokens or req.max_tokens
        check_context(len(prompt["prompt_token_ids"]), max_tokens, self.max_model_len,
                      "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
        return prompt, sampling_params(req, max_tokens=max_tokens, logprobs=logprobs,
                                       structured=structured), plan

    async def chat(self, req: p.ChatCompletionRequest, request_id: str,
                   background: bool = False) -> p.ChatCompletionResponse:
        prompt, params, plan = await asyncio.to_thread(self.chat_inputs, req)
        final = None
        async with aclosing(self.engine.generate(prompt, params, request_id=request_id,
                                                 stream=False,
                                                 **scheduling(req, background))) as outputs:
            async for out in outputs:
                final = out
        assert final is not None and final.finished
        choices = []
        for c in final.outputs:
            message, finish_reason = _chat_message(c, plan)
            choices.append(p.ChatChoice(index=c.index, message=message,
                                        finish_reason=finish_reason,
                                        logprobs=_chat_logprobs(c.token_ids, c.logprobs or [],
                                                                req.top_logprobs or 0)
                                        if req.logprobs else None))
        return p.ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                        usage=_usage([final]), inflight=_history([final]))

    async def chat_stream(self, req: p.ChatCompletionRequest, request_id: str
                          ) -> AsyncIterator[bytes]:
        prompt, params, plan = await asyncio.to_thread(self.chat_inputs, req)
        created = p.now()
        states = [_Choice(i) for i in range(req.n)]
        calls = [_StreamedCalls(plan) for _ in range(req.n)] if plan.parser else None
        final = None
        usage_chunk = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[p.ChatStreamChoice], **extra: Any) -> bytes:
            return p.encode_chunk(p.ChatCompletionChunk(id=request_id, created=created,
                                                        model=self.model_name, choices=choices,
                                                        **extra))

        async with aclosing(self.engine.generate(prompt, params, request_id=request_id,
                                                 stream=True, **scheduling(req))) as outputs:
            async for out in outputs:
                if final is None:  # after the first output, so errors come before any chunk
                    yield chunk([p.ChatStreamChoice(index=i, delta=p.ChatDelta(role="assistant",
                                                                               content=""))
                                 for i in range(req.n)])
                final = out
                parts = []
                for c in out.outputs:
                    delta = states[c.index].advance(c)
                    if delta is None:
                        continue
                    logprobs = (_chat_logprobs(delta.token_ids, delta.logprobs,
                                               req.top_logprobs or 0)
                                if req.logprobs else None)
                    message, finish_reason = p.ChatDelta(content=delta.text), delta.finish_reason
                    if calls is not None:
                        message, finish_reason = calls[c.index].advance(delta)
                        if message is None and logprobs is None and finish_reason is None:
                            continue
                    parts.append(p.ChatStreamChoice(index=c.index, delta=message or p.ChatDelta(),
                                                    logprobs=logprobs,
                                                    finish_reason=finish_reason))
                # The history goes with the last chunk: this one, unless usage follows.
                last = out.finished and not usage_chunk
                if parts or last:
                    yield chunk(parts, inflight=_history([out]) if last else None)
        if usage_chunk and final is not None:
            completion_tokens = sum(s.num_tokens for s in states)
            yield chunk([], usage=_usage([final], completion_tokens), inflight=_history([final]))
        yield DONE


def _chat_message(c: CompletionOutput, plan: ToolPlan) -> tuple[p.ChatMessageOut, str | None]:
    """A finished choice as an assistant message (its tool calls read by the
    plan's parser), and its finish reason ("tool_calls" when it made some)."""
    if plan.parser is None:
        return p.ChatMessageOut(content=c.text), c.finish_reason
    content, calls = extract(plan.parser, c.text, plan.max_calls)
    tool_calls = [p.ToolCallOut(id=call.id, function=p.FunctionCallOut(
        name=call.name, arguments=call.arguments)) for call in calls]
    reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
    return p.ChatMessageOut(content=content, tool_calls=tool_calls), reason


class _StreamedCalls:
    """One streamed choice's text, read for tool calls as it grows."""

    def __init__(self, plan: ToolPlan) -> None:
        self.stream = ToolCallStream(plan.parser, plan.max_calls)
        self.text = ""

    def advance(self, delta: _Delta) -> tuple[p.ChatDelta | None, str | None]:
        """The chunk's message (None when there is nothing to send yet) and
        finish reason."""
        self.text += delta.text
        finished = delta.finish_reason is not None
        content, pieces = self.stream.feed(self.text, finished)
        reason = delta.finish_reason
        if finished and self.stream.calls and reason == "stop":
            reason = "tool_calls"
        if not content and not pieces:
            return None, reason
        return p.ChatDelta(content=content or None,
                           tool_calls=[_call_delta(piece) for piece in pieces] or None), reason


def _call_delta(piece: ToolCallDelta) -> p.ToolCallDeltaOut:
    return p.ToolCallDeltaOut(
        index=piece.index, id=piece.id, type="function" if piece.id else None,
        function=p.FunctionCallDelta(name=piece.name, arguments=piece.arguments))


def _completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]],
                         text_offset: int, top_n: int) -> p.CompletionLogprobs:
    result = p.CompletionLogprobs()
    offset = text_offset
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        token = chosen.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(max(chosen.logprob, MIN_LOGPROB))
        result.text_offset.append(offset)
        offset += len(token)
        result.top_logprobs.append({
            (lp.decoded_token or ""): max(lp.logprob, MIN_LOGPROB)
            for lp in sorted(entry.values(), key=lambda lp: lp.rank)[:top_n]})
    return result


def _chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]],
                   top_n: int) -> p.ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries):
        top = sorted(entry.values(), key=lambda lp: lp.rank)[:top_n]
        content.append(p.TokenLogprob(**_token_fields(entry[token_id]),
                                      top_logprobs=[p.TopLogprob(**_token_fields(lp))
                                                    for lp in top]))
    return p.ChatLogprobs(content=content)


def _token_fields(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": max(lp.logprob, MIN_LOGPROB),
            "bytes": list(token.encode("utf-8"))}


def _usage(outputs: list[RequestOutput], completion_tokens: int | None = None) -> p.Usage:
    """Token counts of final outputs; a stream passes the completion tokens it
    counted from its deltas."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    if completion_tokens is None:
        completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.metrics.num_cached_tokens for o in outputs)
    return p.Usage(prompt_tokens=prompt, completion_tokens=completion_tokens,
                   total_tokens=prompt + completion_tokens,
                   prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached))


def error_json(message: str, kind: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return p.ErrorResponse(error=p.ErrorInfo(message=message, type=kind, param=param,
                                             code=code)).model_dump()
