"""A checkpoint from someone else cannot run code: DCP's `.metadata` index is a pickle, and
resuming (train.py) or exporting (training.export) a folder whose index was crafted to run
a command refuses it, naming the file and the refused global, before anything runs."""

import os
import pickle
import shutil

import pytest
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from tests.conftest import one_process
from meshtrain.training.checkpoint_reader import read_index

ARGS = ["--config", "debug_2d", "--parallelism.dp_shard=1", "--parallelism.tp=1", "--training.steps=2",
        "--training.seq_len=32", "--checkpoint.enable=true", "--checkpoint.interval=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One training run for the module (each test damages its own copy of it)."""
    out = tmp_path_factory.mktemp("security")
    proc = one_process("train.py", *ARGS, f"--job.output_dir={out}", "--job.name=run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "run"


@pytest.fixture
def checkpoint(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run" / "checkpoint" / "step-00000002"


class _RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_command(checkpoint, tmp_path):
    marker = tmp_path / "code_ran"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_RunsACommand(marker)))
    return marker


@pytest.mark.slow
def test_resume_refuses_an_index_that_would_run_code(checkpoint, tmp_path):
    marker = plant_command(checkpoint, tmp_path)
    proc = one_process("train.py", *ARGS, f"--job.output_dir={tmp_path}", "--job.name=run")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ".metadata" in proc.stderr and "posix.system" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not marker.exists(), "the planted command ran"


@pytest.mark.slow
def test_export_refuses_an_index_that_would_run_code(checkpoint, tmp_path):
    marker = plant_command(checkpoint, tmp_path)
    proc = one_process("-m", "meshtrain.training.export", str(checkpoint), str(tmp_path / "out"), "--format", "torch")
    assert proc.returncode != 0
    assert "posix.system" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists(), "the planted command ran"


@pytest.mark.slow
def test_an_entry_stored_as_pickled_bytes_is_refused(checkpoint, tmp_path):
    """DCP would unpickle a bytes entry with weights_only=False: refuse the index instead."""
    index = checkpoint / ".metadata"
    with open(index, "rb") as f:
        metadata = read_index(str(index), f)
    key = next(k for k in metadata.state_dict_metadata if k.startswith("model."))
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    index.write_bytes(pickle.dumps(metadata))
    proc = one_process("train.py", *ARGS, f"--job.output_dir={tmp_path}", "--job.name=run")
    assert proc.returncode == 2 and key in proc.stderr and "pickled bytes" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_a_truncated_index_is_refused_with_its_path(checkpoint, tmp_path):
    index = checkpoint / ".metadata"
    index.write_bytes(index.read_bytes()[:100])
    proc = one_process("train.py", *ARGS, f"--job.output_dir={tmp_path}", "--job.name=run")
    assert proc.returncode == 2 and str(index) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_pickled_hugging_face_weights_are_refused_with_how_to_convert(tmp_path):
    from meshtrain.models.safetensors_files import tensor_files

    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsACommand(tmp_path / "code_ran")))
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin: pickled weights.*safetensors"):
        tensor_files(tmp_path)
    assert not (tmp_path / "code_ran").exists()


def test_a_safetensors_index_may_not_point_outside_its_folder(tmp_path):
    import json

    from meshtrain.models.safetensors_files import tensor_files

    index = {"weight_map": {"model.embed_tokens.weight": "../elsewhere/model-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside"):
        tensor_files(tmp_path)
