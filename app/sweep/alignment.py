"""Token alignment of a clean and a corrupt prompt: which clean position patches which corrupt
position.

Equal token lengths map position to position. Otherwise the longest common token prefix maps
by identity, the longest common token suffix maps with the length difference
(`clean = corrupt + (n_clean - n_corrupt)`), and the corrupt positions in between have no
positional counterpart: they are *unaligned* and a sweep skips them, reporting why. (Same rule
as the reference fork's `align_token_positions`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

UNALIGNED_REASON = "unaligned: clean/corrupt token spans differ here (no positional correspondence)"


@dataclass(frozen=True)
class Alignment:
    n_clean: int
    n_corrupt: int
    prefix_len: int
    suffix_len: int
    #: corrupt position -> clean position, for every aligned corrupt position
    position_map: dict[int, int] = field(default_factory=dict)

    @property
    def unaligned_positions(self) -> list[int]:
        return [p for p in range(self.n_corrupt) if p not in self.position_map]

    @property
    def identity(self) -> bool:
        return self.n_clean == self.n_corrupt

    def to_json(self) -> dict:
        return {
            "n_clean": self.n_clean,
            "n_corrupt": self.n_corrupt,
            "prefix_len": self.prefix_len,
            "suffix_len": self.suffix_len,
            "unaligned_positions": self.unaligned_positions,
            "position_map": {str(k): v for k, v in sorted(self.position_map.items())},
        }


def align_positions(clean_ids: Sequence[int], corrupt_ids: Sequence[int]) -> Alignment:
    """Align corrupt positions to clean positions (see module docstring)."""
    n_clean, n_corrupt = len(clean_ids), len(corrupt_ids)
    if n_clean == n_corrupt:
        prefix = _common_prefix(clean_ids, corrupt_ids)
        suffix = _common_prefix(clean_ids[::-1], corrupt_ids[::-1]) if prefix < n_clean else 0
        return Alignment(n_clean, n_corrupt, prefix, suffix, {p: p for p in range(n_corrupt)})
    limit = min(n_clean, n_corrupt)
    prefix = _common_prefix(clean_ids, corrupt_ids)
    # the suffix may not overlap the prefix in the shorter prompt
    suffix = min(_common_prefix(clean_ids[::-1], corrupt_ids[::-1]), limit - prefix)
    shift = n_clean - n_corrupt
    mapping = {p: p for p in range(prefix)}
    mapping.update({p: p + shift for p in range(n_corrupt - suffix, n_corrupt)})
    return Alignment(n_clean, n_corrupt, prefix, suffix, mapping)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
