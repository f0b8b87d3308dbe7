"""Stage splitting, stage placement and pipeline config checks: pure arithmetic, plus the
405B config built at its real world size on the fake process group."""

import pytest
import torch
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from meshtrain.training import recipe
from meshtrain.models.llama import Llama
from meshtrain.parallel import LayoutError, submesh
from meshtrain.parallel.pipeline import SCHEDULES, check_pipeline, split_into_stages, split_layers, stage_ids
from tests.conftest import ROOT
from meshtrain.training.config_loader import load_config


def test_thirty_layers_on_four_stages_put_the_extra_layers_in_the_middle():
    stages = split_layers(30, 4)
    assert [len(s) for s in stages] == [7, 8, 8, 7]
    assert sum(stages, []) == list(range(30))


@pytest.mark.parametrize("n_layers", [1, 4, 7, 30, 80, 126])
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4, 8, 16])
def test_every_layer_lands_in_exactly_one_stage_in_order(n_layers, n_stages):
    if n_stages > n_layers:
        with pytest.raises(LayoutError, match="at least one layer"):
            split_layers(n_layers, n_stages)
        return
    stages = split_layers(n_layers, n_stages)
    assert len(stages) == n_stages and all(stages)
    assert sum(stages, []) == list(range(n_layers))
    assert max(map(len, stages)) - min(map(len, stages)) <= 1


