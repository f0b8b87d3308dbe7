"""train.py --dry-run --check-collectives: a rank that would hang its group is found before launch.

The check must pass every shipped config at the world size it is written for, and must
fail on models and schedules planted to hang: a rank that issues one collective more than
its peers, a collective whose shape depends on the rank, a stage that sends what the next
does not expect, stages placed where the schedule does not run them, and a schedule whose
ranks wait on each other."""

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from meshtrain import train
from meshtrain.planning.collective_check import (Call, RankTrace, check_collectives, compare_groups,
                                                 compare_stage_boundaries, coordinates, play_schedule,
                                                 representatives, stands_for)
from meshtrain.planning.schedule import Action
from tests.conftest import ROOT
from meshtrain.training.config_loader import load_config

# Each shipped config at the world size it is written for (its comments and docs say so).
SHIPPED = {"debug_2d": 4, "debug_3d": 8, "gpt2_debug_3d": 8, "hf_debug": 4, "llama3_8b": 8,
           "llama3_8b_128k": 8, "hf_qwen2.5_7b": 8, "llama70b_2d": 64, "gpt2_175b": 128,
           "llama405b_3d": 512, "sft_debug": 4, "moe_debug": 4, "lora_debug": 4, "hf_moe_debug": 4}


def test_every_shipped_config_is_listed():
    assert {p.stem for p in (ROOT / "configs").glob("*.toml")} == set(SHIPPED)


# Stages of alike blocks are traced with three of them (planning/alike_blocks.py), so the
# configs are checked at their real depth (70B's 80 blocks in 3 s); 405B with 18 blocks
# (1-2 a stage, uneven as its 126 are on 16 stages) keeps the test at 9 s instead of 13.
# A Hugging Face model's blocks are traced one by one (its forward slices its ModuleList by
# the config's depth, so none is collapsed): Qwen2.5 7B's 28 took 48 s; 4 of the same
# blocks issue the same per-block sequence (no pipeline stages to place them in).
FEWER_BLOCKS = {"llama405b_3d": 18, "hf_qwen2.5_7b": 4}


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_issues_matching_collectives_on_every_traced_rank(name):
    lines = []
    overrides = [f"--model.n_layers={FEWER_BLOCKS[name]}"] if name in FEWER_BLOCKS else []
    problems = check_collectives(load_config(name, overrides), SHIPPED[name], say=lines.append)
    assert problems == [], "\n".join(lines)
    assert not dist.is_initialized()


def test_representatives_share_every_group_of_rank_zero_at_512_ranks():
    dims = SimpleNamespace(pp=8, dp_replicate=1, dp_shard=8, cp=1, tp=8, world_size=512)
    reps = representatives(dims)
    assert reps[:8] == [0, 64, 128, 192, 256, 320, 384, 448] and len(reps) == 11
    coords = {r: coordinates(dims, r) for r in reps}
    for dim in ("pp", "dp_shard", "tp"):  # another traced rank differs from rank 0 in this coordinate only
        assert any(c[dim] > 0 and all(c[d] == 0 for d in c if d != dim) for c in coords.values()), dim


# The fast check traces one rank per pp coordinate (plus the last of each dimension) and
# derives every other rank from the traced rank of its pp coordinate; tracing every rank
# is the reference. Worlds small enough to trace whole, each with ranks left to derive:
# a pipeline, HSDP (dp_replicate x dp_shard x tp) and expert parallelism.
WHOLE_WORLDS = {"pp2_dp2_tp2": ("debug_3d", 8, []),
                "pp2_dp2_tp2_6_blocks_a_stage": ("debug_3d", 8, ["--model.n_layers=12"]),
                "hsdp2x2_tp2": ("debug_2d", 8, ["--parallelism.dp_replicate=2", "--training.global_batch_size=16"]),
                "ep2_dp4": ("moe_debug", 4, [])}


