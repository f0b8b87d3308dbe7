"""How a run is built from its config -- the one recipe `train.py` and the dry run share.

    model  = build_model(cfg, vocab)              # the whole model, on meta (models/registry.py)
    layout = plan_layout(cfg, model, world_size)  # every default resolved, every rule checked:
                                                  #   no process group exists yet
    mesh   = layout.build_mesh(...)
    run    = build_parts(cfg, layout, mesh, model)  # stages cut; TP, AC, compile, FSDP per part
    optimizer, scheduler = build_optimizer(cfg, run.modules)

Each default (the micro-batch, the pipeline's micro-batches and stages per rank, the
sharding strategy) is worked out here once, into the run's `ParallelDims`
(parallel/layout.py), and read from it everywhere else -- the planner included.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from meshtrain.models import registry
from meshtrain.parallel import LayoutError, ParallelDims, mixed_precision_policy, parallelize, submesh
from meshtrain.parallel.async_tp import async_tp_unavailable
from meshtrain.parallel.context_parallel import check_cp_fits
from meshtrain.parallel.float8 import apply_float8, float8_unavailable, precompute_float8_scales
from meshtrain.parallel.lora import LoraError, is_adapter, lora_tp_plan
from meshtrain.parallel.fsdp import check_strategy
from meshtrain.parallel.pipeline import build_schedule, check_pipeline, split_into_stages
from meshtrain.parallel.tensor_parallel import check_tp_plan
from meshtrain.parallel.tied import tie_across_stages
from meshtrain.parallel.vocabulary import default_stages_per_rank
from meshtrain.training.checkpoint import CheckpointError, CheckpointManager
from meshtrain.training.config import ConfigError, JobConfig
from meshtrain.training.config_loader import config_to_toml
from meshtrain.training.optim import Optimizers, Schedulers
from meshtrain.training.step import pipeline_loss_fn, pipeline_train_step, select_loss, train_step

# Embedding rows are padded to a multiple of this when the vocabulary comes from the
# tokenizer (258 for bytes), so any TP degree up to 64 divides it.
VOCAB_MULTIPLE = 64


def device_type(cfg: JobConfig) -> str:
    if cfg.job.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.job.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError('[job] device = "cuda" but no CUDA device is visible; use "auto" or "cpu"')
    return cfg.job.device


def build_model(cfg: JobConfig, tokenizer_vocab: int) -> nn.Module:
    """The whole model on meta: no memory, whatever its size; with [lora] enable, its
    targeted Linear layers wrapped with adapters and every base weight frozen."""
    model = _build_model(cfg, tokenizer_vocab)
    if cfg.lora.enable:
        add_lora(cfg, model)
    return model


def add_lora(cfg: JobConfig, model: nn.Module) -> None:
    """[lora]: adapters on the target_modules (parallel/lora.py), before TP and FSDP."""
    from meshtrain.parallel.lora import LoraError, apply_lora, lora_targets

    lo, family = cfg.lora, registry.get(cfg.model.name)
    if cfg.float8.enable:
        raise ConfigError("[lora] enable = true with [float8] enable = true: float8 would cast the adapters' "
                          "small matrices too; use one or the other")
    if cfg.checkpoint.export_hf_interval:
        raise ConfigError(f"[lora] enable = true with [checkpoint] export_hf_interval = "
                          f"{cfg.checkpoint.export_hf_interval}: export during training writes plain Hugging Face "
                          "folders and knows no adapters. Use export_hf_interval = 0 and export a checkpoint afterwards: "
                          "meshtrain export STEP_DIR OUT --format peft (the adapters) or --format hf --merge-lora")
    where = f"[lora] target_modules = {json.dumps(lo.target_modules)}"
    try:
        paths = lora_targets(model, lo.target_modules, exclude=family.high_precision)
    except LoraError as err:
        raise ConfigError(f"{where}: {err}") from None
    heads = [p for p in paths if p.rsplit(".", 1)[-1] in family.high_precision]
    if heads:  # its weight may be tied to the embedding, and its TP split is the loss's
        raise ConfigError(f"{where} names the output layer ({heads[0]}); LoRA adapts the blocks' Linear "
                          "layers: leave it out (\"all-linear\" does)")
    apply_lora(model, rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, target_modules=paths)


SHAPE_KEYS = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_hidden")


def shape_overrides(cfg: JobConfig) -> dict:
    """[model]'s dimensions that replace the flavor's (0: keep it). ConfigError for a
    dimension the family has no setting for (gpt2's FFN is 4 x dim, it has no kv heads)."""
    m = cfg.model
    given = {k: getattr(m, k) for k in SHAPE_KEYS if getattr(m, k)}
    if m.name == "hf" and set(given) - {"n_layers"}:
        key = next(k for k in given if k != "n_layers")
        raise ConfigError(f"[model] {key} = {given[key]}: name = \"hf\" takes its dimensions from hf_config "
                          f"(only n_layers may be changed here)")
    if given and m.name != "hf":
        from dataclasses import fields

        family = registry.get(m.name)
        known = {f.name for f in fields(next(iter(family.flavors.values())))}
        for key in given:
            if key not in known:
                raise ConfigError(f"[model] {key} = {given[key]}: the {m.name} family has no such setting; "
                                  f"its dimensions: {', '.join(k for k in SHAPE_KEYS if k in known)}")
    return given


def _build_model(cfg: JobConfig, tokenizer_vocab: int) -> nn.Module:
    m, seq_len = cfg.model, cfg.training.seq_len
    shape_overrides(cfg)  # its refusals, for every family
    if m.name == "hf":
        return build_hf_model(cfg, tokenizer_vocab)
    family = registry.get(m.name)
    vocab = m.vocab_size or -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if vocab < tokenizer_vocab:
        raise ConfigError(f"[model] vocab_size = {vocab} is smaller than the tokenizer's "
                          f"vocabulary ({tokenizer_vocab})")
    overrides = {"vocab_size": vocab, "norm_eps": m.norm_eps, **shape_overrides(cfg)}
    if m.name == "moe":
        overrides.update(cfg.moe.overrides())
    if not family.learned_positions:  # positions are computed (rotary): size them for this run
        overrides["max_seq_len"] = seq_len
    try:
        model = family.model_class().from_flavor(m.flavor, meta=True, **overrides)
    except ValueError as err:  # the family's own check of the dimensions (dim % n_heads, ...)
        if not shape_overrides(cfg):
            raise
        given = ", ".join(f"{k} = {v}" for k, v in shape_overrides(cfg).items())
        raise ConfigError(f"[model] {given}: {err}") from None
    if seq_len > model.cfg.max_seq_len:
        raise ConfigError(f"[training] seq_len = {seq_len} is longer than {m.name} {m.flavor}'s "
                          f"{model.cfg.max_seq_len} learned positions; use seq_len <= {model.cfg.max_seq_len}")
    return model


def build_hf_model(cfg: JobConfig, tokenizer_vocab: int) -> nn.Module:
    """[model] name = "hf": transformers' class for the config.json, on meta."""
    from meshtrain.models.hf.config import HFModelError
    from meshtrain.models.hf.model import build_hf
    from meshtrain.models.hf.tp_styles import plan_words

    m, seq_len = cfg.model, cfg.training.seq_len
    where = f'[model] hf_config = "{m.hf_config}"'
    try:
        plan = plan_words(m.hf_tp_plan, "[model] hf_tp_plan") if m.hf_tp_plan else None
        model = build_hf(m.hf_config, n_layers=m.n_layers, block_classes=tuple(m.hf_block_classes), tp_plan=plan)
    except HFModelError as err:
        raise ConfigError(f"{where}: {err}") from None
    c = model.cfg
    if m.vocab_size and m.vocab_size != c.vocab_size:
        raise ConfigError(f"[model] vocab_size = {m.vocab_size}, but {where} has vocab_size = {c.vocab_size}; "
                          "leave vocab_size at 0 for a Hugging Face model")
    if tokenizer_vocab > c.vocab_size:
        raise ConfigError(f"{where} has {c.vocab_size} embedding rows, fewer than the tokenizer's "
                          f"{tokenizer_vocab} tokens ([training] tokenizer)")
    if model.learned_positions() and seq_len > c.max_seq_len:
        raise ConfigError(f"[training] seq_len = {seq_len} is longer than the {c.max_seq_len} learned positions "
                          f"of {where}; use seq_len <= {c.max_seq_len}")
    return model


def run_folder(cfg: JobConfig) -> Path:
    """``{output_dir}/{name}``; under [fault_tolerance] each replica group writes its own
    ``replica_{id}`` folder inside it (its lock, TensorBoard, checkpoints)."""
    folder = Path(cfg.job.output_dir) / cfg.job.name
    return folder / f"replica_{cfg.fault_tolerance.replica_id}" if cfg.fault_tolerance.enable else folder


def group_batch(cfg: JobConfig) -> int:
    """The sequences one step trains on in this replica group: the global batch, or under
    [fault_tolerance] its share of it."""
    ft = cfg.fault_tolerance
    return cfg.training.global_batch_size // ft.group_size if ft.enable else cfg.training.global_batch_size


def data_shard(cfg: JobConfig, mesh) -> tuple[int, int]:
    """(this rank's share of every global batch, how many shares): its data-parallel rank;
    under [fault_tolerance] replica group r's ranks take the r-th group of shares."""
    from meshtrain.parallel import mesh_coordinate

    dp_rank, dp_size = mesh_coordinate(mesh, "dp")
    ft = cfg.fault_tolerance
    return (ft.replica_id * dp_size + dp_rank, ft.group_size * dp_size) if ft.enable else (dp_rank, dp_size)


def _launch_hint(p) -> str:
    """The next step after a world that does not fit the [parallelism] degrees."""
    fixed = p.pp * p.dp_replicate * p.cp * p.tp
    n = fixed * (p.dp_shard if p.dp_shard > 0 else 1)
    many = "" if p.dp_shard > 0 else " (or a multiple: dp_shard = -1 takes the rest)"
    return (f"These degrees need {n} processes{many}: launch `meshtrain train --nproc-per-node {n} ...` "
            f"(or `torchrun --nproc-per-node {n} -m meshtrain.train ...`), "
            f"or for a dry run pass `--world-size {n}`; or change the [parallelism] degrees")


def plan_layout(cfg: JobConfig, model: nn.Module, world_size: int | None = None, *,
                gpus_per_node: int | None = None, this_machine: bool = True) -> ParallelDims:
    """Everything about the layout that can be known without a process group, checked:
    degrees against the world, the model against TP, the strategy against the degrees,
    batch sizes, the pipeline and, with ``this_machine`` (not for a dry run, which plans for
    another), the files named and the speed options against this machine.
    ``gpus_per_node``: warn when TP would leave a node (default: torchrun's local world on CUDA)."""
    t, p = cfg.training, cfg.parallelism
    try:
        dims = ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, cp=p.cp,
                            ep=p.ep, world_size=world_size)
    except LayoutError as err:
        raise LayoutError(f"{err}. {_launch_hint(p)}") from None
    if gpus_per_node is None and this_machine and device_type(cfg) == "cuda":
        gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None
    dims.check_model(model.tp_divisible(), seq_len=t.seq_len, sequence_parallel=p.sequence_parallel,
                     gpus_per_node=gpus_per_node)
    if dims.cp > 1:
        _check_cp(dims, model, t.seq_len, p.sequence_parallel)
    refusal = model.layout_refusal(tp=dims.tp, pp=dims.pp, ep=dims.ep) if hasattr(model, "layout_refusal") else None
    if refusal:
        raise LayoutError(f"[parallelism] tp = {dims.tp}, pp = {dims.pp}, ep = {dims.ep}: {refusal}")
    if dims.tp > 1:  # a plan naming modules that are not there, or that it cannot split: now, not after start-up
        plan = model.tp_plan(sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel)
        try:
            check_tp_plan(model, lora_tp_plan(model, plan))
        except LoraError as err:
            raise LayoutError(f"[parallelism] tp = {dims.tp} with [lora]: {err}") from None
    try:
        strategy = check_strategy(p.sharding_strategy, dims.degrees)
    except LayoutError as err:
        raise LayoutError(f'[parallelism] sharding_strategy = "{p.sharding_strategy}": {err}') from None
    problems = dims.ep_problems(model.ep_divisible() if hasattr(model, "expert_modules") else None, strategy)
    if problems:
        raise LayoutError(f"[parallelism] ep = {dims.ep}: " + "; ".join(problems))
    groups = cfg.fault_tolerance.group_size if cfg.fault_tolerance.enable else 1  # each takes its share
    local = t.local_batch_size or t.global_batch_size // (dims.dp * groups)
    if local < 1 or t.global_batch_size % (dims.dp * groups * local):  # local is 0 when global < dp
        per_step = (f"dp * local_batch_size = {dims.dp_replicate}*{dims.dp_shard} * {local} = {dims.dp * local}"
                    if t.local_batch_size else f"dp = {dims.dp_replicate}*{dims.dp_shard} = {dims.dp}")
        if groups > 1:
            per_step = f"[fault_tolerance] group_size {groups} * {per_step}"
        raise LayoutError(f"[training] global_batch_size = {t.global_batch_size} must be a multiple of "
                          f"{per_step} (dp = dp_replicate*dp_shard)")
    if this_machine:
        _check_inputs(cfg)
        check_speed_options(cfg, dims)
    # A pipeline always reduces once a step; "auto" leaves pp = 1 reducing every micro-batch.
    sync = "step" if dims.pp > 1 or p.gradient_sync == "step" else "microbatch"
    each_step = dict(strategy=strategy, ac=cfg.activation_checkpoint.mode, gradient_sync=sync)
    if dims.pp == 1:
        return dataclasses.replace(dims, micro_batch=local, **each_step)
    per_rank = p.pp_stages_per_rank or default_stages_per_rank(p.pp_schedule)
    micro = p.pp_microbatches or dims.pp * per_rank  # one per stage: the fewest that fill the pipe
    try:
        stage_layers = check_pipeline(
            pp=dims.pp, n_layers=model.cfg.n_layers, schedule=p.pp_schedule, stages_per_rank=per_rank,
            n_microbatches=micro, local_batch=local, layers_per_stage=p.pp_layers_per_stage,
            split_points=p.pp_split_points)
    except LayoutError as err:
        raise LayoutError(f"[parallelism] pp = {dims.pp}, pp_schedule = \"{p.pp_schedule}\": {err}") from None
    return dataclasses.replace(dims, micro_batch=local // micro, pp_schedule=p.pp_schedule, pp_microbatches=micro,
                               stages_per_rank=per_rank, stage_layers=stage_layers, **each_step)


