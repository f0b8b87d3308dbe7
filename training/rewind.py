"""`[checkpoint] load_step` rewinds a run to an earlier checkpoint (to retry past a loss
spike, say). The checkpoints newer than it belong to the abandoned run: left in place, they
would block this run's saves of the same steps (a complete checkpoint is never
overwritten) and the next plain restart would resume the abandoned run. So once the
chosen step has loaded, the newer ones are moved, whole, into `abandoned-TIME/` beside
them -- never deleted -- and the console says so.

The rewind is recorded in `rewound.json`. A restart with the same command (torchrun
--max-restarts, or a rerun that still says load_step = N) then finds checkpoints newer
than N that this run saved after rewinding: it resumes the newest of them instead of
rewinding again, and says so.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

MARKER = "rewound.json"


def load_step_in_effect(folder: Path, load_step: int, newest: int | None) -> tuple[int, str | None]:
    """(the step to load, 0 for the newest; a note for the console or None). ``newest``:
    the newest complete checkpoint's step."""
    if not load_step or newest is None or newest <= load_step:
        return load_step, None
    try:
        done = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return load_step, None
    if not isinstance(done, dict) or done.get("load_step") != load_step:
        return load_step, None
    return 0, (f"[checkpoint] load_step = {load_step} was applied by an earlier start (see {folder / MARKER}); "
               f"the checkpoints since, up to step {newest}, are this rewound run's, so it resumes from step "
               f"{newest}. Set load_step = 0, or delete {MARKER} to rewind to step {load_step} again")


def set_aside_newer(folder: Path, step: int, newer: list[Path]) -> str | None:
    """Move the complete checkpoints ``newer`` (those after ``step``, just loaded) into
    one `abandoned-TIME` folder and record the rewind; returns what was done, in words."""
    if not newer:
        return None
    aside = folder / f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 0
    while aside.exists():  # two rewinds within a second
        n += 1
        aside = folder / f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    aside.mkdir()
    # The marker first: a crash between the moves and it would otherwise let a restart
    # with the same load_step set aside the steps this run saves next.
    (folder / MARKER).write_text(json.dumps({"load_step": step, "set_aside_to": aside.name,
                                             "steps": [p.name for p in newer], "time": time.time()}, indent=1))
    for path in newer:
        path.rename(aside / path.name)
    steps = ", ".join(str(int(p.name.removeprefix("step-"))) for p in newer)
    return (f"[checkpoint] load_step = {step}: rewound. The newer checkpoints of the abandoned run (step "
            f"{steps}) were moved to {aside} (nothing was deleted), so this run's saves take their place and "
            f"a plain restart resumes this run")
