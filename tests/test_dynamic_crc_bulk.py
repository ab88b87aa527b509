"""`replay.ProportionalCrcs` (a proportional policy's action crcs for a whole step at once) equals
`replay.proportional_action_crc` (the crc the request-by-request path names,
`DynamicWorker._action_plan`) bit for bit: any number of sites, any scale bits (negative zero,
subnormals, infinities, NaN), float64 scales cast to float32 as `np.float32(x)` casts them, and a
subset of the windows. Fast tier: no engine."""

from __future__ import annotations

import zlib

import numpy as np

from engine_ext.dynamic.replay import ProportionalCrcs, proportional_action_crc


def _windows(rng: np.random.Generator, n: int) -> list[tuple[str, list[str], int]]:
    out = []
    for k in range(n):
        sites = sorted(rng.choice(48, size=int(rng.integers(0, 4)), replace=False).tolist())
        vec = rng.standard_normal(16).astype("<f4")
        out.append((f"cb-{k}-{rng.integers(1 << 30):08x}", [f"{s}:" for s in sites], zlib.crc32(vec.tobytes())))
    return out


def _one_by_one(windows, scales) -> list[int]:
    return [proportional_action_crc(key, tags, vcrc, np.float32(x).astype("<f4").tobytes())
            for (key, tags, vcrc), x in zip(windows, scales)]


def test_bulk_crcs_equal_the_one_by_one_crcs():
    rng = np.random.default_rng(7)
    windows = _windows(rng, 40)
    bulk = ProportionalCrcs(windows)
    assert len(bulk) == 40
    special = [0.0, -0.0, 1e-45, -1e-45, 3.4e38, np.inf, -np.inf, np.nan, 1.0, -2.5]
    for trial in range(20):
        s64 = rng.standard_normal(40) * 10.0 ** rng.integers(-8, 8)
        s64[rng.integers(40, size=5)] = rng.choice(special, size=5)
        assert bulk.crcs(s64) == _one_by_one(windows, s64), trial  # float64 in: cast as np.float32(x)
        s32 = s64.astype(np.float32)
        assert bulk.crcs(s32) == _one_by_one(windows, s32), trial
        only = sorted(rng.choice(40, size=7, replace=False).tolist())
        assert bulk.crcs(s64, only=only) == [_one_by_one(windows, s64)[k] for k in only]


def test_bulk_crcs_of_a_window_without_sites_is_its_key_alone():
    bulk = ProportionalCrcs([("cb-1-abc", [], 123)])
    assert bulk.crcs(np.array([0.5])) == [zlib.crc32(b"cb-1-abc")] == _one_by_one([("cb-1-abc", [], 123)], [0.5])
    assert ProportionalCrcs([]).crcs(np.zeros(0)) == []