def _check_cp(dims: ParallelDims, model: nn.Module, seq_len: int, sequence_parallel: bool) -> None:
    """[parallelism] cp against the model and the sequence, before any process group."""
    if not any(hasattr(m, "context_parallel") for m in model.modules()):
        raise LayoutError(f"[parallelism] cp = {dims.cp}: {type(model).__name__}'s attention cannot split the "
                          "sequence (no module has a context_parallel attribute; see parallel/context_parallel.py); "
                          "use cp = 1")
    problems = check_cp_fits(dims.cp, dims.tp, heads=model.cfg.n_heads, seq_len=seq_len,
                             sequence_parallel=sequence_parallel)
    if problems:
        raise LayoutError(f"[parallelism] cp = {dims.cp}: " + "; ".join(problems))


def _check_inputs(cfg: JobConfig) -> None:
    """Files and folders the config names, before anything is started."""
    t, hf = cfg.training, cfg.checkpoint.initial_load_hf
    run_dir = run_folder(cfg)
    if cfg.fault_tolerance.enable:
        check_lighthouse(cfg.fault_tolerance.lighthouse)
    folders = [(run_dir / "tb", "[job] output_dir / name"), (run_dir / cfg.checkpoint.folder, "[checkpoint] folder")]
    if cfg.checkpoint.export_hf_interval:
        folders.append((run_dir / "hf", "[checkpoint] export_hf_interval"))
    for path, key in folders:
        blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:  # found now, not by the TensorBoard writer after the first step
            raise ConfigError(f'{key}: "{blocking}" is a file, but the run writes a folder there ({path})')
        # A link to a folder that is gone (an unmounted disk, a moved scratch space) looks
        # like no folder at all: resume would find no checkpoint and start at step 0, and
        # the first save would fail. Refuse it now, before a step is spent.
        dangling = next((p for p in (path, *path.parents) if p.is_symlink() and not p.exists()), None)
        if dangling is not None:
            raise ConfigError(f'{key}: "{dangling}" is a link to "{os.readlink(dangling)}", which does not '
                              f"exist (an unmounted disk or a moved folder?); mount or recreate it, or point "
                              f"{key} elsewhere")
    for section, data in (("training", t), ("validation", cfg.validation)):
        if data.dataset == "text" and not (data.dataset_path and os.path.exists(data.dataset_path)):
            raise ConfigError(f'[{section}] dataset = "text" needs dataset_path = a file or folder of text; '
                              f'"{data.dataset_path}" does not exist')
        if data.dataset == "tokens" and not os.path.isfile(os.path.join(data.dataset_path, "index.json")):
            raise ConfigError(f'[{section}] dataset = "tokens" needs dataset_path = a folder prepared by '
                              f'`meshtrain prepare-data`; no index.json in "{data.dataset_path}"')
        if data.dataset == "sft" and not (data.dataset_path and os.path.exists(data.dataset_path)):
            raise ConfigError(f'[{section}] dataset = "sft" needs dataset_path = a .jsonl/.parquet file, a folder '
                              f'of them, or a folder prepared by `meshtrain prepare-data --kind sft`; '
                              f'"{data.dataset_path}" does not exist')
    # A chat template the tokenizer lacks: now.
    if "sft" in (t.dataset, cfg.validation.dataset) and t.chat_template == "tokenizer":
        from meshtrain.training.chat_template import resolve

        resolve(t.chat_template, t.tokenizer)
    adapter = cfg.lora.initial_load_adapter
    if adapter:
        from meshtrain.training.lora_files import check_adapter_config, read_adapter_config

        if cfg.model.name != "hf":
            raise ConfigError(f'[lora] initial_load_adapter reads a PEFT folder, whose adapters are named by '
                              f'transformers\' module paths; [model] name = "{cfg.model.name}" has its own names: '
                              'use [model] name = "hf", or leave initial_load_adapter empty')
        try:
            check_adapter_config(read_adapter_config(adapter), adapter, rank=cfg.lora.rank, alpha=cfg.lora.alpha)
        except ValueError as err:
            raise ConfigError(f'[lora] initial_load_adapter = "{adapter}": {err}') from None
    if hf and not registry.get(cfg.model.name).hf:
        raise ConfigError(f'[checkpoint] initial_load_hf reads Hugging Face weights; [model] name = '
                          f'"{cfg.model.name}" has no importer')
    if hf and not os.path.isfile(os.path.join(hf, "config.json")):  # False, not OSError, for too long a name
        raise ConfigError(f"[checkpoint] initial_load_hf = \"{hf}\": no Hugging Face config.json there "
                          f"(expected a folder with config.json and *.safetensors)")
    if hf:
        try:
            json.loads(Path(hf, "config.json").read_text())
        except (ValueError, UnicodeDecodeError) as err:
            raise ConfigError(f"[checkpoint] initial_load_hf: {Path(hf, 'config.json')} is not JSON ({err})") from None
        try:  # every weight file's header: a truncated download is named now, not mid-load on each rank
            from meshtrain.models.safetensors_files import tensor_files

            tensor_files(Path(hf))
        except ImportError:
            raise ConfigError('[checkpoint] initial_load_hf reads safetensors, which is not installed: '
                              'pip install "meshtrain[hf]" (or pip install safetensors)') from None
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(f"[checkpoint] initial_load_hf: {err}") from None


