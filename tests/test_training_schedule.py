"""The bundled model's training run is the first ``steps`` of a ``schedule_steps`` run.

The shipped recipe stops a 2600-step cosine schedule early; the model card's claim that the
shipped weights are that longer run's weights at the stopping step rests on these two facts:
the data order and the learning rate of a shorter run are a prefix of the longer run's.
"""

import pytest

from training import corpus
from training.train import TrainConfig, batches, lr_factor, train


@pytest.fixture(scope="module")
def world():
    return corpus.build_world(corpus.SEED)


def test_a_stopped_run_sees_the_first_batches_of_the_full_run(world):
    full = batches(TrainConfig(steps=400, schedule_steps=400), world)
    stopped = batches(TrainConfig(steps=150, schedule_steps=400), world)
    assert len(stopped) == 150 and len(full) == 400
    assert stopped == full[:150]
    assert full[150] != full[149]


def test_a_stopped_run_follows_the_full_schedule():
    stopped, full = TrainConfig(steps=1950), TrainConfig(steps=2600)
    assert stopped.schedule_steps == full.schedule_steps
    assert [lr_factor(stopped, s) for s in range(1950)] == [lr_factor(full, s) for s in range(1950)]
    assert lr_factor(full, 0) == pytest.approx(1 / full.warmup)
    assert lr_factor(full, full.warmup - 1) == pytest.approx(1.0, abs=0.01)
    assert 0 < lr_factor(full, 1949) < 0.2 and lr_factor(full, 2599) < 1e-5


@pytest.mark.parametrize("steps", [0, 2601])
def test_steps_outside_the_schedule_are_refused(steps):
    with pytest.raises(ValueError, match="steps must be in 1..schedule_steps"):
        train(TrainConfig(steps=steps, schedule_steps=2600))
