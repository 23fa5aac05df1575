"""The one interface a front end (the HTTP server, later a Ray ingress) talks
to: generate, abort, model facts, tokenizer operations and load figures. The
in-process ``AsyncEngine`` implements it; a proxy over remote replicas can too,
so the server never reaches into an engine's internals."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from inflight.core.beam_search import BeamSearchParams
from inflight.core.sampling_params import SamplingParams
from inflight.engine.messages import EngineLoad, ModelInfo
from inflight.engine.output import RequestOutput
from inflight.model.tokenizer import Tokenizer


class StepLogSource(Protocol):
    """What the dashboard reads of one engine: its ``engine.step_log.StepLog``,
    in process or through a replica."""

    async def info(self) -> dict[str, int]:
        """``capacity`` (max_num_seqs) and ``next_step`` (the next step's number)."""

    async def steps_since(self, cursor: int, limit: int) -> list[dict[str, Any]]: ...

    async def summary(self) -> dict[str, Any]: ...

    async def history(self, request_id: str) -> dict[str, Any] | None: ...

    def load(self) -> EngineLoad:
        """This engine's load, current even when no step runs."""


class EngineClient(Protocol):
    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped, if it failed (then nothing can be served)."""

    def load(self) -> EngineLoad: ...

    def generate(self, prompt: Any, params: SamplingParams | BeamSearchParams, *, request_id: str | None = None,
                 stream: bool = True, **scheduling: Any) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes: with ``stream``, each output
        holds only what is new since the last (deltas), else there is one final
        output with everything. Closing the iterator early aborts the request."""

    async def abort(self, request_id: str) -> None: ...

    async def reset_prefix_cache(self) -> int: ...

    def step_logs(self) -> dict[str, StepLogSource]:
        """The step log of each engine (one per replica), by name."""

    # Tokenizer operations; ValueError when the engine has no tokenizer.
    @property
    def has_tokenizer(self) -> bool: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str: ...


class TokenizerOps:
    """The EngineClient's tokenizer operations over a client's ``tokenizer``
    (None when the engine runs on token ids only)."""

    tokenizer: Tokenizer | None

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init is set)")
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer().encode(text, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer().decode(token_ids, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        return self._tokenizer().apply_chat_template(messages, add_generation_prompt, tools)
