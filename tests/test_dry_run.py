"""train.py --dry-run: one rank's real step traced on fake tensors at the real world size.
Checked against closed forms: FSDP model state = 16 bytes per held parameter (fp32 param,
fp32 grad, Adam m and v); FSDP traffic = one reduce-scatter of fp32 gradients and two
all-gathers of each block (forward, backward) per micro-batch; TP with sequence parallel = 2 all-gathers
and 2 reduce-scatters per block forward, as many backward."""

import pytest

from meshtrain.training.config_loader import load_config
from meshtrain.planning.dry_run import GiB, dry_run, format_fit
from meshtrain.planning.plan import run as plan_run
from tests.forked_ranks import forked_python


def model_states(report) -> int:
    between = report["memory_between_steps"]
    return between["parameters"] + between["gradients"] + between["optimizer state"]


@pytest.mark.parametrize("world_size", [8, pytest.param(32, marks=pytest.mark.slow),
                                        pytest.param(128, marks=pytest.mark.slow)])
def test_fsdp_model_state_is_16_bytes_per_held_parameter(world_size):
    cfg = load_config("llama3_8b", ["--model.flavor=1B", "--training.seq_len=256", "--training.local_batch_size=1",
                                    f"--training.global_batch_size={world_size}",
                                    "--parallelism.sharding_strategy=FULL_SHARD"])
    report = dry_run(cfg, world_size)
    held = report["parameters"]["held"]
    assert abs(held - report["parameters"]["model"] / world_size) <= 0.01 * held  # evenly sharded
    assert model_states(report) == pytest.approx(16 * held, rel=0.02)


@pytest.mark.slow
def test_llama70b_2d_at_64_ranks_fits_an_h100_and_its_traffic_is_the_closed_form(capsys):
    report = dry_run(load_config("llama70b_2d"), 64, rank=9, gpu="h100-80gb")
    held, accum, dp = report["parameters"]["held"], 4, 8
    assert model_states(report) == pytest.approx(16 * held, rel=0.02)
    assert report["fits"] and 0.2 < report["memory"]["total"] / (80 * GiB) < 0.9
    # Full AC keeps each block's input (Korthikanti's 2sbh: 80 x 2 x 8192 / 8 x 8192 x 2 bytes
    # with sequence parallel) and the loss its fp32 logits (2 x 8192 x 128256 / 8 x 4 bytes).
    kept_inputs, logits = 80 * 2 * 8192 // 8 * 8192 * 2, 2 * 8192 * 128256 // 8 * 4
    assert report["memory"]["activations"] > kept_inputs + logits
    comm = report["comm"]
    _, rs_bytes, _ = comm[("dp_shard", "reduce-scatter")]
    _, ag_bytes, _ = comm[("dp_shard", "all-gather")]
    assert rs_bytes == pytest.approx(accum * 4 * dp * held, rel=0.01)  # fp32 gradients
    assert 0.95 * accum * 2 * 2 * dp * held <= ag_bytes <= accum * 2 * 2 * dp * held * 1.01  # bf16, twice
    out = capsys.readouterr().out
    assert "tp            group of rank 9: ranks [8, 9, 10, 11, 12, 13, 14, 15] on node 1" in out
    assert "fits: peak" in out and "72 GiB usable of 80" in out  # the planner's headroom, named
    assert report["estimate"]["total"] == pytest.approx(report["memory"]["total"], rel=0.10)
    assert "planner's estimate of this layout" in out and "they agree on fits" in out


@pytest.mark.slow
def test_the_dry_run_of_the_planners_pick_agrees_on_fits(tmp_path, capsys):
    # The README's planning command, its pick written as a config, then dry-run: one rule
    # for "fits" (the same headroom) and the planner's estimate beside the traced peak.
    assert plan_run(["--model", "70B", "--nodes", "8", "--gpu", "h100-80gb", "--seq-len", "8192",
                     "--global-batch", "512", "--write", str(tmp_path / "planned.toml")]) == 0
    report = dry_run(load_config(tmp_path / "planned.toml"), 64, gpu="h100-80gb")
    assert report["fits"] and report["estimate"]["fits"]
    assert report["memory"]["total"] <= report["usable"] == pytest.approx(0.9 * 80 * GiB)
    assert "they agree on fits" in capsys.readouterr().out


