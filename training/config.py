"""The run configuration's schema: one dataclass per TOML section, every field's default,
accepted values and help next to it.

A run is one JobConfig. training/config_loader.py fills it -- defaults, then a TOML file
(which may `extends` another), then `--section.key value` flags -- and
training/config_checks.py checks every value against the metadata here before any
process group exists. The help text and
docs/config.md are generated from the same metadata, so the three cannot drift apart.
Nothing here imports torch: reading a config stays fast. The strategies, AC modes and
pipeline schedules accepted are parallel's own (parallel/vocabulary.py, torch-free).
"""

import dataclasses
import math
from dataclasses import dataclass, field, fields

from meshtrain.models import registry
from meshtrain.parallel.vocabulary import AC_MODES, GRADIENT_SYNC, SCHEDULES, STRATEGIES

DTYPES = ("float32", "bfloat16")
PP_SCHEDULES = tuple(SCHEDULES)  # parallel's own list, read without importing torch


def _families() -> tuple[str, ...]:
    return tuple(registry.FAMILIES)


def _flavors() -> tuple[str, ...]:
    return tuple(dict.fromkeys(f for family in registry.FAMILIES.values() for f in family.flavors))


def choices(meta) -> tuple:
    """A field's accepted values; model families and flavors are read from the registry
    when asked, so a family registered later is accepted too."""
    found = meta["choices"]
    return found() if callable(found) else found


class ConfigError(Exception):
    """A bad config; the message is the whole explanation shown to the user."""


