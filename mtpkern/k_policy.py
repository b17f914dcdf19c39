"""Choosing the number of drafts per step, K (0 allowed), from measured acceptance and costs.

A verify of ``K`` drafts yields the accepted drafts plus the target's own next token (the
bonus token, always). With ``alpha_i = P(draft i accepted | drafts before it accepted)``
(``i = 1 .. K``), the expected tokens per verify of one sequence are

    E[K] = 1 + sum_{j=1..K} prod_{i<=j} alpha_i            (E[0] = 1)

and one step (a propose of K drafts, then a verify of K + 1 tokens per sequence, B sequences)
takes ``T(K, B) = t_propose(K, B) + t_verify(K + 1, B) + c(K, B)`` seconds, with no propose at
K = 0; ``c`` is the drafter's catch-up (``catchup_drafter``) when the engine measured it: over
the one decoded token at K = 0, over the accepted drafts at K > 0 (its expectation).
The policy picks the K in ``[0, k_max]`` that maximises the batch's expected tokens per second,
``sum_b E_b[K] / T(K, B)`` (a batch shares one K: ``propose_batch`` drafts the same number for
every sequence). Ties go to the smaller K (the same rate for less work).

The pieces, each filled from the engine's own measurements:

- ``StepCosts``: ``t_propose(k, B)`` and ``t_verify(n, B)`` from measured ``(B, size, seconds)``
  points, per batch size either through the points (a table) or a least-squares line
  ``a + b * size``; between measured batch sizes, linear in ``B``.
- ``acceptance_from_counts`` / ``acceptance_from_stats``: ``alpha_i`` from per-position counts
  (``AcceptanceStats.accepted[i] / AcceptanceStats.reached[i]``, the proposer's ``stats`` or an
  engine's per-sequence ones) under a Beta prior, so a position never offered yet reads as the
  prior's mean, not 0 or 1; with ``optimism`` an upper confidence bound instead of the mean, so
  a policy that stopped drafting on a pessimistic start tries again (a position not offered is
  never counted: with the mean alone, K = 0 can last for good).
- ``choose_k``: the K, with the rate of every K for logging.

Monotone in acceptance (tests/test_k_policy.py): for one sequence, or a batch whose sequences
share one acceptance, raising any ``alpha_i`` never lowers the chosen K (costs fixed). Raising one
sequence's acceptance in a batch of different sequences can lower it: that sequence's gain may
be larger, relatively, at a smaller K, where the other sequences' shares are smaller.

Pure NumPy, no backend: an engine calls it between steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal, Sequence

import numpy as np

from .argtypes import kind, scalar_int

#: the most drafts one propose makes (a module schedule's ``max_drafts``)
MAX_K = 64
#: Beta(1, 1): one accepted and one rejected pseudo-count, a never-offered position reads 0.5
DEFAULT_PRIOR = (1.0, 1.0)

Fit = Literal["interpolate", "affine"]


def _int(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    i = scalar_int(v)
    if i is None:
        raise TypeError(f"{name}: expected an int, got {kind(v)} {v!r}")
    if i < lo or (hi is not None and i > hi):
        raise ValueError(f"{name}: expected an int {f'in [{lo}, {hi}]' if hi is not None else f'>= {lo}'}, "
                         f"got {i}")
    return i


def _real(name: str, v: Any, lo: float = 0.0) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a real number, got {kind(v)} {v!r}")
    x = float(v)
    if not np.isfinite(x) or x < lo:
        raise ValueError(f"{name}: expected a finite number >= {lo}, got {x!r}")
    return x


def _first(mask: np.ndarray) -> tuple[int, ...] | None:
    """The index of the first true entry of ``mask`` (row-major), or None."""
    hits = np.argwhere(mask)
    return tuple(int(j) for j in hits[0]) if hits.size else None


def _reals(name: str, v: Any, ndim: tuple[int, ...]) -> np.ndarray:
    """A float64 copy of a real array of one of the dimensions ``ndim``."""
    if isinstance(v, (str, bytes, dict)):
        raise TypeError(f"{name}: expected an array of real numbers, got {kind(v)}")
    try:
        a = np.array(v)
    except (ValueError, TypeError) as e:
        raise TypeError(f"{name}: expected an array of real numbers, got {kind(v)} ({e})") from None
    if a.dtype.kind not in "iuf":
        raise TypeError(f"{name}: expected an array of real numbers, got {kind(v)} of {a.dtype}")
    if a.ndim not in ndim:
        want = " or ".join(f"{d}-d" for d in ndim)
        raise ValueError(f"{name}: expected a {want} array, got shape {a.shape}")
    a = a.astype(np.float64)
    i = _first(~np.isfinite(a))
    if i is not None:
        raise ValueError(f"{name}{list(i)}: expected a finite number, got {float(a[i])!r}")
    return a


# -- costs --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class CostTable:
    """Seconds of one call (a propose of ``x = k`` drafts, or a verify of ``x = n`` tokens, per
    sequence) at batch size ``B``. ``batch_sizes`` sorted; per batch size ``xs[i]`` (sorted,
    at least 2) and ``seconds[i]``, the line through neighbouring points giving the time at and
    beyond them (two points: one line ``a + b * x``)."""

    name: str
    batch_sizes: tuple[int, ...]
    xs: tuple[np.ndarray, ...]
    seconds: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        n = len(self.batch_sizes)
        if n < 1 or len(self.xs) != n or len(self.seconds) != n or \
                list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise ValueError(f"{self.name}: expected sorted distinct batch sizes, each with its sizes and seconds; "
                             f"got {n} batch sizes, {len(self.xs)} size rows, {len(self.seconds)} seconds rows "
                             f"(CostTable.from_points builds one from measured points)")
        for B, x, y in zip(self.batch_sizes, self.xs, self.seconds):
            if x.ndim != 1 or x.shape != y.shape or len(x) < 2 or np.any(np.diff(x) <= 0) or \
                    not np.all(np.isfinite(y)):
                raise ValueError(f"{self.name}: expected at B={B} at least 2 increasing sizes with as many finite "
                                 f"seconds, got sizes {x!r} and seconds {y!r}")

    @classmethod
    def from_points(cls, name: str, points: Iterable[Sequence[Any]], fit: Fit = "interpolate") -> "CostTable":
        """``points``: ``(B, size, seconds)`` measurements (``B >= 1``, ``size >= 1``, seconds
        finite and ``>= 0``, each ``(B, size)`` once, at least two sizes per batch size).
        ``fit="interpolate"``: through the points; ``"affine"``: the least-squares line per ``B``."""
        if fit not in ("interpolate", "affine"):
            raise ValueError(f"fit: expected 'interpolate' or 'affine', got {fit!r}")
        if isinstance(points, (str, bytes)) or not isinstance(points, Iterable):
            raise TypeError(f"{name}: expected (B, size, seconds) points, got {kind(points)}")
        rows: dict[int, dict[int, float]] = {}
        for i, p in enumerate(points):
            if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray)) or len(p) != 3:
                raise TypeError(f"{name}[{i}]: expected a (B, size, seconds) triple, got {kind(p)} {p!r}")
            B = _int(f"{name}[{i}] B", p[0], 1)
            x = _int(f"{name}[{i}] size", p[1], 1)
            s = _real(f"{name}[{i}] seconds", p[2])
            if x in rows.setdefault(B, {}):
                raise ValueError(f"{name}[{i}]: expected each (B, size) once, got (B={B}, size={x}) again")
            rows[B][x] = s
        if not rows:
            raise ValueError(f"{name}: expected at least 2 (B, size, seconds) points per batch size, got none")
        bs = tuple(sorted(rows))
        xs, secs = [], []
        for B in bs:
            if len(rows[B]) < 2:
                raise ValueError(f"{name}: expected at least 2 sizes measured at B={B} (a time per size needs a "
                                 f"slope), got {len(rows[B])} ({sorted(rows[B])})")
            x = np.array(sorted(rows[B]), np.float64)                  # [n]
            y = np.array([rows[B][int(v)] for v in x], np.float64)     # [n]
            if fit == "affine":
                slope, icpt = np.polyfit(x, y, 1)
                x, y = x[[0, -1]], icpt + slope * x[[0, -1]]           # the line, as its two end points
            xs.append(x)
            secs.append(y)
        return cls(name, bs, tuple(xs), tuple(secs))

    def _row(self, i: int, x: np.ndarray) -> np.ndarray:
        """Batch size ``batch_sizes[i]``'s seconds at sizes ``x``: through the points, and
        beyond the ends along the end segments."""
        xs, ys = self.xs[i], self.seconds[i]
        seg = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)    # [len(x)]
        x0, x1, y0, y1 = xs[seg], xs[seg + 1], ys[seg], ys[seg + 1]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def __call__(self, sizes: Any, B: int) -> np.ndarray:
        """Seconds at each of ``sizes`` (per sequence) for batch size ``B``; ``ValueError`` for a
        ``B`` outside the measured ones, or a time that the fit takes below 0."""
        B = _int("B", B, 1)
        x = np.atleast_1d(np.asarray(sizes, np.float64))
        lo, hi = self.batch_sizes[0], self.batch_sizes[-1]
        if not lo <= B <= hi:
            raise ValueError(f"B: expected a batch size within the {self.name} measurements' [{lo}, {hi}], got {B} "
                             f"(measure the smallest and the largest batch the engine runs)")
        j = int(np.searchsorted(self.batch_sizes, B))
        if self.batch_sizes[j] == B:
            t = self._row(j, x)
        else:                                                          # between two measured batch sizes
            b0, b1 = self.batch_sizes[j - 1], self.batch_sizes[j]
            w = (B - b0) / (b1 - b0)
            t = (1 - w) * self._row(j - 1, x) + w * self._row(j, x)
        if np.any(t < 0):
            i = int(np.argmax(t < 0))
            raise ValueError(f"{self.name}: the measurements give {float(t[i]):.3g} s at size {int(x[i])}, B={B} "
                             f"(below 0: the fit extrapolates too far; measure nearer that size)")
        return t


@dataclass(frozen=True, slots=True, eq=False)
class StepCosts:
    """The cost model of one speculative step, in seconds: ``propose(k, B)`` drafts ``k >= 1``
    tokens for each of ``B`` sequences; ``verify(n, B)`` is the target's forward over ``n``
    tokens of each of ``B`` sequences (``n = K + 1``: the last verified token and the drafts).
    ``catchup(n, B)``, when given, is ``catchup_drafter`` over ``n`` verified tokens of each sequence:
    every ``K = 0`` step pays it for the decoded token (the drafter kept current), a ``K > 0`` step
    for its accepted drafts; without it a ``K = 0`` step looks cheaper than it is. Anything else
    the engine does per step (sampling, scheduling) belongs in ``verify``."""

    propose: CostTable
    verify: CostTable
    catchup: CostTable | None = None

    def __post_init__(self) -> None:
        for name in ("propose", "verify", "catchup"):
            v = getattr(self, name)
            if not isinstance(v, CostTable) and not (name == "catchup" and v is None):
                raise TypeError(f"{name}: expected a CostTable{' or None' if name == 'catchup' else ''}, "
                                f"got {kind(v)}")

    @classmethod
    def from_points(cls, propose: Iterable[Sequence[Any]], verify: Iterable[Sequence[Any]],
                    fit: Fit = "interpolate", catchup: Iterable[Sequence[Any]] | None = None) -> "StepCosts":
        """From measured ``(B, k, seconds)`` propose points and ``(B, n, seconds)`` verify points
        (``CostTable.from_points``); ``catchup``: ``(B, n, seconds)`` points of ``catchup_drafter`` /
        ``catchup_batch`` over ``n`` verified tokens a sequence, or None (not counted)."""
        return cls(CostTable.from_points("propose", propose, fit), CostTable.from_points("verify", verify, fit),
                   None if catchup is None else CostTable.from_points("catchup", catchup, fit))

    def catchup_seconds(self, alphas: np.ndarray, B: int) -> np.ndarray:
        """The expected seconds of a step's catch-up for ``K = 0 .. k_max`` (``[k_max + 1]``; zeros
        without a ``catchup`` table): a ``K = 0`` step catches the drafter up over the one decoded
        token; a ``K > 0`` step over the ``a`` accepted drafts (none when ``a = 0``), with
        ``P(a = j)`` from ``alphas`` ``[.., k_max]`` (the mean over a batch's rows)."""
        a = alphas.reshape(-1, alphas.shape[-1])                         # [R, k_max]
        k_max = a.shape[-1]
        out = np.zeros(k_max + 1)
        if self.catchup is None:
            return out
        out[0] = float(self.catchup(np.array([1]), B)[0])
        if k_max:
            t = self.catchup(np.arange(1, k_max + 1), B)                  # [k_max]: t_c(j), j = 1 .. k_max
            reach = np.cumprod(a, axis=-1)                               # [R, k_max]: P(a >= j)
            for K in range(1, k_max + 1):
                p = reach[:, :K] - np.concatenate([reach[:, 1:K], np.zeros((a.shape[0], 1))], axis=-1)
                out[K] = float((p @ t[:K]).mean())                        # sum_j P(a = j) t_c(j)
        return out

    def step_seconds(self, k_max: int, B: int) -> np.ndarray:
        """``T(K, B)`` for ``K = 0 .. k_max`` (``[k_max + 1]``): no propose at ``K = 0``."""
        k_max = _int("k_max", k_max, 0, MAX_K)
        K = np.arange(k_max + 1)
        t = self.verify(K + 1, B)
        if k_max:
            t[1:] += self.propose(K[1:], B)
        if np.any(t <= 0):
            i = int(np.argmax(t <= 0))
            raise ValueError(f"costs: expected a step time > 0, got {float(t[i])!r} s at K={i}, B={B} "
                             f"(a verify takes time)")
        return t


# -- acceptance ---------------------------------------------------------------------------------------------


def _prior(prior: Any) -> tuple[float, float]:
    if isinstance(prior, (str, bytes)) or not isinstance(prior, (Sequence, np.ndarray)) or len(prior) != 2:
        raise TypeError(f"prior: expected (accepted, rejected) pseudo-counts, got {kind(prior)} {prior!r}")
    a, r = _real("prior[0]", prior[0]), _real("prior[1]", prior[1])
    if a <= 0 or r <= 0:
        raise ValueError(f"prior: expected pseudo-counts > 0 (a Beta prior), got {(a, r)}")
    return a, r


def acceptance_from_counts(accepted: Any, reached: Any, k_max: int, prior: Any = DEFAULT_PRIOR,
                           optimism: float = 0.0) -> np.ndarray:
    """Per-position conditional acceptance ``alpha_i`` (``[k_max]``, or ``[B, k_max]`` for
    ``[B, P]`` counts, one row per sequence) from counts: ``reached[i]`` verifies judged draft ``i``
    after accepting every draft before it, ``accepted[i]`` of them accepted it. The posterior
    mean under ``Beta(prior[0], prior[1])``:

        alpha_i = (accepted[i] + prior[0]) / (reached[i] + prior[0] + prior[1])

    Positions past the counts (``i >= P``, e.g. ``k_max`` beyond the modules an engine counted)
    read ``prior[0] / (prior[0] + prior[1])``. Counts may be reals (e.g. decayed counts that
    follow a drifting acceptance); ``0 <= accepted <= reached``.

    ``optimism`` ``z >= 0``: the posterior mean plus ``z`` posterior standard deviations (at most
    1), an upper confidence bound. A position a policy stops offering is never counted again, so
    with ``z = 0`` a pessimistic start can keep K at 0 for good (the prior's mean says drafting
    does not pay, and no verify ever says otherwise); with ``z > 0`` a little-counted position
    reads high, gets offered, and its counts then decide."""
    k_max = _int("k_max", k_max, 0, MAX_K)
    pa, pr = _prior(prior)
    z = _real("optimism", optimism)
    acc = _reals("accepted", accepted, (1, 2))
    rea = _reals("reached", reached, (1, 2))
    if acc.shape != rea.shape:
        raise ValueError(f"reached: expected the shape of accepted {acc.shape}, got {rea.shape}")
    i = _first((acc < 0) | (rea < 0))
    if i is not None:
        name, v = ("accepted", acc[i]) if acc[i] < 0 else ("reached", rea[i])
        raise ValueError(f"{name}{list(i)}: expected a count >= 0, got {float(v)!r}")
    i = _first(acc > rea)
    if i is not None:
        raise ValueError(f"accepted{list(i)}: expected <= reached{list(i)} = {float(rea[i])!r}, got {float(acc[i])!r}")
    P = acc.shape[-1]
    n = min(P, k_max)
    a = np.full(acc.shape[:-1] + (k_max,), pa)                                     # Beta(a, b) per position
    b = np.full(acc.shape[:-1] + (k_max,), pr)
    a[..., :n] += acc[..., :n]
    b[..., :n] += rea[..., :n] - acc[..., :n]
    mean = a / (a + b)
    if z == 0.0:
        return mean
    sd = np.sqrt(a * b / ((a + b) ** 2 * (a + b + 1.0)))
    return np.minimum(mean + z * sd, 1.0)


def acceptance_from_stats(stats: Any, k_max: int, prior: Any = DEFAULT_PRIOR, optimism: float = 0.0) -> np.ndarray:
    """``acceptance_from_counts`` of an ``AcceptanceStats`` (the proposer's ``stats``, counted over
    every sequence: ``[k_max]``) or of a list of them (an engine's per-sequence counters:
    ``[B, k_max]``); read with ``snapshot()``, so a verify is never counted half-way."""
    many = isinstance(stats, (list, tuple))
    items = list(stats) if many else [stats]
    if many and not items:
        raise ValueError("stats: expected an AcceptanceStats or a list of at least one, got an empty list")
    acc, rea = [], []
    for i, s in enumerate(items):
        if not callable(getattr(s, "snapshot", None)):
            raise TypeError(f"stats{f'[{i}]' if many else ''}: expected an AcceptanceStats, got {kind(s)}")
        _, r, a = s.snapshot()
        acc.append(a)
        rea.append(r)
    if len({len(a) for a in acc}) > 1:
        raise ValueError(f"stats: expected the same number of positions in each, got {[len(a) for a in acc]}")
    if many:
        return acceptance_from_counts(acc, rea, k_max, prior, optimism)
    return acceptance_from_counts(acc[0], rea[0], k_max, prior, optimism)


def expected_tokens(alphas: Any) -> np.ndarray:
    """``E[K]`` for ``K = 0 .. k_max`` (``[.., k_max + 1]``) from ``alphas`` ``[.., k_max]``:
    ``1 + sum_{j<=K} prod_{i<=j} alpha_i`` (the bonus token always)."""
    a = _alphas(alphas)
    reach = np.cumprod(a, axis=-1)                       # [.., k_max]: P(drafts 1..j all accepted)
    zero = np.zeros(a.shape[:-1] + (1,))
    return 1.0 + np.concatenate([zero, np.cumsum(reach, axis=-1)], axis=-1)


def _alphas(alphas: Any) -> np.ndarray:
    a = _reals("alphas", alphas, (1, 2))
    i = _first((a < 0) | (a > 1))
    if i is not None:
        raise ValueError(f"alphas{list(i)}: expected a probability in [0, 1], got {float(a[i])!r}")
    return a


# -- the choice ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class KChoice:
    """``k``: the number of drafts to propose (0: skip the propose). Per ``K = 0 .. k_max``:
    ``expected_tokens`` (the batch's sum), ``step_seconds`` and their ratio ``tokens_per_second``."""

    k: int
    tokens_per_second: np.ndarray
    expected_tokens: np.ndarray
    step_seconds: np.ndarray

    def __repr__(self) -> str:
        return (f"KChoice(k={self.k}, tokens_per_second={np.round(self.tokens_per_second, 3).tolist()}, "
                f"expected_tokens={np.round(self.expected_tokens, 3).tolist()})")


def choose_k(alphas: Any, costs: StepCosts, k_max: int, batch_size: int | None = None) -> KChoice:
    """The number of drafts ``K`` in ``[0, k_max]`` that maximises the expected tokens per second.

    ``alphas``: ``[k_max]`` conditional acceptances shared by ``batch_size`` sequences (default 1:
    one sequence alone), or ``[B, k_max]``, one row per sequence of a batch (``batch_size`` then
    ``None`` or ``B``). ``costs``: a ``StepCosts``. The rate of ``K`` is
    ``sum_b E_b[K] / (t_propose(K, B) + t_verify(K + 1, B) + c(K))`` (no propose at ``K = 0``;
    ``c``: ``StepCosts.catchup_seconds``, 0 without a catch-up table); the
    smallest ``K`` among equal rates wins. ``k_max`` may exceed the modules where the proposer
    drafts more (``module_schedule=``, ``max_drafts=``), at most 64."""
    k_max = _int("k_max", k_max, 0, MAX_K)
    if not isinstance(costs, StepCosts):
        raise TypeError(f"costs: expected a StepCosts, got {kind(costs)}")
    a = _alphas(alphas)
    if a.shape[-1] != k_max:
        raise ValueError(f"alphas: expected {k_max} per sequence (k_max, one per draft position), got shape {a.shape}")
    if a.ndim == 2:
        if batch_size is not None and _int("batch_size", batch_size, 1) != a.shape[0]:
            raise ValueError(f"batch_size: expected None or {a.shape[0]} (the rows of alphas), got {batch_size}")
        if a.shape[0] < 1:
            raise ValueError("alphas: expected at least one sequence's row, got 0")
        B = a.shape[0]
        E = expected_tokens(a).sum(axis=0)                               # [k_max + 1]
    else:
        B = 1 if batch_size is None else _int("batch_size", batch_size, 1)
        E = B * expected_tokens(a)                                       # [k_max + 1]
    T = costs.step_seconds(k_max, B) + costs.catchup_seconds(a, B)      # [k_max + 1]
    rate = E / T
    return KChoice(int(np.argmax(rate)), rate, E, T)
