"""Fitting a probe from captured stream values of two prompt sets (pure numpy, no engine).

* `mean_diff` — the difference of the class means, `mu_pos - mu_neg`, as a `direction` probe
  (scores are projections; the midpoint is a natural threshold: `midpoint_threshold`);
* `least_squares` — a `linear` probe: ridge regression of the labels (+1 / -1) on the
  centred values (`W = (X^T X + l I)^-1 X^T y`), bias so the score is 0 halfway between classes;
* `logistic` — a `linear` probe: L2-regularised logistic regression by Newton's method
  (deterministic; a few iterations), scores are logits.
"""

from __future__ import annotations

import numpy as np

from engine_ext.errors import SpecError

FIT_METHODS = ("mean_diff", "least_squares", "logistic")


def _check(pos: np.ndarray, neg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    pos, neg = np.asarray(pos, np.float64), np.asarray(neg, np.float64)
    if pos.ndim != 2 or neg.ndim != 2 or not len(pos) or not len(neg):
        raise SpecError("positive", "both prompt sets need at least one captured value")
    if pos.shape[1] != neg.shape[1]:
        raise SpecError("negative", f"values have dimension {neg.shape[1]}, the positives {pos.shape[1]}")
    return pos, neg


def fit(pos: np.ndarray, neg: np.ndarray, method: str = "mean_diff", l2: float = 1e-2) -> tuple[str, np.ndarray, float]:
    """(probe kind, weights [H] float32, bias) for values `pos` [n, H] vs `neg` [m, H]."""
    if method not in FIT_METHODS:
        raise SpecError("method", f"must be one of {', '.join(FIT_METHODS)}, got {method!r}")
    pos, neg = _check(pos, neg)
    if method == "mean_diff":
        d = pos.mean(0) - neg.mean(0)
        if not np.any(d):
            raise SpecError("positive", "the two prompt sets have the same mean: no direction separates them")
        return "direction", d.astype(np.float32), 0.0
    x = np.concatenate([pos, neg])
    y = np.concatenate([np.ones(len(pos)), -np.ones(len(neg))])
    mu = x.mean(0)
    xc = x - mu
    h = x.shape[1]
    if method == "least_squares":
        w = np.linalg.solve(xc.T @ xc + l2 * np.eye(h), xc.T @ y)
        mid = 0.5 * (pos.mean(0) + neg.mean(0))
        return "linear", w.astype(np.float32), float(-(mid @ w))
    # logistic: labels 1 / 0, Newton iterations with an L2 penalty (not on the bias)
    t = (y > 0).astype(np.float64)
    xa = np.concatenate([xc, np.ones((len(xc), 1))], axis=1)
    beta = np.zeros(h + 1)
    reg = np.full(h + 1, l2)
    reg[-1] = 0.0
    for _ in range(25):
        z = np.clip(xa @ beta, -30, 30)
        p = 1.0 / (1.0 + np.exp(-z))
        grad = xa.T @ (p - t) + reg * beta
        hess = (xa * (p * (1 - p))[:, None]).T @ xa + np.diag(reg) + 1e-9 * np.eye(h + 1)
        step = np.linalg.solve(hess, grad)
        beta -= step
        if np.max(np.abs(step)) < 1e-10:
            break
    w = beta[:-1]
    return "linear", w.astype(np.float32), float(beta[-1] - mu @ w)


def midpoint_threshold(pos: np.ndarray, neg: np.ndarray, weights: np.ndarray, bias: float = 0.0) -> float:
    """The score halfway between the two classes' mean scores (a starting `on` threshold)."""
    pos, neg = _check(pos, neg)
    w = np.asarray(weights, np.float64)
    return float(0.5 * ((pos @ w).mean() + (neg @ w).mean()) + bias)
