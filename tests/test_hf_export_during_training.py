"""`[checkpoint] export_hf_interval`: train.py writes, every N steps and at the last, a folder
that transformers' own `AutoModelForCausalLM.from_pretrained` loads, holding the training
model of that step (judged by transformers' forward against the model of the checkpoint
saved at the same step); written in the background under async_save; complete or absent
when the disk fails. In this process, as a world of one (tests/in_process.py); the
multi-process proof (dp 2 x tp 2, gathered from shards) is in tests/test_checkpoint.py."""

from __future__ import annotations

import errno
import time

import pytest
import torch

from meshtrain.training.config import ConfigError
from meshtrain.training.config_loader import load_config
from tests.in_process import refused, tiny_run, train_in_process

transformers = pytest.importorskip("transformers")  # a dev dependency: the judge of the export

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def checkpoint_model(step_dir):
    """Our Llama with the weights of a checkpoint: the training model at that step."""
    from meshtrain.models.llama import Llama
    from meshtrain.training.export import model_tensors, read_model_config

    model = Llama(read_model_config(step_dir))
    model.load_state_dict(dict(model_tensors(step_dir)))
    return model.eval()


def tokens():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def assert_transformers_gives_the_logits_of(hf_dir, step_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        want = checkpoint_model(step_dir)(tokens())
        torch.testing.assert_close(hf(tokens()).logits, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("background", [False, True])
def test_every_nth_and_the_last_step_load_in_transformers_with_that_steps_logits(tmp_path, monkeypatch, background):
    if background:  # a slow disk: the next steps update the weights in place while the files are written
        from meshtrain.models import safetensors_files

        real = safetensors_files.save_file
        monkeypatch.setattr(safetensors_files, "save_file", lambda *a, **kw: (time.sleep(0.5), real(*a, **kw))[1])
    hf = tmp_path / "run" / "hf"
    hf.mkdir(parents=True)
    (hf / ".step-00000002.partial-1").mkdir()  # what a run killed mid-export left: removed
    result = train_in_process(*tiny_run(tmp_path, "run", "--training.steps=5", "--checkpoint.export_hf_interval=2",
                                        f"--checkpoint.async_save={str(background).lower()}"))
    assert result.code == 0, result.stderr[-3000:]
    assert sorted(p.name for p in hf.iterdir()) == ["step-00000002", "step-00000004", "step-00000005"]
    said = [line for line in result.stdout.splitlines() if line.startswith("meshtrain: exported step ")]
    how = "written in the background" if background else "written on the step's path"
    assert len(said) == 3 and all(line.endswith(how) for line in said), result.stdout
    for step in ("step-00000002", "step-00000005"):
        assert_transformers_gives_the_logits_of(hf / step, tmp_path / "run" / "checkpoint" / step)
    with pytest.raises(AssertionError):  # each folder is its own step's model, not the last one's
        assert_transformers_gives_the_logits_of(hf / "step-00000002", tmp_path / "run" / "checkpoint" / "step-00000005")


@pytest.mark.parametrize("background", [False, True])
def test_a_full_disk_leaves_no_half_written_folder_and_stops_with_one_line(tmp_path, monkeypatch, background):
    from meshtrain.models import safetensors_files

    real, calls = safetensors_files.save_file, []

    def second_export_finds_the_disk_full(tensors, path, **kw):
        calls.append(path)
        if len(calls) == 2:
            real(tensors, path, **kw)  # some bytes written, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(tensors, path, **kw)

    monkeypatch.setattr(safetensors_files, "save_file", second_export_finds_the_disk_full)
    result = train_in_process(*tiny_run(tmp_path, "run", "--training.steps=6", "--checkpoint.export_hf_interval=2",
                                        f"--checkpoint.async_save={str(background).lower()}"))
    message = refused(result)
    hf = tmp_path / "run" / "hf"
    assert "[checkpoint] export_hf_interval: cannot write the export" in message, message
    assert "No space left on device" in message and str(hf / "step-00000004") in message, message
    assert sorted(p.name for p in hf.iterdir()) == ["step-00000002"]  # step 4: absent, not half there
    assert_transformers_gives_the_logits_of(hf / "step-00000002", tmp_path / "run" / "checkpoint" / "step-00000002")


def test_a_hugging_face_model_is_exported_as_transformers_holds_it(tmp_path):
    """[model] name = "hf": the folder is that model's own class with the step's weights."""
    from meshtrain.training.export import model_tensors

    result = train_in_process(*tiny_run(tmp_path, "qwen", "--training.steps=2", "--checkpoint.export_hf_interval=2",
                                        config="hf_debug"))
    assert result.code == 0, result.stderr[-3000:]
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qwen" / "hf" / "step-00000002").eval()
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    trained = transformers.AutoModelForCausalLM.from_config(exported.config).eval()
    trained.load_state_dict(dict(model_tensors(tmp_path / "qwen" / "checkpoint" / "step-00000002")))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens()).logits, trained(tokens()).logits, rtol=0, atol=0)


def test_a_file_where_the_folders_go_is_refused_at_start_up(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "hf").write_text("not a folder")
    message = refused(train_in_process(*tiny_run(tmp_path, "run", "--checkpoint.export_hf_interval=2")))
    assert f'[checkpoint] export_hf_interval: "{tmp_path / "run" / "hf"}" is a file' in message, message


def test_a_family_without_a_converter_and_a_pipeline_are_refused_naming_the_key(tmp_path):
    config = tmp_path / "gpt2.toml"
    config.write_text('extends = "gpt2_debug_3d"\n[parallelism]\npp = 1\n[checkpoint]\nexport_hf_interval = 5\n')
    with pytest.raises(ConfigError, match=r'gpt2.toml: \[checkpoint\] export_hf_interval = 5: \[model\] name = "gpt2" '
                                          r"has no Hugging Face converter .* are llama, hf\. Use export_hf_interval = 0"):
        load_config(config)
    with pytest.raises(ConfigError, match=r"command line: --checkpoint\.export_hf_interval=5: export during training "
                                          r"gathers the whole model on rank 0, which a pipeline \(\[parallelism\] pp = 2\)"
                                          r".* meshtrain export STEP_DIR OUT --format hf"):
        load_config("debug_3d", ["--checkpoint.export_hf_interval=5"])
    assert load_config("debug_3d", ["--checkpoint.export_hf_interval=0"]).checkpoint.export_hf_interval == 0
