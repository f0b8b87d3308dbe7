"""Where rank 0's scalars go besides the console: `[metrics] trackers`.

Each tracker is two calls, ``log(step, scalars)`` and ``close()``; `metrics.MetricsLogger`
holds the list and hands every logged dict to each, so every tracker gets the same scalars
at the same steps. Each one also records the run's config once, as hyperparameters.
Everything is written under the run folder, nothing goes over the network:

- tensorboard: tb/ (event files; the config as text)
- wandb: wandb/, in offline mode (`wandb sync wandb/offline-run-*` uploads it later; set
  WANDB_MODE=online to log live instead)
- mlflow: an MLflow file store in mlflow/ (`mlflow ui --backend-store-uri mlflow`), or the
  server named by MLFLOW_TRACKING_URI when that is set
- trackio: trackio/ (`TRACKIO_DIR=trackio trackio show`), unless TRACKIO_DIR is already set

A resumed run continues the same tracker run rather than starting another: the first run
keeps each tracker's run id in the run folder's trackers.json, and a resumed run (its
``purge_step``, the first step it logs) hands it back -- W&B's ``id`` with ``resume="allow"`` (offline,
the id is what `wandb sync` joins the pieces by), MLflow's run id, trackio's run name.
Steps an interrupted run logged after its last checkpoint are logged again: TensorBoard
drops the old ones (``purge_step``); MLflow keeps both values in the metric's history and
W&B (online) keeps the first -- a checkpoint interval's worth of steps, at most.

The packages are imported only on rank 0 and only when named; this module itself imports
neither torch nor any of them, so the config check can ask it what is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

IDS = "trackers.json"  # in the run folder: {tracker: its run id}, for a resume to continue

# tracker -> (the module it imports, the extra of pyproject.toml that installs it)
_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow"), "trackio": ("trackio", "trackio")}


def resolve_trackers(trackers: list[str], enable_tensorboard: bool = True) -> list[str]:
    """The trackers a run uses: ``trackers`` in order, once each, less tensorboard when
    enable_tensorboard is false (the older switch, still honoured)."""
    names = list(dict.fromkeys(trackers))
    return [n for n in names if n != "tensorboard" or enable_tensorboard]


def missing_package(name: str) -> str | None:
    """The pip command that installs tracker ``name``'s package, when it is not installed."""
    if name not in _PACKAGES:
        return None
    module, extra = _PACKAGES[name]
    return None if importlib.util.find_spec(module) else f'pip install "meshtrain[{extra}]"'


def flat_config(config: dict) -> dict[str, object]:
    """{"section.key": value}: the form MLflow's params take (the others take it nested)."""
    return {f"{section}.{key}": value for section, keys in config.items() for key, value in keys.items()}


def open_tracker(name: str, run_dir: Path, *, tb_dir: Path, run_name: str, config: dict,
                 config_text: str | None, purge_step: int | None):
    """Tracker ``name``, writing under ``run_dir`` (TensorBoard into ``tb_dir``). With
    ``purge_step`` (a resumed run) the tracker run the folder's first run opened goes on."""
    if name == "tensorboard":
        return TensorBoardTracker(tb_dir, config_text, purge_step)
    resume_id = saved_ids(run_dir).get(name) if purge_step is not None else None
    if name == "wandb":
        tracker = WandbTracker(run_dir, run_name, config, resume_id)
    elif name == "mlflow":
        tracker = MLflowTracker(run_dir / "mlflow", run_name, config, resume_id)
    elif name == "trackio":
        tracker = TrackioTracker(run_dir / "trackio", run_name, config, resume_id)
    else:
        raise ValueError(f"unknown tracker {name!r}")  # the config check accepts only the four
    save_id(run_dir, name, tracker.run_id)
    return tracker


def saved_ids(run_dir: Path) -> dict[str, str]:
    try:
        return json.loads((run_dir / IDS).read_text())
    except (OSError, ValueError):  # none yet (or a damaged one): a new tracker run
        return {}


def save_id(run_dir: Path, name: str, run_id: str) -> None:
    ids = {**saved_ids(run_dir), name: run_id}
    tmp = run_dir / f"{IDS}.tmp"
    tmp.write_text(json.dumps(ids, indent=1) + "\n")
    tmp.replace(run_dir / IDS)


class TensorBoardTracker:
    def __init__(self, log_dir: Path, config_text: str | None, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)
        if config_text is not None:
            # Fenced so TensorBoard's markdown keeps the config's line breaks and indentation.
            self.writer.add_text("config", f"```\n{config_text}\n```", 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a crash loses at most the line being written

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, run_name: str, config: dict, resume_id: str | None = None):
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)  # W&B writes into its wandb/ there
        # console="off": the console line is meshtrain's own; W&B would capture it a second time.
        self.run = wandb.init(mode=os.environ.get("WANDB_MODE", "offline"), dir=str(run_dir), project=run_name,
                              name=run_name, config=config, id=resume_id, resume="allow" if resume_id else None,
                              settings=wandb.Settings(console="off", silent=True))
        self.run_id = self.run.id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowTracker:
    def __init__(self, folder: Path, run_name: str, config: dict, resume_id: str | None = None):
        # MLflow 3 keeps its file store only behind this opt-in; the database backends need
        # SQLAlchemy, which mlflow-skinny leaves out. The file store is what a run folder wants.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or folder.resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        if resume_id is not None and self._exists(resume_id):
            self.run_id = resume_id  # its params were logged by the first run (MLflow's are write-once)
            self.client.update_run(resume_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(run_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(run_name)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(k, str(v)) for k, v in flat_config(config).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params a call
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
            return True
        except MlflowException:  # another store (MLFLOW_TRACKING_URI changed) or removed
            return False

    def log(self, step: int, scalars: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker:
    def __init__(self, folder: Path, run_name: str, config: dict, resume_id: str | None = None):
        # trackio reads its folder from the environment once, when first imported.
        os.environ.setdefault("TRACKIO_DIR", str(folder.resolve()))
        import trackio

        self.trackio = trackio
        # A run is named within its project; a resume names the same one ("allow": it goes on).
        self.run = trackio.init(project=run_name, name=resume_id or run_name, config=config,
                                resume="allow" if resume_id else "never")
        self.run_id = self.run.name

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
