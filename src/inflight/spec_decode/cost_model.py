"""Whether drafting pays, step by step. A verified run of k drafts costs k more
tokens in the step; it yields the drafts accepted. On this CPU a decode step of
one request reads all the weights whatever its token count, so a few more
tokens are nearly free; in a large batch the step is compute-bound and every
drafted token costs about as much as a decoded one.

``StepTimeModel`` fits a step's seconds to the tokens it computes, the rows it
samples and the verified runs it holds, over the engine's measured steps.
``choose`` keeps drafts one at a time, likeliest first, while they raise the
expected tokens per second of the step, each draft's chance from its request's
running acceptance rate. A request whose drafts were left out is given a
probe now and then, so that its rate can recover: a run of one draft (the
cheapest that measures acceptance), twice as far apart after each probe that
does not win the request back.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

DECAY = 0.98          # weight of past steps in the time fit, per step
MIN_OBSERVATIONS = 8  # steps before the fit is trusted (until then: draft)
PRIOR_ACCEPTANCE = 0.5
PAYOFF_MARGIN = 0.1   # a draft is kept if it beats the step's rate by this much (fit error)
ACCEPTANCE_EMA = 0.3  # weight of the newest run in a request's acceptance rate
PROBE_EVERY = 16      # steps a request goes undrafted before its first probe run
MAX_PROBE_EVERY = 256  # probes that do not win the request back space out up to this


@dataclass
class StepTimeModel:
    """``seconds = a + b * tokens + c * rows + d * runs`` over the engine's
    steps. ``rows`` are the positions that need logits and sampling (a
    decode's one, every position of a verified run): a draft token costs a
    forward pass through the layers and a row of the vocabulary projection and
    sampler, which prompt tokens do not. ``runs`` counts the verified runs,
    for what a run costs beyond its tokens (the reference backend attends it as
    a prompt chunk, not with the batched decodes; the CPU and Triton backends
    attend it like decodes, so there it fits near zero). Exponentially
    weighted least squares, with a small ridge on b and c so that steps where
    every token is a row still give their sum."""

    xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 4 for _ in range(4)])
    xty: list[float] = field(default_factory=lambda: [0.0] * 4)
    observations: int = 0
    runs_seen: set[bool] = field(default_factory=set)

    def observe(self, tokens: int, rows: int, runs: int, seconds: float) -> None:
        x = (1.0, float(tokens), float(rows), float(runs))
        for i in range(4):
            self.xty[i] = DECAY * self.xty[i] + x[i] * seconds
            for j in range(4):
                self.xtx[i][j] = DECAY * self.xtx[i][j] + x[i] * x[j]
        self.observations += 1
        self.runs_seen.add(runs > 0)

    def fit(self) -> tuple[float, float, float, float] | None:
        """(a, b, c, d), or None while the steps seen do not pin the cost down."""
        if self.observations < MIN_OBSERVATIONS or len(self.runs_seen) < 2:
            return None  # steps with and without runs are needed to tell d from a
        n, sx = self.xtx[0][0], self.xtx[0][1]
        if n * self.xtx[1][1] - sx * sx <= 1e-9 * max(1.0, n * self.xtx[1][1]):
            return None  # one token count only: no slope
        ridge = 1e-6 * (self.xtx[1][1] + self.xtx[2][2])
        m = [row[:] for row in self.xtx]
        m[1][1] += ridge
        m[2][2] += ridge
        # Costs are not negative: a coefficient that fits below zero is fixed
        # at zero and the rest fitted again (clipping it afterwards would leave
        # the others compensating for it: a negative per-run cost made every
        # draft token look three times dearer than it was).
        free = [0, 1, 2, 3]
        while True:
            solution = _solve([[m[i][j] for j in free] for i in free], [self.xty[i] for i in free])
            if solution is None:
                return None
            coefficients = [0.0] * 4
            for i, value in zip(free, solution):
                coefficients[i] = value
            negative = [i for i in free[1:] if coefficients[i] < 0]
            if not negative:
                break
            free.remove(min(negative, key=lambda i: coefficients[i]))
        a, b, c, d = coefficients
        return max(a, 1e-6), b, c, d


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting."""
    m = [row[:] + [x] for row, x in zip(m, v)]
    size = len(m)
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-15:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(size):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[r][size] / m[r][r] for r in range(size)]


def choose(candidates: list[tuple[str, int, float]], base_tokens: int, base_rows: int,
           base_outputs: int, fit: tuple[float, float, float, float] | None) -> dict[str, int]:
    """How many of its drafts each of ``(request id, drafts, acceptance rate)``
    keeps (those keeping none are left out), so that the step's expected output
    tokens per second is highest. ``base_*``: what the step computes without
    drafts (tokens, sampled rows) and the tokens it yields.

    A run's j-th draft yields a token with probability ``acceptance ** j`` and
    costs a token and a sampled row; a run also costs its own ``d``. So a
    request first offers its best-paying run (the length with the most
    expected tokens per second, ``d`` included), then one more draft at a
    time; offers are taken best first while each raises the step's rate (by
    ``PAYOFF_MARGIN`` at least: the fit is an estimate): a request with
    middling acceptance keeps its first drafts and drops the unlikely tail."""
    if fit is None:
        return {rid: k for rid, k, _ in candidates if k > 0}
    a, b, c, d = fit
    per_draft = max(b + c, 1e-12)
    seconds = a + b * base_tokens + c * base_rows
    outputs = float(base_outputs)
    kept: dict[str, int] = {}
    offers = []  # (-expected tokens per second, request, drafts after it, gain, cost, ...)
    for rid, k, acceptance in candidates:
        gain, best = 0.0, None
        for j in range(1, k + 1):
            gain += acceptance ** j
            cost = per_draft * j + d
            if best is None or gain / cost > best[1] / best[2]:
                best = (j, gain, cost)
        if best is not None:
            offers.append((-best[1] / best[2], rid, best[0], best[1], best[2], acceptance, k))
    heapq.heapify(offers)
    while offers:
        _, rid, upto, gain, cost, acceptance, k = heapq.heappop(offers)
        if gain * seconds <= cost * outputs * (1 + PAYOFF_MARGIN):
            break  # it does not raise the rate enough, nor does any offer after it
        outputs += gain
        seconds += cost
        kept[rid] = upto
        if upto < k:  # (it pays less than the run did: the run's length was its best)
            more = acceptance ** (upto + 1)
            heapq.heappush(offers, (-more / per_draft, rid, upto + 1, more, per_draft,
                                    acceptance, k))
    return kept