def _both(name, world, overrides):
    said = []
    fast = check_collectives(load_config(name, overrides), world, say=said.append)
    every = check_collectives(load_config(name, overrides), world, exhaustive=True, say=said.append)
    traced = int(said[0].split("tracing ")[1].split()[0])
    assert "representative ranks" in said[0] and traced < world, said  # some ranks were left to derive
    return fast, every


@pytest.mark.slow
@pytest.mark.parametrize("layout", WHOLE_WORLDS)
def test_the_fast_check_finds_what_tracing_every_rank_finds(layout):
    fast, every = _both(*WHOLE_WORLDS[layout])
    assert fast == every == []


@pytest.mark.slow
def test_a_pipeline_stage_issuing_another_collective_is_found_in_every_group_as_tracing_every_rank_finds(monkeypatch):
    # The last pp coordinate (ranks 4-7 of pp 2 x dp 2 x tp 2) issues one all-reduce more in
    # attention: a rank of one role whose program differs. Ranks 5 and 6 are not traced.
    _plant(monkeypatch, lambda rank: dist.all_reduce(torch.zeros(8)) if rank >= 4 else None)
    fast, every = _both(*WHOLE_WORLDS["pp2_dp2_tp2"])
    assert fast == every, "\n".join(fast + ["-- against --"] + every)
    assert any("group [0, 1, 2, 3, 4, 5, 6, 7]: rank 4 issues 2 more call(s) than rank 0" in p and
               "all-reduce of [8] float32 during the forward of stage 1" in p for p in fast), fast


# A stage of more than three alike blocks is traced with three, the middle one's calls
# repeated for every middle block (planning/alike_blocks.py); tracing every block is the
# reference. One rank of each kind of layout, where the ends of a stage differ most: the
# last pipeline stage (the head, the loss), FULL_SHARD's backward prefetch, no pipeline,
# each activation checkpointing mode, experts, tied embeddings, interleaved stages.
EXPANDED = {
    "pp_last_stage": ("debug_3d", 8, 7, ["--model.n_layers=12"]),
    "pp_full_shard_full_ac": ("debug_3d", 8, 5, ["--model.n_layers=12", "--activation_checkpoint.mode=full",
                                                 "--parallelism.sharding_strategy=FULL_SHARD"]),
    "interleaved": ("debug_3d", 8, 2, ["--model.n_layers=16", "--parallelism.pp_schedule=Interleaved1F1B",
                                       "--parallelism.pp_stages_per_rank=2", "--activation_checkpoint.mode=full"]),
    "no_pipeline_no_ac": ("debug_2d", 4, 1, ["--model.n_layers=7", "--activation_checkpoint.mode=none"]),
    "no_pipeline_op_ac": ("debug_2d", 4, 2, ["--model.n_layers=6", "--activation_checkpoint.mode=op"]),
    "experts": ("moe_debug", 4, 3, ["--model.n_layers=7"]),
    "tied_embeddings": ("gpt2_debug_3d", 8, 6, ["--model.n_layers=10"]),
    # Selective checkpointing wraps every k-th block: units of k blocks are traced and expanded.
    "pp_selective_ac": ("debug_3d", 8, 5, ["--model.n_layers=16", "--activation_checkpoint.mode=selective"]),
    "no_pipeline_selective_every_3": ("debug_2d", 4, 1, ["--model.n_layers=15", "--activation_checkpoint.mode=selective",
                                                         "--activation_checkpoint.selective_every=3"]),
}