def test_a_disagreement_on_fits_is_said():
    report = {"memory": {"total": 75 * GiB}, "usable": 72 * GiB, "capacity": 80 * GiB, "gpu": "H100",
              "fits": False, "estimate": {"total": 65 * GiB, "fits": True, "pp_rank": 0, "traced_pp_rank": 0}}
    text = format_fit(report)
    assert "does NOT fit: peak 75.0 GiB, 3.0 GiB over" in text and "+15% from it; they DISAGREE" in text


@pytest.mark.slow
def test_llama70b_2d_at_512_ranks():
    # 4 of its 80 blocks: the mesh, the sharding and the bytes per parameter do not depend
    # on the depth, and each block costs seconds of tracing.
    cfg = load_config("llama70b_2d", ["--training.global_batch_size=512", "--model.n_layers=4"])
    report = dry_run(cfg, 512, rank=0)  # a first rank: uneven shards leave the last ranks a little less
    assert report["parameters"]["held"] == pytest.approx(report["parameters"]["model"] / 512, rel=0.01)
    assert model_states(report) == pytest.approx(16 * report["parameters"]["held"], rel=0.02)


@pytest.mark.slow
def test_llama405b_3d_at_512_ranks_traces_both_stages_of_a_rank():
    # 30 of its 126 blocks (a tracing minute saved): 16 stages of 2 blocks, the first and
    # last of 1, as 126 splits into stages of 8 and two of 7 -- so pp rank 1 stays the
    # fullest, the rank the planner estimates, as at full depth.
    report = dry_run(load_config("llama405b_3d", ["--model.n_layers=30"]), 512, rank=100, gpu="h100-80gb")
    assert [i for i, _ in report["stages"]] == [1, 9]  # pp rank 1: looped placement
    assert report["parameters"]["held"] == pytest.approx(report["parameters"]["stages"] / 64, rel=0.01)
    assert report["memory"]["total"] < 80 * GiB
    count, _, _ = report["comm"][("pp", "send/recv")]
    assert count == 2 * 2 * 2 * 32  # 2 middle stages x (send + recv) x (fwd + bwd) x 32 micro-batches
    # torch's Interleaved1F1B runs the two stages' micro-batches interleaved: at the peak
    # both are gathered in bf16 and both accumulate unsharded fp32 gradients (tracing one
    # stage after the other saw half of that, and 36 GiB in all).
    stages_local = report["parameters"]["stages"] / 8  # after tp 8
    assert report["memory"]["temporaries"] >= 0.98 * 4 * stages_local
    assert report["memory"]["parameters"] >= 2 * stages_local
    # The planner's estimate of this pipeline rank (the 405B point of tests/test_memory_grid.py).
    assert report["estimate"]["pp_rank"] == report["estimate"]["traced_pp_rank"] == 1
    assert report["estimate"]["total"] == pytest.approx(report["memory"]["total"], rel=0.10)


def test_tp_collectives_per_block_match_sequence_parallel(capsys):
    cfg = load_config("debug_2d")  # 4 blocks, dp 2 x tp 2, no activation checkpointing
    report = dry_run(cfg, 4)
    n_layers = 4
    for kind in ("all-gather", "reduce-scatter"):
        count, payload, _ = report["comm"][("tp", kind)]
        # + 2: the embedding's output and the output layer's input change layout too
        assert count == 4 * n_layers + 2


@pytest.mark.parametrize("sequence_parallel, loss_parallel", [(True, True), (True, False), (False, True),
                                                                (False, False)])
