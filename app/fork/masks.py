"""The reference fork's per-dimension patch `mask`, as the engine's `Mask`.

The fork's forms: `{"indices": [dims]}` (those dimensions fully, the others untouched) and
`{"inline": row}` (a graded row of the request's `patch_vectors`, values in [0, 1]); the engine's
own forms (`{"weights": [...]}`, a list of indices or of booleans) are accepted too. A masked
patch is `(1 - alpha * m) * h + alpha * m * t` per dimension (the fork's precise lerp).

The engine's `Mask` (`engine_ext.specs`) does the arithmetic; this module only reads the fork's
`inline` form, which refers to the request's `patch_vectors` table.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine_ext.errors import SpecError
from engine_ext.specs import Mask, mask_from_json


def fork_mask(value: Any, field: str, *, table: np.ndarray | None, hidden: int) -> Mask:
    """The fork's mask as the engine's `Mask` (validated against `hidden`); SpecError naming the
    field when it is malformed or out of range."""
    if not (isinstance(value, dict) and "inline" in value):
        mask = mask_from_json(value, field)  # the engine's forms: {"indices"}, {"weights"}, index or boolean lists
    else:
        if set(value) != {"inline"}:
            raise SpecError(field, "give exactly one of 'indices', 'weights' and 'inline'")
        row = value["inline"]
        if table is None:
            raise SpecError(f"{field}.inline", "needs the patch_vectors table")
        if not isinstance(row, int) or isinstance(row, bool) or not 0 <= row < table.shape[0]:
            raise SpecError(f"{field}.inline", f"row {row!r} is outside patch_vectors ({table.shape[0]} rows)")
        weights = np.asarray(table[row], dtype=np.float32)
        if not np.all(np.isfinite(weights)) or weights.min() < 0 or weights.max() > 1:
            raise SpecError(f"{field}.inline", "a graded mask row must hold values in [0, 1]")
        mask = mask_from_json({"weights": weights.tolist()}, field)
    mask.values(hidden, field)  # dimensions within the hidden size
    return mask