def _every_block_and_expanded(monkeypatch, name, world, rank, overrides):
    from meshtrain.planning import collective_check
    from meshtrain.planning.fake_world import one_thread

    collapsed = []
    collapse = collective_check.collapse

    def noted(*args, **kwargs):
        built, tags, real = collapse(*args, **kwargs)
        collapsed.append(real)
        return built, tags, real

    monkeypatch.setattr(collective_check, "collapse", noted)
    with one_thread():
        every, _ = collective_check.trace_rank(load_config(name, overrides), world, rank, 8, every_block=True)
        assert not collapsed
        expanded, _ = collective_check.trace_rank(load_config(name, overrides), world, rank, 8)
    return every, expanded, collapsed[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", EXPANDED)
def test_three_traced_blocks_expanded_issue_what_every_block_issues(monkeypatch, layout):
    every, expanded, collapsed = _every_block_and_expanded(monkeypatch, *EXPANDED[layout])
    assert collapsed and all(n > 3 for n in collapsed.values()), collapsed  # stages were traced with fewer blocks
    assert expanded.labels == every.labels and expanded.stage_io == every.stage_io
    assert expanded.calls == every.calls  # every group's sequence, call for call


@pytest.mark.slow
def test_a_block_unlike_the_others_keeps_its_stage_whole(monkeypatch):
    # Block 4 of the first stage (blocks 0-5) is flagged and issues one all-reduce more: a
    # middle block, which collapsing the stage would leave out. It is traced, as is block
    # 5 after it: only the alike blocks 0-3 before it (and 6-11, the other stage) are
    # collapsed, and the extra call is there as tracing every block has it.
    from meshtrain.models.llama import model as llama

    built = llama.Llama.__init__

    def flag_block_4(self, cfg):
        built(self, cfg)
        self.layers["4"].issues_more = True

    def forward(self, *args, **kwargs):
        if getattr(self, "issues_more", False):
            dist.all_reduce(torch.zeros(3))
        return block_forward(self, *args, **kwargs)

    block_forward = llama.TransformerBlock.forward
    monkeypatch.setattr(llama.Llama, "__init__", flag_block_4)
    monkeypatch.setattr(llama.TransformerBlock, "forward", forward)
    every, expanded, collapsed = _every_block_and_expanded(monkeypatch, "debug_3d", 8, 0, ["--model.n_layers=12"])
    assert list(collapsed) == [(0, 0), (1, 0)], collapsed  # runs: blocks 0-3 | 4 | 5, and 6-11
    assert expanded.calls == every.calls
    assert any(c.shape == (3,) for calls in expanded.calls.values() for c in calls)


def _role_traces(dims, traced, extra_on_stage=None, odd_rank=None):
    """Synthetic traces of a pp x dp world: every rank all-reduces [4] on its dp group and
    a scalar on the whole world (clipping); ``extra_on_stage``'s ranks all-reduce [2] on the
    world first; ``odd_rank`` all-reduces [5] instead of [4]."""
    world, dp = dims.world_size, dims.world_size // dims.pp
    rows, everyone = torch.arange(world).reshape(dims.pp, dp), torch.arange(world).unsqueeze(0)
    out = []
    for rank in traced:
        mine, world_members = tuple(rows[rank // dp].tolist()), tuple(range(world))
        extra = [Call("all-reduce", (2,), "float32", "forward")] if rank // dp == extra_on_stage else []
        calls = {mine: [Call("all-reduce", (5,) if rank == odd_rank else (4,), "float32", "backward")],
                 world_members: extra + [Call("all-reduce", (), "float32", "gradient clipping")]}
        out.append(RankTrace(rank, {}, calls=calls, labels={mine: "dp_shard", world_members: "ppxdp_shard"},
                             partitions={"dp_shard": rows, "ppxdp_shard": everyone}))
    return out


def test_every_group_of_131072_ranks_is_compared_from_six_traces():
    dims = SimpleNamespace(pp=4, dp_replicate=1, dp_shard=32768, cp=1, tp=1, world_size=131072)
    reps = representatives(dims)
    assert len(reps) == 6  # pp coordinates, the last dp_shard rank, the world's last
    assert compare_groups(_role_traces(dims, reps), stands_for(dims, reps)) == []
    # A role (pp coordinate 2, ranks 65536-98303, one traced) issuing one collective more:
    # found in the world's group from its first rank, as tracing every rank would.
    assert compare_groups(_role_traces(dims, reps, extra_on_stage=2), stands_for(dims, reps)) == [
        "ppxdp_shard group [0, 1, 2, 3, ..., 131071] (131072): call #1 differs: rank 0 issues all-reduce of [] "
        "float32 during the gradient clipping; rank 65536 issues all-reduce of [2] float32 during the forward"]
    # The world's last rank (traced) issuing another shape: found in its own dp group only.
    assert compare_groups(_role_traces(dims, reps, odd_rank=131071), stands_for(dims, reps)) == [
        "dp_shard group [98304, 98305, 98306, 98307, ..., 131071] (32768): call #1 differs: rank 98304 issues "
        "all-reduce of [4] float32 during the backward; rank 131071 issues all-reduce of [5] float32 during the backward"]


def test_fsdp_chunks_cut_when_read_are_torchs_chunks():
    """planning/fake_world.py's `_Chunks` stands for FSDP2's `_chunk_with_empty` on the fake
    world: the same chunks, values included, and the same empty ones past the last."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from meshtrain.planning.fake_world import _Chunks

    for shape, n, dim in [((0, 3), 4, 0), ((5, 3), 4, 0), ((5, 3), 8, 0), ((16, 7), 4, 0), ((7, 10), 3, 1),
                          ((1, 1), 64, 0), ((1000, 2), 128, 0)]:
        t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        torchs, ours = _chunk_with_empty(t, n, dim), _Chunks(t, n, dim)
        assert len(ours) == len(torchs) == n
        for i, (a, b) in enumerate(zip(torchs, [ours[j] for j in range(n)])):
            assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset()), (shape, n, i)
            assert torch.equal(a, b), (shape, n, i)


def test_fully_shard_on_the_fake_world_shards_every_parameter_as_torch_does(monkeypatch):
    """The fake world also concatenates each pair of FSDP and TP/EP meshes once: every
    sharded parameter must come out as torch's own path makes it (placements, mesh, local
    shape, strides), for a MoE model whose experts sit on other meshes than the rest (ep 2
    x tp 2), on a rank whose small parameters get empty chunks."""
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from meshtrain.planning.fake_world import init_fake_world
    from meshtrain.planning.traced_step import build_rank

    def shards(world=256, rank=255):
        cfg = load_config("moe_debug", ["--parallelism.dp_shard=-1", "--parallelism.tp=2",
                                        f"--training.global_batch_size={world}"])
        init_fake_world(rank, world)
        try:
            _, _, _, parts = build_rank(cfg, world, 8)
            out = {}
            for _, part in parts:
                for name, p in part.named_parameters():
                    assert isinstance(p, DTensor), name
                    local = p.to_local()
                    out[name] = (p.placements, p.device_mesh.mesh_dim_names, p.device_mesh.mesh.tolist(),
                                 p.device_mesh._dim_group_names, tuple(local.shape), local.stride())
            return out
        finally:
            dist.destroy_process_group()

    fast = shards()
    monkeypatch.setattr(DeviceMesh, "_concatenate", staticmethod(DeviceMesh._concatenate.torchs))
    monkeypatch.setattr(fsdp_param, "_chunk_with_empty", fsdp_param._chunk_with_empty.torchs)
    torchs = shards()
    assert fast == torchs
    assert len({v[1] for v in torchs.values()}) > 1  # parameters on different meshes
    assert any(0 in v[4] for v in torchs.values())  # and empty chunks


def test_derived_ranks_give_what_tracing_every_rank_gives():
    dims = SimpleNamespace(pp=4, dp_replicate=1, dp_shard=4, cp=1, tp=1, world_size=16)
    reps = representatives(dims)
    for extra, odd in ((None, None), (2, None), (0, None), (None, 15), (None, 3), (2, 15), (None, 9), (None, 4)):
        every = compare_groups(_role_traces(dims, range(16), extra, odd), torch.arange(16))
        fast = compare_groups(_role_traces(dims, reps, extra, odd), stands_for(dims, reps))
        if odd in (4, 9):
            # One rank unlike the others of its pp coordinate, where no other rank of that
            # coordinate is traced (9), or it is the one traced for them (4): the limit of
            # deriving ranks from their role, stated in the module's docstring.
            assert every and fast != every, (fast, every)
        else:
            assert fast == every, (extra, odd, fast, every)
    assert every  # the cases above include problems, not only agreement on none


def _plant(monkeypatch, collective):
    """Llama's attention calls ``collective(rank)`` after each forward: the rank-dependent model."""
    from meshtrain.models.llama import model as llama

    original = llama.Attention.forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        collective(dist.get_rank())
        return out

    monkeypatch.setattr(llama.Attention, "forward", forward)


def _run_check(capsys, *argv):
    code = train.run(["--config", "debug_2d", "--dry-run", "--world-size", "4", "--check-collectives", *argv])
    return code, capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("cores", [1, 2])
def test_a_rank_issuing_one_collective_more_is_reported_and_the_run_refused(monkeypatch, capsys, tmp_path, cores):
    # On 2 cores the check runs in a forked process while this one runs the dry run; its
    # verdict and its lines come back, after the dry run's report.
    from meshtrain.planning import collective_check, forked

    def extra_on_odd_tp_ranks(rank):
        if rank % 2 == 1:  # tp is innermost: odd ranks are tp rank 1
            dist.all_reduce(torch.zeros(16))

    _plant(monkeypatch, extra_on_odd_tp_ranks)
    monkeypatch.setattr(forked, "default_jobs", lambda: cores)
    checked, pid = collective_check.check_collectives, tmp_path / "pid"

    def noting_the_process(*args, **kwargs):
        pid.write_text(str(os.getpid()))
        return checked(*args, **kwargs)

    monkeypatch.setattr(collective_check, "check_collectives", noting_the_process)
    with pytest.raises(SystemExit) as stop:
        _run_check(capsys)
    assert stop.value.code == 1
    assert (pid.read_text() == str(os.getpid())) == (cores == 1)
    out = capsys.readouterr().out
    assert out.index("memory of this rank") < out.index("meshtrain collective check: tracing") < out.index("HANG")
    # The whole world is the clipping group: rank 0's first call there is the gradient
    # norm's all-reduce, rank 1's is the planted one.
    assert "HANG: dp_shardxtp group [0, 1, 2, 3]: call #1 differs: rank 0 issues all-reduce of [] float32 " \
           "during the gradient clipping; rank 1 issues all-reduce of [16] float32 during the forward" in out, out


@pytest.mark.slow
def test_a_collective_whose_shape_depends_on_the_rank_is_reported(monkeypatch):
    _plant(monkeypatch, lambda rank: dist.all_reduce(torch.zeros(8 + rank % 2)))
    lines = []
    problems = check_collectives(load_config("debug_2d"), 4, say=lines.append)
    assert problems, lines
    assert "differs: rank 0 issues all-reduce of [8] float32 during the forward" in problems[0], problems
    assert "issues all-reduce of [9] float32" in problems[0], problems


@pytest.mark.slow
def test_without_a_plant_the_same_model_passes(capsys):
    code, out = _run_check(capsys)
    assert code == 0 and "HANG" not in out and "issue the same sequence" in out, out


def test_a_stage_sending_another_shape_than_the_next_receives_is_reported():
    bf16 = torch.bfloat16
    ok = [RankTrace(0, {}, stage_io={0: (((2, 8), torch.long), ((2, 8, 64), bf16))}),
          RankTrace(1, {}, stage_io={1: (((2, 8, 64), bf16), ((2, 8, 256), bf16))})]
    assert compare_stage_boundaries(ok) == []
    ok[1].stage_io[1] = (((2, 4, 64), bf16), ((2, 4, 256), bf16))
    assert "stage 0 sends ((2, 8, 64), torch.bfloat16) but stage 1 is built to receive ((2, 4, 64)" in \
        compare_stage_boundaries(ok)[0]


def _pipeline(schedule, pp, per_rank, n_micro, placement="loop"):
    return SimpleNamespace(stage_layers=[[i] for i in range(pp * per_rank)], pp=pp,
                           pp_schedule=schedule, stages_per_rank=per_rank, pp_microbatches=n_micro,
                           placement=placement)


@pytest.mark.parametrize("schedule,per_rank", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2),
                                               ("LoopedBFS", 2)])
