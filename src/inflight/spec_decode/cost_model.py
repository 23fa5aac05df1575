"""Whether drafting pays, step by step. A verified run of k drafts costs k more
tokens in the step; it yields the drafts accepted. On this CPU a decode step of
one request reads all the weights whatever its token count, so a few more
tokens are nearly free; in a large batch the step is compute-bound and every
drafted token costs about as much as a decoded one.

``StepTimeModel`` fits ``seconds = a + b * tokens`` to the engine's measured
steps (exponentially weighted least squares). ``choose`` keeps the drafts of
the requests, most promising first, while they raise the expected tokens per
second of the step, with each request's expected accepted drafts from its own
running acceptance rate. A request whose drafts were left out is given a
probe run now and then, so that its rate can recover.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.98          # weight of past steps in the time fit, per step
MIN_OBSERVATIONS = 8  # steps before the fit is trusted (until then: draft)
PRIOR_ACCEPTANCE = 0.5
ACCEPTANCE_EMA = 0.3  # weight of the newest run in a request's acceptance rate
PROBE_EVERY = 16      # steps a request goes undrafted before a probe run


@dataclass
class StepTimeModel:
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    observations: int = 0

    def observe(self, tokens: int, seconds: float) -> None:
        for name in ("n", "sx", "sy", "sxx", "sxy"):
            setattr(self, name, getattr(self, name) * DECAY)
        self.n += 1
        self.sx += tokens
        self.sy += seconds
        self.sxx += tokens * tokens
        self.sxy += tokens * seconds
        self.observations += 1

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None while the steps seen do not pin a line down."""
        if self.observations < MIN_OBSERVATIONS:
            return None
        spread = self.n * self.sxx - self.sx * self.sx
        if spread <= 1e-9 * max(1.0, self.n * self.sxx):
            return None
        b = (self.n * self.sxy - self.sx * self.sy) / spread
        a = (self.sy - b * self.sx) / self.n
        return max(a, 1e-6), max(b, 0.0)


def expected_accepted(acceptance: float, k: int) -> float:
    """Accepted drafts of a run of k, each accepted with probability
    ``acceptance`` once the ones before it were."""
    if acceptance >= 1.0:
        return float(k)
    return acceptance * (1 - acceptance ** k) / (1 - acceptance)


def choose(candidates: list[tuple[str, int, float]], base_tokens: int, base_outputs: int,
           fit: tuple[float, float] | None) -> set[str]:
    """Of ``(request id, drafts, acceptance rate)``, those whose drafts raise
    the step's expected output tokens per second. ``base_tokens``: the tokens
    the step computes without drafts; ``base_outputs``: the tokens it yields."""
    if fit is None:
        return {rid for rid, _, _ in candidates}
    a, b = fit
    ranked = sorted(candidates, key=lambda c: -expected_accepted(c[2], c[1]) / c[1])
    chosen: set[str] = set()
    tokens, outputs = base_tokens, float(base_outputs)
    best = outputs / (a + b * tokens)
    for rid, k, acceptance in ranked:
        gain = expected_accepted(acceptance, k)
        rate = (outputs + gain) / (a + b * (tokens + k))
        if rate <= best:
            break
        chosen.add(rid)
        tokens, outputs, best = tokens + k, outputs + gain, rate
    return chosen
