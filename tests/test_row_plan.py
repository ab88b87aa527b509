"""RowPlan: rows -> (request, absolute position) under the batch shapes vLLM produces."""

import numpy as np
import pytest

from engine_ext.worker.row_plan import RowPlan, ScheduledRequest


def test_single_prefill():
    plan = RowPlan([ScheduledRequest("a", 0, 5, 0)], 5)
    assert plan.row_request.tolist() == [0] * 5
    assert plan.row_position.tolist() == [0, 1, 2, 3, 4]


def test_chunked_prefill_second_chunk_starts_at_num_computed():
    plan = RowPlan([ScheduledRequest("a", 0, 4, 8)], 4)
    assert plan.row_position.tolist() == [8, 9, 10, 11]
    rows, pos = plan.window("a").rows_for(np.array([7, 9, 11, 12]))
    assert rows.tolist() == [1, 3] and pos.tolist() == [9, 11]


def test_mixed_decode_and_prefill_batch_with_padding():
    # V2 orders decode requests first; padding rows (CUDA graph sizes) belong to nobody
    plan = RowPlan.from_query_start(["d1", "d2", "p"], [0, 1, 2, 7], [12, 30, 0], num_rows=8)
    assert plan.row_request.tolist() == [0, 1, 2, 2, 2, 2, 2, -1]
    assert plan.row_position.tolist() == [12, 30, 0, 1, 2, 3, 4, -1]
    assert plan.window("d2").first_position == 30 and plan.window("p").n_rows == 5


def test_preempted_request_resumes_at_its_new_num_computed():
    # after preemption a request recomputes from what the prefix cache still holds
    before = RowPlan([ScheduledRequest("a", 0, 1, 20)], 1)
    after = RowPlan([ScheduledRequest("a", 0, 5, 16)], 5)
    assert before.row_position.tolist() == [20]
    assert after.row_position.tolist() == [16, 17, 18, 19, 20]  # position 20 visited again


def test_prompt_length_is_carried():
    plan = RowPlan.from_query_start(["a"], [0, 3], [0], 3, num_prompt=[3])
    assert plan.windows[0].num_prompt == 3


@pytest.mark.parametrize("reqs, rows", [
    ([ScheduledRequest("a", 0, 3, 0), ScheduledRequest("b", 2, 2, 0)], 5),  # overlapping rows
    ([ScheduledRequest("a", 0, 6, 0)], 5),                                  # past the step
    ([ScheduledRequest("a", 0, 2, -1)], 5),                                 # negative computed
])
def test_inconsistent_input_is_refused(reqs, rows):
    with pytest.raises(ValueError):
        RowPlan(reqs, rows)