def check_lighthouse(address: str, timeout: float = 5.0) -> None:
    """[fault_tolerance] lighthouse answers: a TCP connection to it opens (torchft's own
    failure to reach it is a Rust error, long after start-up)."""
    import socket
    import urllib.parse

    url = urllib.parse.urlsplit(address)
    try:
        socket.create_connection((url.hostname, url.port), timeout=timeout).close()
    except OSError as err:
        raise ConfigError(f'[fault_tolerance] lighthouse = "{address}": no lighthouse answers there '
                          f"({err.strerror or err}); start one first (torchft_lighthouse --min_replicas 1 "
                          f"--bind [::]:{url.port}, docs/reliability.md) or fix the address") from None


def check_speed_options(cfg: JobConfig, dims: ParallelDims) -> None:
    """[compile] async_tp and [float8] need hardware and packages a machine may lack: say which."""
    dev = device_type(cfg)
    if cfg.compile.async_tp:
        reason = async_tp_unavailable(dev, compile=cfg.compile.enable, tp=dims.tp)
        if reason:
            raise ConfigError(f"[compile] async_tp = true cannot run here: {reason}")
    if cfg.float8.enable:
        reason = float8_unavailable(dev)
        if reason:
            raise ConfigError(f"[float8] enable = true cannot run here: {reason}")
        if cfg.float8.enable_fsdp_float8_all_gather and cfg.float8.recipe != "tensorwise":
            raise ConfigError(f'[float8] enable_fsdp_float8_all_gather = true needs recipe = "tensorwise" (got '
                              f'"{cfg.float8.recipe}"): a rowwise scale needs the whole row, which only the '
                              "all-gather brings")


