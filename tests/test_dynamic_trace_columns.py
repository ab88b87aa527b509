"""Fast tier: a dynamic result's trace travels from the worker as columns and reaches the caller
as the public dicts (`engine_ext.dynamic.trace`): the same dicts the worker would have built."""

from engine_ext.dynamic import trace


def test_columns_expand_to_the_public_dicts():
    entries = [(4, 0.25, 1.0, 0.0), (5, 1.5, 1.0, 2.0), (6, -0.5, -1.0, -3.0)]
    want = [{"position": p, "score": s, "threshold": t, "engaged": x != 0.0, "scale": x} for p, s, t, x in entries]
    cols = trace.columns(entries)
    assert cols == [[4, 5, 6], [0.25, 1.5, -0.5], [1.0, 1.0, -1.0], [0.0, 2.0, -3.0]]
    assert trace.dicts(cols) == want
    res = {"policies": [{}, {}], "trace_columns": [cols, trace.columns([])], "actions": 2}
    out = trace.expand(res)
    assert out == {"policies": [{}, {}], "trace": [want, []], "actions": 2}
    assert "trace_columns" in res  # the worker's reply itself is left as it was
    assert trace.expand(None) is None
    assert trace.expand({"trace": [want]}) == {"trace": [want]}


def test_policy_indices_expand_to_copies_of_the_wire_policies():
    api = [{"probe": "a", "vector": [1.0, 2.0]}, {"probe": "b"}]
    res = {"policy_index": [1, 0], "trace_columns": [[[], [], [], []], [[], [], [], []]], "actions": 0}
    out = trace.expand(res, api)
    assert out == {"policies": [{"probe": "b"}, {"probe": "a", "vector": [1.0, 2.0]}], "trace": [[], []], "actions": 0}
    out["policies"][1]["vector"].append(3.0)  # each result's copy is its own
    assert api[0]["vector"] == [1.0, 2.0]
    try:
        trace.expand(res)
    except ValueError as exc:
        assert "wire policies" in str(exc)
    else:
        raise AssertionError("policy indices without the wire's policies must not pass")
