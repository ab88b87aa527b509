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
