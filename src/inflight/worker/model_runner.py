"""SchedulerOutput -> flat tensors -> model -> sampler -> the tokens each
request that reached the end of its known tokens accepts. ``worker.load``
builds it from an EngineConfig.

The step's tokens are laid out request after request: ``input_ids[T]``,
``positions[T]`` and ``slot_mapping[T]``, with ``query_start_loc[B+1]`` marking
where each request's tokens start. Logits are computed only for the last token
of requests that sample this step (a prompt chunk that does not finish its
prompt samples nothing), and for each draft position of a request verifying
drafts. On CUDA, decode-only steps replay CUDA graphs (``worker.cuda_graphs``)
once ``capture_decode_graphs`` has run.

Verification samples the target's token at every position of a verified run
(its last real token, then each draft), each with the context of the drafts
before it, and accepts drafts while they equal those samples; the first that
differs, or the one after the last draft, is the extra token. For greedy rows
that is the argmax test; for sampled rows it is exact speculative sampling
with a drafter that proposes one token (accepted with the target's
probability of it; on rejection the target's sample given that it differs),
and with seeded draws keyed by (seed, position) a request's tokens are the
same with and without speculation.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from inflight.attention.backend import AttentionBackend, BatchLayout, KVCaches, WindowedMetadata
from inflight.core.scheduler import PLACEHOLDER_TOKEN, SchedulerOutput
from inflight.core.window_kv import NO_BLOCK
from inflight.model.llama import Attention
from inflight.ops.staging import HostStaging
from inflight.worker.cpu_share import SharedCores
from inflight.worker.cuda_graphs import DecodeGraphs, Graph
from inflight.worker.runner import RunnerOutput, TokenLogprobs
from inflight.worker.sampler import SampledBatch, Sampler, SamplerOutput, SamplingRow


class PreparedStep:
    """A step whose inputs are read (``ModelRunner.prepare_step``): ``launch``
    computes it (on CUDA: queues its work, then returns), ``collect`` waits
    for its results. ``sampled_rows``: request id -> its row among the
    step's samples."""

    def __init__(self, sampled_rows: dict[str, int], compute: Callable[[], SampledBatch | None],
                 collect: Callable[[SampledBatch | None], RunnerOutput]) -> None:
        self.sampled_rows = sampled_rows
        self._compute: Callable[[], SampledBatch | None] | None = compute
        self._collect = collect
        self._sampled: SampledBatch | None = None

    def launch(self) -> None:
        self._sampled = self._compute()
        self._compute = None  # (its inputs, and the step it was fed from, may go)

    def collect(self) -> RunnerOutput:
        return self._collect(self._sampled)

    def sampled_tokens(self) -> torch.Tensor:
        """The sampled tokens, where the device holds them (once launched)."""
        return self._sampled.tokens


@dataclass
class _Feedback:
    """Token ids of a step that the step prepared before it samples: input
    positions ``dst`` take that step's samples ``src``."""

    dst: np.ndarray
    src: np.ndarray
    source: PreparedStep | None


