"""Hugging Face mixtures of experts, one process: transformers' fused routed experts run as
meshtrain's (models/hf/experts.py) and give the unmodified class's logits and gradients
(Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE with its shared expert); the per-expert tensors
save_pretrained writes load fused, each rank reading only its experts' block under
expert parallelism; TP leaves the experts whole; the moe/ loads are a count of
transformers' router's top-k, once per training forward. Training under FSDP x EP (x TP) against
the unmodified class is tests/test_hf_toml.py's (qwen3_moe); the refusals are in
tests/test_expert_parallel.py."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from meshtrain.models.hf.experts import RoutedExperts, StackedExperts
from meshtrain.models.hf.model import build_hf, causal_lm_class
from meshtrain.models.hf.weights import load_hf_weights_
from meshtrain.parallel import ParallelDims, parallelize
from meshtrain.parallel.init import canonical_name
from tests.conftest import ROOT
from tests.hf_configs import ARCHS, COMMON

MOE = {
    "qwen3_moe": {**COMMON, **ARCHS["qwen3_moe"]},
    "mixtral": dict(COMMON, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(COMMON, model_type="olmoe", num_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(COMMON, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
}


def ours_and_theirs(arch: str):
    """meshtrain's model of MOE[arch] (initialized) and transformers' unmodified class with
    the same weights, computing its experts with its own loop over them ("eager")."""
    ours = build_hf("", hf=MOE[arch])
    ours.init_weights(seed=3, device="cpu")
    cls = causal_lm_class(MOE[arch])
    config = cls.config_class.from_dict(MOE[arch])
    config._experts_implementation = "eager"
    theirs = cls(config)
    theirs.load_state_dict(ours.state_dict())
    assert type(theirs) is cls
    return ours, theirs


def loss_and_grads(model, tokens):
    out = model(tokens[:, :-1])
    logits = out if isinstance(out, torch.Tensor) else out.logits
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item(), {canonical_name(n): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", list(MOE))
def test_fused_experts_run_as_meshtrains_and_match_the_unmodified_class(arch):
    ours, theirs = ours_and_theirs(arch)
    experts = ours.expert_modules()
    assert experts and all(isinstance(m, RoutedExperts) for m in experts.values())
    assert ours.ep_divisible() == {"routed experts": MOE[arch].get("num_experts") or MOE[arch]["num_local_experts"]}
    tokens = torch.randint(0, 320, (2, 33), generator=torch.Generator().manual_seed(0))
    loss, grads = loss_and_grads(ours, tokens)
    want_loss, want = loss_and_grads(theirs, tokens)
    assert abs(loss - want_loss) < 1e-6 * want_loss, (loss, want_loss)
    assert set(grads) == set(want)
    for name, g in want.items():
        scale = g.abs().max().item()
        assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-5 * scale), name


def test_tp_plan_leaves_the_experts_whole():
    """transformers' plan splits the experts' weights (packed_colwise, moe_tp_experts);
    meshtrain drops those entries (experts whole on each tp rank, split by ep instead)
    and keeps the attention's and the dense block's."""
    model = build_hf(str(ROOT / "configs/hf/qwen3-moe-tiny"))
    assert model.layout_refusal(tp=2, pp=1, ep=2) is None
    assert all(".experts" not in key for key in model._mt_tp_words), model._mt_tp_words
    assert {"layers.*.self_attn.q_proj", "layers.*.mlp.gate_proj"} <= set(model._mt_tp_words)
    assert all(".experts" not in key for key in model.tp_plan())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """transformers' Qwen3-MoE saved by its own save_pretrained (one tensor per expert)."""
    folder = tmp_path_factory.mktemp("qwen3_moe")
    cls = causal_lm_class(MOE["qwen3_moe"])
    torch.manual_seed(11)
    model = cls(cls.config_class.from_dict(MOE["qwen3_moe"]))
    model.save_pretrained(folder)
    return folder, {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_per_expert_tensors_read_as_any_block_of_the_fused_weight(saved):
    from safetensors import safe_open

    from meshtrain.models.safetensors_files import tensor_files

    folder, full = saved
    files = tensor_files(folder)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in files  # the layout save_pretrained writes
    with safe_open(files["model.layers.1.mlp.experts.0.gate_proj.weight"], framework="pt") as f:
        for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"):
            source = StackedExperts.find(name, files, f.get_slice)
            assert source.get_shape() == list(full[name].shape)
            # experts 3-6, rows across gate_proj's end and up_proj's start, some columns
            box = (slice(3, 7), slice(20, 45), slice(5, 30))
            assert torch.equal(source[box], full[name][box]), name


def test_initial_load_reads_each_ranks_experts_under_ep_and_tp(saved, fake_world):
    """dp_shard 2 x tp 2 with ep 2 (4 ranks): each rank's expert weights are its ep half
    of the experts (whole over tp: FSDP's one-rank shard of them), the rest as TP x FSDP
    split them; every local block is the one in the folder."""
    folder, full = saved
    for rank in range(4):
        fake_world(4, rank=rank)
        _clear_sharding_prop_cache()
        mesh = ParallelDims(dp_shard=2, tp=2, ep=2, world_size=4).build_mesh("cpu")
        model = parallelize(build_hf("", hf=MOE["qwen3_moe"]), mesh, ep=2)
        load_hf_weights_(model, folder)
        for name, p in model.named_parameters():
            name = canonical_name(name)
            assert isinstance(p, DTensor), name
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            want = full[name][tuple(slice(o, o + n) for o, n in zip(offset, shape))]
            assert torch.equal(p.to_local(), want), (rank, name)
            if ".experts." in name:
                ep = p.device_mesh.mesh_dim_names.index("ep")
                assert str(p.placements[ep]) == "S(0)" and p.to_local().shape[0] == 4, (name, p.placements)
                assert offset[0] == 4 * (rank // 2), (rank, name)  # ep is dp_shard here: tp innermost


def test_export_of_the_fused_experts_loads_in_transformers(tmp_path):
    """`export --format hf` writes the model's names (a DCP checkpoint holds each expert
    weight whole under its name, whatever the ep it was saved from): from_pretrained loads
    them into the unmodified class, with our logits."""
    from transformers import AutoModelForCausalLM

    from meshtrain.models.hf.weights import save_hf

    ours = build_hf("", hf=MOE["qwen3_moe"])
    ours.init_weights(seed=5, device="cpu")
    save_hf(ours.state_dict().items(), ours.cfg, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not isinstance(loaded.model.layers[1].mlp.experts, RoutedExperts)
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, ours(tokens), atol=1e-6, rtol=0)


def test_active_parameters_count_the_top_k_of_each_layers_experts():
    """MFU counts what a token uses: every weight but the experts it is not sent to."""
    model = build_hf(str(ROOT / "configs/hf/qwen3-moe-tiny"))
    cls = causal_lm_class(model.cfg.hf)
    plain = dict(cls(cls.config_class.from_dict(model.cfg.hf)).named_parameters())
    experts = sum(p.numel() for name, p in plain.items() if ".mlp.experts." in name)
    others = sum(p.numel() for p in plain.values()) - experts
    hf = json.loads((ROOT / "configs/hf/qwen3-moe-tiny/config.json").read_text())
    assert model.active_parameters() == others + experts * hf["num_experts_per_tok"] // hf["num_experts"]
    assert build_hf("", hf={**COMMON, **ARCHS["qwen3"]}).active_parameters() == sum(
        p.numel() for p in build_hf("", hf={**COMMON, **ARCHS["qwen3"]}).parameters())  # dense: all of them


def test_expert_loads_are_the_top_k_transformers_router_picks():
    """The moe/ load statistics of a Hugging Face mixture of experts: each MoE layer's loads,
    counted once per training forward -- two micro-batches add up; an evaluation forward and
    activation checkpointing's recomputation in backward add nothing -- are a count of the
    experts transformers' own router (its top-k) picks for the same tokens, and the logged
    ratio is the busiest expert's over the mean."""
    from meshtrain.parallel.activation_checkpoint import apply_ac

    hf = json.loads((ROOT / "configs/hf/qwen3-moe-tiny/config.json").read_text())
    ours = build_hf(str(ROOT / "configs/hf/qwen3-moe-tiny"))
    ours.init_weights(seed=3, device="cpu")
    cls = causal_lm_class(hf)
    theirs = cls(cls.config_class.from_dict(hf))
    theirs.load_state_dict(ours.state_dict())
    picked: dict[str, torch.Tensor] = {}

    def count(layer, module, args, out):
        _, _, top_k_index = out
        picked[layer] = picked.get(layer, 0) + torch.bincount(top_k_index.flatten(), minlength=hf["num_experts"])

    for name, module in theirs.named_modules():
        if type(module).__name__ == "Qwen3MoeTopKRouter":  # "model.layers.3.mlp.gate"
            module.register_forward_hook(functools.partial(count, name.split(".")[2]))
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, hf["vocab_size"], (2, 33), generator=generator) for _ in range(2)]
    with torch.no_grad():
        for tokens in batches:
            theirs(tokens)
    apply_ac(ours.transformer_blocks(), "full")
    with torch.no_grad():
        ours(batches[0])  # evaluation: not counted
    for tokens in batches:
        ours(tokens).sum().backward()  # each block recomputed in backward: not counted again
    ours.after_optimizer_step()

    layers, loads = ours.last_loads
    assert layers == sorted(picked) == ["1", "2", "3"]  # block 0 is dense (mlp_only_layers)
    assert torch.equal(loads, torch.stack([picked[layer] for layer in layers]).double())
    want = {f"moe/load_max_over_mean/layer{layer}": (c.max() / c.double().mean()).item() for layer, c in picked.items()}
    assert ours.metrics() == pytest.approx({**want, "moe/dropped_tokens": 0.0}, rel=1e-12)
    ours.after_optimizer_step()  # a step with no forward: nothing carried over
    assert ours.last_loads[1].sum() == 0


def test_a_pipeline_stage_counts_only_the_schedules_forwards(tmp_path):
    """torch's pipeline stages run an extra forward on their first step to infer shapes
    (parallel/pipeline.py `inferring_stage_metadata`): the loads of a one-stage schedule
    over two micro-batches are the plain model's over the batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshtrain.parallel.pipeline import build_schedule

    plain = build_hf(str(ROOT / "configs/hf/qwen3-moe-tiny"))
    plain.init_weights(seed=3, device="cpu")
    piped = plain.pipeline_stage(list(range(plain.cfg.n_layers)), first=True, last=True)
    tokens = torch.randint(0, plain.cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    loss = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        schedule = build_schedule("GPipe", [(0, piped)], init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))["pp"],
                                  n_microbatches=2, n_stages=1, device=torch.device("cpu"), loss_fn=loss)
        schedule.step(inputs, target=labels)
    finally:
        dist.destroy_process_group()
    loss(plain(inputs), labels).backward()
    for model in (piped, plain):
        model.after_optimizer_step()
    assert piped.last_loads[0] == plain.last_loads[0] == ["1", "2", "3"]
    assert torch.equal(piped.last_loads[1], plain.last_loads[1])
