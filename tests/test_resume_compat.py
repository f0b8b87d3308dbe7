"""What a resume compares with the checkpoint's model config: what defines the model, not
library metadata. A checkpoint written under another transformers version (model_config.json
differs only in transformers_version, the download's dtype, a key the library added)
resumes; a real difference is refused, naming it, and resumes with if_config_differs =
"resume" (before: refused in both cases, so a transformers upgrade stranded every run)."""

from __future__ import annotations

import json

from tests.in_process import refused, tiny_run, train_in_process


def test_library_metadata_and_one_sided_keys_are_no_difference():
    from meshtrain.training.resume_compat import model_differences

    saved = {"dim": 64, "hf": {"model_type": "qwen2", "transformers_version": "4.57.1", "dtype": "bfloat16",
                               "rms_norm_eps": 1e-6, "rope_theta": 10000.0}}
    now = {"dim": 64, "hf": {"model_type": "qwen2", "transformers_version": "5.2.0", "dtype": "float32",
                             "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default"}}}
    assert model_differences(saved, now) == []
    now["hf"]["rms_norm_eps"], now["dim"] = 1e-5, 128
    assert model_differences(saved, now) == ["dim: checkpoint 64 vs this run 128",
                                             "hf.rms_norm_eps: checkpoint 1e-06 vs this run 1e-05"]


def _edit_model_config(tmp_path, **hf):
    """As if every checkpoint so far had been written with ``hf`` in the model's config."""
    for path in (tmp_path / "hf_run" / "checkpoint").glob("step-*/model_config.json"):
        saved = json.loads(path.read_text())
        saved["hf"].update(hf)
        path.write_text(json.dumps(saved))


def test_a_checkpoint_written_under_another_transformers_version_resumes(tmp_path):
    run = lambda steps, *more: train_in_process(*tiny_run(tmp_path, "hf_run", f"--training.steps={steps}", *more,
                                                          config="hf_debug"))
    first = run(1)
    assert first.code == 0, first.stderr[-3000:]
    _edit_model_config(tmp_path, transformers_version="4.57.1", dtype="bfloat16", a_key_it_added_since=True)
    resumed = run(2)
    assert resumed.code == 0 and "resumed at step 1" in resumed.stdout, resumed.stderr[-3000:]

    _edit_model_config(tmp_path, rms_norm_eps=0.5)  # a real difference: refused, then resumed when told
    message = refused(run(3))
    assert "is of another model (hf.rms_norm_eps: checkpoint 0.5 vs this run 1e-06)" in message, message
    assert 'if_config_differs = "resume"' in message
    told = run(3, "--checkpoint.if_config_differs=resume")
    assert told.code == 0 and "resumed at step 2" in told.stdout, told.stderr[-3000:]