class ModelRunner:
    """Implements ``worker.runner.Runner`` with a real model."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, *, num_blocks: int,
                 block_size: int, device: torch.device, dtype: torch.dtype, seed: int,
                 max_model_len: int, num_parameters: int, weight_bytes: int = 0,
                 num_host_blocks: int = 0, kv_window: int | None = None,
                 window_pages: int = 1, cores: SharedCores | None = None,
                 lend_spare_core: Callable[[bool], None] | None = None) -> None:
        """``num_parameters``: the model's, as stored (a tied embedding once),
        counted before its weights were packed; ``weight_bytes``: the memory its
        weights take as loaded (packed, quantized). With ``kv_window``, the
        layers with that sliding window keep only their window's KV
        (``core.window_kv``): ``num_blocks`` pages (and page 0) in the global
        layers' tensors hold blocks of either kind, the window layers in
        ``window_pages`` groups, each on the global layers' tensors. With
        ``cores``, each step runs on as many threads as it says (the CPU
        kernels' threads, where their number is not fixed), and
        ``lend_spare_core`` hears whether threads are given up
        (``cpu_ops.lend_spare_core``)."""
        cfg = model.config
        self._num_threads = torch.get_num_threads()  # (as configured by the loader)
        self.cores = cores
        self._lend_spare_core = lend_spare_core
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.num_kv_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.max_model_len = max_model_len
        self.num_parameters = num_parameters
        self.weight_bytes = weight_bytes
        self.kv_window = kv_window
        windows = cfg.sliding_windows or [None] * cfg.num_hidden_layers
        places = _kv_places([kv_window is not None and w == kv_window for w in windows])
        self.window_pages = window_pages if kv_window is not None else 1
        heads, head_dim = cfg.num_key_value_heads, cfg.head_dim
        # (Page 0 stays zero: what window table entries behind the window read.)
        self.kv_caches, self._page_caches = _per_layer(
            places, lambda layers, blocks: backend.allocate_kv_cache(
                layers, blocks, block_size, heads, head_dim, dtype, device),
            num_blocks + (kv_window is not None))
        # Where swapped-out KV blocks wait: host memory, pinned for fast copies
        # from a GPU.
        self.host_kv_caches, self._host_pages = _per_layer(
            places, lambda layers, blocks: backend.allocate_host_cache(
                layers, blocks, block_size, heads, head_dim, dtype,
                pin_memory=device.type == "cuda"),
            num_host_blocks) if num_host_blocks else ([], [])
        if kv_window is not None:
            groups = [group for _, group in places]
            if max(groups) + 1 != window_pages:
                raise ValueError(f"the window layers form {max(groups) + 1} groups, not "
                                 f"window_pages={window_pages}")
            attentions = [m for m in model.modules() if isinstance(m, Attention)]
            for attention, group in zip(attentions, groups, strict=True):
                attention.kv_group = group
            backend.layouts_per_step = 1 + window_pages
        self.sampler = Sampler(device, seed)
        self._staging = HostStaging(device)
        self.graphs: DecodeGraphs | None = None
        self._last_step: PreparedStep | None = None
        # A step's launch only queues its work (CUDA); on the CPU it computes.
        self.launch_queues = device.type == "cuda"

    def capture_decode_graphs(self, max_batch: int, new_graph: Callable[[], Graph]) -> None:
        """Capture decode-only steps of up to ``max_batch`` requests (the backend
        must provide static decode buffers: ``TritonPagedBackend``)."""
        max_blocks = -(-self.max_model_len // self.block_size)
        buffers = [self.backend.decode_buffers(max_batch, max_blocks, self.max_model_len,
                                               self.device)
                   for _ in range(self.backend.layouts_per_step)]

        def step(input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
            return self.model.compute_logits(
                self.model(input_ids, positions, self.kv_caches, metadata))

        graphs = DecodeGraphs(step, buffers[0], max_batch, self.device, new_graph,
                              window_buffers=buffers[1:])
        with torch.inference_mode():
            graphs.capture()
        self.graphs = graphs

    def prepare(self, out: SchedulerOutput) -> tuple[np.ndarray, np.ndarray, BatchLayout,
                                                     list[int]]:
        """Host-side input preparation: token ids, positions, the batch layout and
        the indices of the batch rows that sample."""
        requests, num_new = out.requests, out.num_new_tokens
        num_reqs = len(requests)
        starts = [r.num_computed_tokens for r in requests]
        token_ids: list[int] = []
        sample_rows: list[int] = []
        for i, (request, n, start, drafts) in enumerate(zip(requests, num_new, starts,
                                                            out.draft_token_ids)):
            tokens = request.all_token_ids
            if n == 1:
                token_ids.append(tokens[start])
            elif drafts:
                token_ids.append(tokens[start])
                token_ids.extend(drafts)
            else:
                token_ids.extend(tokens[start:start + n])
            if start + n - len(drafts) == len(tokens):
                sample_rows.append(i)

        num_new_np = np.array(num_new, dtype=np.int64)
        context_lens = np.array(starts, dtype=np.int64)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_new_np, out=query_start_loc[1:])
        seq_lens = context_lens + num_new_np
        num_tokens = int(query_start_loc[-1])
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(
            query_start_loc[:-1] - context_lens, num_new_np)

        token_rows = np.repeat(np.arange(num_reqs), num_new_np)
        bs = self.block_size
        step = dict(query_start_loc=query_start_loc, context_lens=context_lens,
                    seq_lens=seq_lens, block_size=bs)
        windows = tuple(
            _layout(_window_table([groups[g] for groups in out.window_block_ids]), token_rows,
                    positions, step)
            for g in range(self.window_pages if out.window_block_ids else 0))
        layout = _layout(_block_table(out.block_ids), token_rows, positions, step, windows)
        return np.array(token_ids, dtype=np.int64), positions, layout, sample_rows

    @staticmethod
    def _sampling_rows(out: SchedulerOutput, sample_rows: list[int]) -> list[SamplingRow]:
        """One row per sampled position: a request's next token, or each
        position of its verified run, with the drafts before it as context
        (and the grammar bitmask row of each, for a constrained request)."""
        rows = []
        grammar_rows = {} if out.grammar_bitmask is None else out.grammar_bitmask.rows
        for i in sample_rows:
            request = out.requests[i]
            params = request.sampling_params
            drafts = out.draft_token_ids[i]
            outputs = request.output_token_ids
            first_mask = grammar_rows.get(i)
            for j in range(len(drafts) + 1):
                row = SamplingRow(params, position=request.num_tokens + j,
                                  bitmask_row=None if first_mask is None else first_mask + j)
                if row.has_penalties:
                    row.prompt_token_ids = request.prompt_token_ids
                    row.output_token_ids = outputs + drafts[:j] if j else outputs
                if request.num_output_tokens + j < params.min_tokens and request.stop_token_ids:
                    row.banned_token_ids = request.stop_token_ids
                rows.append(row)
        return rows

    @torch.inference_mode()
    def move_blocks(self, out: SchedulerOutput) -> None:
        """Copy-on-write copies between device blocks, then swapped-out blocks to
        host memory, then swapped-in blocks back (in that order: a block freed by
        one may be reused by the next). Runs before ``execute``, even for a step
        that computes nothing."""
        # (Pairs are pages, of every layer's tensors: window layers share them.)
        caches, host_caches = self._page_caches, self._host_pages
        copies, swap_out, swap_in = out.copy_blocks, out.swap_out, out.swap_in
        if copies:
            self.backend.copy_blocks(caches, copies)
        if swap_out:
            self.backend.swap_blocks(caches, host_caches, swap_out)
        if swap_in:
            self.backend.swap_blocks(host_caches, caches, swap_in)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        step = self.prepare_step(out)
        step.launch()
        return step.collect()

    def init_compute_thread(self) -> None:
        """Run first in a thread that will compute steps (async scheduling):
        OpenMP's thread count is per calling thread, and a new thread would
        otherwise use every core whatever ``num_threads`` says (the C kernels
        share PyTorch's OpenMP runtime)."""
        torch.set_num_threads(self._num_threads)

    def _use_free_cores(self) -> None:
        """In the thread that computes, as many threads as ``cores`` says now."""
        if self.cores is not None and (threads := self.cores.current()) != torch.get_num_threads():
            torch.set_num_threads(threads)
            if self._lend_spare_core is not None:
                self._lend_spare_core(threads < self.cores.max_threads)

    def prepare_step(self, out: SchedulerOutput) -> PreparedStep:
        """Read everything the step needs from ``out`` and its requests now;
        the step's ``launch`` and ``collect`` touch neither again (so that
        another thread may launch it while the scheduler moves on: async
        scheduling).

        A token the step before has not sampled yet (``PLACEHOLDER_TOKEN``:
        that step was prepared before this one but may not have run) is taken
        from its sampled tokens when this step launches, on the device."""
        input_ids, positions, layout, sample_rows = self.prepare(out)
        num_rows = len(out.requests)
        drafts = list(out.draft_token_ids)
        rows = self._sampling_rows(out, sample_rows) if sample_rows else []
        bitmask = None if out.grammar_bitmask is None else out.grammar_bitmask.bitmask
        bucket = self.graphs.bucket(layout) if self.graphs is not None and sample_rows else None
        logit_positions = (self._logit_positions(out, layout, sample_rows) if bucket is None
                           else None)
        sample_index = np.array(sample_rows, dtype=np.int64)
        feedback = self._feedback(out, input_ids, layout)
        greedy_head = (self._greedy_head() if bucket is None and rows
                       and Sampler.plain_greedy(rows) else None)

        @torch.inference_mode()
        def compute() -> SampledBatch | None:
            self._use_free_cores()
            if bucket is not None:
                ids, pos, index = self._stage(input_ids, [positions, sample_index], feedback)
                logits = self.graphs.run(ids, pos, layout, bucket)
                if len(sample_rows) < num_rows:
                    logits = logits[index]
            elif greedy_head is not None:
                return Sampler.greedy_batch(*self._forward(input_ids, positions, layout,
                                                           logit_positions, feedback,
                                                           greedy_head))
            else:
                logits = self._forward(input_ids, positions, layout, logit_positions, feedback)
            return self.sampler.sample_deferred(logits, rows, bitmask) if sample_rows else None

        def collect(sampled: SampledBatch | None) -> RunnerOutput:
            return self._accept(None if sampled is None else sampled.read(), sample_rows,
                                drafts, num_rows)

        sampled_rows = ({} if any(drafts) else
                        {out.requests[i].request_id: j for j, i in enumerate(sample_rows)})
        self._last_step = PreparedStep(sampled_rows, compute, collect)
        return self._last_step

    def _greedy_head(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        """The model's output layer for plain greedy steps, where it finds the
        tokens without the logits (``LlamaForCausalLM.greedy_head``)."""
        greedy_head = getattr(self.model, "greedy_head", None)
        return greedy_head() if greedy_head is not None else None

    def _feedback(self, out: SchedulerOutput, input_ids: np.ndarray,
                  layout: BatchLayout) -> _Feedback | None:
        """Where the step's input holds placeholders, and which of the previous
        prepared step's samples go there."""
        holes = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN)
        if not holes.size:
            return None
        source = self._last_step
        owners = np.searchsorted(layout.query_start_loc, holes, side="right") - 1
        try:
            src = [source.sampled_rows[out.requests[row].request_id] for row in owners.tolist()]
        except (AttributeError, KeyError):
            raise RuntimeError("a step's input holds a token that the step prepared before it "
                               "does not sample") from None
        return _Feedback(holes, np.array(src, dtype=np.int64), source)

    def _stage(self, input_ids: np.ndarray, arrays: list[np.ndarray],
               feedback: _Feedback | None) -> list[torch.Tensor]:
        """The step's token ids (placeholders filled in from the previous step's
        samples, on the device) and ``arrays``, on the device."""
        if feedback is None:
            return self._staging.to_device([input_ids, *arrays])
        *staged, dst, src = self._staging.to_device([input_ids, *arrays, feedback.dst,
                                                     feedback.src])
        staged[0].index_copy_(0, dst, feedback.source.sampled_tokens().index_select(0, src))
        feedback.source = None  # (no chain of steps kept alive)
        return staged

    def _accept(self, result: SamplerOutput | None, sample_rows: list[int],
                drafts: list[list[int]], num_rows: int) -> RunnerOutput:
        """Accept each sampled row's tokens (a verified run: the drafts that
        match the samples, and one more)."""
        sampled: list[Sequence[int]] = [()] * num_rows
        logprobs: dict[int, list[TokenLogprobs]] = {}
        errors: dict[int, str] = {}
        if result is not None:
            k = 0
            for row in sample_rows:
                row_drafts = drafts[row]
                span = range(k, k + len(row_drafts) + 1)
                k += len(row_drafts) + 1
                error = next((result.errors[j] for j in span if j in result.errors), None)
                if error is not None:
                    errors[row] = error
                    continue
                accepted = []
                for position, j in enumerate(span):
                    accepted.append(result.token_ids[j])
                    if position < len(row_drafts) and result.token_ids[j] != row_drafts[position]:
                        break
                sampled[row] = accepted
                if result.logprobs[span[0]] is not None:
                    logprobs[row] = [result.logprobs[j] for j in span[:len(accepted)]]
        return RunnerOutput(sampled, logprobs, errors)

    @staticmethod
    def _logit_positions(out: SchedulerOutput, layout: BatchLayout,
                         sample_rows: list[int]) -> np.ndarray:
        """Flat indices of the tokens whose logits are needed: the last of each
        sampling request, and for a verified run each of its tokens."""
        ends = layout.query_start_loc[np.array(sample_rows, dtype=np.int64) + 1]
        if not any(out.draft_token_ids[i] for i in sample_rows):
            return ends - 1
        return np.concatenate([np.arange(end - 1 - len(out.draft_token_ids[i]), end)
                               for i, end in zip(sample_rows, ends.tolist())])

    @torch.inference_mode()
    def prompt_logprobs(self, token_ids: Sequence[int], chunk_size: int = 512) -> np.ndarray:
        """The log-probability of each token after the first given those before
        it, the text run in prompt chunks of ``chunk_size`` tokens through the
        first blocks of the KV cache (so only on a runner with no request in
        flight: scoring, perplexity)."""
        n, bs = len(token_ids), self.block_size
        limit = min(self.max_model_len, self.num_kv_blocks * bs)
        if not 2 <= n <= limit:
            raise ValueError(f"a text to score needs 2 to {limit} tokens, got {n}")
        num_blocks = -(-n // bs)
        block_table = np.arange(num_blocks, dtype=np.int64)[None]
        window_tables = []
        if self.kv_window is not None:
            # Each group of window layers uses its share of the pages after
            # the global ones' as a ring: a chunk and the window before it
            # never wrap onto each other.
            block_table += 1  # (page 0 stays zero)
            ring = (self.num_kv_blocks - num_blocks) // self.window_pages
            window_tables = [num_blocks + 1 + g * ring
                             + np.arange(num_blocks, dtype=np.int64)[None] % ring
                             for g in range(self.window_pages)]
            if ring < num_blocks:  # (the capacity leaves a ring longer than the window)
                chunk_size = min(chunk_size, (ring - 1) * bs - self.kv_window + 1)
        ids = np.asarray(token_ids, dtype=np.int64)
        logprobs = []
        for start in range(0, n - 1, chunk_size):
            end = min(start + chunk_size, n)
            step = dict(query_start_loc=np.array([0, end - start], dtype=np.int64),
                        context_lens=np.array([start], dtype=np.int64),
                        seq_lens=np.array([end], dtype=np.int64), block_size=bs)
            positions = np.arange(start, end, dtype=np.int64)
            windows = tuple(_layout(table, 0, positions, step) for table in window_tables)
            layout = _layout(block_table, 0, positions, step, windows)
            scored = min(end, n - 1) - start  # positions whose next token is known
            logits = self._forward(ids[start:end], positions, layout,
                                   np.arange(scored, dtype=np.int64))
            targets = torch.from_numpy(ids[start + 1:start + 1 + scored]).to(logits.device)
            chunk = torch.log_softmax(logits.float(), dim=-1)
            logprobs.append(chunk.gather(1, targets[:, None])[:, 0].cpu().numpy())
        return np.concatenate(logprobs).astype(np.float64)

    def _forward(self, input_ids: np.ndarray, positions: np.ndarray, layout: BatchLayout,
                 logits_index: np.ndarray, feedback: _Feedback | None = None,
                 head: Callable[[torch.Tensor], Any] | None = None) -> Any:
        """One eager step; the logits of the tokens at ``logits_index`` (None if
        there are none), or what ``head`` makes of their hidden states."""
        ids, pos, index = self._stage(input_ids, [positions, logits_index], feedback)
        metadata = self.backend.build_metadata(layout, self.device)
        if layout.windows:
            metadata = WindowedMetadata(metadata, [self.backend.build_metadata(w, self.device)
                                                   for w in layout.windows])
        hidden = self.model(ids, pos, self.kv_caches, metadata)
        if not logits_index.size:
            return None
        # The indices rise within [0, T): T of them is every token (a decode
        # step), and the gather would only copy.
        return (head or self.model.compute_logits)(
            hidden if logits_index.size == hidden.shape[0] else hidden[index])


def _block_table(tables: list[list[int]]) -> np.ndarray:
    """Block tables as one ``[rows, longest]`` array, padded with block 0."""
    lengths = np.fromiter(map(len, tables), np.int64, len(tables))
    table = np.zeros((len(tables), int(lengths.max())), dtype=np.int64)
    table[np.arange(table.shape[1]) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), np.int64, int(lengths.sum()))
    return table


def _window_table(tables: list[list[int]]) -> np.ndarray:
    """As ``_block_table`` for window tables, whose entries behind the window
    (``NO_BLOCK``, all before the first live one) read page 0, which stays
    zero: only the live entries are read from the lists (a long context's
    table is mostly behind its window, and a model has a table per group)."""
    firsts = [bisect.bisect_right(t, NO_BLOCK) for t in tables]  # (-1s, then pages)
    starts = np.array(firsts, dtype=np.int64)
    lengths = np.fromiter(map(len, tables), np.int64, len(tables))
    columns = np.arange(int(lengths.max()))
    table = np.zeros((len(tables), columns.size), dtype=np.int64)
    table[(columns >= starts[:, None]) & (columns < lengths[:, None])] = np.fromiter(
        itertools.chain.from_iterable(t[f:] for t, f in zip(tables, firsts)), np.int64,
        int((lengths - starts).sum()))
    return table


def _layout(table: np.ndarray, rows: np.ndarray | int, positions: np.ndarray,
            step: dict[str, Any], windows: tuple[BatchLayout, ...] = ()) -> BatchLayout:
    """The step's layout over ``table``: each position's KV slot is the block
    its row's table gives for it, times the block size, plus its offset in
    the block."""
    bs = step["block_size"]
    return BatchLayout(block_table=table,
                       slot_mapping=table[rows, positions // bs] * bs + positions % bs,
                       windows=windows, **step)


def _kv_places(in_window: list[bool]) -> list[tuple[int, int]]:
    """Where each layer keeps its K/V: (the global layer whose tensors, its
    group of window layers). Global layer ``i`` in its own (group 0); window
    layer ``m`` (counting window layers only) in global layer ``m % G``'s, at
    the pages of group ``m // G`` (``G`` global layers)."""
    num_global = len(in_window) - sum(in_window)
    places, num_window = [], 0
    for w in in_window:
        if w:
            places.append((num_window % num_global, num_window // num_global))
            num_window += 1
        else:
            places.append((len(places) - num_window, 0))
    return places


def _per_layer(places: list[tuple[int, int]], allocate: Callable[[int, int], KVCaches],
               num_blocks: int) -> tuple[KVCaches, KVCaches]:
    """Every layer's (K, V), in layer order, and the tensors allocated
    (``allocate(layers, blocks)``): one (K, V) per global layer, which the
    window layers share (``_kv_places``)."""
    pages = allocate(1 + max(i for i, _ in places), num_blocks)
    return [pages[i] for i, _ in places], pages