def opt(default, help: str, **checks):
    """A config field. ``checks`` is data for the validator and the help text:
    choices; min/max (inclusive) and gt/lt (exclusive) bounds, which apply to each item
    of a list; also (values accepted outside the range, such as -1 = infer); aliases
    (spellings people try for this key, e.g. torchtitan's names, so the typo message can
    point at the right one). A list default is copied for every config."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **checks})
    return field(default=default, metadata={"help": help, **checks})


def default_of(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@dataclass
class JobSection:
    name: str = opt("debug", "run name, used in logs and output paths")
    output_dir: str = opt("outputs", "folder for checkpoints and TensorBoard logs")
    description: str = opt("", "free text, shown in TensorBoard")
    device: str = opt("auto", "auto: cuda when available, else cpu", choices=("auto", "cpu", "cuda"))


@dataclass
class ModelSection:
    name: str = opt("llama", "model family: llama (Llama 3), gpt2 (GPT-2/GPT-3 shapes, tied "
                    "embeddings), hf (any Hugging Face causal LM, from hf_config), or any family in "
                    "models/registry.py", choices=_families)
    flavor: str = opt("debug", "size preset of that family (debug is tiny, for tests)",
                      choices=_flavors)
    vocab_size: int = opt(0, "embedding rows; 0: take it from the tokenizer", min=0,
                          max=2**31)  # token ids are int32
    norm_eps: float = opt(1e-5, "epsilon of the norms (RMSNorm in Llama, LayerNorm in GPT-2)", gt=0,
                          lt=math.inf)
    n_layers: int = opt(0, "transformer blocks; 0: the flavor's (fewer: a flavor's blocks on fewer "
                        "GPUs, for benchmarks and smoke tests)", min=0, max=10_000)
    dim: int = opt(0, "model width (hidden size); 0: the flavor's. With n_heads, n_kv_heads, ffn_hidden, "
                   "n_layers and vocab_size: any size of a native family, no config.json", min=0, max=1_000_000)
    n_heads: int = opt(0, "attention heads (must divide dim); 0: the flavor's", min=0, max=100_000)
    n_kv_heads: int = opt(0, "key/value heads (GQA; must divide n_heads); 0: the flavor's. Families with "
                          "GQA (llama)", min=0, max=100_000)
    ffn_hidden: int = opt(0, "FFN width; 0: the flavor's. Families whose FFN width is a setting (llama); "
                          "gpt2's is 4 x dim", min=0, max=10_000_000)
    hf_config: str = opt("", 'name = "hf": a Hugging Face config.json (or its folder) of any causal LM '
                         "transformers knows; the model is built from it on meta, nothing downloaded")
    hf_block_classes: list[str] = opt([], 'name = "hf": the transformer block classes FSDP wraps (like '
                                      "Accelerate's fsdp_transformer_layer_cls_to_wrap); []: the "
                                      "architecture's _no_split_modules")
    hf_tp_plan: list[str] = opt([], 'name = "hf": a TP plan as "pattern=style" entries relative to the '
                                'base model, e.g. "layers.*.mlp.up_proj=colwise"; []: the config\'s '
                                "base_model_tp_plan")


@dataclass
class MoESection:
    """[model] name = "moe": the mixture's settings over the flavor's (0, "" or -1: the flavor's)."""
    n_experts: int = opt(0, 'name = "moe": routed experts per MoE layer; 0: the flavor\'s', min=0, max=65_536)
    top_k: int = opt(0, 'name = "moe": experts each token is sent to (at most n_experts); 0: the flavor\'s',
                     min=0, max=65_536)
    score_func: str = opt("", 'name = "moe": router scores, softmax or sigmoid; "": the flavor\'s',
                          choices=("", "softmax", "sigmoid"))
    balance_loss_coef: float = opt(-1.0, 'name = "moe": weight of the sequence-wise load-balance loss (0: off); '
                                   "-1: the flavor's", min=0, lt=math.inf, also=(-1.0,))
    bias_update_rate: float = opt(-1.0, 'name = "moe": step of the loss-free balancing bias after each optimizer '
                                  "step (0: off); -1: the flavor's", min=0, lt=math.inf, also=(-1.0,))
    n_dense_layers: int = opt(-1, 'name = "moe": the first blocks that keep a dense feed-forward of width '
                              "ffn_hidden (DeepSeek's first_k_dense_replace; n_layers: a dense model of the same "
                              "attention); -1: the flavor's", min=0, max=1_000_000, also=(-1,))

    def overrides(self) -> dict:
        """The settings given, as MoEConfig fields (those left at the flavor's omitted)."""
        given = {"n_experts": self.n_experts or None, "top_k": self.top_k or None,
                 "score_func": self.score_func or None,
                 "balance_loss_coef": None if self.balance_loss_coef == -1 else self.balance_loss_coef,
                 "bias_update_rate": None if self.bias_update_rate == -1 else self.bias_update_rate,
                 "n_dense_layers": None if self.n_dense_layers == -1 else self.n_dense_layers}
        return {key: value for key, value in given.items() if value is not None}


@dataclass
class TrainingSection:
    steps: int = opt(20, "optimizer steps to run", min=1,
                     max=10**12)  # far past any run; the schedule's arithmetic is float
    global_batch_size: int = opt(8, "sequences per optimizer step, all data-parallel ranks together", min=1)
    local_batch_size: int = opt(0, "sequences per forward on one rank; 0: global/dp (no accumulation)", min=0)
    seq_len: int = opt(128, "tokens per sequence", min=2,  # one input and one label at least
                       max=2**20)  # beyond needs context parallelism; the rotary tables alone are 0.5 GiB here
    seed: int = opt(0, "seed for weight init and data order", min=-2**63,
                    max=2**64 - 1)  # what torch.manual_seed accepts
    max_norm: float = opt(1.0, "gradient clipping norm; 0 disables clipping", min=0)
    chunked_loss: bool = opt(False, "cross-entropy a chunk of tokens at a time, keeping the logits in their own "
                             "dtype and no fp32 copy of them: 4 bytes per bf16 logit at the loss's peak "
                             "instead of 12 (docs/benchmarks.md, The loss's memory); the same loss and gradients to fp32 rounding")
    dataset: str = opt("stdlib", "corpus: stdlib (Python's own sources), text (dataset_path, "
                       "tokenized at start-up), tokens (dataset_path prepared by meshtrain "
                       "prepare-data, memory-mapped; see docs/data.md) or sft (prompt/response or "
                       "chat records, loss on the responses only; see docs/finetuning.md)",
                       choices=("stdlib", "text", "tokens", "sft"))
    dataset_path: str = opt("", "file or folder for the text dataset; the prepared folder for tokens; for "
                            "sft a .jsonl/.parquet file, a folder of them, or a folder prepared by "
                            "meshtrain prepare-data --kind sft")
    chat_template: str = opt("auto", 'sft "messages" records: tokenizer (the chat template of the '
                             "tokenizer's folder, rendered by transformers), plain (meshtrain's, "
                             "docs/finetuning.md) or auto (the tokenizer's when it has one, else plain)",
                             choices=("auto", "tokenizer", "plain"))
    document_masking: bool = opt(False, "each packed document attends only to itself, its positions counted "
                                 "from 0 (as if alone in its sequence): sft records, or the EOS-separated "
                                 "documents of stdlib/text/tokens windows. Default: true for sft, false for "
                                 "the others (one causal stream, as before); see docs/finetuning.md")
    tokenizer: str = opt("byte", "byte, or the path of a Hugging Face tokenizer.json")
    mixed_precision_param: str = opt("float32", "dtype of parameters in forward/backward", choices=DTYPES)
    mixed_precision_reduce: str = opt("float32", "dtype of the gradient reduction", choices=DTYPES)
    nonfinite: str = opt("stop", "a step whose loss or gradient norm is inf/NaN: stop (after "
                         "checkpointing the last good state) or skip it (no update)", choices=("stop", "skip"))
    max_skipped_steps: int = opt(3, "skip: stop anyway after this many skipped steps", min=0)


@dataclass
class OptimizerSection:
    name: str = opt("AdamW", "optimizer: AdamW, or Muon (torch.optim.Muon) for the 2-D hidden weights and "
                    "AdamW for embeddings, the output layer, norms and biases (docs/optimizers.md)",
                    choices=("AdamW", "Muon"))
    lr: float = opt(3e-4, "peak learning rate (both optimizers with Muon)", gt=0, lt=math.inf)
    beta1: float = opt(0.9, "AdamW beta1", min=0, lt=1)
    beta2: float = opt(0.95, "AdamW beta2", min=0, lt=1)
    eps: float = opt(1e-8, "AdamW epsilon", gt=0, lt=math.inf)
    weight_decay: float = opt(0.1, "decoupled weight decay (matrices and embeddings only; both optimizers "
                              "with Muon)", min=0, lt=math.inf)
    momentum: float = opt(0.95, "Muon: momentum factor (torch.optim.Muon momentum)", min=0, lt=1)
    nesterov: bool = opt(True, "Muon: Nesterov momentum (torch.optim.Muon nesterov)")
    ns_steps: int = opt(5, "Muon: Newton-Schulz iterations (torch.optim.Muon ns_steps)", min=1, lt=100)
    adjust_lr_fn: str = opt("original", "Muon: lr scale per matrix shape: original (sqrt(max(1, rows/cols)), "
                            "torch's default) or match_rms_adamw (0.2 sqrt(max(rows, cols)), Moonlight's, "
                            "for AdamW's lr and weight decay)", choices=("original", "match_rms_adamw"))

    # torch.optim.Muon's settings here; its ns_coefficients and eps keep torch's defaults
    # ([optimizer] eps is AdamW's).
    MUON_KEYS = ("momentum", "nesterov", "ns_steps", "adjust_lr_fn")

    def muon_settings(self) -> dict:
        """torch.optim.Muon's keyword arguments beyond lr and weight_decay."""
        return {k: getattr(self, k) for k in self.MUON_KEYS}


@dataclass
class LRSchedulerSection:
    warmup_steps: int = opt(2, "steps of linear warmup to the peak lr", min=0)
    decay_type: str = opt("cosine", "shape of the decay after warmup",
                          choices=("cosine", "linear", "wsd", "constant"))
    min_lr_ratio: float = opt(0.1, "final lr as a fraction of the peak", min=0, max=1)
    decay_ratio: float = opt(0.2, "wsd: fraction of the steps spent decaying", min=0, max=1)


@dataclass
class ParallelismSection:
    dp_replicate: int = opt(1, "data-parallel replicas (HSDP outer dimension)", min=1,
                            aliases=("data_parallel_replicate_degree", "dp_replicate_degree"))
    dp_shard: int = opt(-1, "FSDP shard degree; -1: whatever the world size leaves", min=1, also=(-1,),
                        aliases=("data_parallel_shard_degree", "dp_shard_degree", "fsdp"))
    tp: int = opt(1, "tensor-parallel degree (keep it within a node)", min=1,
                  aliases=("tensor_parallel", "tensor_parallel_degree", "tp_degree"))
    pp: int = opt(1, "pipeline-parallel stages", min=1,
                  aliases=("pipeline_parallel", "pipeline_parallel_degree", "pp_degree"))
    cp: int = opt(1, "context-parallel degree: ranks that split every sequence (Ulysses attention: two "
                  "all-to-alls per layer trade the sequence split for a head split); keep it within a node",
                  min=1, aliases=("context_parallel", "context_parallel_degree", "cp_degree"))
    ep: int = opt(1, "expert-parallel degree: routed experts split over this many ranks borrowed from dp_shard "
                  "(each holds n_experts / ep; tokens travel by all-to-all); must divide dp_shard and n_experts",
                  min=1, aliases=("expert_parallel", "expert_parallel_degree", "ep_degree"))
    pp_schedule: str = opt("1F1B", "pipeline schedule (torch.distributed.pipelining)", choices=PP_SCHEDULES,
                           aliases=("pipeline_parallel_schedule",))
    pp_microbatches: int = opt(0, "micro-batches the schedule cuts each local batch into; "
                               "0: one per pipeline stage", min=0,
                               aliases=("pipeline_parallel_microbatches", "microbatches"))
    pp_stages_per_rank: int = opt(0, "virtual stages per pp rank (looped / V schedules); "
                                  "0: 1 for GPipe/1F1B, else 2", min=0)
    pp_layers_per_stage: int = opt(0, "layers in each stage (the last takes the rest); "
                                   "0: split as evenly as possible", min=0,
                                   aliases=("pipeline_parallel_layers_per_stage",))
    pp_split_points: list[int] = opt([], "first layer of each stage after the first, e.g. [8, 16, 24]",
                                     min=1, aliases=("pipeline_parallel_split_points",))
    sharding_strategy: str = opt("auto", "what FSDP shards and when it reshards; auto: FULL_SHARD, "
                                 "SHARD_GRAD_OP under a pipeline, HYBRID_* with dp_replicate > 1",
                                 choices=("auto", *STRATEGIES))
    gradient_sync: str = opt("auto", "when gradient accumulation reduces: microbatch (after every micro-batch's "
                             "backward; FSDP2's default, least memory) or step (once, after the last: DDP's no_sync, "
                             "Megatron's and ZeRO-1's; each FSDP unit's weights stay gathered and its unsharded fp32 "
                             "gradient sum is held between micro-batches, 6 bytes per parameter this rank holds); "
                             "auto: step under a pipeline, which always reduces once, else microbatch",
                             choices=("auto", *GRADIENT_SYNC))
    sequence_parallel: bool = opt(True, "shard norms/residuals over the sequence inside TP")
    loss_parallel: bool = opt(True, "cross-entropy on vocab-sharded logits inside TP")
    cpu_offload: bool = opt(False, "keep FSDP parameter shards and optimizer state on CPU")


@dataclass
class CheckpointSection:
    enable: bool = opt(False, "save checkpoints, and resume from the newest one at start")
    folder: str = opt("checkpoint", "checkpoint folder, inside the job's output folder")
    interval: int = opt(500, "save every this many steps (and at the last step)", min=1)
    keep_latest_k: int = opt(0, "checkpoints to keep; 0 keeps all", min=0)
    async_save: bool = opt(False, "write checkpoints in the background while training goes on",
                           aliases=("async_mode",))
    load_step: int = opt(0, "resume from this step's checkpoint, moving newer ones aside (abandoned-TIME/); "
                            "0: the newest complete one", min=0)
    last_save_model_only: bool = opt(False, "the last step saves model weights only (export_dtype)",
                                     aliases=("last_save_model_weights_only",))
    export_dtype: str = opt("float32", "dtype of the model-only last save", choices=DTYPES)
    if_config_differs: str = opt("refuse", "the newest checkpoint was written with another config "
                                 "(model, data, optimizer...): refuse, or resume anyway (this config's lr "
                                 "applies)",
                                 choices=("refuse", "resume"))
    export_hf_interval: int = opt(0, "write a Hugging Face folder (config.json + safetensors, what "
                                  "from_pretrained loads) to the run folder's hf/step-N/ every this many steps "
                                  "and at the last step, in the background with async_save; 0: off. Llama and "
                                  '[model] name = "hf", pp = 1 (docs/checkpointing.md)', min=0)
    initial_load_hf: str = opt("", "a Hugging Face folder (config.json + *.safetensors; Llama, or the "
                               'model of [model] name = "hf") to start from when there is no '
                               "checkpoint to resume")


TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")


@dataclass
class MetricsSection:
    log_freq: int = opt(10, "log every this many steps", min=1)
    enable_tensorboard: bool = opt(True, "write TensorBoard event files; false drops tensorboard from trackers")
    trackers: list[str] = opt(["tensorboard"], "where rank 0 logs the scalars and the config: tensorboard "
                              "(the run folder's tb/), wandb (offline, wandb/), mlflow (a file store, "
                              "mlflow/), trackio (trackio/); the last three are extras, e.g. "
                              'pip install "meshtrain[wandb]" (docs/tensorboard.md)', choices=TRACKERS)


@dataclass
class ProfilingSection:
    enable: bool = opt(False, "profile a window of steps: a torch.profiler trace per rank under the run "
                       "folder's profile/, and memory (CUDA: the allocator's history; CPU: peak RSS per "
                       "step phase); see docs/profiling.md")
    start_step: int = opt(3, "the first profiled step (the first steps are slower: warm-up, compilation)",
                          min=1)
    steps: int = opt(2, "profiled steps, from start_step on", min=1, max=1000)


@dataclass
class ActivationCheckpointSection:
    mode: str = opt("none", "recompute activations in backward: none, full (every block), "
                    "selective (every selective_every-th block) or op (every block, keeping "
                    "matmul, attention and collective outputs: only cheap ops are recomputed)",
                    choices=AC_MODES)
    selective_every: int = opt(2, "selective: checkpoint one block in this many", min=1)


@dataclass
class CompileSection:
    enable: bool = opt(False, "torch.compile each transformer block")
    loss: bool = opt(False, "torch.compile the cross-entropy too (fuses the fp32 upcast of the "
                     "logits into the softmax instead of materializing it)")
    async_tp: bool = opt(False, "async tensor parallelism: compile overlaps each TP all-gather / "
                         "reduce-scatter with its matmul (needs CUDA, enable = true and tp > 1)")


@dataclass
class Float8Section:
    enable: bool = opt(False, "train the Linear layers (not the output layer) in float8 with "
                       "torchao (pip install torchao; CUDA with compute capability >= 8.9; on CPU torch's "
                       "reference float8 matmul: right numbers, no speed-up)")
    recipe: str = opt("tensorwise", "torchao's scaling recipe: tensorwise (one scale per tensor; float8 "
                      "all-gathers under TP) or rowwise (one per row: more accurate with outliers)",
                      choices=("tensorwise", "rowwise"))
    enable_fsdp_float8_all_gather: bool = opt(False, "FSDP gathers the float8 layers' weights in float8 (half "
                                              "the bf16 bytes), their scales computed at the start of each "
                                              "step in one all-reduce; tensorwise only")


@dataclass
class ValidationSection:
    enable: bool = opt(False, "evaluate the loss on held-out data every interval steps and after the last "
                       "step (no gradients; training is bitwise the same with it on or off)")
    interval: int = opt(100, "evaluate every this many steps (and after the last step)", min=1)
    steps: int = opt(10, "batches of global_batch_size sequences per evaluation (the same batches every "
                     "time)", min=1)
    split: float = opt(0.0, "the fraction of the training data held out for validation (when dataset is "
                       "empty): the end of its token stream, or for sft whole records (a fixed selection); "
                       "training never reads it, whether or not enable is on", min=0, lt=1)
    dataset: str = opt("", "validation data, any kind training accepts: stdlib, text, tokens or sft (with "
                       "[training]'s tokenizer and chat_template); empty: the held-out split of the training "
                       "data", choices=("", "stdlib", "text", "tokens", "sft"))
    dataset_path: str = opt("", "file or folder of the text dataset; the prepared folder for tokens; for sft "
                            "a .jsonl/.parquet file, a folder of them, or a folder prepared by meshtrain "
                            "prepare-data --kind sft")


@dataclass
class LoraSection:
    enable: bool = opt(False, "train low-rank adapters (LoRA) on the target_modules' Linear layers, every base "
                       "weight frozen: no gradient, no optimizer state (docs/finetuning.md)")
    rank: int = opt(8, "the adapters' rank r: each adapted [out, in] weight W gets B [out, r] and A [r, in]",
                    min=1, max=65536, aliases=("r", "lora_r"))
    alpha: float = opt(16.0, "the adapters' output is scaled by alpha / rank", gt=0, lt=math.inf,
                       aliases=("lora_alpha",))
    dropout: float = opt(0.0, "dropout on the adapters' input (the base layer sees it undropped)", min=0, lt=1,
                         aliases=("lora_dropout",))
    target_modules: list[str] = opt(["all-linear"], "the Linear layers that get adapters, as PEFT spells "
                                    'them: a module name or the end of its path ("q_proj", '
                                    '"self_attn.q_proj"; llama: "wq", "w1"...), or "all-linear" (every '
                                    "Linear but the output layer)")
    initial_load_adapter: str = opt("", "a PEFT adapter folder (adapter_config.json + "
                                    "adapter_model.safetensors) to start the adapters from when there is no "
                                    "checkpoint to resume; empty: A random, B zero (the adapters start as "
                                    "a no-op)")


@dataclass
class CommSection:
    init_timeout_seconds: float = opt(600.0, "collective timeout until the first step is done "
                                      "(start-up, compilation, shape inference)", gt=0,
                                      max=365 * 86400)  # a year; inf or ~1e14 overflow timedelta
    train_timeout_seconds: float = opt(300.0, "collective timeout after the first step: a rank "
                                       "that dies or stalls fails the others this fast, and the run "
                                       "folder's hang/ says which rank is behind", gt=0,
                                       max=365 * 86400, aliases=("timeout",))


@dataclass
class FaultToleranceSection:
    enable: bool = opt(False, "replica groups that drop out and rejoin without stopping the others, with torchft "
                       '(pip install "meshtrain[ft]"): each group is a torchrun job of its own, FSDP inside it, '
                       "its gradients averaged over the live groups each step; a lighthouse must be running "
                       "(docs/reliability.md)")
    replica_id: int = opt(0, "this replica group's number, 0 .. group_size - 1 (it takes that share of "
                          "every global batch)", min=0, max=100_000)
    group_size: int = opt(1, "how many replica groups the job has: the global batch is split over "
                          "group_size x the data-parallel ranks of a group", min=1, max=100_000)
    lighthouse: str = opt("http://localhost:29510", "the torchft lighthouse's address, http://HOST:PORT "
                          "(started by torchft_lighthouse --min_replicas 1, docs/reliability.md)")


@dataclass
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    moe: MoESection = field(default_factory=MoESection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    activation_checkpoint: ActivationCheckpointSection = field(default_factory=ActivationCheckpointSection)
    compile: CompileSection = field(default_factory=CompileSection)
    float8: Float8Section = field(default_factory=Float8Section)
    validation: ValidationSection = field(default_factory=ValidationSection)
    lora: LoraSection = field(default_factory=LoraSection)
    comm: CommSection = field(default_factory=CommSection)
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
    fault_tolerance: FaultToleranceSection = field(default_factory=FaultToleranceSection)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(JobConfig)}
