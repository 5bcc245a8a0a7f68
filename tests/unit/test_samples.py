"""samples.jsonl: one line per trained sample, cut back to a checkpoint's step on resume; the
batches made ahead in async mode are trained first after a resume, in order."""
from __future__ import annotations

import pytest

from cluster.loop.batches import AsyncBatches, Batch
from cluster.loop.samples import SampleLog, read, sample_ids
from common.messages import GenerationRequest


def _requests(*indices: int) -> list:
    return [GenerationRequest(i, f"p{i}", str(i), {}, 0) for i in indices]


def test_each_sample_is_one_line_and_a_rewind_keeps_the_steps_up_to_the_checkpoint(tmp_path):
    log = SampleLog(tmp_path)
    for step in (1, 2, 3):
        log.append(sample_ids(step, _requests(5, 9), [step, step - 1], group_size=2))
    assert read(tmp_path)[:4] == [(1, 5, 0, 1), (1, 5, 1, 1), (1, 9, 0, 0), (1, 9, 1, 0)]
    assert len(read(tmp_path)) == 12
    log.rewind(2)  # a learner rebuilt from the checkpoint of step 2
    assert {s[0] for s in read(tmp_path)} == {1, 2}
    log.append(sample_ids(3, _requests(5, 9), [3, 2], group_size=2))
    resumed = SampleLog(tmp_path, resume_step=3)  # a resume keeps what the checkpoint covers
    resumed.append(sample_ids(4, _requests(1), [4], group_size=2))
    assert [s[0] for s in read(tmp_path)] == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 2
    SampleLog(tmp_path)  # a fresh run starts the file over
    assert read(tmp_path) == []


class _Sampler:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"epoch": 0, "position": self.position}


def _batch(tag: int) -> Batch:
    return Batch(refs=[], items=[(tag, None)], versions=[tag], reward_stats={}, metrics={}, times={})


def test_saved_ahead_batches_are_trained_first_and_none_is_made_again():
    saved = [(3, _batch(30)), (4, _batch(40))]
    batches = AsyncBatches(None, _Sampler(), None, first_step=3, last_step=4, lookahead=2, ready=saved)
    try:
        assert batches.ahead == 2  # nothing else to make: both steps left are saved
        made, sampler = batches.ahead_state()
        assert [step for step, _ in made] == [3, 4] and sampler == {"epoch": 0, "position": 0}
        assert batches.next(3).items == [(30, None)] and batches.next(4).items == [(40, None)]
    finally:
        batches.close()


def test_a_saved_batch_out_of_order_is_refused():
    with pytest.raises(AssertionError, match="step 4"):
        AsyncBatches(None, _Sampler(), None, first_step=3, last_step=5, lookahead=1, ready=[(4, _batch(4))])
