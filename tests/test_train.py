"""train.py end to end: real torchrun, real data, TensorBoard files read back, every
layout training like plain PyTorch on one process (tests/train_oracle.py), and bad input
ending every rank with a message."""


import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from meshtrain.training import recipe
from tests import oracle, train_oracle
from tests.conftest import ROOT, recipe_runs, torchrun
from tests.forked_ranks import forked_python, forked_ranks
from meshtrain.training.config_loader import load_config


def scalars(run_dir, tag):
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


@pytest.mark.slow
def test_debug_2d_trains_on_four_processes_and_writes_tensorboard(tmp_path):
    proc = torchrun("train.py", "--config", "debug_2d", "--training.steps", "10",
                    f"--job.output_dir={tmp_path}", nproc=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "debug_2d"
    losses = scalars(run_dir, "loss")
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses  # from ~6.4 to under 5 on the stdlib
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert {"loss", "lr", "grad_norm", "tokens_per_second"} <= set(acc.Tags()["scalars"])
    assert "step   10 | loss" in proc.stdout


SAVE_LAST = ("--checkpoint.enable=true", "--checkpoint.interval=1000", "--checkpoint.last_save_model_only=true")


def _args(tmp_path, name, *overrides, config="debug_2d"):
    return ["--config", config, "--training.steps", "6", "--training.seq_len", "64",
            f"--job.output_dir={tmp_path}", f"--job.name={name}", *overrides]


def _run(tmp_path, name, nproc, *overrides, config="debug_2d"):
    """Train; return the run folder (TensorBoard files, and the last step's weights with SAVE_LAST)."""
    args = _args(tmp_path, name, *overrides, config=config)
    if nproc == 1:
        proc = forked_python("train.py", *args, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    else:
        proc = forked_ranks("train.py", *args, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp_path / name


def _losses(tmp_path, name, nproc, *overrides, config="debug_2d"):
    return torch.tensor(train_oracle.logged(_run(tmp_path, name, nproc, *overrides, config=config), "loss"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Plain PyTorch on the same config, data and initial weights (tests/train_oracle.py)."""
    return train_oracle.oracle_for(*_args(tmp_path_factory.mktemp("ref"), "ref"), with_unclipped=True)


@pytest.mark.slow
def test_clipping_binds_in_the_debug_config(reference):
    oracle.assert_clipping_binds(reference, "debug_2d")


@pytest.mark.slow
def test_one_process_and_dp2_tp2_with_accumulation_train_like_plain_pytorch(tmp_path, reference):
    # Through train.py: its data, schedule and checkpoint. The other layouts (HSDP, ZeRO-2,
    # NO_SHARD, pipelines) are proven against the same kind of reference in tests/test_parity.py.
    runs = {
        "single": _run(tmp_path, "single", 1, "--parallelism.dp_shard=1", "--parallelism.tp=1", *SAVE_LAST),
        # Gradient accumulation (4 sequences a rank a step: 2 micro-batches of 2) sees the same global batch too.
        "dp2_tp2_accum": _run(tmp_path, "dp2_tp2_accum", 4, "--training.local_batch_size=2", *SAVE_LAST),
    }
    for name, run_dir in runs.items():
        train_oracle.assert_run_matches(run_dir, reference, name)


@pytest.mark.slow
def test_debug_3d_trains_like_plain_pytorch(tmp_path, reference):
    # The shipped 3-D config, pp 2 x dp_shard 2 x tp 2; every pipeline schedule is proven in
    # tests/test_parity.py.
    three_d = _run(tmp_path, "debug_3d", 8, *SAVE_LAST, config="debug_3d")
    train_oracle.assert_run_matches(three_d, reference, "debug_3d")


@pytest.mark.slow
def test_checkpointing_offload_and_chunked_loss_change_no_number_and_bf16_stays_close(tmp_path, reference):
    # Recomputation, offloading and the chunked loss move work and memory, not numbers. The
    # runs share one start-up (tests/workers/recipe_runs.py: train.py's recipe and data).
    runs = recipe_runs(tmp_path, {
        "ac": _args(tmp_path, "ac", "--activation_checkpoint.mode=full",
                    "--parallelism.sharding_strategy=SHARD_GRAD_OP", "--parallelism.cpu_offload=true"),
        "chunked_loss": _args(tmp_path, "chunked_loss", "--training.chunked_loss=true"),
        "bf16": _args(tmp_path, "bf16", "--training.mixed_precision_param=bfloat16"),
        # TP alone has no data-parallel dimension: FSDP runs over a one-rank one for the bf16.
        "bf16_tp": _args(tmp_path, "bf16_tp", "--training.mixed_precision_param=bfloat16",
                         "--parallelism.dp_shard=1", "--parallelism.tp=4"),
    }, nproc=4)
    ac = runs["ac"]
    oracle.assert_matches(ac["losses"], ac["grad_norms"], ac["final"], reference, "ac + cpu offload")
    chunked = runs["chunked_loss"]  # debug_2d: dp 2 x tp 2, the loss on vocab-sharded logits
    assert chunked["loss_function"] == "chunked_cross_entropy" and ac["loss_function"] == "_cross_entropy_fp32"
    oracle.assert_matches(chunked["losses"], chunked["grad_norms"], chunked["final"], reference, "chunked_loss")
    fp32 = torch.tensor(reference.fp32.losses)
    for name in ("bf16", "bf16_tp"):
        run = torch.tensor(runs[name]["losses"], dtype=fp32.dtype)
        # bf16 keeps 8 significant bits (a relative step of 2^-8 = 0.4 %) in every matmul
        # input; the fp32 loss over 4 blocks stays within 1 %.
        torch.testing.assert_close(run, fp32, rtol=1e-2, atol=0)
        assert (run - fp32).abs().max() > 1e-4  # bf16 compute really ran (fp32 layouts agree to ~1e-6)


@pytest.mark.slow
def test_gpt2_with_tied_embeddings_trains_in_pp_x_tp_resumes_in_one_process_and_exports(tmp_path):
    # pp 2 x tp 2 (gpt2_debug_3d with dp_shard 1; its dp 2 x pp x tp layouts are in
    # tests/test_parity.py): the tied weight is one DTensor under TP and a pair of copies
    # on the first and last stage, whose gradients are summed every step.
    one_proc = ("--parallelism.pp=1", "--parallelism.dp_shard=1", "--parallelism.tp=1")
    pp_tp = "--parallelism.dp_shard=1"
    flat = "--lr_scheduler.decay_type=constant"  # the lr of steps 1-6 does not depend on the run's length
    reference = train_oracle.oracle_for(*_args(tmp_path, "ref", flat, config="gpt2_debug_3d"))
    one = _losses(tmp_path, "gpt2_single", 1, *one_proc, flat, "--training.steps=10", config="gpt2_debug_3d")
    three_d = _run(tmp_path, "gpt2_3d", 4, pp_tp, flat, "--checkpoint.enable=true", config="gpt2_debug_3d")
    assert one[-1] < one[0] - 0.5, one
    train_oracle.assert_run_matches(three_d, reference, "gpt2 pp x tp")  # steps 1-6 and the step-6 weights

    # The pipeline's step-6 checkpoint (the embedding on stage 0, its copy on stage 1)
    # resumes as one tied weight in one process, and steps 7-8 continue the same run.
    resumed = _losses(tmp_path, "gpt2_3d", 1, *one_proc, flat, "--checkpoint.enable=true", "--training.steps=8",
                      config="gpt2_debug_3d")
    torch.testing.assert_close(resumed[-2:], one[6:8], rtol=1e-4, atol=0)
    # And back: that one-process step-8 checkpoint (one weight, its optimizer state under
    # wte.weight only) resumes in pp x tp, where the last stage's copy reads wte's state.
    back = _losses(tmp_path, "gpt2_3d", 4, pp_tp, flat, "--checkpoint.enable=true", "--training.steps=10",
                   config="gpt2_debug_3d")
    torch.testing.assert_close(back[-2:], one[8:10], rtol=1e-4, atol=0)

    from meshtrain.models.gpt2 import GPT2
    from meshtrain.training.export import export

    step6 = tmp_path / "gpt2_3d" / "checkpoint" / "step-00000006"
    export(step6, tmp_path / "gpt2.pt", "torch")
    state = torch.load(tmp_path / "gpt2.pt")
    assert state["wte.weight"].data_ptr() == state["lm_head.weight"].data_ptr()  # one tensor, stored once
    model = GPT2.from_flavor("debug", vocab_size=state["wte.weight"].shape[0])
    model.load_state_dict(state)  # strict: every name, nothing extra
    with pytest.raises(ValueError, match="Hugging Face export is for Llama"):
        export(step6, tmp_path / "hf", "hf")


def _train_cli(*args):
    return forked_python("train.py", *args, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["--config", "debug_2d", "--parallelism.tensor_paralel", "2"], "Did you mean 'tp'"),
    (["--config", "debug_2d", "--training.steps", "ten"], "must be an integer"),
    (["--config", "no_such_config"], "debug_2d"),
    (["--config", "debug_2d", "--parallelism.tp=3", "--parallelism.dp_shard=1"], "world size is 1"),
    (["--config", "debug_2d", "--parallelism.tp=1", "--parallelism.dp_shard=1",
      "--model.vocab_size=100"], "smaller than the tokenizer"),
    (["--config", "debug_2d", "--parallelism.tp=1", "--parallelism.dp_shard=1",
      "--training.global_batch_size=8", "--training.local_batch_size=3"], "local_batch_size"),
])
def test_bad_input_exits_2_with_a_message_and_no_traceback(args, message):
    proc = _train_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_bug_in_meshtrain_shows_its_traceback_and_is_not_called_bad_input(tmp_path):
    """Only meshtrain's own error types mean bad input (exit 2, one line). A ValueError from
    inside the code -- here planted in the loss -- is a bug: traceback, exit 1."""
    code = ("import sys\nfrom meshtrain import train\nimport meshtrain.training.step as s\n"
            "def broken(*a, **k):\n    raise ValueError('planted bug')\n"
            "s.summed_cross_entropy = broken\n"
            "sys.exit(train.run(sys.argv[1:]))")
    proc = forked_python("-c", code, "--config", "debug_2d", "--parallelism.dp_shard=1", "--parallelism.tp=1",
                         "--training.steps=1", f"--job.output_dir={tmp_path}", timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" in proc.stderr and "planted bug" in proc.stderr
    assert "meshtrain: error" not in proc.stderr


@pytest.mark.slow
def test_impossible_layout_stops_every_rank_before_the_process_group(tmp_path):
    proc = torchrun("train.py", "--config", "debug_2d", "--parallelism.tp=3", nproc=4, timeout=120)
    assert proc.returncode != 0
    assert "pp*dp_replicate*dp_shard*tp = 1*1*2*3 = 6, but the world size is 4" in proc.stderr
    assert 'train.py", line' not in proc.stderr  # torchrun's own summary may follow; ours has no traceback


@pytest.mark.slow
def test_bad_pipeline_config_stops_every_rank_with_the_reason(tmp_path):
    proc = torchrun("train.py", "--config", "debug_2d", "--parallelism.pp=2", "--parallelism.tp=1",
                    "--parallelism.pp_microbatches=3", nproc=4, timeout=120)
    assert proc.returncode != 0
    assert "pp_microbatches = 3 must divide the sequences each pipeline runs per forward (local batch 4)" in proc.stderr
    assert 'train.py", line' not in proc.stderr


@pytest.mark.slow
def test_print_config_shows_merged_values():
    proc = _train_cli("--config", "debug_2d", "--parallelism.tp", "1", "--print-config")
    assert proc.returncode == 0
    assert "[parallelism]" in proc.stdout and "tp = 1" in proc.stdout


def test_llama70b_2d_config_builds_its_mesh_at_64_ranks(fake_world):
    cfg = load_config(ROOT / "configs" / "llama70b_2d.toml")
    fake_world(64, rank=9)
    cfg.job.device = "cpu"  # same layout checks; no GPU in CI
    model = recipe.build_model(cfg, tokenizer_vocab=258)
    layout = recipe.plan_layout(cfg, model, world_size=64)
    assert (layout.dp_shard, layout.tp) == (8, 8)
    mesh = layout.build_mesh("cpu")
    assert mesh.mesh_dim_names == ("dp_shard", "tp")
    assert mesh["tp"].mesh.tolist() == list(range(8, 16))  # rank 9's node
    model = recipe.parallelize_part(model, mesh, cfg, layout)
    assert sum(p.numel() for p in model.parameters()) > 70e9


def test_gpt2_175b_config_shards_its_tied_weight_once_at_128_ranks(fake_world):
    from torch.distributed.tensor import Shard

    cfg = load_config(ROOT / "configs" / "gpt2_175b.toml")
    cfg.job.device = "cpu"
    fake_world(128, rank=0)
    model = recipe.build_model(cfg, tokenizer_vocab=258)
    layout = recipe.plan_layout(cfg, model, world_size=128)
    assert 174e9 < sum(p.numel() for p in model.parameters()) < 175e9  # the tied weight counted once
    model = recipe.parallelize_part(model, layout.build_mesh("cpu"), cfg, layout)
    wte = model.wte.weight
    assert model.lm_head.weight is wte  # still one weight after TP and FSDP
    assert wte.placements[-1] == Shard(0) and wte.to_local().shape == (50304 // 128, 12288)