@dataclass
class Parts:
    """This rank's share of the model, parallelized over the mesh."""
    mesh: object
    parts: list[tuple[int, nn.Module]]   # (stage index, module); one (0, model) without a pipeline
    model: nn.Module                     # the whole model, on meta: its config, names and ties
    schedule: object = None              # the pipeline schedule over these stages (pipeline_schedule)

    @property
    def modules(self) -> list[nn.Module]:
        return [module for _, module in self.parts]


def build_parts(cfg: JobConfig, layout: ParallelDims, mesh, model: nn.Module) -> Parts:
    """Cut this rank's pipeline stages out of the meta model (nothing else is ever
    allocated), then apply float8, TP, activation checkpointing, compile and FSDP to each."""
    pp_mesh = submesh(mesh, "pp")
    parts = [(0, model)] if pp_mesh is None else split_into_stages(model, pp_mesh, layout.stage_layers,
                                                                   style=layout.placement)
    run = Parts(mesh, [(i, parallelize_part(part, mesh, cfg, layout)) for i, part in parts], model)
    if cfg.lora.enable:  # a weight copied for a stage, or made by a wrapper, must stay frozen
        stray = [n for part in run.modules for n, p in part.named_parameters() if p.requires_grad and not is_adapter(n)]
        if stray:
            raise RuntimeError(f"[lora]: base weights left trainable after parallelizing: {stray[:3]}")
    return run


