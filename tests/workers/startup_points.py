"""Moments of a run's start-up, each the call of train.main that begins it, and a SIGTERM
delivered to this process there: the config (before torch is imported), the layout (torch
imported, the model on meta, before the process group), the run folder (just after the
process group), the model's shards (built and initialized), the checkpoint (resume)."""

import os
import signal

from meshtrain import train
from meshtrain.training import recipe

POINTS = {"config": (train, "parse_args"), "layout": (recipe, "plan_layout"),
          "run_dir": (recipe, "claim_run_dir"), "parts": (recipe, "build_parts"),
          "checkpoint": (recipe, "open_checkpoint")}


def signal_at(point: str, setattr=setattr) -> None:
    """SIGTERM to this process as start-up reaches ``point`` (``setattr``: a monkeypatch's,
    to undo it after a test)."""
    owner, name = POINTS[point]
    real = getattr(owner, name)

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)
    setattr(owner, name, signalled)
