"""Per-position acceptance estimates, fitted online from verification outcomes.

The estimator of vLLM's adaptive verification (`acceptance_estimator.py` in
vLLM 0.32's Model Runner V2), written here from its description: a draft at
position k is accepted with probability p_k = sigmoid(w f + b_k), where
f = logit(max_v q_k(v)) is read off the draft *distribution* (not the drawn
token: a decision on it is made from what was known before the draft was
drawn, ALGORITHMS.md), w is one slope shared by all positions and b_k one
intercept per position. After verification the drafts before the first
rejection are labelled accepted, the first rejected one rejected, later ones
unobserved; every `refit_interval` rounds one damped Newton (IRLS) step
refits (w, b). Used by `vllm_av` (which slots to verify). The batch gate
(whether another draft step pays for the batch) fits the same model to all
outcomes seen so far (`BinnedAcceptanceEstimator`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MAX_LOG_ODDS = 40.0  # the feature's clamp (one-hot rows send it to infinity)
INIT_SLOPE, INIT_BIAS = 0.5, -0.2  # vLLM's cold start: a fit replaces it within a refit or two
L2, DAMPING = 1e-3, 50.0  # ridge on the Newton solve; a step moves n / (n + DAMPING) of the way


def top_log_odds(top: torch.Tensor) -> torch.Tensor:
    """f = log(q_max / (1 - q_max)), clamped, from top [B] = log q_max of each row (NaN for a broken
    row, which gets the floor) -> [B]."""
    top = top.float().clamp(max=0.0)  # [B] log q_max
    rest = torch.log(-torch.expm1(top))  # [B] log(1 - q_max); -inf when q_max == 1
    return torch.nan_to_num(top - rest, nan=-MAX_LOG_ODDS).clamp(-MAX_LOG_ODDS, MAX_LOG_ODDS)


def log_odds(top: float) -> float:
    """`top_log_odds` of one row on the host: top = log q_max (NaN for a broken row) -> f."""
    if math.isnan(top):
        return -MAX_LOG_ODDS
    top = min(top, 0.0)
    if top == 0.0:
        return MAX_LOG_ODDS
    f = top - math.log(-math.expm1(top))
    return max(-MAX_LOG_ODDS, min(MAX_LOG_ODDS, f))


def sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def max_log_odds(logp: torch.Tensor) -> torch.Tensor:
    """f of each row's draft distribution. logp: [B, V] -> [B]."""
    return top_log_odds(logp.amax(dim=-1))


def graded_drafts(rows: list[tuple[list[float], list[float], int, int]]):
    """The observed drafts of one round's rows (features, preds, accepted, admitted), labelled: yields
    (position t, feature, prediction, label). A row's drafts before its first rejection are accepted (1),
    the first rejected one rejected (0); later ones, and those past `admitted`, are unobserved."""
    for features, preds, accepted, admitted in rows:
        for t in range(min(len(features), accepted + 1, admitted)):
            yield t, features[t], preds[t], 1.0 if t < accepted else 0.0


def survival(conf: torch.Tensor) -> torch.Tensor:
    """Probability that every draft up to k is accepted. conf: [B, K] -> [B, K]."""
    return torch.cumprod(conf, dim=1)


