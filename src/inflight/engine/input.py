"""A front end's first step: a caller's prompt and options, validated and
tokenized into the ``CoreRequest`` an EngineCore queues. It touches no engine
state, so any thread may run it (a long prompt's tokenization stays off the
server's event loop)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from inflight.core.beam_search import BeamSearchParams
from inflight.core.sampling_params import SamplingParams
from inflight.core.scheduler import Clock
from inflight.engine.messages import CoreRequest, ModelInfo
from inflight.engine.output import OutputKind
from inflight.model.tokenizer import Tokenizer
from inflight.structured import validate

PromptType = str | list[int] | dict[str, Any]


@dataclass
class PreparedRequest:
    """A request ready for the core, with what only the front end keeps: the
    prompt's text and how its outputs are to be reported."""

    core: CoreRequest
    prompt: str | None
    kind: OutputKind

    @property
    def request_id(self) -> str:
        return self.core.request_id


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, model: ModelInfo,
                 clock: Clock = time.time, stream_interval: int = 1, id_prefix: str = "") -> None:
        """``stream_interval``: a stream's tokens come from the core in runs of
        this many (``EngineConfig.stream_interval``); ``id_prefix`` begins the
        ids given to requests that come without one."""
        self.tokenizer = tokenizer
        self.model = model
        self.clock = clock
        self.stream_interval = stream_interval
        self.id_prefix = id_prefix
        self._ids = itertools.count()

    def output_interval(self, params: SamplingParams | BeamSearchParams,
                        kind: OutputKind) -> int:
        """How often the core is to report a request's tokens
        (``CoreRequest.output_interval``): every token where the front end
        watches the text for stop strings (so that the sequence ends at the
        token that completes one, and computes nothing past it); else a
        stream's every ``stream_interval``, a final answer's only at its end."""
        if isinstance(params, SamplingParams) and params.stop:
            return 1
        return self.stream_interval if kind is OutputKind.DELTA else 0

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Prompt text (if any) and token ids, or ValueError naming the problem."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"unknown prompt field(s): {', '.join(sorted(unknown))}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt must be token ids when skip_tokenizer_init is set")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict with "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    def _check_token_ids(self, ids: Any) -> list[int]:
        vocab = self.model.vocab_size
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad}, outside the vocabulary [0, {vocab})")
        return ids

    def prepare(self, prompt: PromptType,
                params: SamplingParams | BeamSearchParams | None = None, *,
                request_id: str | None = None, kind: OutputKind = OutputKind.FINAL,
                arrival_time: float | None = None, priority: int = 0,
                tenant: str | None = None, deadline_ms: float | None = None,
                expected_output_tokens: int | None = None,
                cache_salt: str | None = None, background: bool = False) -> PreparedRequest:
        """Validate and tokenize a request (ValueError names what is wrong).

        ``priority``: lower runs first (priority policy); ``tenant``: whose share
        it counts against (fair policy); ``deadline_ms``: due this long after
        arrival (deadline policy); ``expected_output_tokens``: its expected
        length, for shortest-job-first (``max_tokens`` otherwise);
        ``cache_salt``: shares cached KV only with requests of the same salt;
        ``background``: batch work, run only in capacity that interactive
        requests leave idle (``core.background``). A beam search
        (BeamSearchParams) always reports once, finished."""
        params = SamplingParams() if params is None else params
        beam = isinstance(params, BeamSearchParams)
        if not (beam or isinstance(params, SamplingParams)):
            raise ValueError(f"sampling params must be a SamplingParams or BeamSearchParams, "
                             f"got {type(params).__name__}")
        if not beam and params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set)")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer (skip_tokenizer_init is "
                                 "set)")
            validate(params.structured_outputs)
        text, ids = self.tokenize_prompt(prompt)
        max_model_len = self.model.max_model_len
        if len(ids) > max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len="
                             f"{max_model_len}")
        request_id = f"{self.id_prefix}{next(self._ids)}" if request_id is None else request_id
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        max_tokens = max(1, max_model_len - len(ids))
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if deadline_ms is not None and (isinstance(deadline_ms, bool) or not isinstance(
                deadline_ms, (int, float)) or not 0 < deadline_ms < 1e12):
            raise ValueError(f"deadline_ms must be a positive number, got {deadline_ms!r}")
        if expected_output_tokens is not None and (
                not isinstance(expected_output_tokens, int) or expected_output_tokens < 1):
            raise ValueError(f"expected_output_tokens must be an integer >= 1, "
                             f"got {expected_output_tokens!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        if tenant is not None and not isinstance(tenant, str):
            raise ValueError(f"tenant must be a string, got {type(tenant).__name__}")
        if not isinstance(background, bool):
            raise ValueError(f"background must be true or false, got {background!r}")
        arrival = self.clock() if arrival_time is None else arrival_time
        kind = OutputKind.FINAL if beam else kind
        core = CoreRequest(
            request_id=request_id, prompt_token_ids=ids,
            sampling=None if beam else params, beam=params if beam else None,
            max_tokens=max_tokens, arrival_time=arrival, priority=priority, tenant=tenant,
            deadline=None if deadline_ms is None else arrival + deadline_ms / 1000,
            expected_output_tokens=expected_output_tokens, cache_salt=cache_salt,
            background=background, output_interval=self.output_interval(params, kind))
        return PreparedRequest(core, text, kind)