def test_without_sequence_or_loss_parallelism_the_estimate_is_the_traced_memory_and_tp_traffic(
        sequence_parallel, loss_parallel):
    """[parallelism] sequence_parallel = false keeps the whole sequence between sub-blocks
    (block inputs and norm inputs full length, all-reduces for the gather/scatter pairs);
    loss_parallel = false gathers the whole vocabulary's logits on every tp rank (one more
    all-gather, the fp32 loss over all of it). The planner's memory and TP bytes sent are
    those of the traced step; the dry run counts a functional all-gather by the gathered
    tensor, not this rank's shard. Fails when the estimate traces its probe with both on
    (up to +83% at 70B tp 8), forgets the logits' gather, or the counter the shard."""
    from meshtrain.physics.gpus import get_gpu
    from meshtrain.planning.estimate import estimate_config

    cfg = load_config("llama3_8b", ["--model.flavor=debug", "--model.vocab_size=8192", "--training.seq_len=512",
                                    "--parallelism.tp=2", "--parallelism.dp_shard=2", "--training.global_batch_size=8",
                                    "--training.local_batch_size=4",
                                    f"--parallelism.sequence_parallel={sequence_parallel}",
                                    f"--parallelism.loss_parallel={loss_parallel}"])
    report = dry_run(cfg, 4, quiet=True)
    e = estimate_config(cfg, 4, 8, get_gpu("h100-80gb"))
    assert report["memory"]["total"] == pytest.approx(e.memory.total, rel=0.03)
    sent = {kind: s for (dim, kind), (_, _, s) in report["comm"].items() if dim == "tp"}
    assert sum(sent.values()) == pytest.approx(e.comm_bytes["tp"], rel=0.01)
    assert ("all-gather" in sent) == (sequence_parallel or not loss_parallel)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_reducing_once_a_step_is_traced_and_estimated_as_it_runs(strategy):
    """[parallelism] gradient_sync = "step", four accumulation micro-batches: the dry run
    traces the first, a middle one and the last (parallel/fsdp.py hold_gradients), so it
    reduce-scatters each unit once a step, not four times, and under SHARD_GRAD_OP gathers
    each once (one more: FSDP2 gathers the head again in the last micro-batch), and its peak
    holds every unit's unsharded fp32 gradient sum. The planner's memory is within 4% of that
    peak and its FSDP bytes are the traced ones, to 1%. Fails when the dry run traces one
    micro-batch for all (the counts), the estimate ignores gradient_sync (-13%), or it
    gathers the embedding and the head as blocks (FULL_SHARD +29%, SHARD_GRAD_OP -12%)."""
    from meshtrain.physics.gpus import get_gpu
    from meshtrain.planning.estimate import estimate_config

    def traced(sync, batch=16):
        cfg = load_config("llama3_8b", ["--model.flavor=debug", "--model.vocab_size=8192", "--training.seq_len=128",
                                        "--parallelism.tp=2", "--parallelism.dp_shard=2",
                                        f"--training.global_batch_size={batch}", "--training.local_batch_size=2",
                                        f"--parallelism.sharding_strategy={strategy}",
                                        f"--parallelism.gradient_sync={sync}"])
        return cfg, dry_run(cfg, 4, quiet=True)

    (_, every), (cfg, once) = traced("microbatch"), traced("step")
    count = lambda report, kind: report["comm"][("dp_shard", kind)][0]
    assert count(every, "reduce-scatter") == 4 * count(once, "reduce-scatter") > 0
    if strategy == "SHARD_GRAD_OP":
        assert count(every, "all-gather") == 4 * (count(once, "all-gather") - 1)
    else:  # FULL_SHARD still re-gathers each block for every backward
        assert count(once, "all-gather") < count(every, "all-gather")
    assert once["memory"]["total"] > every["memory"]["total"]
    e = estimate_config(cfg, 4, 8, get_gpu("h100-80gb"))
    assert e.layout.gradient_sync == "step"
    assert once["memory"]["total"] == pytest.approx(e.memory.total, rel=0.04)
    # The FSDP bytes, unit by unit as traced (planning/step_time.py end_gathers): SHARD_GRAD_OP
    # gathers each unit once and the head once more; FULL_SHARD a block m + 1 times, the
    # embedding each forward, the head twice. Charging every unit as a block, FULL_SHARD's
    # came out 29% high, SHARD_GRAD_OP's 12% low (the head's second gather).
    fsdp_bytes = lambda report: sum(report["comm"][("dp_shard", kind)][2] for kind in ("all-gather", "reduce-scatter"))
    assert e.comm_bytes["dp_shard"] == pytest.approx(fsdp_bytes(once), rel=0.01)
    # One micro-batch a step holds nothing: gathered as reducing every micro-batch (the
    # head's second gather charged there was 12% and 13% too many bytes).
    cfg1, single = traced("step", batch=4)
    assert estimate_config(cfg1, 4, 8, get_gpu("h100-80gb")).comm_bytes["dp_shard"] == pytest.approx(
        fsdp_bytes(single), rel=0.01)


