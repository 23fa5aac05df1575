"""The offline API: ``LLM(model).generate(prompts, params)``, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from inflight.config import EngineConfig
from inflight.core.beam_search import BeamSearchParams
from inflight.core.sampling_params import SamplingParams
from inflight.engine.factory import build_llm_engine
from inflight.engine.input import PromptType
from inflight.engine.output import RequestOutput
from inflight.model.tokenizer import Tokenizer

ChatMessages = list[dict[str, Any]]


@dataclass
class BeamSearchSequence:
    """One hypothesis of a beam search, as vLLM's: ``tokens`` are the prompt's
    and the generated ones (an ending EOS included); ``text`` is the generated
    text; ``score`` is ``cum_logprob`` divided by the generated length to the
    power ``length_penalty``, which ranks the hypotheses."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    """A prompt's beam search: ``beam_width`` hypotheses, best first."""

    sequences: list[BeamSearchSequence]


class LLM:
    """Runs batches of prompts to completion with continuous batching.

    ``model`` is a Hugging Face directory, a ``.gguf`` file, or None for the
    default model; other keyword options are ``EngineConfig`` fields.
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.config = EngineConfig.from_options(model=model, **options)
        self.engine = build_llm_engine(self.config)

    def get_tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise ValueError("no tokenizer is loaded (skip_tokenizer_init is set)")
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | BeamSearchParams
                 | Sequence[SamplingParams | BeamSearchParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is a string, ``{"prompt_token_ids": [...]}`` or a list of token
        ids inside a list of prompts. ``sampling_params`` is one SamplingParams
        for all prompts or a list with one per prompt. If any prompt is invalid,
        a ValueError names the problem and nothing of this call keeps running.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, (SamplingParams,
                                                                     BeamSearchParams)):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries for "
                                 f"{len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, params, prio in zip(prompts, params_list, priorities):
                ids.append(self.engine.add_request(prompt, params, priority=prio))
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (prompts as in ``generate``), all of them
        in the same continuous batch; outputs in input order."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        outputs = self.generate(prompts, [params] * len(prompts), use_tqdm)
        return [BeamSearchOutput([
            BeamSearchSequence(o.prompt_token_ids + c.token_ids, c.text, c.cumulative_logprob,
                               c.score, c.finish_reason) for c in o.outputs]) for o in outputs]

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``
        messages) or to a list of conversations, using the model's chat template
        (which also renders OpenAI-style ``tools``)."""
        tokenizer = self.get_tokenizer()
        if not messages:
            raise ValueError("messages must contain at least one message")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(list(conversation), add_generation_prompt, tools)
            prompts.append({"prompt": text,
                            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", unit="req",
                  disable=not use_tqdm) as bar:
            try:
                while pending:
                    outputs = self.engine.step()
                    if not outputs and not self.engine.has_unfinished_requests():
                        raise RuntimeError("the engine stopped with requests unfinished")
                    for output in outputs:
                        if output.finished and output.request_id in pending:
                            pending.discard(output.request_id)
                            finished[output.request_id] = output
                            bar.update(1)
            except BaseException:
                self.engine.abort_request(list(pending))
                raise
        return [finished[rid] for rid in request_ids]
