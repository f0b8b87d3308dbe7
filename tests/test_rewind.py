"""`[checkpoint] load_step` rewinds to an earlier step: the abandoned run's newer
checkpoints are moved aside (never deleted) and the console says where, so the rewound
run's saves are kept and a restart resumes it. Before, its saves were dropped (a complete
step folder is never overwritten) and the next plain restart resumed the abandoned run."""

from __future__ import annotations

from tests.in_process import tiny_run, train_in_process
from meshtrain.training.checkpoint import complete_checkpoints


def run(tmp_path, steps: int, *more: str):
    result = train_in_process(*tiny_run(tmp_path, "run", f"--training.steps={steps}", "--checkpoint.interval=2",
                                        *more))
    assert result.code == 0, result.stderr[-3000:]
    return result


def test_a_rewind_sets_the_abandoned_steps_aside_and_a_restart_resumes_the_rewound_run(tmp_path):
    folder = tmp_path / "run" / "checkpoint"
    run(tmp_path, 4)
    abandoned = (folder / "step-00000004" / "meta.json").stat().st_mtime_ns
    rewound = run(tmp_path, 4, "--checkpoint.load_step=2")
    assert "resumed at step 2" in rewound.stdout
    aside = next(folder.glob("abandoned-*"))
    assert f"The newer checkpoints of the abandoned run (step 4) were moved to {aside}" in rewound.stdout
    assert [p.name for p in aside.iterdir()] == ["step-00000004"]
    assert (aside / "step-00000004" / "meta.json").stat().st_mtime_ns == abandoned
    assert [s for s, _ in complete_checkpoints(folder)] == [2, 4]  # step 4 is the rewound run's own

    # The same command again (a torchrun restart): resume the rewound run, do not rewind again.
    again = run(tmp_path, 6, "--checkpoint.load_step=2")
    assert "load_step = 2 was applied by an earlier start" in again.stdout and "resumed at step 4" in again.stdout
    assert [s for s, _ in complete_checkpoints(folder)] == [2, 4, 6]
    assert len(list(folder.glob("abandoned-*"))) == 1
    plain = run(tmp_path, 6)
    assert "nothing to do: the newest checkpoint" in plain.stdout and "step 6" in plain.stdout