def parallelize_part(part: nn.Module, mesh, cfg: JobConfig, layout: ParallelDims) -> nn.Module:
    p, t = cfg.parallelism, cfg.training
    mixed = None
    if (t.mixed_precision_param, t.mixed_precision_reduce) != ("float32", "float32"):
        mixed = mixed_precision_policy(t.mixed_precision_param, t.mixed_precision_reduce)
    if cfg.fault_tolerance.enable and mixed is None:
        # FSDP even where the group has one rank: its all-reduce hook is what averages the
        # gradients over the replica groups (training/fault_tolerance.py).
        mixed = MixedPrecisionPolicy()
    if cfg.float8.enable:  # first: FSDP then shards the float8 layers' weights as usual
        apply_float8(part, skip=registry.get(cfg.model.name).high_precision, recipe=cfg.float8.recipe,
                     fsdp_float8_all_gather=cfg.float8.enable_fsdp_float8_all_gather)
    return parallelize(part, mesh, sharding_strategy=layout.strategy, mixed_precision=mixed,
                       cpu_offload=p.cpu_offload, sequence_parallel=p.sequence_parallel,
                       loss_parallel=p.loss_parallel, activation_checkpoint=layout.ac,
                       ac_every=cfg.activation_checkpoint.selective_every, compile=cfg.compile.enable,
                       async_tp=cfg.compile.async_tp, ep=layout.ep)


