"""The CPU engine's intra-op thread count (`runtime.cpu_thread_count`): one core left for the
rest of the process and the machine, so a busy neighbour cannot stall every OpenMP parallel
region of the forward (docs/performance.md, "The CPU's slow mode"). The pure rule, the refusal
of a bad setting naming the field, and the thread count of a real engine."""

from __future__ import annotations

import os

import pytest
import torch

from engine_ext.engine import runtime
from engine_ext.errors import SpecError


def test_the_rule(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [runtime.cpu_thread_count(cores=n) for n in (1, 2, 4, 16)] == [1, 1, 3, 15]
    assert runtime.cpu_thread_count(3, cores=2) == 3  # configured wins
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert runtime.cpu_thread_count(cores=8) == 2  # then the user's OMP_NUM_THREADS
    assert runtime.cpu_thread_count(5, cores=8) == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "garbage")
    assert runtime.cpu_thread_count(cores=8) == 7
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="positive integer"):
            runtime.cpu_thread_count(bad, cores=2)


def test_a_bad_setting_is_refused_naming_the_field():
    from engine_ext import Engine

    with pytest.raises(SpecError) as info:
        Engine(device="cpu", cpu_threads=0).start()
    assert info.value.field == "cpu_threads" and "positive integer" in info.value.message


#: the user's setting, read at collection (before any engine of the session started)
USER_OMP = os.environ.get("OMP_NUM_THREADS")


@pytest.mark.engine
def test_the_engine_runs_with_one_core_to_spare(engine):
    if USER_OMP is not None:
        pytest.skip(f"OMP_NUM_THREADS={USER_OMP} was set by the user")
    expected = max(1, len(os.sched_getaffinity(0)) - 1)
    assert torch.get_num_threads() == expected
    assert os.environ["OMP_NUM_THREADS"] == str(expected)  # what the processes it starts use