@dataclass
class OnlineAcceptanceEstimator:
    """p_k = sigmoid(slope * f + intercepts[k]), fitted by damped Newton-IRLS steps.

    Between refits it accumulates, per position k, the entries of X^T W X (a_k = sum w f^2,
    b_k = sum w f, c_k = sum w) and X^T (y - p) (g0_k = sum r f, g1_k = sum r) for design rows
    x = [f, e_k], IRLS weights w = p (1 - p), residuals r = y - p; `refit` solves the arrowhead
    system (X^T W X + L2 I) d = X^T (y - p) for d = [d_slope, d_intercepts]."""

    k: int
    slope: float = INIT_SLOPE
    intercepts: torch.Tensor = field(default=None)  # type: ignore[assignment]  # [K]
    stats: torch.Tensor = field(default=None)  # type: ignore[assignment]  # [K, 6]: a, b, c, g0, g1, n

    def __post_init__(self):
        self._on_device: dict = {}  # (device, dtype) -> intercepts there: no host copy per draft step
        if self.intercepts is None:
            self.intercepts = torch.full((self.k,), INIT_BIAS, dtype=torch.float64)
        if self.stats is None:
            self.stats = torch.zeros(self.k, 6, dtype=torch.float64)

    def predict(self, features: torch.Tensor, first: int = 0) -> torch.Tensor:
        """features: [B, T] at positions first..first+T-1 (< K) -> acceptance estimates [B, T]."""
        t = features.shape[1]
        key = (features.device, features.dtype)
        if key not in self._on_device:
            self._on_device[key] = self.intercepts.to(features.device, features.dtype)
        return torch.sigmoid(self.slope * features + self._on_device[key][first : first + t])

    def acceptance(self, f: float, k: int) -> float:
        """`predict` of one feature at position k, on the host (no tensor op)."""
        if "host" not in self._on_device:
            self._on_device["host"] = self.intercepts.tolist()
        return sigmoid(self.slope * f + self._on_device["host"][k])

    def observe(self, features: torch.Tensor, preds: torch.Tensor, accepted: torch.Tensor, admitted: torch.Tensor):
        """One round's graded drafts. features, preds: [N, T]; accepted, admitted: [N] (accepted <= admitted)."""
        t = features.shape[1]
        steps = torch.arange(t, device=features.device)[None, :]  # [1, T]
        observed = (steps <= accepted[:, None]) & (steps < admitted[:, None])  # [N, T]
        label = (steps < accepted[:, None]).to(preds.dtype)
        w = torch.where(observed, preds * (1 - preds), torch.zeros_like(preds))
        r = torch.where(observed, label - preds, torch.zeros_like(preds))
        f = features
        cols = [w * f * f, w * f, w, r * f, r, observed.to(preds.dtype)]
        self.stats[:t] += torch.stack([c.sum(dim=0) for c in cols], dim=1).double().cpu()

    def observe_rows(self, rows: list[tuple[list[float], list[float], int, int]]) -> None:
        """`observe` on the host, for one round's rows: (features, preds, accepted, admitted) each,
        features and preds per drafted position. Same labels and sums as `observe`."""
        sums = [[0.0] * 6 for _ in range(self.k)]
        for t, f, p, label in graded_drafts(rows):
            w, r = p * (1.0 - p), label - p
            acc = sums[t]
            acc[0] += w * f * f
            acc[1] += w * f
            acc[2] += w
            acc[3] += r * f
            acc[4] += r
            acc[5] += 1.0
        self.stats += torch.tensor(sums, dtype=torch.float64)

    def refit(self) -> None:
        a_k, b_k, c_k, g0_k, g1_k, n_k = self.stats.unbind(dim=1)
        c_k = c_k + L2
        a, g0, total = a_k.sum() + L2, g0_k.sum(), n_k.sum()
        d_slope = (g0 - (b_k * g1_k / c_k).sum()) / (a - (b_k * b_k / c_k).sum())
        d_slope = d_slope * total / (total + DAMPING)
        if not torch.isfinite(d_slope) or self.slope + float(d_slope) < 0:
            d_slope = torch.zeros((), dtype=torch.float64)
        d_icpt = (g1_k - b_k * d_slope) / c_k * (n_k / (n_k + DAMPING))
        self.slope += float(d_slope)
        self.intercepts += torch.nan_to_num(d_icpt, nan=0.0, posinf=0.0, neginf=0.0)
        self._on_device.clear()
        self.stats.zero_()


# The batch gate's estimator (BinnedAcceptanceEstimator)
BIN_WIDTH, BINNED_MAX = 0.25, 10.0  # outcomes counted per feature bin over [-10, 10] (f clamped there)
NEWTON_STEPS, FADE = 10, 0.9  # Newton steps per refit; what the counts keep at each refit
PRIOR_WEIGHT = 1.0  # pseudo-weight pulling each intercept towards INIT_BIAS (a position seldom reached)
MAX_STEP_SLOPE, MAX_STEP_BIAS, MAX_SLOPE = 0.5, 1.0, 5.0  # near-separable counts diverge unclamped


