"""The startup heap's freeze (`runtime.freeze_startup_heap`, issue 13): a started engine's objects
leave the garbage collector's oldest generation, in its own process and its workers'; the last
engine's close hands them back; `CAUSALBOARD_FREEZE_HEAP=0` leaves the collector alone."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

from tests.conftest import REPO

PROBE = """
import gc, json, weakref
from engine_ext.engine import runtime
class Node: pass
junk = [[i] for i in range(50_000)]  # tracked objects alive at the freeze
gc.collect()
gen2 = len(gc.get_objects(2))
base = gc.get_freeze_count()  # a package may have frozen a few at import
froze = runtime.freeze_startup_heap()
after = (gc.get_freeze_count(), len(gc.get_objects(2)))
closed_engine = Node(); closed_engine.me = closed_engine  # a cycle, frozen by the second engine's start
gone = weakref.ref(closed_engine)
runtime.freeze_startup_heap()  # a second engine of the process
del closed_engine
runtime.unfreeze_heap()        # it closes: its garbage is reclaimed, the first engine's heap frozen again
still, reclaimed = gc.get_freeze_count(), gone() is None
runtime.unfreeze_heap()        # the last closes
print(json.dumps({"base": base, "gen2": gen2, "froze": froze, "frozen": after[0], "gen2_after": after[1], "still": still,
                  "reclaimed": reclaimed, "thawed": gc.get_freeze_count(), "gen2_thawed": len(gc.get_objects(2))}))
"""


def _probe(env_extra: dict) -> dict:
    env = {**{k: v for k, v in os.environ.items() if k != "CAUSALBOARD_FREEZE_HEAP"}, **env_extra}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_startup_heap_leaves_the_oldest_generation_until_the_last_engine_closes():
    got = _probe({})
    assert got["froze"] is True
    assert got["frozen"] >= got["base"] + 50_000 and got["gen2"] >= 50_000, got
    assert got["gen2_after"] < 1_000, got  # a full collection now walks next to nothing
    assert got["still"] >= got["frozen"], "one engine of two closed: the other's heap stays frozen"
    assert got["reclaimed"], "a closed engine's cyclic garbage does not stay frozen"
    assert got["thawed"] == 0 and got["gen2_thawed"] >= 50_000, got


def test_the_switch_off_leaves_the_collector_alone():
    got = _probe({"CAUSALBOARD_FREEZE_HEAP": "0"})
    assert got["froze"] is False and got["frozen"] == got["base"] and got["gen2_after"] >= 50_000, got


def test_a_started_engine_froze_its_process_heap(engine):
    """The session's in-process CPU engine: this process's heap is frozen while it runs."""
    assert engine._heap_frozen and gc.get_freeze_count() > 0
