"""Fast tier (no engine): the engine loop hands over final outputs whose worker results carry
captured values only once those values are copied out of the capture ring. A two-part sink
(`convert`, then `put`: `outputs.QueueSink`) has its item built while the ring readers' threads
still copy; a sink with `on_output` alone is called after the copies, as before."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

import engine_ext.capture_ring as cr
from engine_ext.capture_ring import CaptureRing, RingReaders
from engine_ext.engine.loop import EngineLoop
from engine_ext.engine.outputs import QueueSink


class PlainSink:
    def __init__(self, events: list) -> None:
        self.events = events
        self.got: list = []

    def on_output(self, output, worker_result=None) -> None:
        self.events.append(("on_output", output.request_id))
        self.got.append(worker_result)

    def on_error(self, error) -> None:
        self.got.append(error)


def _ring_reply(ring: CaptureRing, n: int) -> tuple[dict, dict]:
    reply, want = {}, {}
    rng = np.random.default_rng(3)
    for i in range(n):
        vals = rng.standard_normal(2048).astype("<f4")
        off = ring.alloc(vals.nbytes)
        ring.buffer(off, vals.nbytes)[:] = vals.tobytes()
        reply[f"k{i}"] = {"key": f"k{i}", "status": "ok", "errors": [],
                          "captures": {"keys": [[0, 1]], "ring": ring.share(off, 0, vals.nbytes)}}
        ring.deref(off)
        want[f"k{i}"] = vals
    return reply, want


def _deliver(loop: EngineLoop, reply: dict, sinks: list) -> None:
    """Request `r<i>` (result key `k<i>`) finished with sink `sinks[i]`; its `cb_collect` reply
    (one worker's) is in: the loop hands the outputs over."""
    loop._sinks = {f"r{i}": sink for i, sink in enumerate(sinks)}
    fut: Future = Future()
    fut.set_result([reply])
    loop._collecting.append((fut, [(SimpleNamespace(request_id=f"r{i}", finished=True), f"k{i}") for i in range(len(sinks))]))
    loop._deliver_collected(wait=True)


@pytest.fixture
def ring_loop():
    """A capture ring, the client's readers with it mapped (copying: these tests are about
    deliveries that wait for copies; lent values need none), and an engine loop (not started)
    that reads through them."""
    ring = CaptureRing(1 << 20)
    readers = RingReaders(lend=False)
    loop = EngineLoop(lambda: None)
    loop.rings = readers
    try:
        assert readers.open(ring.name)
        yield ring, readers, loop
    finally:
        readers.close()
        ring.close()


def test_final_outputs_are_converted_while_values_are_copied_and_handed_over_after(ring_loop, monkeypatch):
    monkeypatch.setattr(cr, "PARALLEL_COPY_BYTES", 1024)  # the readers' threads copy
    ring, readers, loop = ring_loop
    readers.threads = 3
    events: list = []
    started = readers.materialize_started
    copying = threading.Event()

    def materialize_started(reply, copy=True):
        out, copied = started(reply, copy)
        copying.set()

        def waited():
            events.append("copies awaited")
            copied()
            events.append("copied")
        return out, waited

    readers.materialize_started = materialize_started
    reply, want = _ring_reply(ring, 3)

    def convert(out, res):
        assert copying.is_set()
        events.append(("convert", out.request_id))
        return res

    class Recording(QueueSink):
        def put(self, item):
            events.append(("put", item["key"]))
            super().put(item)

    two_part = [Recording(convert), Recording(convert)]
    plain = PlainSink(events)
    _deliver(loop, reply, [two_part[0], plain, two_part[1]])

    assert events == [("convert", "r0"), ("convert", "r2"), "copies awaited", "copied",
                      ("put", "k0"), ("on_output", "r1"), ("put", "k2")]
    for sink, key in ((two_part[0], "k0"), (two_part[1], "k2")):
        item = sink.q.get_nowait()
        assert np.array_equal(np.frombuffer(item["captures"]["data"], "<f4"), want[key])
    assert np.array_equal(np.frombuffer(plain.got[0]["captures"]["data"], "<f4"), want["k1"])
    assert not loop._sinks and not loop._collecting
    ring.release(readers.take_acks()[ring.name])
    assert ring.in_use == 0


def test_a_failing_convert_is_logged_and_the_others_still_delivered(ring_loop, caplog):
    """A consumer's bug in `convert` must not stop the loop: logged once as a failing sink,
    nothing handed to that sink, the other outputs handed over."""
    ring, readers, loop = ring_loop
    reply, want = _ring_reply(ring, 2)

    def broken(out, res):
        raise RuntimeError("consumer bug")

    bad, good = QueueSink(broken), QueueSink(lambda out, res: res)
    with caplog.at_level("ERROR"):
        _deliver(loop, reply, [bad, good])
    assert caplog.text.count("sink failed for r0") == 1 and bad.q.empty()
    assert np.array_equal(np.frombuffer(good.q.get_nowait()["captures"]["data"], "<f4"), want["k1"])