def test_torchs_schedules_play_out_with_our_placement(schedule, per_rank):
    assert play_schedule(_pipeline(schedule, 4, per_rank, 8)) == []


def test_stages_placed_where_the_schedule_does_not_run_them_are_reported():
    problems = play_schedule(_pipeline("Interleaved1F1B", 4, 2, 8, placement="v"))
    assert problems[0] == ("the Interleaved1F1B schedule runs stage(s) [4] on pp rank 0, which holds "
                           "stages [0, 7] (v placement)"), problems


def test_a_schedule_whose_ranks_wait_on_each_other_is_reported(monkeypatch):
    import meshtrain.planning.schedule as schedule

    crossed = [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
               [Action("F", 1, 1), Action("F", 1, 0), Action("B", 1, 0), Action("B", 1, 1)]]
    monkeypatch.setattr(schedule, "rank_actions", lambda *a: crossed)
    problems = play_schedule(_pipeline("1F1B", 2, 1, 2))
    assert problems == ["the 1F1B schedule deadlocks: pp rank 0 at its backward of stage 0, micro-batch 0; "
                        "pp rank 1 at its forward of stage 1, micro-batch 1 wait for each other"]


def test_meshtrain_check_runs_the_collective_check_without_the_dry_runs_memory_trace(capsys):
    from meshtrain import cli

    assert cli.main(["check", "--config", "debug_2d", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "every group's members issue the same sequence" in out, out
    assert "peak" not in out.lower(), out  # the dry run's memory report: `meshtrain dry-run --check-collectives`


def test_ranks_traced_in_forked_processes_give_what_tracing_them_here_gives(monkeypatch):
    # Each traced rank's step is independent of the others: `check_collectives` traces them
    # in one process per core. A child must trace the rank it is given (not the parent's
    # last one) and send back all of it; the pid shows the children really ran them.
    import os

    from meshtrain.planning import collective_check
    from meshtrain.planning.fake_world import one_thread

    traced = collective_check.trace_rank

    def noting_the_process(*args, **kwargs):
        trace, layout = traced(*args, **kwargs)
        trace.pid = os.getpid()
        return trace, layout

    monkeypatch.setattr(collective_check, "trace_rank", noting_the_process)
    cfg, ranks = load_config("debug_3d"), [4, 2, 7]  # pp 2 x dp 2 x tp 2: both stages, three roles
    with one_thread():
        here = collective_check.trace_ranks(cfg, 8, ranks, 8, jobs=1)
        forked = collective_check.trace_ranks(cfg, 8, ranks, 8, jobs=2)
    assert [t.rank for t in forked] == ranks
    assert {t.pid for t in here} == {os.getpid()} and os.getpid() not in {t.pid for t in forked}
    for a, b in zip(here, forked):
        assert (a.coords, a.calls, a.labels, a.stage_io) == (b.coords, b.calls, b.labels, b.stage_io)
        assert a.partitions.keys() == b.partitions.keys()
        assert all(torch.equal(a.partitions[k], b.partitions[k]) for k in a.partitions if a.partitions[k] is not None)
    assert here[0].calls != here[1].calls  # the ranks' traces differ: a child tracing the wrong rank shows
    assert not dist.is_initialized()
