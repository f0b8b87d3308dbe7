"""A state that is not finite is never saved nor called good. With lr = 1e39 the first
update overflows the weights to inf while its loss is still finite; before, the next
step's NaN stop saved those weights as "the last good state", and a save falling on the
overflowing step wrote them too -- a checkpoint every restart would resume into NaN."""

from __future__ import annotations

import pytest

from tests.in_process import tiny_run, train_in_process
from meshtrain.training.checkpoint import complete_checkpoints


@pytest.mark.parametrize("interval,said", [
    # The stop at step 2 would checkpoint step 1 as the last good state.
    (10, "The weights after step 1 are not finite either (its update overflowed), so they were not saved; "
         "there is no complete checkpoint in"),
    # The regular save after step 1 meets the overflowed weights first.
    (1, "step 1: the weights or optimizer state are not finite (inf/NaN), so step 1 was not saved"),
])
def test_an_overflowed_state_is_not_saved_and_not_called_good(tmp_path, interval, said):
    result = train_in_process(*tiny_run(tmp_path, "run", "--training.steps=3", "--optimizer.lr=1e39",
                                        f"--checkpoint.interval={interval}"))
    assert result.code == 3, (result.code, result.stderr[-2000:])
    assert said in result.stderr and "The last good state is checkpointed" not in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert complete_checkpoints(tmp_path / "run" / "checkpoint") == []


def test_a_finite_state_before_the_overflow_is_the_one_named(tmp_path):
    """Step 1 at a sane lr is saved; resumed at lr = 1e39, step 2 overflows and step 3 stops:
    the newest finite checkpoint, step 1, is named, and nothing later is written."""
    first = train_in_process(*tiny_run(tmp_path, "run", "--training.steps=1"))
    assert first.code == 0, first.stderr[-2000:]
    result = train_in_process(*tiny_run(tmp_path, "run", "--training.steps=4", "--optimizer.lr=1e39",
                                        "--checkpoint.interval=10", "--checkpoint.if_config_differs=resume"))
    assert result.code == 3, result.stderr[-2000:]
    assert "the newest complete checkpoint is step-00000001" in result.stderr, result.stderr
    assert [s for s, _ in complete_checkpoints(tmp_path / "run" / "checkpoint")] == [1]
