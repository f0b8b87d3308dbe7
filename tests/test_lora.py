"""[lora]: adapters on a frozen base, proven against PEFT's own LoRA on transformers' own
model (`get_peft_model` / `PeftModel.from_pretrained`), in one process and in every layout.

The base model is a tiny Qwen2 (tied embeddings) saved by transformers; the adapters a
PEFT folder saved by PEFT, with B drawn non-zero so that every gradient is non-trivial."""

from __future__ import annotations

import copy
import json
import shutil
import threading

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("peft")
pytest.importorskip("transformers")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 12.0


def make_folders(root):
    """(base folder, adapter folder): transformers' Qwen2 and a PEFT adapter of it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.hf_configs import write_config

    base = write_config(root / "base", "qwen2")
    torch.manual_seed(3)
    plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    plain.save_pretrained(base)
    torch.manual_seed(4)
    peft = get_peft_model(plain, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():  # PEFT starts B at zero; a non-zero B gives A a gradient too
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    peft.save_pretrained(root / "adapter")
    return base, root / "adapter"


def peft_model(base, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter, is_trainable=True)


def our_name(peft_name: str) -> str:
    """PEFT's parameter name -> meshtrain's canonical one (base_layer dropped)."""
    from meshtrain.parallel.init import canonical_name

    return canonical_name(peft_name.removeprefix("base_model.model."))


def lora_argv(base, adapter, *extra) -> list[str]:
    return ["--config", "hf_debug", f"--model.hf_config={base}", f"--checkpoint.initial_load_hf={base}",
            "--lora.enable=true", f"--lora.rank={RANK}", f"--lora.alpha={ALPHA}",
            f"--lora.target_modules={','.join(TARGETS)}", f"--lora.initial_load_adapter={adapter}", *extra]


def one_process_model(argv):
    """meshtrain's model of ``argv`` in this process, no mesh: built, initialized and
    loaded as train.py does."""
    from meshtrain.models.hf.weights import load_hf_weights_
    from meshtrain.training import recipe
    from meshtrain.training.config_loader import parse_args
    from meshtrain.training.lora_files import load_adapter_

    cfg, _ = parse_args(argv)
    model = recipe.build_model(cfg, 258)
    model.init_weights(seed=0, device="cpu")
    load_hf_weights_(model, cfg.checkpoint.initial_load_hf)
    load_adapter_(model, cfg.lora.initial_load_adapter)
    return cfg, model


# ---------------------------------------------------------------- one process


def test_forward_and_gradients_equal_peft_and_only_adapters_get_gradients(tmp_path):
    """Same base and adapter folders: meshtrain's logits and every adapter gradient equal
    PEFT's on transformers' Qwen2; the base weights get no gradient at all."""
    base, adapter = make_folders(tmp_path)
    _, ours = one_process_model(lora_argv(base, adapter))
    theirs = peft_model(base, adapter)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    got, want = ours(tokens), theirs(input_ids=tokens).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    F.cross_entropy(got.flatten(0, 1), tokens.flatten()).backward()
    F.cross_entropy(want.flatten(0, 1), tokens.flatten()).backward()
    mine = dict(ours.named_parameters())
    adapters = 0
    for name, p in theirs.named_parameters():
        q = mine[name.removeprefix("base_model.model.")]
        if p.requires_grad:
            adapters += 1
            assert q.requires_grad and torch.allclose(q.grad, p.grad, rtol=1e-4, atol=1e-6), name
        else:
            assert not q.requires_grad and q.grad is None, name
    assert adapters == 2 * len(TARGETS) * 2  # A and B, 7 modules, 2 layers


def test_a_fresh_adapter_changes_nothing_and_is_drawn_as_peft_draws_it(tmp_path):
    """Without an adapter folder: B is zero (the model is the base model) and A is
    kaiming-uniform with a = sqrt(5), the bound PEFT's (and nn.Linear's) init gives."""
    import math

    base, _ = make_folders(tmp_path)
    from meshtrain.models.hf.weights import load_hf_weights_
    from meshtrain.training import recipe
    from meshtrain.training.config_loader import parse_args

    cfg, _ = parse_args(lora_argv(base, "")[:-1])
    model = recipe.build_model(cfg, 258)
    model.init_weights(seed=0, device="cpu")
    load_hf_weights_(model, base)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(base)
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(tokens), plain(input_ids=tokens).logits)
    a = model.get_parameter("model.layers.0.self_attn.q_proj.lora_A.default.weight")
    bound = 1 / math.sqrt(a.shape[1])  # kaiming_uniform(a=sqrt(5)) on [r, in]
    assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound


def test_the_optimizer_holds_only_the_adapters(tmp_path):
    base, adapter = make_folders(tmp_path)
    from meshtrain.training.optim import build_optimizer

    _, model = one_process_model(lora_argv(base, adapter))
    opt = build_optimizer(model, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in held}
    assert names == {n for n, _ in model.named_parameters() if ".lora_" in n} and names


# ---------------------------------------------------------------- bad input


def refusal(*argv) -> str:
    from meshtrain.training import recipe
    from meshtrain.training.config import ConfigError
    from meshtrain.training.config_loader import parse_args

    with pytest.raises(ConfigError) as err:
        cfg, _ = parse_args(list(argv))
        model = recipe.build_model(cfg, 258)
        recipe._check_inputs(cfg)
    return str(err.value)


def test_a_target_that_matches_nothing_names_the_nearest_linear_layers(tmp_path):
    from tests.hf_configs import write_config

    folder = write_config(tmp_path / "qwen2", "qwen2")
    msg = refusal("--config", "hf_debug", f"--model.hf_config={folder}", "--lora.enable=true",
                  "--lora.target_modules=q_proj,qproj")
    assert "'qproj' matches no nn.Linear" in msg and "q_proj" in msg and "[lora] target_modules" in msg
    msg = refusal("--config", "debug_2d", "--lora.enable=true", "--lora.target_modules=q_proj")
    assert "wq" in msg and "all-linear" in msg  # the native family's own names
    msg = refusal("--config", "hf_debug", f"--model.hf_config={folder}", "--lora.enable=true",
                  "--lora.target_modules=input_layernorm")
    assert "not an nn.Linear" in msg


def test_lora_with_export_during_training_is_refused_pointing_at_the_offline_exports():
    msg = refusal("--config", "debug_2d", "--lora.enable=true", "--lora.target_modules=wq",
                  "--checkpoint.export_hf_interval=5")
    assert "[checkpoint] export_hf_interval = 5" in msg and "--format peft" in msg and "--merge-lora" in msg


def test_rank_zero_is_refused():
    from meshtrain.training.config import ConfigError
    from meshtrain.training.config_loader import parse_args

    with pytest.raises(ConfigError, match=r"--lora.rank=0 is out of range; accepted: >= 1"):
        parse_args(["--config", "debug_2d", "--lora.enable=true", "--lora.rank=0"])


def test_an_adapter_folder_of_another_base_model_is_refused_with_the_shapes(tmp_path):
    """An adapter trained on a wider model: the first adapter that does not fit is named,
    with both shapes; one of another rank is refused by its config before anything runs."""
    from meshtrain.training.checkpoint import CheckpointError
    from meshtrain.training.recipe import Parts, load_adapter
    from tests.hf_configs import write_config

    base, adapter = make_folders(tmp_path / "small")
    other = write_config(tmp_path / "wide", "qwen2")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 128, "num_attention_heads": 8,
                                                   "num_key_value_heads": 4}))
    from meshtrain.training.config_loader import parse_args
    from meshtrain.training import recipe

    def loading(argv):
        cfg, _ = parse_args([a for a in argv if "initial_load_hf" not in a])
        model = recipe.build_model(cfg, 258)
        model.init_weights(seed=0, device="cpu")
        with pytest.raises(CheckpointError) as err:
            load_adapter(cfg, Parts(None, [(0, model)], model))
        return str(err.value)

    msg = loading(lora_argv(other, adapter))
    assert "initial_load_adapter" in msg and "has shape (4, 64) in the checkpoint, but the model's" in msg
    assert "is (4, 128)" in msg
    assert "rank = 8 but the folder's r = 4" in refusal(*lora_argv(base, adapter), "--lora.rank=8")
    msg = loading(lora_argv(base, adapter, "--lora.target_modules=q_proj"))
    assert "holds adapters this model has no place for (24, e.g." in msg


# ---------------------------------------------------------------- TP: the adapters follow their base layer


def _tp_worker(rank, sp, store, ref, x, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    from meshtrain.parallel.lora import lora_tp_plan

    dist.init_process_group("threaded", rank=rank, world_size=2, store=store)
    try:
        model = copy.deepcopy(ref)
        between = Shard(1) if sp else Replicate()
        plan = {"mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
                "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=between)}
        parallelize_module(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), lora_tp_plan(model, plan))
        y = model(x.chunk(2, dim=1)[rank] if sp else x)
        y = y.to_local() if isinstance(y, DTensor) else y
        # Replicated output: every rank computes the whole loss. Sequence-sharded: each its
        # share of it, which the backward collectives sum over the ranks.
        y.square().sum().backward()
        full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        out[rank] = {"y": y.detach().clone(),
                     "grads": {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None},
                     "placements": {n: str(p.placements) for n, p in model.named_parameters()
                                    if isinstance(p, DTensor)}}
    finally:
        dist.destroy_process_group()


def tp_run(sp: bool):
    """A colwise Linear then a rowwise one, both adapted, over 2 TP ranks (threads of
    this process: torch's threaded process group), against the same model unsplit."""
    import torch.distributed as dist
    from torch import nn
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    from meshtrain.parallel.lora import apply_lora

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    ref = nn.Sequential()
    torch.manual_seed(0)
    ref.mlp = MLP()
    apply_lora(ref, rank=4, alpha=8, target_modules=["up", "down"])
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.normal_()
    x = torch.randn(2, 6, 8)
    whole = copy.deepcopy(ref)
    y = whole(x)
    y.square().sum().backward()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        _install_threaded_pg()
        store, out = dist.HashStore(), {}
        threads = [threading.Thread(target=_tp_worker, args=(r, sp, store, ref, x, out)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:  # the process's own world and autograd threading back, for the tests after
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    want = {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}
    return y.detach(), want, out


@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sequence_parallel"])
def test_adapters_follow_their_base_layer_under_tp(sp):
    """colwise base: A replicated, B split by output rows; rowwise base: A split by input
    columns, B replicated. Outputs and every adapter gradient equal the unsplit model's,
    with the activations between layers replicated or sequence-sharded."""
    y, want, out = tp_run(sp)
    assert set(out) == {0, 1}
    for rank, got in out.items():
        assert torch.allclose(got["y"], y.chunk(2, dim=1)[rank] if sp else y, atol=1e-6)
        assert set(got["grads"]) == set(want)  # adapters only: the base is frozen
        for name, g in want.items():
            assert torch.allclose(got["grads"][name], g, atol=1e-5), (rank, name)
        assert got["placements"]["mlp.up.lora_B.default.weight"] == "(Shard(dim=0),)"
        assert got["placements"]["mlp.down.lora_A.default.weight"] == "(Shard(dim=1),)"
        assert "mlp.up.lora_A.default.weight" not in got["placements"]  # replicated: a plain tensor


# ---------------------------------------------------------------- every layout, one start-up

LAYOUTS = {
    "fsdp4": ["--parallelism.dp_shard=4", "--parallelism.tp=1"],
    "dp2_tp2": ["--parallelism.dp_shard=2", "--parallelism.tp=2"],
    "pp2_dp2": ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.tp=1"],
}
# Constant lr (AdamW's own, no schedule to reimplement); clipping at 0.5 binds.
TRAIN = ["--training.steps=4", "--training.seq_len=32", "--training.global_batch_size=8", "--training.max_norm=0.5",
         "--optimizer.lr=1e-2", "--lr_scheduler.warmup_steps=0", "--lr_scheduler.decay_type=constant"]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    from tests.conftest import recipe_runs

    root = tmp_path_factory.mktemp("lora_layouts")
    base, adapter = make_folders(root)
    runs = {name: lora_argv(base, adapter, *TRAIN, *flags, f"--job.output_dir={root / 'out'}", f"--job.name={name}")
            for name, flags in LAYOUTS.items()}
    return root, runs, recipe_runs(root, runs, nproc=4)


def peft_training(argv) -> dict:
    """PEFT on transformers' Qwen2, in this process, with torch's AdamW and clipping: the
    losses, gradient norms, last step's (clipped) gradients and final weights, by our names."""
    from meshtrain.training.config_loader import parse_args
    from meshtrain.training.data import build_dataloader

    cfg, _ = parse_args(argv)
    t, o = cfg.training, cfg.optimizer
    model = peft_model(cfg.checkpoint.initial_load_hf, cfg.lora.initial_load_adapter)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
    data, _ = build_dataloader(t, dp_rank=0, dp_size=1)
    result = {"losses": [], "grad_norms": []}
    for step in range(t.steps):
        optimizer.zero_grad(set_to_none=True)
        batches = data.batch(step)
        total = 0.0
        for x, y in batches:
            loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()) / len(batches)
            loss.backward()
            total += loss.item()
        result["grad_norms"].append(torch.nn.utils.clip_grad_norm_(params, t.max_norm).item())
        result["losses"].append(total)
        optimizer.step()
    named = list(model.named_parameters())
    result["grads"] = {our_name(n): p.grad.clone() for n, p in named if p.grad is not None}
    result["final"] = {our_name(n): p.detach().clone() for n, p in named}
    return result


@pytest.fixture(scope="module")
def peft_reference(layout_runs):
    _, runs, _ = layout_runs
    return peft_training(runs["fsdp4"])  # one process: the layout flags do not matter


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_training_equals_peft_in_every_layout(layout_runs, peft_reference, layout):
    """FSDP 4, dp 2 x tp 2 (adapters split with their base layers), pp 2 x dp 2 (1F1B, tied
    embeddings on two stages): four AdamW steps with binding clipping from the same base and
    PEFT adapter folders give PEFT's losses, gradient norms, last-step adapter gradients and
    final adapter weights; every base weight ends bitwise as transformers saved it.
    Plants (run by hand): parallel/lora.py's scaling rank/alpha fails every layout on the
    first loss; B of a colwise base split by input columns, and apply_lora leaving the base
    trainable, stop the runs (a shape error; training.recipe's check that only adapters
    train). test_adapters_follow_their_base_layer_under_tp catches the split numerically."""
    from safetensors.torch import load_file

    root, _, results = layout_runs
    got, want = results[layout], peft_reference
    for ours, theirs in zip(got["losses"], want["losses"]):
        assert abs(ours - theirs) <= 1e-5 * theirs, (layout, got["losses"], want["losses"])
    assert want["grad_norms"][0] > 0.5  # clipping binds
    for ours, theirs in zip(got["grad_norms"], want["grad_norms"]):
        assert abs(ours - theirs) <= 1e-4 * theirs, (layout, got["grad_norms"], want["grad_norms"])
    assert set(got["grads"]) == set(want["grads"])  # the adapters, and nothing else
    for name, g in want["grads"].items():
        assert torch.allclose(got["grads"][name], g, rtol=1e-4, atol=1e-4 * g.abs().max()), (layout, name)
    saved = load_file(root / "base" / "model.safetensors")
    for name, w in want["final"].items():
        if ".lora_" in name:
            assert torch.allclose(got["final"][name], w, rtol=1e-4, atol=1e-5), (layout, name)
        elif name in saved:  # the tied output layer is saved once, as the embedding
            assert torch.equal(got["final"][name], saved[name]), (layout, name)


# ---------------------------------------------------------------- checkpoints and export


@pytest.mark.slow
def test_a_lora_checkpoint_resumes_in_another_layout(layout_runs, peft_reference, tmp_path):
    """train.py: 2 steps in dp 2 x tp 2, saved; resumed in pp 2 x dp 2 for 2 more (DCP
    re-slices the adapters, their AdamW state and the base): the adapters after step 4 are
    PEFT's after 4 steps in one process."""
    from meshtrain.training.export import model_tensors
    from tests.forked_ranks import forked_ranks

    root, _, _ = layout_runs
    common = lora_argv(root / "base", root / "adapter", *TRAIN, "--checkpoint.enable=true",
                       "--checkpoint.interval=2", f"--job.output_dir={tmp_path}", "--job.name=reshard")
    for flags in (["--training.steps=2", *LAYOUTS["dp2_tp2"]], LAYOUTS["pp2_dp2"]):
        proc = forked_ranks("train.py", *common, *flags, nproc=4)
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed at step 2" in proc.stdout
    final = dict(model_tensors(tmp_path / "reshard" / "checkpoint" / "step-00000004"))
    adapters = {n: w for n, w in peft_reference["final"].items() if ".lora_" in n}
    assert adapters and set(adapters) <= set(final)
    for name, w in adapters.items():
        assert torch.allclose(final[name], w, rtol=1e-4, atol=1e-5), name


@pytest.mark.slow
def test_a_resumed_lora_run_is_the_uninterrupted_one_and_exports_as_peft_and_merged(tmp_path):
    """train.py, one process: 4 steps straight vs a copy of its step-2 checkpoint resumed for
    2 more (a run stopped there; constant lr) -- the checkpoints of step 4 are bitwise equal (adapters, their AdamW state, the frozen base),
    and only the adapters have optimizer state. `export --format peft` gives a folder
    PeftModel.from_pretrained loads, and `--format hf --merge-lora` one from_pretrained
    loads; both give the logits of meshtrain's model with the checkpoint's weights.
    Plants (run by hand): training/checkpoint.py's load leaving the optimizer state out;
    training/lora_files.py's peft_name swapping lora_A and lora_B; merged_tensors folding
    B A in with scaling 1. Each fails this test."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from meshtrain.parallel.init import canonical_name
    from meshtrain.training.export import export, model_tensors
    from tests.conftest import one_process

    base, adapter = make_folders(tmp_path)
    argv = lambda name, steps: lora_argv(base, adapter, *TRAIN, "--parallelism.dp_shard=1", "--parallelism.tp=1",
                                         "--checkpoint.enable=true", "--checkpoint.interval=2",
                                         f"--training.steps={steps}", f"--job.output_dir={tmp_path / 'out'}",
                                         f"--job.name={name}")
    proc = one_process("train.py", *argv("whole", 4))
    assert proc.returncode == 0, proc.stderr[-4000:]
    shutil.copytree(tmp_path / "out" / "whole" / "checkpoint" / "step-00000002",
                    tmp_path / "out" / "resumed" / "checkpoint" / "step-00000002")
    proc = one_process("train.py", *argv("resumed", 4))  # job.name may differ from the saved one
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed at step 2" in proc.stdout, proc.stdout[-2000:]
    step4 = lambda name: tmp_path / "out" / name / "checkpoint" / "step-00000004"
    whole, resumed = dict(model_tensors(step4("whole"))), dict(model_tensors(step4("resumed")))
    assert set(whole) == set(resumed)
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name
    keys = FileSystemReader(str(step4("whole"))).read_metadata().state_dict_metadata
    optimizer = [k for k in keys if k.startswith("optimizer.")]
    assert optimizer and all(".lora_" in k for k in optimizer)
    saved = load_file(base / "model.safetensors")
    assert all(torch.equal(whole[n], saved[n]) for n in saved)  # the base, untouched

    export(step4("whole"), tmp_path / "peft", "peft")
    export(step4("whole"), tmp_path / "merged", "hf", merge_lora=True)
    _, ours = one_process_model(lora_argv(base, adapter))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(whole[canonical_name(name)])
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    want = ours(tokens)
    assert not torch.allclose(want, peft_model(base, adapter)(input_ids=tokens).logits, atol=1e-3)  # it trained
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "peft")
    assert torch.allclose(loaded(input_ids=tokens).logits, want, rtol=1e-5, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(merged(input_ids=tokens).logits, want, rtol=1e-4, atol=1e-4)


def test_tp_leaves_the_base_frozen_and_splits_llamas_adapters_with_their_layers(fake_world):
    """Llama under dp 2 x tp 2 with sequence parallelism (a fake process group): no style
    unfreezes a base weight (SequenceParallel makes the norms new Parameters), and each
    adapter takes its base layer's split: wq/w1 B by output rows, wo/w2 A by input columns,
    their other matrix whole."""
    from torch.distributed.tensor import DTensor

    from meshtrain.training import recipe
    from meshtrain.training.config_loader import load_config

    fake_world(4)
    cfg = load_config("debug_2d", ["--lora.enable=true"])
    model = recipe.build_model(cfg, 258)
    layout = recipe.plan_layout(cfg, model, 4, this_machine=False)
    run = recipe.build_parts(cfg, layout, layout.build_mesh("cpu"), model)
    part = run.modules[0]
    trainable = {n for n, p in part.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in part.named_parameters() if ".lora_" in n} and trainable

    def tp_placement(name):
        p = part.get_parameter(name)
        names = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
        return repr(p.placements[names.index("tp")]) if "tp" in names else "whole"

    block = "layers.0."
    for layer in ("attention.wq", "attention.wk", "feed_forward.w1", "feed_forward.w3"):
        assert tp_placement(f"{block}{layer}.lora_B.default.weight") == "Shard(dim=0)", layer
        assert tp_placement(f"{block}{layer}.lora_A.default.weight") == "whole", layer
    for layer in ("attention.wo", "feed_forward.w2"):
        assert tp_placement(f"{block}{layer}.lora_A.default.weight") == "Shard(dim=1)", layer
        assert tp_placement(f"{block}{layer}.lora_B.default.weight") == "Replicate()", layer  # SequenceParallel


@pytest.mark.slow
def test_a_llama_lora_run_exports_merged_to_transformers(tmp_path):
    """The native family (its own names: wq, w1...): a one-process LoRA run's checkpoint
    exports with --merge-lora to a folder transformers' LlamaForCausalLM loads, with the
    logits of meshtrain's adapted model; --format peft is refused (PEFT keys transformers'
    module names), and so is --format hf without --merge-lora (the adapters would be lost).
    Plant (run by hand): merged_tensors writing the base weights unmerged fails it."""
    from transformers import AutoModelForCausalLM

    from meshtrain.parallel.init import canonical_name
    from meshtrain.training import recipe
    from meshtrain.training.config_loader import parse_args
    from meshtrain.training.export import export, model_tensors
    from tests.conftest import one_process

    argv = ["--config", "debug_2d", "--parallelism.dp_shard=1", "--parallelism.tp=1", "--lora.enable=true",
            "--lora.target_modules=wq,wv,w2", "--training.steps=3", "--training.seq_len=32", "--optimizer.lr=1e-2",
            "--checkpoint.enable=true", f"--job.output_dir={tmp_path}", "--job.name=llama"]
    proc = one_process("train.py", *argv)
    assert proc.returncode == 0, proc.stderr[-4000:]
    step = tmp_path / "llama" / "checkpoint" / "step-00000003"
    with pytest.raises(ValueError, match="--format peft is for"):
        export(step, tmp_path / "peft", "peft")
    with pytest.raises(ValueError, match="add --merge-lora"):
        export(step, tmp_path / "plain", "hf")
    export(step, tmp_path / "merged", "hf", merge_lora=True)
    cfg, _ = parse_args(argv)
    ours = recipe.build_model(cfg, 258)
    ours.init_weights(seed=0, device="cpu")
    saved = dict(model_tensors(step))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(saved[canonical_name(name)])
    assert saved["layers.0.attention.wq.lora_B.default.weight"].abs().max() > 0  # it trained
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(theirs(input_ids=tokens).logits[..., :258], ours(tokens)[..., :258], rtol=1e-4, atol=1e-4)
