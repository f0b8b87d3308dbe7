"""Context parallelism (Ulysses all-to-all attention): every layout trains like plain
PyTorch on one process (tests/train_oracle.py, tests/oracle.py), through the recipe
train.py uses and through train.py itself; what cannot split is refused before any
process group; and the all-to-all bytes the dry run counts match the closed form."""

from __future__ import annotations

import math

import pytest

from meshtrain.parallel.context_parallel import kv_repeats
from tests import oracle, train_oracle
from tests.conftest import dry_run_refusal, recipe_runs
from tests.forked_ranks import forked_python, forked_ranks

TRAIN = ["--training.steps=4", "--training.seq_len=64", "--training.global_batch_size=8",
         "--training.max_norm=0.1", "--optimizer.lr=3e-3"]
# name -> (config, processes, layout flags). The debug Llama has 8 heads and 4 kv heads.
LAYOUTS = {
    "cp2": ("debug_2d", 2, ["--parallelism.cp=2", "--parallelism.dp_shard=1", "--parallelism.tp=1"]),
    "cp4": ("debug_2d", 4, ["--parallelism.cp=4", "--parallelism.dp_shard=1", "--parallelism.tp=1"]),
    "cp2_tp2": ("debug_2d", 4, ["--parallelism.cp=2", "--parallelism.dp_shard=1", "--parallelism.tp=2"]),
    "cp2_dp2": ("debug_2d", 4, ["--parallelism.cp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1"]),
    "cp2_hsdp": ("debug_2d", 4, ["--parallelism.cp=2", "--parallelism.dp_replicate=2", "--parallelism.dp_shard=1",
                                 "--parallelism.tp=1", "--parallelism.sharding_strategy=HYBRID_SHARD"]),
    "cp2_no_shard": ("debug_2d", 4, ["--parallelism.cp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1",
                                     "--parallelism.sharding_strategy=NO_SHARD"]),
    # Full activation checkpointing: the recomputed forward exchanges again.
    "cp2_dp2_ac": ("debug_2d", 4, ["--parallelism.cp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1",
                                   "--activation_checkpoint.mode=full"]),
    "pp2_cp2": ("debug_2d", 4, ["--parallelism.pp=2", "--parallelism.cp=2", "--parallelism.dp_shard=1",
                                "--parallelism.tp=1"]),
    # Two kv heads over tp 2: one a TP rank, split over cp 2: fewer than cp, so each is repeated twice.
    "gqa_cp2_tp2": ("debug_2d", 4, ["--model.n_kv_heads=2", "--parallelism.cp=2", "--parallelism.dp_shard=1",
                                    "--parallelism.tp=2"]),
    # GPT-2's learned positions: each rank looks up its own piece's positions.
    "gpt2_cp2_tp2": ("gpt2_debug_3d", 4, ["--parallelism.cp=2", "--parallelism.dp_shard=1", "--parallelism.tp=2",
                                          "--parallelism.pp=1"]),
}