def build_optimizer(cfg: JobConfig, modules: list[nn.Module]) -> tuple[Optimizers, Schedulers]:
    o, s = cfg.optimizer, cfg.lr_scheduler
    optimizer = Optimizers(modules, name=o.name, output_layer=registry.get(cfg.model.name).output_layer,
                           muon=o.muon_settings(), lr=o.lr, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                           weight_decay=o.weight_decay)
    scheduler = Schedulers(optimizer, warmup_steps=s.warmup_steps, total_steps=cfg.training.steps,
                           decay_type=s.decay_type, min_lr_ratio=s.min_lr_ratio, decay_ratio=s.decay_ratio)
    return optimizer, scheduler


def build_step(cfg: JobConfig, layout: ParallelDims, run: Parts, optimizer: Optimizers, device: torch.device,
               ft=None):
    """``step(micro_batches, step_number) -> (loss, grad_norm)``: forward, backward, clip
    and update, with or without a pipeline schedule. A weight tied across pipeline stages
    (its copies start equal: init draws each under its source's name) gets its copies'
    gradients summed every step. ``ft``: [fault_tolerance]'s (training/fault_tolerance.py):
    the update waits for the quorum's commit, the loss is the mean over the replica groups."""
    if ft is not None and ft.enabled:
        from meshtrain.training.fault_tolerance import CommittingOptimizer

        group_step = build_step(cfg, layout, run, CommittingOptimizer(optimizer, ft), device)

        def step(micro_batches, number):
            loss, grad_norm = group_step(micro_batches, number)
            return ft.mean_over_groups(loss), grad_norm
        return step
    mesh, t = run.mesh, cfg.training
    pp_mesh, dp_mesh, cp_mesh = submesh(mesh, "pp"), submesh(mesh, "dp"), submesh(mesh, "cp")
    loss_parallel = submesh(mesh, "tp") is not None and cfg.parallelism.loss_parallel
    select_loss(chunked=t.chunked_loss, compiled=cfg.compile.loss)  # process-wide: every step's cross-entropy
    if not layout.pipelined:
        model = run.modules[0]

        def step(micro_batches, number):
            return train_step(model, optimizer, micro_batches, max_norm=t.max_norm, loss_parallel=loss_parallel,
                              dp_mesh=dp_mesh, cp_mesh=cp_mesh, device=device, step=number, skip_nonfinite=True,
                              gradient_sync=layout.gradient_sync)
        return with_float8_scales(cfg, run, step)

    # A weight tied across stages (GPT-2's embedding and output) has a copy at each end.
    tied = tie_across_stages(run.modules, mesh, pp_mesh, run.model.tied_weights())
    first, last = holds_ends(layout, run)
    schedule = pipeline_schedule(cfg, layout, run, device)

    def step(micro_batches, number):
        return pipeline_train_step(schedule, run.modules, optimizer, micro_batches, first=first, last=last,
                                   max_norm=t.max_norm, loss_parallel=loss_parallel, dp_mesh=dp_mesh,
                                   pp_mesh=pp_mesh, cp_mesh=cp_mesh, device=device, step=number,
                                   skip_nonfinite=True, tied=tied)
    return with_float8_scales(cfg, run, step)


