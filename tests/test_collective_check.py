"""train.py --dry-run --check-collectives: a rank that would hang its group is found before launch.

The check must pass every shipped config at the world size it is written for, and must
fail on models and schedules planted to hang: a rank that issues one collective more than
its peers, a collective whose shape depends on the rank, a stage that sends what the next
does not expect, stages placed where the schedule does not run them, and a schedule whose
ranks wait on each other."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from meshtrain import train
from meshtrain.planning.collective_check import (RankTrace, check_collectives, compare_stage_boundaries,
                                       coordinates, play_schedule, representatives)
from meshtrain.planning.schedule import Action
from tests.conftest import ROOT
from meshtrain.training.config_loader import load_config

# Each shipped config at the world size it is written for (its comments and docs say so).
SHIPPED = {"debug_2d": 4, "debug_3d": 8, "gpt2_debug_3d": 8, "hf_debug": 4, "llama3_8b": 8,
           "llama3_8b_128k": 8, "hf_qwen2.5_7b": 8, "llama70b_2d": 64, "gpt2_175b": 128,
           "llama405b_3d": 512, "sft_debug": 4, "moe_debug": 4, "lora_debug": 4, "hf_moe_debug": 4}


def test_every_shipped_config_is_listed():
    assert {p.stem for p in (ROOT / "configs").glob("*.toml")} == set(SHIPPED)


# Every block of a model issues the same collectives, so a hang shows in a few blocks as
# well as in all of them: the full-size configs are traced with fewer blocks (their
# layout, world size and widths unchanged) -- the trace costs a block at a time. 405B
# keeps an uneven split (18 blocks on its 16 stages, as 126 is) so stages differ in length.
FEWER_BLOCKS = {"llama70b_2d": 4, "gpt2_175b": 4, "llama3_8b": 4, "llama3_8b_128k": 4, "llama405b_3d": 18}


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
def test_a_rank_issuing_one_collective_more_is_reported_and_the_run_refused(monkeypatch, capsys):
    def extra_on_odd_tp_ranks(rank):
        if rank % 2 == 1:  # tp is innermost: odd ranks are tp rank 1
            dist.all_reduce(torch.zeros(16))

    _plant(monkeypatch, extra_on_odd_tp_ranks)
    with pytest.raises(SystemExit) as stop:
        _run_check(capsys)
    assert stop.value.code == 1
    out = capsys.readouterr().out
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


def test_check_collectives_needs_a_dry_run(capsys):
    assert train.run(["--config", "debug_2d", "--check-collectives"]) == 2
    assert "--check-collectives runs on the fake process group of a dry run" in capsys.readouterr().err
