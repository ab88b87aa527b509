"""The capture keys of a `cb_collect` reply, sent once per layout.

A worker's results name their captured values by `keys`, a list of `[site, position]` pairs per
result. The requests of one batch usually share one layout (P3: 1000 results, each the same 16
pairs; the worker keeps one list per layout, `worker.state._block_layout`), yet a reply would
carry every result's copy through msgpack, and the client would decode one list per pair again
(1000 x 16: ~6 ms a reply on the 2-core CPU, ~1 ms once per layout).

Wire form (`share_layouts`, the worker's `cb_collect`; `expand_layouts`, the client, before
anything reads a reply): a capture block that carries a key list also carries `layout`, an index
counting the reply's distinct lists (by identity) in result order; the first block of a layout
keeps its `keys`, every later one carries `layout` alone. Expanded, each of those blocks gets
the first one's list back (one list object shared by them all: read-only for every reader).
"""

from __future__ import annotations


def share_layouts(results: dict[str, dict]) -> dict[str, dict]:
    """Worker side, in place: each capture block's key list replaced by `layout` after the first
    block that holds the same list object (see the module docstring). Returns `results`."""
    seen: dict[int, int] = {}
    for res in results.values():
        block = res.get("captures")
        if not block:
            continue
        keys = block.get("keys")
        if not keys:
            continue
        ident = id(keys)  # every list is held by its result meanwhile: ids are not reused
        idx = seen.get(ident)
        if idx is None:
            block["layout"] = seen[ident] = len(seen)
        else:
            del block["keys"]
            block["layout"] = idx
    return results


def expand_layouts(results: dict[str, dict]) -> dict[str, dict]:
    """Client side, in place: every capture block's `keys` again (`share_layouts` undone; a
    reply without `layout` entries is left as it is). Returns `results`."""
    table: list[list] = []
    for key, res in results.items():
        block = res.get("captures")
        if not block or "layout" not in block:
            continue
        idx = block.pop("layout")
        if "keys" in block:
            if idx != len(table):
                raise ValueError(f"cb_collect reply: result {key!r} starts layout {idx}, expected {len(table)}")
            table.append(block["keys"])
        elif 0 <= idx < len(table):
            block["keys"] = table[idx]
        else:
            raise ValueError(f"cb_collect reply: result {key!r} names layout {idx} before it was sent")
    return results
