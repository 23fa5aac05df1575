"""A fake worker for scheduler tests: it stores, for every KV slot, the token
whose KV it holds, and checks every read and write against the request's
tokens (no torch). A request that reads a slot holding another token would
compute garbage; a write into a shared or cached block would corrupt another
request's KV. With a ``WindowedKVCacheManager`` it checks the window layers'
tables too (one per group of window layers): every read within a query's
window, every write, and that the blocks behind a request's window are given
back."""

from __future__ import annotations

import itertools
import zlib

from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.scheduler import SchedulerOutput
from inflight.core.window_kv import (NO_BLOCK, NULL_WINDOW_BLOCK, WINDOW_KEY,
                                     WindowedKVCacheManager)

VOCAB = 50


def next_token(tokens: list[int], sample: int) -> int:
    """A deterministic 'model': the next token depends on every token before it
    (and on which sample of a prompt this is)."""
    return zlib.crc32(bytes(str((tokens, sample)), "ascii")) % VOCAB


def next_token_candidates(tokens: list[int], k: int) -> list[tuple[int, float]]:
    """The 'model's' ``k`` likeliest next tokens (distinct) with made-up
    log-probabilities, best first: what a beam reports."""
    h = zlib.crc32(bytes(str(tokens), "ascii"))
    return [((h + 7 * j) % VOCAB, -0.5 * (j + 1) - (h % 97) / 1000) for j in range(k)]


