"""A fake worker for scheduler tests: it stores, for every KV slot, the token
whose KV it holds, and checks every read and write against the request's
tokens (no torch). A request that reads a slot holding another token would
compute garbage; a write into a shared or cached block would corrupt another
request's KV. With a ``WindowedKVCacheManager`` it checks the window layers'
table too: every read within a query's window, every write, and that the
blocks behind a request's window are given back."""

from __future__ import annotations

import zlib

from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.scheduler import SchedulerOutput
from inflight.core.window_kv import NO_BLOCK, NULL_WINDOW_BLOCK, WindowedKVCacheManager

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
    and write against the request's tokens. Window blocks are numbered after
    the global ones, as in the step's block pairs."""

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

    def window_step(self, table: list[int], tokens: list[int], start: int, n: int,
                    request_id: str) -> None:
        """The window layers' reads (the first query's window reaches back
        furthest) and writes."""
        kv = self.kv
        bs, base = kv.block_size, kv.window_id_base
        assert table is kv.window_block_ids(request_id)
        for p in range(max(0, start - kv.window + 1), start):
            block = table[p // bs]
            assert block != NO_BLOCK, f"{request_id}'s window lost position {p}"
            assert self.device.get((base + block, p % bs)) == (tokens[p], p), (
                f"{request_id} reads wrong window KV at position {p}")
        for p in range(start, start + n):
            block = table[p // bs]
            assert block != NO_BLOCK, f"{request_id} writes behind its window at {p}"
            assert kv.window_ref_count(block) == 1, "a shared window block is written"
            assert kv.window_block_hash(block) is None, "a cached window block is written"
            self.device[base + block, p % bs] = (tokens[p], p)

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
                if block != NO_BLOCK and kv.window_block_hash(block) is not None:
                    for p in range(i * bs, (i + 1) * bs):
                        assert self.device.get((kv.window_id_base + block, p % bs)) == (
                            tokens[p], p), f"cached window block {block} of {request_id}"


def check_accounting(kv: KVCacheManager) -> None:
    tables = kv.owned_blocks()
    holders: dict[int, int] = {}
    for table in tables.values():
        assert len(table) == len(set(table))
        for block in table:
            holders[block] = holders.get(block, 0) + 1
    if getattr(kv, "shared_pool", False):  # window blocks are pages of the same pool
        assert NULL_WINDOW_BLOCK not in holders
        for table in kv.owned_window_blocks().values():
            for block in table:
                if block != NO_BLOCK:
                    holders[block] = holders.get(block, 0) + 1
    for block in range(len(kv._pool.ref_counts)):
        assert kv.ref_count(block) == holders.get(block, 0)
    assert len(holders) + kv.num_free_blocks == kv.num_blocks, "free + cached + held != all"


def check_window_accounting(kv: WindowedKVCacheManager, running: list) -> None:
    """Window tables line up with the block tables, hold blocks from their
    first live entry on, count their references, and a running request holds
    none behind the window of the block its last computed position is in
    (kept for forks)."""
    tables, windows = kv.owned_blocks(), kv.owned_window_blocks()
    assert set(windows) == set(tables)
    holders: dict[int, int] = {}
    for rid, table in windows.items():
        assert len(table) == len(tables[rid])
        live = [b for b in table if b != NO_BLOCK]
        assert table[len(table) - len(live):] == live, "a window table has a hole"
        for block in live:
            holders[block] = holders.get(block, 0) + 1
    assert NULL_WINDOW_BLOCK not in holders
    if kv.shared_pool:  # a page holds a global block or a window block, not both
        assert not holders.keys() & {b for t in tables.values() for b in t}
    else:  # (a shared pool's counts are check_accounting's)
        for block in range(1, kv.num_window_blocks + 1):
            assert kv.window_ref_count(block) == holders.get(block, 0)
        assert len(holders) + kv.num_free_window_blocks == kv.num_window_blocks
    for request in running:
        table = windows.get(request.request_id, [])
        bs = kv.block_size
        block_start = (request.num_computed_tokens - 1) // bs * bs
        behind = max(0, block_start - kv.window + 1) // bs
        assert all(b == NO_BLOCK for b in table[:behind]), (
            f"{request.request_id} holds window blocks behind its window")