@pytest.mark.parametrize("sync", ["microbatch", "step"])
def test_a_bf16_gradient_reduction_is_traced_and_estimated_at_half_the_bytes(sync):
    """[training] mixed_precision_reduce = "bfloat16" under HSDP (tp 2 x dp_shard 2 x
    dp_replicate 2), four micro-batches: torch's FSDP2, traced, reduce-scatters and
    all-reduces half the bytes of the fp32 reduction and gathers the same; the estimate's
    FSDP bytes over both dimensions are the traced ones to 1% and its memory (the reduce
    buffers, and with gradient_sync = "step" the held sums, in bf16) within 4% of the traced
    peak. Fails when the planner reduces in fp32 whatever the config says (dp_shard +45%
    and +31%, dp_replicate +100%), or holds the reduce buffers and sums in fp32 (the memory
    with gradient_sync = "step", +9%)."""
    from meshtrain.physics.gpus import get_gpu
    from meshtrain.planning.estimate import estimate_config

    def traced(reduce):
        cfg = load_config("llama3_8b", ["--model.flavor=debug", "--model.vocab_size=8192", "--training.seq_len=128",
                                        "--parallelism.tp=2", "--parallelism.dp_shard=2", "--parallelism.dp_replicate=2",
                                        "--parallelism.sharding_strategy=HYBRID_SHARD", "--training.global_batch_size=16",
                                        "--training.local_batch_size=2", f"--parallelism.gradient_sync={sync}",
                                        f"--training.mixed_precision_reduce={reduce}"])
        return cfg, dry_run(cfg, 8, quiet=True)

    (_, fp32), (cfg, bf16) = traced("float32"), traced("bfloat16")
    sent = lambda report, dim, kind: report["comm"][(dim, kind)][2]
    assert sent(bf16, "dp_shard", "reduce-scatter") == sent(fp32, "dp_shard", "reduce-scatter") / 2 > 0
    assert sent(bf16, "dp_replicate", "all-reduce") == sent(fp32, "dp_replicate", "all-reduce") / 2 > 0
    assert sent(bf16, "dp_shard", "all-gather") == sent(fp32, "dp_shard", "all-gather")
    e = estimate_config(cfg, 8, 8, get_gpu("h100-80gb"))
    assert e.comm_bytes["dp_shard"] == pytest.approx(
        sent(bf16, "dp_shard", "all-gather") + sent(bf16, "dp_shard", "reduce-scatter"), rel=0.01)
    assert e.comm_bytes["dp_replicate"] == pytest.approx(sent(bf16, "dp_replicate", "all-reduce"), rel=0.01)
    assert e.memory.total == pytest.approx(bf16["memory"]["total"], rel=0.04)


@pytest.mark.slow
def test_a_hugging_face_model_under_tp_is_estimated_without_sequence_parallelism():
    """Hugging Face TP plans never apply sequence parallelism, and such a model's activations
    come from the closed forms (planning/memory.py), which must then keep the norm and
    block inputs whole: Qwen2.5 7B at tp 4 x dp 2, full recomputation, traced 27.3 GiB,
    estimated 25.7 (+6%); 23.3 (+17%) while the forms assumed sequence parallelism."""
    report = dry_run(load_config("hf_qwen2.5_7b", ["--parallelism.tp=4"]), 8, quiet=True, gpu="h100-80gb")
    assert report["estimate"]["total"] == pytest.approx(report["memory"]["total"], rel=0.10)


def test_gpt2_first_stage_pays_one_tp_collective_pair_per_embedding():
    report = dry_run(load_config("gpt2_debug_3d"), 8, rank=0)  # pp 2 x dp 2 x tp 2: stage 0, layers 0-1
    assert report["stages"] == [(0, [0, 1])]
    assert report["parameters"]["held"] == pytest.approx(report["parameters"]["stages"] / 4, rel=0.01)
    for kind in ("all-gather", "reduce-scatter"):
        count, _, _ = report["comm"][("tp", kind)]
        # 2 micro-batches x (4 per block, forward and backward, + token and position embeddings)
        assert count == 2 * (4 * 2 + 2)


@pytest.mark.slow
def test_a_config_that_cannot_fit_says_by_how_much_and_exits_1():
    proc = forked_python("train.py", "--config", "llama3_8b", "--dry-run", "--world-size", "1", "--gpu", "h100-80gb",
                         "--training.seq_len=512", "--training.global_batch_size=1", "--training.local_batch_size=0",
                         timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "does NOT fit" in proc.stdout and "GiB over" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["AdamW", "Muon"])