class FakeWorker:
    """Holds (token, position) per device and host KV slot; checks every read
    and write against the request's tokens. A page holds a global block or
    one group's page of a window block."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.device: dict[tuple[int, int], tuple[int, int]] = {}
        self.host: dict[tuple[int, int], tuple[int, int]] = {}
        self.computed_prompt_tokens = 0

    def move_blocks(self, out: SchedulerOutput) -> None:
        bs = self.kv.block_size
        for src, dst in out.copy_blocks:
            for o in range(bs):
                self.device.pop((dst, o), None)
                if (src, o) in self.device:
                    self.device[dst, o] = self.device[src, o]
        for pairs, a, b in ((out.swap_out, self.device, self.host),
                            (out.swap_in, self.host, self.device)):
            for src, dst in pairs:
                for o in range(bs):
                    b.pop((dst, o), None)
                    if (src, o) in a:
                        b[dst, o] = a[src, o]

    def execute(self, out: SchedulerOutput) -> list[list[int]]:
        """Per request, its accepted tokens: with drafts (the last of its new
        tokens), those equal to what the 'model' predicts, then one more."""
        bs, kv = self.kv.block_size, self.kv
        sampled: list[list[int]] = []
        drafts_of = out.draft_token_ids or [[] for _ in out.requests]
        for request, n, drafts in zip(out.requests, out.num_new_tokens, drafts_of):
            table, start = kv.block_ids(request.request_id), request.num_computed_tokens
            tokens = request.all_token_ids + list(drafts)  # what this step computes
            for p in range(start):  # the context it attends to
                assert self.device.get((table[p // bs], p % bs)) == (tokens[p], p), (
                    f"{request.request_id} reads wrong KV at position {p}")
            for p in range(start, start + n):
                block = table[p // bs]
                assert kv.ref_count(block) == 1, "a shared block is written"
                assert kv.block_hash(block) is None, "a cached block is written"
                self.device[block, p % bs] = (tokens[p], p)
            if isinstance(kv, WindowedKVCacheManager):
                self.window_step(out.window_block_ids[out.requests.index(request)], tokens,
                                 start, n, request.request_id)
            self.check_cached_blocks(request.request_id, request.all_token_ids)
            self.computed_prompt_tokens += max(0, min(start + n, request.num_prompt_tokens) - start)
            if start + n == len(tokens):
                suffix = request.request_id.partition("#")[2]
                sample = int(suffix) if suffix.isdigit() else 0
                known = request.all_token_ids
                accepted = [next_token(known, sample)]
                for draft in drafts:
                    if draft != accepted[-1]:
                        break
                    known = known + [draft]
                    accepted.append(next_token(known, sample))
                sampled.append(accepted)
            else:
                sampled.append([])
        return sampled

    def window_step(self, groups: list[list[int]], tokens: list[int], start: int, n: int,
                    request_id: str) -> None:
        """The window layers' reads (the first query's window reaches back
        furthest) and writes, in each group's pages."""
        kv = self.kv
        bs, table = kv.block_size, kv.window_block_ids(request_id)
        assert groups == kv.window_group_tables(request_id) and len(groups) == kv.window_pages
        assert groups[0] is table
        for g, pages in enumerate(groups):
            assert [b if b == NO_BLOCK else kv.window_block_pages(b)[g] for b in table] == pages
            for p in range(max(0, start - kv.window + 1), start):
                assert pages[p // bs] != NO_BLOCK, f"{request_id}'s window lost position {p}"
                assert self.device.get((pages[p // bs], p % bs)) == (tokens[p], p), (
                    f"{request_id} reads wrong window KV at position {p} (group {g})")
            for p in range(start, start + n):
                block = table[p // bs]
                assert block != NO_BLOCK, f"{request_id} writes behind its window at {p}"
                assert kv.ref_count(block) == 1, "a shared window block is written"
                assert kv.block_hash(block) is None, "a cached window block is written"
                self.device[pages[p // bs], p % bs] = (tokens[p], p)

    @staticmethod
    def beam_candidates(out: SchedulerOutput, sampled: list[list[int]]
                        ) -> dict[int, list[tuple[int, float]]]:
        """For each beam row that reached its last token, its candidates."""
        return {row: next_token_candidates(r.all_token_ids, r.beam.num_candidates)
                for row, r in enumerate(out.requests) if r.beam is not None and sampled[row]}

    def check_cached_blocks(self, request_id: str, tokens: list[int]) -> None:
        """Every block of the request that is in the prefix cache holds its
        tokens (never a rejected draft)."""
        bs, kv = self.kv.block_size, self.kv
        for i, block in enumerate(kv.block_ids(request_id)):
            if kv.block_hash(block) is not None:
                for p in range(i * bs, (i + 1) * bs):
                    assert self.device.get((block, p % bs)) == (tokens[p], p), (
                        f"cached block {block} of {request_id} holds another token at {p}")
        if isinstance(kv, WindowedKVCacheManager):
            for i, block in enumerate(kv.window_block_ids(request_id)):
                if block != NO_BLOCK and kv.block_hash(block) is not None:
                    for page, p in itertools.product(kv.window_block_pages(block),
                                                     range(i * bs, (i + 1) * bs)):
                        assert self.device.get((page, p % bs)) == (tokens[p], p), (
                            f"cached window block {block} of {request_id}")


def check_accounting(kv: KVCacheManager) -> None:
    """Reference counts are the tables' holders, and every page is held or
    free (a window block's companions held with it)."""
    tables = kv.owned_blocks()
    holders: dict[int, int] = {}
    for table in tables.values():
        assert len(table) == len(set(table))
        for block in table:
            holders[block] = holders.get(block, 0) + 1
    companions: list[int] = []
    if isinstance(kv, WindowedKVCacheManager):  # window blocks are pages of the same pool
        for table in kv.owned_window_blocks().values():
            for block in table:
                if block != NO_BLOCK:
                    holders[block] = holders.get(block, 0) + 1
        companions = [p for b in holders for p in kv.window_block_pages(b)[1:]]
        assert NULL_WINDOW_BLOCK not in holders and NULL_WINDOW_BLOCK not in companions
        assert len(set(companions)) == len(companions) and not holders.keys() & set(companions)
        assert kv.num_cached_blocks == sum(not h.endswith(WINDOW_KEY) for h in kv._pool.cached)
    for block in range(len(kv._pool.ref_counts)):
        assert kv.ref_count(block) == holders.get(block, 0)
    assert len(holders) + len(companions) + kv.num_free_blocks == kv.num_blocks, (
        "free + cached + held != all")


def check_window_accounting(kv: WindowedKVCacheManager, running: list) -> None:
    """Window tables line up with the block tables, hold blocks from their
    first live entry on, share no page with a global block, and a running
    request holds none behind the window of the block its last computed
    position is in (kept for forks)."""
    tables, windows = kv.owned_blocks(), kv.owned_window_blocks()
    assert set(windows) == set(tables)
    live_blocks: set[int] = set()
    for rid, table in windows.items():
        assert len(table) == len(tables[rid])
        live = [b for b in table if b != NO_BLOCK]
        assert table[len(table) - len(live):] == live, "a window table has a hole"
        live_blocks.update(live)
    assert NULL_WINDOW_BLOCK not in live_blocks
    pages = {p for b in live_blocks for p in kv.window_block_pages(b)}
    assert not pages & {b for t in tables.values() for b in t}, (
        "a page holds a global block and a window block")
    for request in running:
        table = windows.get(request.request_id, [])
        bs = kv.block_size
        block_start = (request.num_computed_tokens - 1) // bs * bs
        behind = max(0, block_start - kv.window + 1) // bs
        assert all(b == NO_BLOCK for b in table[:behind]), (
            f"{request.request_id} holds window blocks behind its window")