def precomputes_float8_scales(cfg: JobConfig) -> bool:
    """Whether each step begins with `precompute_float8_scales` (FSDP's float8 all-gather):
    train.py's steps and the dry run's traced one alike."""
    return cfg.float8.enable and cfg.float8.enable_fsdp_float8_all_gather


def with_float8_scales(cfg: JobConfig, run: Parts, step):
    """With FSDP's float8 all-gather, each step begins by computing every weight's float8
    scale from the weights as they are (`precompute_float8_scales`: one all-reduce), so the
    first step and a resumed one gather with the same scales as every other; otherwise
    ``step`` itself. Without it each all-gather would compute its weights' scales itself,
    one all-reduce per weight per gather."""
    if not precomputes_float8_scales(cfg):
        return step

    def scales_then_step(micro_batches, number):
        precompute_float8_scales(run.modules)
        return step(micro_batches, number)
    return scales_then_step


def model_metrics(run: Parts) -> dict[str, float]:
    """The scalars the model reports of its last step (its optional ``metrics()``, e.g. a
    mixture of experts' loads), from every pipeline stage: a tag several stages report is
    summed. Every rank calls it on the same steps (a collective under a pipeline)."""
    import torch.distributed as dist

    def merged(dicts) -> dict[str, float]:
        out: dict[str, float] = {}
        for d in dicts:
            for tag, value in d.items():
                out[tag] = out.get(tag, 0.0) + value
        return out

    mine = merged(part.metrics() for part in run.modules if callable(getattr(part, "metrics", None)))
    pp_mesh = submesh(run.mesh, "pp")
    if pp_mesh is None or not hasattr(run.model, "metrics"):  # the same answer on every rank: no hang
        return mine
    everyone = [None] * pp_mesh.size()
    dist.all_gather_object(everyone, mine, group=pp_mesh.get_group())
    return merged(everyone)


def holds_ends(layout: ParallelDims, run: Parts) -> tuple[bool, bool]:
    """Whether this rank holds the first pipeline stage (feeds tokens) and the last
    (computes the loss)."""
    ids = [i for i, _ in run.parts]
    return 0 in ids, len(layout.stage_layers) - 1 in ids


def pipeline_schedule(cfg: JobConfig, layout: ParallelDims, run: Parts, device: torch.device):
    """This rank's pipeline schedule, built once per `Parts`: the training step and the
    validation (its forward-only ``eval``) run the same stages. The loss of each schedule
    micro-batch is divided by every micro-batch of the step, so a step's losses sum to its
    mean (training/step.py `pipeline_loss_fn`)."""
    if run.schedule is None:
        per_step = layout.pp_microbatches * layout.grad_accum(cfg.training.global_batch_size)
        run.schedule = build_schedule(layout.pp_schedule, run.parts, submesh(run.mesh, "pp"),
                                      n_microbatches=layout.pp_microbatches, n_stages=len(layout.stage_layers),
                                      device=device, loss_fn=pipeline_loss_fn(per_step))
    return run.schedule


