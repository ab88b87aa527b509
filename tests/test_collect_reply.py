"""Fast tier (no engine): a `cb_collect` reply sends each capture layout's keys once
(`engine_ext.collect_reply`): through vLLM's own msgpack encoding the client gets every result's
keys back, one shared list per layout, and a malformed reply is an error naming the result."""

from __future__ import annotations

import copy

import pytest
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from engine_ext.collect_reply import expand_layouts, share_layouts


def _reply() -> tuple[dict, dict]:
    shared = [[2, 15], [5, 15], [8, 15]]  # one layout, as the worker shares it between results
    other = [[1, 3]]
    results = {f"k{i}": {"key": f"k{i}", "status": "ok", "errors": [],
                         "captures": {"keys": shared, "ring": ["ring", 64 * i, 48]}} for i in range(5)}
    results["k2"]["captures"] = {"keys": other, "data": b"\0" * 4}
    results["k-own"] = {"key": "k-own", "status": "ok", "errors": [], "captures": {"keys": [[2, 15], [5, 15], [8, 15]],
                                                                                   "data": b"\0" * 12}}
    results["k-none"] = {"key": "k-none", "status": "ok", "errors": [], "captures": {"keys": [], "data": b""}}
    results["k-plain"] = {"key": "k-plain", "status": "ok", "errors": []}
    return results, copy.deepcopy(results)


def test_each_layout_travels_once_and_every_result_gets_its_keys_back():
    results, want = _reply()
    wire = share_layouts(results)
    sent = [r["captures"] for r in wire.values() if r.get("captures", {}).get("layout") is not None]
    assert sum("keys" in b for b in sent) == 3  # the shared list, the other, the equal list of its own
    assert [b["layout"] for b in sent] == [0, 0, 1, 0, 0, 2]
    got = expand_layouts(MsgpackDecoder(dict).decode(MsgpackEncoder().encode(wire)))
    assert got == want
    # one list for every result of the shared layout
    assert len({id(got[k]["captures"]["keys"]) for k in ("k0", "k1", "k3", "k4")}) == 1


def test_a_reply_without_layouts_is_left_as_it_is():
    results, want = _reply()
    assert expand_layouts(results) == want


@pytest.mark.parametrize("damage", ["later_first", "missing_first"])
def test_a_malformed_reply_names_the_result(damage):
    results, _ = _reply()
    wire = share_layouts(results)
    if damage == "later_first":
        wire["k0"]["captures"]["layout"] = 1
    else:
        del wire["k0"]["captures"]["keys"]
    with pytest.raises(ValueError, match="k0|k1"):
        expand_layouts(wire)
