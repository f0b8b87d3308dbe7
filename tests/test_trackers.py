"""[metrics] trackers: one training run logs to TensorBoard, W&B (offline), MLflow (file
store) and trackio at once; each package's own files are read back with that package's own
reader (the .wandb log with W&B's protobufs), and hold the same scalars and the config."""

from __future__ import annotations

import json
import struct
import sys

import pytest

from meshtrain.training.metrics import MetricsLogger
from tests.in_process import refused, tiny_run, train_in_process

STEPS = 3


def wandb_records(path):
    """The records of a W&B offline run file (run-*.wandb): a 7-byte header, then 32 KiB
    blocks of chunks, each a 7-byte header (crc32, length, type: full, first, middle, last)
    and a piece of one serialized `Record` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pieces = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", data[:8]
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # no room for a chunk header: the block's tail is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the block's end
            pos += block - pos % block
            continue
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def read_wandb(run_dir):
    [path] = run_dir.glob("wandb/offline-run-*/run-*.wandb")  # one run: before any resume
    history, config = {}, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[row["_step"]] = row
        elif kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
    return history, config


def read_mlflow(run_dir):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlflow").resolve().as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("trk").experiment_id])
    history = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            history.setdefault(m.step, {})[key] = m.value
    return history, run.data.params


def read_trackio(run_dir):
    import trackio.utils
    from trackio.sqlite_storage import SQLiteStorage

    assert trackio.utils.TRACKIO_DIR == (run_dir / "trackio").resolve()  # the run folder's, not ~/.cache
    history = {row["step"]: row for row in SQLiteStorage.get_logs("trk", "trk")}
    return history, SQLiteStorage.get_run_config("trk", "trk")


def read_tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    history = {}
    for key in acc.Tags()["scalars"]:
        for e in acc.Scalars(key):
            history.setdefault(e.step, {})[key] = e.value
    return history


def test_every_tracker_holds_the_same_scalars_and_the_config(tmp_path, monkeypatch):
    assert "trackio" not in sys.modules  # it reads TRACKIO_DIR once, at its first import
    monkeypatch.delenv("TRACKIO_DIR", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = lambda steps: train_in_process(*tiny_run(  # noqa: E731
        tmp_path, "trk", f"--training.steps={steps}", f"--checkpoint.interval={STEPS}",
        "--metrics.enable_tensorboard=true", "--metrics.log_freq=1", "--metrics.trackers=tensorboard,wandb,mlflow,trackio"))
    result = run(STEPS)
    assert result.code == 0, result.stderr[-3000:]
    run_dir = tmp_path / "trk"
    wandb_history, wandb_config = read_wandb(run_dir)
    mlflow_history, mlflow_params = read_mlflow(run_dir)
    trackio_history, trackio_config = read_trackio(run_dir)
    tensorboard = read_tensorboard(run_dir)

    logged = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(logged) == STEPS
    keys = {"loss", "lr", "grad_norm", "tokens_per_second", "rss_gib", "peak_rss_gib"}
    for step in range(1, STEPS + 1):
        scalars = {k: v for k, v in mlflow_history[step].items()}
        assert set(scalars) == keys, scalars
        assert {k: wandb_history[step][k] for k in keys} == scalars
        assert {k: trackio_history[step][k] for k in keys} == scalars
        assert tensorboard[step] == pytest.approx(scalars, rel=1e-6)  # stored as float32
        assert f"loss {scalars['loss']:.4f}" in logged[step - 1]  # the console line's loss

    # The config, as hyperparameters: what --print-config would say.
    assert wandb_config["training"]["seq_len"] == 16 and trackio_config["training"]["seq_len"] == 16
    assert wandb_config["metrics"]["trackers"] == ["tensorboard", "wandb", "mlflow", "trackio"]
    assert mlflow_params["training.seq_len"] == "16" and mlflow_params["job.name"] == "trk"

    # Resumed from the step-3 checkpoint, the same folder goes on in the same tracker runs:
    # one MLflow run and one trackio run holding steps 1-5, and a second W&B offline piece
    # under the first one's run id (what `wandb sync` joins them by).
    resumed = run(STEPS + 2)
    assert resumed.code == 0 and f"resumed at step {STEPS}" in resumed.stdout, resumed.stdout[-2000:]
    mlflow_history, _ = read_mlflow(run_dir)  # read_mlflow unpacks exactly one run
    trackio_history, _ = read_trackio(run_dir)
    assert sorted(mlflow_history) == sorted(trackio_history) == list(range(1, STEPS + 3))
    first, second = sorted(run_dir.glob("wandb/offline-run-*"))
    assert first.name.split("-")[-1] == second.name.split("-")[-1]  # offline-run-DATE-ID
    assert (run_dir / "trackers.json").exists()


def test_only_rank0_logs(tmp_path, capsys):
    logger = MetricsLogger(tmp_path / "tb", rank=1, log_freq=1, trackers=["tensorboard", "wandb", "mlflow", "trackio"],
                           config={"job": {"name": "x"}})
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert list(tmp_path.iterdir()) == [] and capsys.readouterr().out == ""


def test_a_missing_package_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what Python sees when mlflow is not installed
    message = refused(train_in_process(*tiny_run(tmp_path, "x", "--metrics.trackers=tensorboard,mlflow")))
    assert "--metrics.trackers=" in message and "names mlflow" in message, message
    assert 'pip install "meshtrain[mlflow]"' in message and "[metrics] trackers" in message, message
    assert not (tmp_path / "x").exists()