def argv(name: str, out) -> list[str]:
    config, _, flags = LAYOUTS[name]
    return ["--config", config, *TRAIN, *flags, f"--job.output_dir={out}", f"--job.name={name}"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    got = {}
    for nproc in sorted({n for _, n, _ in LAYOUTS.values()}):
        runs = {name: argv(name, root / "out") for name, (_, n, _) in LAYOUTS.items() if n == nproc}
        got.update(recipe_runs(root, runs, nproc=nproc, timeout=900))
    return got


def model_of(name: str) -> tuple:
    """What the one-process reference of a layout depends on: its config and model flags."""
    config, _, flags = LAYOUTS[name]
    return config, *[f for f in flags if f.startswith("--model.")]


@pytest.fixture(scope="module")
def oracles(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_ref")
    one = ["--parallelism.cp=1", "--parallelism.dp_shard=1", "--parallelism.tp=1", "--parallelism.pp=1"]
    first = {}
    for name in LAYOUTS:
        first.setdefault(model_of(name), name)
    return {model: train_oracle.oracle_for(*argv(name, root), *one, with_unclipped=True)
            for model, name in first.items()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_layout_trains_like_plain_pytorch(results, oracles, layout):
    reference = oracles[model_of(layout)]
    oracle.assert_clipping_binds(reference, layout)
    got = results[layout]
    oracle.assert_matches(got["losses"], got["grad_norms"], got["final"], reference, layout)


@pytest.mark.parametrize("q_heads,kv_heads,cp", [(8, 4, 2), (8, 2, 4), (4, 1, 4), (8, 1, 2), (6, 2, 3), (12, 4, 6),
                                                 (4, 2, 4), (16, 4, 8), (8, 8, 4)])
def test_each_rank_receives_the_kv_heads_its_query_heads_read(q_heads, kv_heads, cp):
    """After repeating kv heads `kv_repeats` times and splitting both over cp ranks, each
    rank's query head i, read by SDPA's grouping on that rank, meets the kv head it reads
    in one process: head (global index) // (q_heads / kv_heads)."""
    repeats = kv_repeats(q_heads, kv_heads, cp)
    expanded = [h for h in range(kv_heads) for _ in range(repeats)]  # repeat_interleave
    assert len(expanded) % cp == 0
    q_per, kv_per = q_heads // cp, len(expanded) // cp
    assert q_per % kv_per == 0, "SDPA's grouped-query attention needs whole groups on each rank"
    for rank in range(cp):
        mine = expanded[rank * kv_per:(rank + 1) * kv_per]
        for i in range(q_per):
            assert mine[i // (q_per // kv_per)] == (rank * q_per + i) // (q_heads // kv_heads)
    assert repeats <= q_heads // kv_heads


@pytest.mark.slow
def test_train_py_cp2_tp2_gives_the_one_process_losses(tmp_path):
    """The issue's command: torchrun --nproc-per-node 4 train.py --config debug_2d
    --parallelism.cp 2 --parallelism.tp 2 --parallelism.dp_shard 1."""
    common = ["--config", "debug_2d", "--training.steps=4", "--training.seq_len=64", f"--job.output_dir={tmp_path}"]
    proc = forked_ranks("train.py", *common, "--job.name=cp", "--parallelism.cp", "2", "--parallelism.tp", "2",
                    "--parallelism.dp_shard", "1", nproc=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one = forked_python("train.py", *common, "--job.name=one", "--parallelism.tp=1", "--parallelism.dp_shard=1")
    assert one.returncode == 0, one.stderr[-4000:]
    got, want = (train_oracle.logged(tmp_path / n, "loss") for n in ("cp", "one"))
    assert len(got) == 4 and all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(got, want)), (got, want)


# ---- refused before any process group ----

def _refusal(tmp_path, *args: str) -> str:
    return dry_run_refusal("--config", "debug_2d", f"--job.output_dir={tmp_path}", *args)


def test_what_cp_cannot_split_is_refused_with_the_arithmetic(tmp_path):
    message = _refusal(tmp_path, "--world-size", "16", "--parallelism.cp=4", "--parallelism.tp=4",
                       "--parallelism.dp_shard=1")
    assert "[parallelism] cp = 4: heads (8) are not divisible by tp*cp = 4*4 = 16" in message
    message = _refusal(tmp_path, "--world-size", "8", "--parallelism.cp=4", "--parallelism.tp=2",
                       "--parallelism.dp_shard=1", "--training.seq_len=100")
    assert "seq_len = 100 is not divisible by cp*tp = 4*2 (sequence parallel splits each piece again)" in message
    message = _refusal(tmp_path, "--world-size", "3", "--parallelism.cp=3", "--parallelism.tp=1",
                       "--parallelism.dp_shard=1")
    assert "heads (8) are not divisible by tp*cp = 1*3 = 3" in message
    message = _refusal(tmp_path, "--world-size", "4", "--parallelism.cp=4", "--parallelism.dp_shard=2")
    assert "pp*dp_replicate*dp_shard*cp*tp = 1*1*2*4*2 = 16" in message


@pytest.mark.slow
def test_dry_run_of_the_128k_config_counts_the_closed_form_all_to_all_bytes():
    """llama3_8b_128k at 8 ranks (cp 4 x tp 2): each of 32 layers exchanges q, k, v and the
    output -- [1, 131072/4, heads/2, 128] bf16 for q and the output, kv heads/2 for k and
    v -- once in forward, once in the recomputed forward (full AC) and once in backward."""
    from meshtrain.planning.dry_run import dry_run
    from meshtrain.training.config_loader import load_config

    cfg = load_config("llama3_8b_128k")
    report = dry_run(cfg, world_size=8, rank=0, gpus_per_node=8, gpu="h100-80gb", quiet=True)
    count, payload, sent = report["comm"][("cp", "all-to-all")]
    layers, heads, kv_heads, head_dim, tp, cp = 32, 32, 8, 128, 2, 4
    per_layer = 1 * (131072 // cp) * head_dim * 2 * (2 * heads // tp + 2 * kv_heads // tp)  # bytes
    assert count == 32 * 4 * 3
    assert payload == layers * 3 * per_layer
    assert sent == payload * (cp - 1) / cp
    assert report["fits"], report["memory"]["total"] / 2**30
    # The planner's formulas (planning/memory.py, planning/step_time.py) count the same bytes, and memory near the trace.
    from meshtrain.planning.estimate import estimate_config
    from meshtrain.physics.gpus import get_gpu

    e = estimate_config(cfg, 8, 8, get_gpu("h100-80gb"))
    assert math.isclose(e.comm_bytes["cp"], sent, rel_tol=1e-9), (e.comm_bytes["cp"], sent)
    traced = report["memory"]["total"]
    assert abs(e.memory.total - traced) <= 0.10 * traced, (e.memory.total / 2**30, traced / 2**30)


def _losses_printed(stdout: str) -> dict[int, float]:
    import re

    return {int(m[1]): float(m[2]) for m in re.finditer(r"step\s+(\d+) \| loss ([\d.]+)", stdout)}


@pytest.mark.slow
def test_a_checkpoint_saved_at_cp2_resumes_at_cp1_and_back(tmp_path):
    """Checkpoints do not depend on cp (FSDP over dp_shard x cp, DCP reshards): cp 2 saves
    steps 2, 4, 6; one process resumes from step 2, and cp 2 again from that run's step 4;
    both continue with the losses of the uninterrupted run."""
    import shutil

    common = ["--config", "debug_2d", "--training.steps=6", "--training.seq_len=64", "--checkpoint.enable=true",
              "--checkpoint.interval=2", "--job.name=run", "--parallelism.tp=1", "--parallelism.dp_shard=1"]
    a = forked_ranks("train.py", *common, f"--job.output_dir={tmp_path / 'a'}", "--parallelism.cp=2", nproc=2)
    assert a.returncode == 0, a.stderr[-4000:]
    want = _losses_printed(a.stdout)
    assert sorted(want) == [1, 2, 3, 4, 5, 6]

    def resume_from(source, step, folder, *launch):
        shutil.copytree(tmp_path / source, tmp_path / folder)
        for later in (tmp_path / folder / "run" / "checkpoint").glob("step-*"):
            if int(later.name[5:]) > step:
                shutil.rmtree(later)
        args = [*common, f"--job.output_dir={tmp_path / folder}"]
        if launch:
            return forked_ranks("train.py", *args, *launch, nproc=2)
        return forked_python("train.py", *args)

    b = resume_from("a", 2, "b")  # cp 2 -> one process
    assert b.returncode == 0 and "resumed at step 2" in b.stdout, b.stderr[-4000:]
    c = resume_from("b", 4, "c", "--parallelism.cp=2")  # one process -> cp 2
    assert c.returncode == 0 and "resumed at step 4" in c.stdout, c.stderr[-4000:]
    got = {**_losses_printed(b.stdout), **_losses_printed(c.stdout)}
    assert sorted(_losses_printed(b.stdout)) == [3, 4, 5, 6] and sorted(_losses_printed(c.stdout)) == [5, 6]
    for step in (3, 4, 5, 6):
        assert math.isclose(got[step], want[step], rel_tol=1e-4), (step, got, want)


def test_a_hugging_face_model_refuses_cp_naming_why(tmp_path):
    message = dry_run_refusal("--config", "hf_debug", "--world-size", "4", "--parallelism.cp=2", "--parallelism.tp=1",
                              "--parallelism.dp_shard=2", f"--job.output_dir={tmp_path}")
    assert "cannot split the sequence" in message and "use cp = 1" in message


@pytest.mark.slow
def test_the_planner_tries_cp_for_long_sequences_only_and_writes_it(tmp_path):
    from meshtrain.physics.gpus import get_gpu
    from meshtrain.planning.plan import resolve_model
    from meshtrain.planning.report import to_toml
    from meshtrain.planning.search import candidates, plan
    from meshtrain.planning.shape import Job
    from meshtrain.training.config_loader import load_config

    job = Job(resolve_model("8B"), get_gpu("h100-80gb"), nodes=1, gpus_per_node=8, seq_len=131072, global_batch=1)
    fitting, _, _ = plan(job)
    assert fitting and all(e.layout.cp > 1 for e in fitting)  # one sequence of 128K: no layout without cp fits
    path = tmp_path / "best.toml"
    path.write_text(to_toml(fitting[0], job, "best", "test"))
    cfg = load_config(path)
    assert cfg.parallelism.cp == fitting[0].layout.cp and cfg.training.seq_len == 131072
    # plan() estimates only what candidates() offers: at 8K no layout it offers has cp (the
    # estimates of the short job, each an activation trace, would add nothing to that).
    short = Job(resolve_model("8B"), get_gpu("h100-80gb"), nodes=1, gpus_per_node=8, seq_len=8192, global_batch=16)
    offered = list(candidates(short))
    assert offered and all(lay.cp == 1 for lay in offered)