def test_the_fake_trace_counts_what_the_same_step_on_real_tensors_allocates(optimizer):
    """The reference for the dry run's memory: the same rank's step on real CPU tensors
    (a fake process group, so no other rank is needed), tracked by the same tracker in
    eager mode, where torch's own rule keeps DTensor's shape propagation out. Under fake
    tensors that rule fails (the propagation reuses our fake mode) and the full-vocabulary
    logits of loss_parallel were counted on every rank: +17 % here, +13 GiB at 70B tp 8."""
    over = ["--model.vocab_size=8192", "--training.seq_len=256",  # tp 2 x dp 2, loss_parallel
            f"--optimizer.name={optimizer}"]  # Muon: its step (gathered matrices) is traced too
    fake = dry_run(load_config("debug_2d", over), 4, quiet=True)
    real = dry_run(load_config("debug_2d", over), 4, fake=False, quiet=True)
    assert fake["memory"]["total"] == pytest.approx(real["memory"]["total"], rel=0.01)
    assert fake["memory"]["activations"] == pytest.approx(real["memory"]["activations"], rel=0.01)


def test_with_document_masking_the_dry_run_counts_the_mask_as_the_real_step_allocates():
    """[training] document_masking: the model builds a [b, 1, s, s] mask from whole-sequence
    positions and SDPA's masked path keeps s x s terms the causal kernel does not. The
    dry run passes positions as training/step.py does, so it counts them: equal to the
    same step on real tensors, and above the unmasked step by more than the mask itself.
    Fails with planning/traced_step.py's packed_inputs returning {} (the masked trace is
    then the unmasked one)."""
    over = ["--model.vocab_size=8192", "--training.seq_len=512", "--training.document_masking=true"]
    fake = dry_run(load_config("debug_2d", over), 4, quiet=True)
    real = dry_run(load_config("debug_2d", over), 4, fake=False, quiet=True)
    causal = dry_run(load_config("debug_2d", over[:-1]), 4, quiet=True)
    assert fake["memory"]["activations"] == pytest.approx(real["memory"]["activations"], rel=0.01)
    local = 8 // 2  # global batch 8 over dp 2
    assert fake["memory"]["activations"] > causal["memory"]["activations"] + local * 512 * 512
    piped = dry_run(load_config("debug_2d", [*over, "--parallelism.pp=2", "--parallelism.tp=1"]), 4, quiet=True)
    assert piped["memory"]["activations"] > 0  # every stage is handed the positions, as the schedule does


@pytest.mark.slow
def test_gpt2_175b_full_ac_holds_the_block_inputs_korthikanti_counts():
    # Korthikanti et al. 2022, full recomputation: each block keeps only its input, 2sbh
    # bytes in bf16, / tp under sequence parallel. GPT-2's categories must show it as
    # activations, as Llama's do (it once read 0.00).
    # 24 of its 96 blocks: the count is per block (at the peak one block's input is already
    # freed, so the depth must keep that within the 5 %).
    cfg = load_config("gpt2_175b", ["--model.n_layers=24"])
    report = dry_run(cfg, 128, gpu="h100-80gb")
    t, s, b, h, layers = 8, cfg.training.seq_len, cfg.training.local_batch_size, 12288, 24
    assert report["memory"]["activations"] == pytest.approx(layers * 2 * s * b * h / t, rel=0.05)
    assert report["fits"] and report["estimate"]["fits"]


def test_lora_keeps_no_gradient_or_adamw_state_for_the_frozen_base_and_the_planner_agrees():
    """[lora]: between steps a rank holds its fp32 shards (4 bytes per held parameter) and,
    for the adapters alone, a gradient and AdamW's two moments; the planner's estimate of
    the peak is within 10% of the trace. (Before the dry run's steady state left frozen
    weights out, their zero gradients were counted: 4 more bytes per parameter.)"""
    from meshtrain.training import recipe

    cfg = load_config("llama3_8b", ["--model.flavor=1B", "--training.seq_len=256", "--training.local_batch_size=1",
                                    "--training.global_batch_size=8", "--parallelism.sharding_strategy=FULL_SHARD",
                                    "--lora.enable=true"])
    report = dry_run(cfg, 8, gpu="h100-80gb")
    adapters = sum(p.numel() for p in recipe.build_model(cfg, 1).parameters() if p.requires_grad) / 8
    held, between = report["parameters"]["held"], report["memory_between_steps"]
    assert 0 < adapters < 0.01 * held
    assert between["parameters"] == pytest.approx(4 * held, rel=0.02)
    assert between["gradients"] == pytest.approx(4 * adapters, rel=0.05)
    assert between["optimizer state"] == pytest.approx(8 * adapters, rel=0.05)
    assert report["estimate"]["total"] == pytest.approx(report["memory"]["total"], rel=0.10)


