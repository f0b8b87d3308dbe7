"""`meshtrain export` never leaves the destination worse than it found it: an export from
a damaged checkpoint over an earlier export stops with one line and the earlier export is
untouched (before: a traceback, and the earlier model.safetensors already deleted); a
destination of the wrong kind (a folder for --format torch's file, a file for --format
hf's folder, a path under a file) or one that cannot be written is named with the fix."""

from __future__ import annotations

import dataclasses
import errno
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from meshtrain.models.llama import Llama
from meshtrain.training.export import main as export_main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TINY = dict(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=48, max_seq_len=32)


@pytest.fixture
def step(tmp_path):
    """A one-step checkpoint folder of a tiny Llama, as DCP writes it."""
    torch.manual_seed(0)
    model = Llama.from_flavor("debug", **TINY)
    folder = tmp_path / "checkpoint" / "step-00000001"
    dcp.save({"model": model.state_dict()}, checkpoint_id=folder, no_dist=True)
    (folder / "model_config.json").write_text(json.dumps(dataclasses.asdict(model.cfg)))
    return folder


def export(capsys, *args) -> tuple[int, str]:
    code = export_main([str(a) for a in args])
    err = capsys.readouterr().err.strip()
    if code:
        assert err.startswith("meshtrain: error: ") and err.count("\n") == 0 and "Traceback" not in err, err
    return code, err


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _truncate_a_shard(step):
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    return "is truncated"


def _garble_a_shard(step):  # the same size, so only reading it finds out
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(b"\0" * shard.stat().st_size)
    return "failed, a shard is damaged"


@pytest.mark.parametrize("harm", [_truncate_a_shard, _garble_a_shard])
def test_exporting_a_damaged_checkpoint_keeps_the_earlier_export(step, tmp_path, capsys, harm):
    out = tmp_path / "hf"
    assert export(capsys, step, out, "--format", "hf")[0] == 0
    (out / "tokenizer.json").write_text("{}")  # the user's own file beside the export
    before = snapshot(out)
    said = harm(step)
    code, err = export(capsys, step, out, "--format", "hf")
    assert code == 2 and said in err and str(step) in err, err
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir() if ".partial" in p.name] == []


def test_a_new_export_replaces_the_earlier_one_and_keeps_other_files(step, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_text("an earlier export in two shards")
    (out / "tokenizer.json").write_text("{}")
    assert export(capsys, step, out, "--format", "hf")[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert export(capsys, step, tmp_path / "model.pt", "--format", "torch")[0] == 0
    assert export(capsys, step, tmp_path / "model.pt", "--format", "torch")[0] == 0  # over the earlier file
    assert "tok_embeddings.weight" in torch.load(tmp_path / "model.pt", weights_only=True)


def test_a_destination_of_the_wrong_kind_is_named_with_the_fix(step, tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    code, err = export(capsys, step, folder, "--format", "torch")
    assert code == 2 and f"{folder} is a folder, and --format torch writes one file" in err, err
    assert f"{folder / 'model.pt'}" in err and list(folder.iterdir()) == []
    file = tmp_path / "file"
    file.write_text("mine")
    code, err = export(capsys, step, file, "--format", "hf")
    assert code == 2 and f"{file} is a file, and --format hf writes a folder" in err, err
    code, err = export(capsys, step, file / "hf", "--format", "hf")
    assert code == 2 and f"{file} is a file, so {file / 'hf'} cannot be created under it" in err, err
    assert file.read_text() == "mine"
    code, err = export(capsys, file, tmp_path / "out", "--format", "hf")  # a file given as the checkpoint
    assert code == 2 and f"checkpoint folder {file} is a file: give a step's checkpoint folder" in err, err


def test_a_damaged_model_config_is_named(step, tmp_path, capsys):
    (step / "model_config.json").write_text("{ cut")
    code, err = export(capsys, step, tmp_path / "hf", "--format", "hf")
    assert code == 2 and f"{step / 'model_config.json'} is not JSON" in err, err


def _read_only_by_permission(folder, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("root writes whatever the permission bits say; the simulated read-only case covers it")
    folder.chmod(0o555)


def _read_only_file_system(folder, monkeypatch):
    """What a read-only mount answers (EROFS) to creating a folder in ``folder``, where an
    hf export starts. Simulated, because the tests run as root, whom permission bits do not
    stop, and mounting a file system needs privileges a test should not have."""
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if os.path.dirname(os.path.abspath(path)) == str(folder):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)


@pytest.mark.parametrize("make_read_only", [_read_only_by_permission, _read_only_file_system])
def test_a_destination_that_cannot_be_written_is_named(step, tmp_path, capsys, monkeypatch, make_read_only):
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    make_read_only(shelf, monkeypatch)
    try:
        code, err = export(capsys, step, shelf / "hf", "--format", "hf")
    finally:
        monkeypatch.undo()
        shelf.chmod(0o755)
    assert code == 2 and f"cannot write the export {shelf / 'hf'}" in err, err
    assert ("Read-only file system" in err or "Permission denied" in err) and str(shelf) in err, err
    assert list(shelf.iterdir()) == []
