"""Run `train.py` in this process, as a world of one: a gloo group of one rank when the run
gets that far, none when it is refused before. A second of work instead of a subprocess's
start-up, so the fast tier can prove what happens across a save and a resume."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from pathlib import Path

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
CORPUS = "the quick brown fox jumps over the lazy dog. " * 40


@dataclasses.dataclass
class Result:
    code: int
    stdout: str
    stderr: str


def tiny_run(tmp_path: Path, name: str = "run", *more: str, config: str = "debug_2d") -> list[str]:
    """Arguments of a one-process run of ``config`` small enough for the fast tier, with
    checkpoints on (a save every step unless ``more`` says otherwise)."""
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(CORPUS)
    return ["--config", config, "--parallelism.tp=1", "--parallelism.dp_shard=1", "--training.seq_len=16",
            "--training.global_batch_size=2", "--training.dataset=text", f"--training.dataset_path={corpus}",
            f"--job.output_dir={tmp_path}", f"--job.name={name}", "--checkpoint.enable=true",
            "--checkpoint.interval=1", "--metrics.enable_tensorboard=false", "--lr_scheduler.warmup_steps=0",
            "--lr_scheduler.decay_type=constant", *more]


def train_in_process(*argv: str) -> Result:
    """`train.run(argv)` here; an exception that escapes it (a bug's traceback) propagates.
    The launcher's variables a run of one sets for itself are put back afterwards, and a
    process group it left behind is taken down."""
    import torch.distributed as dist

    from meshtrain import train

    saved = {k: os.environ.pop(k) for k in ENV_KEYS if k in os.environ}
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = train.run(list(argv))
    finally:
        for key in ENV_KEYS:
            os.environ.pop(key, None)
        os.environ.update(saved)
        if dist.is_initialized():
            dist.destroy_process_group()
    return Result(code, out.getvalue(), err.getvalue())


def refused(result: Result) -> str:
    """The one error line of a run that was refused as bad input (exit 2)."""
    message = result.stderr.strip()
    assert result.code == 2, (result.code, result.stdout[-2000:], message[-2000:])
    assert message.startswith("meshtrain: error: ") and message.count("meshtrain: error:") == 1, message
    assert "Traceback" not in message, message
    return message