def test_explicit_split_points_and_layers_per_stage():
    assert split_layers(8, 3, split_points=[2, 5]) == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert split_layers(10, 0, layers_per_stage=4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    for bad in ([0, 4], [4, 2], [3, 3], [8]):
        with pytest.raises(LayoutError, match="increasing layer indices"):
            split_layers(8, 2, split_points=bad)


@pytest.mark.parametrize("pp,per_rank", [(2, 2), (4, 2), (8, 2), (4, 3)])
@pytest.mark.parametrize("style", ["loop", "v"])
def test_stage_placement_matches_torch_for_looped_and_v_schedules(pp, per_rank, style):
    if style == "v" and per_rank != 2:
        return
    want = generate_stage_to_rank_mapping(pp, pp * per_rank, style=style)
    for rank in range(pp):
        assert stage_ids(rank, pp, pp * per_rank, style) == sorted(s for s, r in want.items() if r == rank)


def test_v_shape_puts_first_and_last_stage_on_rank_zero():
    assert stage_ids(0, 4, 8, "v") == [0, 7]
    assert stage_ids(3, 4, 8, "v") == [3, 4]


@pytest.mark.parametrize("kwargs,message", [
    (dict(schedule="1F1B", stages_per_rank=2), "runs one stage per rank"),
    (dict(schedule="ZBVZeroBubble", stages_per_rank=3), "exactly 2 stages per rank"),
    (dict(schedule="1F1B", n_microbatches=1), "at least as many micro-batches as stages"),
    (dict(schedule="GPipe", n_microbatches=3), "must divide"),
    (dict(schedule="Interleaved1F1B", stages_per_rank=2, n_microbatches=9, local_batch=9, pp=4, n_layers=8),
     "must be a multiple of 2"),
    (dict(schedule="1F1B", pp=8), "at least one layer"),
    (dict(schedule="1F1B", split_points=[1, 2]), "the split gives 3 stages"),
    (dict(schedule="NoSuch"), "accepted: GPipe"),
])
def test_impossible_pipelines_are_layout_errors(kwargs, message):
    args = {**dict(pp=2, n_layers=4, stages_per_rank=1, n_microbatches=2, local_batch=4), **kwargs}
    with pytest.raises(LayoutError, match=message):
        check_pipeline(**args)


@pytest.mark.parametrize("override,message", [
    ("--parallelism.pp_microbatches=3", "pp_microbatches = 3 must divide"),
    ("--parallelism.pp_stages_per_rank=2", "1F1B runs one stage per rank"),
    ("--parallelism.pp_split_points=1,2", "the split gives 3 stages"),
])
def test_bad_pipeline_configs_name_the_setting_before_any_process_group(override, message):
    cfg = load_config("debug_3d", [override])
    with pytest.raises(LayoutError, match=message) as err:
        recipe.plan_layout(cfg, recipe.build_model(cfg, tokenizer_vocab=258), world_size=8)
    assert 'pp_schedule = "1F1B"' in str(err.value)


@pytest.mark.parametrize("rank", [0, 9, 200, 511])
def test_llama405b_3d_builds_at_512_ranks_with_each_stage_on_its_ranks(fake_world, rank):
    cfg = load_config(ROOT / "configs" / "llama405b_3d.toml")
    cfg.job.device = "cpu"  # the same layout checks; CI has no GPU
    fake_world(512, rank=rank)
    model = recipe.build_model(cfg, tokenizer_vocab=258)
    layout = recipe.plan_layout(cfg, model, world_size=512)
    dims, layers = layout, layout.stage_layers
    assert (dims.pp, dims.dp_shard, dims.tp) == (8, 8, 8)
    assert len(layers) == 16 and sum(layers, []) == list(range(126))
    mesh = dims.build_mesh("cpu")
    pp_mesh = submesh(mesh, "pp")
    pp_rank = rank // 64  # pp is outermost: 64 consecutive ranks (8 nodes) per pipeline rank
    assert pp_mesh.get_local_rank() == pp_rank
    parts = split_into_stages(model, pp_mesh, layers, style=SCHEDULES[cfg.parallelism.pp_schedule][1])
    assert [i for i, _ in parts] == [pp_rank, pp_rank + 8]  # looped: stages r and r + pp
    for index, part in parts:
        assert sorted(int(k) for k in part.layers) == layers[index]
        assert (part.tok_embeddings is not None) == (index == 0)
        assert (part.output is not None) == (index == 15)
        part = recipe.parallelize_part(part, mesh, cfg, layout)
        local = sum(p.to_local().numel() for p in part.parameters())
        full = sum(p.numel() for p in part.parameters())
        assert all(p.is_meta for p in part.parameters())
        assert full / 64 <= local <= full / 64 * 1.01  # 1/(dp*tp) of the stage, within padding
    assert 400e9 < sum(p.numel() for p in model.parameters()) < 410e9


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tied_weights_split_over_stages_start_as_equal_copies(family):
    from meshtrain.models.gpt2 import GPT2

    cls, embed, out = (Llama, "tok_embeddings.weight", "output.weight") if family == "llama" else \
        (GPT2, "wte.weight", "lm_head.weight")
    model = cls.from_flavor("debug", meta=True, tie_embeddings=True)
    assert model.tied_weights() == [(embed, out)]
    first = model.pipeline_stage([0, 1], first=True, last=False)
    last = model.pipeline_stage([2, 3], first=False, last=True)
    whole = model.pipeline_stage([0, 1, 2, 3], first=True, last=True)
    for stage in (first, last, whole):
        stage.init_weights(seed=3)
    first_w, last_w = dict(first.named_parameters())[embed], dict(last.named_parameters())[out]
    assert last_w is not first_w and torch.equal(last_w, first_w)  # a copy, drawn as its source
    assert whole.get_parameter(out) is whole.get_parameter(embed)  # on one stage: still one weight
    assert torch.equal(whole.get_parameter(embed), first_w)


def test_a_stage_keeps_the_whole_models_parameter_names():
    model = Llama.from_flavor("debug", meta=True)
    stage = model.pipeline_stage([2, 3], first=False, last=True)
    names = {n for n, _ in stage.named_parameters()}
    assert names == {n for n, _ in model.named_parameters() if n.startswith(("layers.2.", "layers.3.", "norm", "output"))}
    assert isinstance(stage(torch.zeros(1, 4, 128, device="meta")), torch.Tensor)