def open_checkpoint(cfg: JobConfig, run: Parts, optimizer, scheduler, data, run_dir: Path):
    """(the checkpoint manager or None, the step to resume after: 0 for a fresh run)."""
    c = cfg.checkpoint
    if not c.enable:
        return None, 0
    # Its own lock: the folder may lie outside the run folder, shared by mistake with another run.
    claim_folder(run_dir / c.folder, run_dir=run_dir, key="[checkpoint] folder")
    checkpoint = CheckpointManager(run_dir / c.folder, parts=run.modules, optimizers=optimizer,
                                   schedulers=scheduler, model_config=run.model.cfg,
                                   job_config_text=config_to_toml(cfg), interval=c.interval,
                                   keep_latest_k=c.keep_latest_k, async_save=c.async_save,
                                   last_save_model_only=c.last_save_model_only,
                                   export_dtype=getattr(torch, c.export_dtype),
                                   if_config_differs=c.if_config_differs, tied=run.model.tied_weights())
    start_step, data_state = checkpoint.resume(c.load_step)
    if data_state:
        data.load_state_dict(data_state)  # refuses a different dataset / seq_len / batch
    return checkpoint, start_step


def open_hf_export(cfg: JobConfig, run: Parts, run_dir: Path):
    """Hugging Face folders every [checkpoint] export_hf_interval steps (training/hf_export.py),
    or None when it is 0."""
    from meshtrain.training.hf_export import HFExport

    c = cfg.checkpoint
    if not c.export_hf_interval:
        return None
    (module,) = run.modules  # pp = 1: config_checks refuses export during training under a pipeline
    return HFExport(run_dir / "hf", module=module, family=registry.get(cfg.model.name), model_config=run.model.cfg,
                    interval=c.export_hf_interval, background=c.async_save)


def load_initial_weights(cfg: JobConfig, run: Parts) -> None:
    """A fresh run (no checkpoint resumed): the base model from [checkpoint]
    initial_load_hf, the adapters from [lora] initial_load_adapter, where given."""
    if cfg.checkpoint.initial_load_hf:
        load_hf_weights(cfg, run)
    if cfg.lora.initial_load_adapter:
        load_adapter(cfg, run)


def load_adapter(cfg: JobConfig, run: Parts) -> None:
    """[lora] initial_load_adapter: each rank reads only its own blocks of the adapters."""
    from meshtrain.training.lora_files import load_adapter_, unused_adapters

    folder = cfg.lora.initial_load_adapter
    unused = unused_adapters(run.model, folder)
    if unused:
        raise CheckpointError(f'[lora] initial_load_adapter = "{folder}" holds adapters this model has no place '
                              f"for ({len(unused)}, e.g. {unused[0]}): [lora] target_modules = "
                              f"{json.dumps(cfg.lora.target_modules)} leaves them out, or the folder is of another "
                              "model")
    for part in run.modules:
        try:
            load_adapter_(part, folder)
        except (ValueError, FileNotFoundError) as err:  # the folder does not fit the model
            raise CheckpointError(f'[lora] initial_load_adapter = "{folder}": {err}') from None


def load_hf_weights(cfg: JobConfig, run: Parts) -> None:
    """Fine-tuning: each rank reads only its own shards of each tensor from the folder."""
    hf = registry.get(cfg.model.name).hf_module()
    for part in run.modules:
        try:
            hf.load_hf_weights_(part, cfg.checkpoint.initial_load_hf)
        except (ValueError, FileNotFoundError) as err:  # the folder does not fit the model
            raise CheckpointError(f"[checkpoint] initial_load_hf: {err}") from None


def claim_run_dir(run_dir: Path) -> None:
    """One run per folder (training/run_lock.py)."""
    claim_folder(run_dir)


def claim_folder(folder: Path, *, run_dir: Path | None = None, key: str | None = None) -> None:
    """Rank 0 takes the folder's lock (training/run_lock.py); every rank learns the answer,
    so a second job on the same folder stops on all its ranks at once."""
    import torch.distributed as dist

    from meshtrain.training import run_lock

    refusal = [None]
    if dist.get_rank() == 0:
        try:
            run_lock.acquire(folder, run_dir=run_dir, key=key)
        except ConfigError as err:
            refusal[0] = str(err)
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0]:
        raise ConfigError(refusal[0])