def test_lora_on_one_gpu_and_on_two_stages_a_rank_is_traced():
    """torch's plain MemTracker (a rank without FSDP, or with several pipeline stages)
    hooks every parameter's gradient, and a frozen one refuses a hook: the dry run of LoRA
    on one GPU, or under an interleaved pipeline, ended in RuntimeError. Between steps on
    one GPU: every weight in fp32 (4 bytes), a gradient and AdamW's two moments for the
    adapters alone, counted here from the model's own trainable parameters."""
    from meshtrain.training import recipe

    cfg = load_config("lora_debug", ["--parallelism.dp_shard=1", "--parallelism.tp=1"])
    between = dry_run(cfg, 1, quiet=True)["memory_between_steps"]
    model = recipe.build_model(cfg, 1)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < adapters < 0.5 * sum(p.numel() for p in model.parameters())
    assert between["gradients"] == pytest.approx(4 * adapters, rel=0.05)
    assert between["optimizer state"] == pytest.approx(8 * adapters, rel=0.05)
    piped = dry_run(load_config("lora_debug", ["--parallelism.pp=2", "--parallelism.tp=1",
                                               "--parallelism.pp_schedule=Interleaved1F1B",
                                               "--parallelism.pp_stages_per_rank=2", "--parallelism.pp_microbatches=4",
                                               "--training.global_batch_size=16"]), 4, 1, quiet=True)
    assert len(piped["stages"]) == 2 and piped["memory_between_steps"]["gradients"] > 0


def test_muon_keeps_one_moment_for_the_hidden_matrices_and_adamws_two_for_the_rest():
    """[optimizer] name = "Muon": between steps the optimizer state is Muon's momentum (4
    bytes) per held hidden-matrix parameter and AdamW's m and v (8 bytes) for the rest."""
    from meshtrain.models import registry
    from meshtrain.training import recipe
    from meshtrain.training.muon import hidden_matrices

    cfg = load_config("llama3_8b", ["--model.flavor=1B", "--training.seq_len=256", "--training.local_batch_size=1",
                                    "--training.global_batch_size=8", "--parallelism.sharding_strategy=FULL_SHARD",
                                    "--optimizer.name=Muon"])
    report = dry_run(cfg, 8, gpu="h100-80gb")
    model = recipe.build_model(cfg, 1)
    hidden = sum(p.numel() for p in hidden_matrices(model, registry.get("llama").output_layer)) / 8
    held = report["parameters"]["held"]
    assert 0.5 * held < hidden < held
    assert report["memory_between_steps"]["optimizer state"] == pytest.approx(4 * hidden + 8 * (held - hidden),
                                                                              rel=0.02)
    # The planner's closed form agrees on the state (not on the step's transients: it has
    # no model of Muon's step, which the CPU trace inflates with gloo's all-gather fallback).
    assert report["estimate"]["optimizer"] == pytest.approx(report["memory_between_steps"]["optimizer state"],
                                                            rel=0.02)


@pytest.mark.parametrize("config, flavor", [("llama3_8b", "8B"), ("gpt2_175b", "124M")])
def test_the_memory_tracker_leaves_fsdps_collectives_as_torch_issues_them(config, flavor, monkeypatch):
    """FSDPMemTracker replaces FSDP's forward hooks with one pair per module; on a unit of
    several modules (Llama's [norm, output], GPT-2's tied embeddings and head) that ended
    the unit after its first module and made the traced step gather the head again in
    backward (planning/fake_world.py grouped_units). The same step traced under torch's
    plain MemTracker, which leaves FSDP's own hooks alone, issues the same collectives."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from meshtrain.planning import dry_run as dry_run_module
    from meshtrain.planning.fake_world import peak_only

    cfg = lambda: load_config(config, ["--model.n_layers=2", "--training.seq_len=128", "--training.local_batch_size=1",
                                       "--training.global_batch_size=16", "--parallelism.sharding_strategy=FULL_SHARD",
                                       "--parallelism.dp_shard=8", "--parallelism.tp=1", f"--model.flavor={flavor}"])
    traced = dry_run(cfg(), 8)["comm"]

    def untouched_hooks(parts, optimizers):
        tracker = peak_only(MemTracker)()
        tracker.track_external(*parts, *optimizers.optimizers)
        return tracker
    monkeypatch.setattr(dry_run_module, "memory_tracker", untouched_hooks)
    assert traced == dry_run(cfg(), 8)["comm"]
