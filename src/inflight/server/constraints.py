"""What a request asks of its output's shape: its structured-output fields
(OpenAI's ``response_format``, vLLM's ``structured_outputs`` and the older
``guided_*``) as the engine's ``StructuredOutputsParams``, checked before
anything is queued; and its tool fields (``tools``, ``tool_choice``,
``parallel_tool_calls``) as a ``ToolPlan``: the tools the chat template
renders, the grammar that enforces a required or named call, and the parser
that reads calls from the output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inflight.core.sampling_params import StructuredOutputsParams
from inflight.server import protocol as p
from inflight.server.invalid_request import InvalidRequest
from inflight.server.tool_parsers import NamedParser, RequiredParser, ToolParser, make_parser
from inflight.structured import validate

AUTO_TOOL_CHOICE_NEEDS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                          '--tool-call-parser to be set')


def _checked(options: dict[str, Any], param: str) -> StructuredOutputsParams:
    """The options as StructuredOutputsParams whose schema, expression or
    grammar is valid; else a 400 naming ``param``."""
    try:
        params = StructuredOutputsParams(**options)
        validate(params, param)
    except ValueError as e:
        raise InvalidRequest(str(e), param) from None
    return params


def _from_response_format(fmt: p.ResponseFormat) -> dict[str, Any] | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise InvalidRequest("response_format json_schema needs json_schema.schema",
                                 "response_format.json_schema")
        return {"json": fmt.json_schema.json_schema}
    tag = fmt.model_dump(exclude_none=True, include={"format", "structures", "triggers"})
    if not tag:
        raise InvalidRequest("response_format structural_tag needs format (or structures and "
                             "triggers)", "response_format")
    return {"structural_tag": {"type": "structural_tag", **tag} if "format" in tag else tag}


def structured_outputs(req: p.CompletionRequest | p.ChatCompletionRequest
                       ) -> StructuredOutputsParams | None:
    """The request's constraint, from whichever one field gives it."""
    given: list[tuple[str, dict[str, Any]]] = []
    if req.response_format is not None:
        options = _from_response_format(req.response_format)
        if options is not None:
            given.append(("response_format", options))
    if req.structured_outputs is not None:
        given.append(("structured_outputs",
                      req.structured_outputs.model_dump(by_alias=True, exclude_none=True)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            given.append((name, {kind: value}))
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(f"give one of response_format, structured_outputs and guided_*, "
                             f"not {' and '.join(name for name, _ in given)}", given[1][0])
    param, options = given[0]
    return _checked(options, param)


def _tool_grammar(schema: dict[str, Any]) -> StructuredOutputsParams:
    return _checked({"json": schema, "disable_any_whitespace": True}, "tools")


@dataclass
class ToolPlan:
    """How a chat request's tools shape the prompt and the answer: ``tools``
    for the chat template, the ``parser`` of calls in the output (None: the
    output is content), at most ``max_calls`` of them, and the grammar of a
    required or named choice."""

    tools: list[dict[str, Any]] | None = None
    parser: ToolParser | None = None
    max_calls: int | None = None
    structured: StructuredOutputsParams | None = None


def tool_plan(req: p.ChatCompletionRequest, auto_parser: str | None) -> ToolPlan:
    """``auto_parser``: the server's ``--tool-call-parser`` when
    ``--enable-auto-tool-choice`` is set. The grammar of a required or named
    call writes JSON the way models do (``", "`` and ``": "``, no other
    whitespace): free whitespace lets a small model spend its tokens on it."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", "tool_choice")
        return ToolPlan()
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    functions = {t.function.name: t.function for t in req.tools}
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan(tools)
    if choice == "auto":
        if auto_parser is None:
            raise InvalidRequest(AUTO_TOOL_CHOICE_NEEDS, "tool_choice")
        return ToolPlan(tools, make_parser(auto_parser), None if req.parallel_tool_calls else 1)
    if choice == "required":
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object",
             "properties": {"name": {"type": "string", "enum": [name]},
                            "parameters": f.parameters or {"type": "object"}},
             "required": ["name", "parameters"]} for name, f in functions.items()]}}
        if not req.parallel_tool_calls:
            calls["maxItems"] = 1
        return ToolPlan(tools, RequiredParser(), None, _tool_grammar(calls))
    name = choice.function.name
    if name not in functions:
        raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools",
                             "tool_choice")
    schema = functions[name].parameters or {"type": "object"}
    return ToolPlan(tools, NamedParser(name), 1, _tool_grammar(schema))