class BinnedAcceptanceEstimator:
    """The batch gate's estimator: the model of `OnlineAcceptanceEstimator`, p_k = sigmoid(slope f + b_k),
    fitted to every outcome seen so far (older ones faded) instead of one damped Newton step on the last
    window's outcomes.

    Why: one step per window of about 100 rounds left the fit noisy where the gate reads it, and the gate
    then ended rounds too early. On the training replay at batch 1 (`benchmarks/gate_replay.py`: the
    bundled draft model, 75 responses per family, S at c = 5.6, the gate on its bundled costs, against the
    rule alone) the gate with vLLM's estimator cost confidence 0.4 1.3% / 5.8% (code / prose), confidence
    0.6 0.4% / 4.0% and copy 0.7 1.5% / 5.6%; with this one 1.2% / 0.8%, 0.2% / 0.1% and 1.1% / 2.9%.

    Outcomes (labelled as `OnlineAcceptanceEstimator.observe_rows` labels them) are counted per position k
    and feature bin; a refit runs NEWTON_STEPS Newton steps on the counts, each clamped, with a ridge of
    PRIOR_WEIGHT on the intercepts towards INIT_BIAS; a position never observed takes the intercept of the
    position before it (the gate looks one position past the last drafted). Then the counts fade by FADE:
    about the last ten refits' outcomes weigh."""

    def __init__(self, k: int):
        self.k = k
        self.slope = INIT_SLOPE
        self.intercepts = torch.full((k,), INIT_BIAS, dtype=torch.float64)  # [K]
        bins = int(round(2 * BINNED_MAX / BIN_WIDTH)) + 1
        self.centers = torch.linspace(-BINNED_MAX, BINNED_MAX, bins, dtype=torch.float64)  # [bins]
        self.seen = torch.zeros(k, bins, dtype=torch.float64)  # [K, bins] outcomes observed
        self.accepted = torch.zeros(k, bins, dtype=torch.float64)  # [K, bins] of them accepted
        self._host: list[float] | None = None  # intercepts on the host, for acceptance

    def acceptance(self, f: float, k: int) -> float:
        """p_k of one feature f, on the host."""
        if self._host is None:
            self._host = self.intercepts.tolist()
        return sigmoid(self.slope * f + self._host[k])

    def observe_rows(self, rows: list[tuple[list[float], list[float], int, int]]) -> None:
        """One round's rows: (features, preds, accepted, admitted) each, labelled by `graded_drafts` as
        `OnlineAcceptanceEstimator` labels them (preds unused: the refit recomputes them)."""
        for t, f, _p, label in graded_drafts(rows):
            b = round((min(BINNED_MAX, max(-BINNED_MAX, f)) + BINNED_MAX) / BIN_WIDTH)
            self.seen[t, b] += 1.0
            self.accepted[t, b] += label

    def refit(self) -> None:
        n, a, f = self.seen, self.accepted, self.centers[None, :]  # [K, bins], [K, bins], [1, bins]
        per_position = n.sum(dim=1)  # [K]
        if float(per_position.sum()) == 0.0:
            return
        slope, b = self.slope, self.intercepts.clone()
        for _ in range(NEWTON_STEPS):
            p = torch.sigmoid(slope * f + b[:, None])  # [K, bins]
            w, r = n * p * (1 - p), a - n * p  # IRLS weights and residuals
            fw, cw = (w * f).sum(dim=1), w.sum(dim=1) + PRIOR_WEIGHT  # [K] each
            g1 = r.sum(dim=1) - PRIOR_WEIGHT * (b - INIT_BIAS)  # [K]
            # the arrowhead system [[sum w f^2, fw^T], [fw, diag(cw)]] [d_slope, d_b] = [sum r f, g1]
            d_slope = ((r * f).sum() - (fw * g1 / cw).sum()) / ((w * f * f).sum() + L2 - (fw * fw / cw).sum())
            d_slope = float(torch.nan_to_num(d_slope, nan=0.0).clamp(-MAX_STEP_SLOPE, MAX_STEP_SLOPE))
            d_b = ((g1 - fw * d_slope) / cw).clamp(-MAX_STEP_BIAS, MAX_STEP_BIAS)
            slope, b = min(MAX_SLOPE, max(0.0, slope + d_slope)), b + torch.nan_to_num(d_b, nan=0.0)
        for k in range(1, self.k):
            if per_position[k] < 1.0:
                b[k] = b[k - 1]
        self.slope, self.intercepts, self._host = slope, b, None
        n.mul_(FADE)
        a.mul_(FADE)


class AcceptanceTracker:
    """The estimator plus one round's bookkeeping: the features of every draft step, the
    predictions made with them, and the grading of those predictions after verification."""

    def __init__(self, refit_interval: int = 100):
        self.refit_interval = refit_interval
        self.estimator: OnlineAcceptanceEstimator | None = None
        self.req_ids: list[str] = []
        self.features: list[torch.Tensor] = []  # this round's f_t, each [B]
        # the round's graded drafts: req_id -> row of _graded_features / _graded_preds ([B, T] each)
        self._graded: dict[str, int] = {}
        self._graded_features: torch.Tensor | None = None
        self._graded_preds: torch.Tensor | None = None
        self._rounds = 0

    def start_round(self, req_ids: list[str], cap: int) -> None:
        self.req_ids, self.features = list(req_ids), []
        if self.estimator is None or self.estimator.k < cap + 1:
            self.estimator = OnlineAcceptanceEstimator(cap + 1)  # + 1: the gate looks one position ahead

    def record(self, top: torch.Tensor) -> torch.Tensor:
        """Draft step t's top [B] = log q_max of each row (the distribution's, known before its
        token is drawn; NaN for a broken row) -> f_t [B]."""
        f = top_log_odds(top)
        self.features.append(f)
        return f

    def finish_round(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, predictions), each [B, T], for the drafts of this round; kept for grading."""
        features = torch.stack(self.features, dim=1)
        preds = self.estimator.predict(features)
        self._graded = {r: i for i, r in enumerate(self.req_ids)}
        self._graded_features, self._graded_preds = features, preds
        return features, preds

    def end_round(self, req_ids: list[str], drafted: list[int], accepted: list[int]) -> None:
        """Grade the round's predictions: per request, drafts verified and drafts accepted.
        Whole-batch tensor ops (one gather), no per-row tensor work: this runs every round."""
        if self.estimator is None:
            return
        rows = [(self._graded[r], d, a) for r, d, a in zip(req_ids, drafted, accepted) if r in self._graded]
        if rows:
            device = self._graded_features.device
            index, adm, acc = (torch.tensor(col, device=device) for col in zip(*rows))  # each [N]
            self.estimator.observe(self._graded_features[index], self._graded_preds[index], acc, adm)
        self._graded, self._graded_features, self._graded_preds = {}, None, None
        self._rounds += 1
        if self._rounds % self.refit_interval == 0:
            self.estimator.refit()

    def forget(self, req_id: str) -> None:
        self._graded.pop(req_id, None)
