"""transformers' tensor-parallel style words, as torch's ParallelStyles.

transformers writes a model's TP plan as words (`base_model_tp_plan`: "colwise",
"embedding_rowwise", ...) that name its own style classes. meshtrain applies torch's
styles instead, so each word is translated here by what it does to the weights, the
input and the output; a word that no torch style expresses is refused, with why and what
to do instead. tests/test_hf_tp_styles.py scans every plan the installed transformers
ships, so a word new to transformers fails that test rather than a user's run.
"""

from __future__ import annotations

from typing import Callable

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from meshtrain.models.hf.config import HFModelError

# word -> the torch style (a fresh one per call: torch styles keep state once applied);
# None: the module stays whole on every TP rank (FSDP still shards it over data parallel).
STYLES: dict[str, Callable[[], ParallelStyle | None]] = {
    # A Linear split by output features (each rank its own heads / MLP columns), and the
    # one after it by input features (partial sums all-reduced).
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    # The column split's output gathered: the next op needs all of it (OLMo2's norm over
    # the whole q; Phi3's fused qkv, cut into q, k, v by position). "_rep" is the old name.
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    # The row split of a whole input: each rank keeps its own slice of it.
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    # A module on each rank's own heads (Qwen3's, Gemma3's per-head q/k norms) whose weight
    # is whole on every rank: its input is labelled as split (dim 2 of [batch, seq, heads,
    # head_dim]; any dim but the normalized last one computes the same), so DTensor sums
    # the weight's gradient over the TP ranks -- without, each rank's copy would drift.
    "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=2, use_local_output=True),
    # An nn.Embedding split by vocabulary rows: every rank gets all token ids, looks up
    # the rows it holds (zeros for the others), and the partial lookups are summed.
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    # ... or by embedding columns: each rank looks up its slice of every vector, and the
    # slices are gathered.
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    # Whole on every rank: Inkling2's embedding normalizes each looked-up row in forward,
    # which a row split would do to each rank's partial lookup.
    "replicate": lambda: None,
}

_ONLY_THE_MLP = "splitting only the MLP (gate/up colwise, down rowwise)"
_EXPERTS_WHOLE = "leaving the experts whole (FSDP still shards them)"

# word -> (why meshtrain does not translate it, the plan to give instead of the model's).
REFUSED: dict[str, tuple[str, str]] = {
    "moe_tp_experts": (
        "it splits a mixture-of-experts layer's experts (each rank runs its slice of every expert, "
        "the outputs summed); meshtrain splits experts by expert parallelism instead ([parallelism] ep), "
        "and drops these entries itself for experts in transformers' fused layout",
        _EXPERTS_WHOLE),
    "moe_identity_expert": (
        "it divides an identity expert's input by the TP size so that moe_tp_experts' sum counts it "
        "once; it only exists alongside moe_tp_experts (meshtrain splits experts by [parallelism] ep instead)",
        _EXPERTS_WHOLE),
    "packed_colwise": (
        "it splits the experts' stacked, fused gate_up weight (a bare 3-D parameter, each rank keeping "
        "its slice of gate and of up): expert weights, which meshtrain splits by expert ([parallelism] ep) instead",
        _EXPERTS_WHOLE),
    "packed_rowwise": (
        "it splits the experts' stacked, fused weights along their input features: expert weights, "
        "which meshtrain splits by expert ([parallelism] ep) instead",
        _EXPERTS_WHOLE),
    "all_reduce": (
        "it sums a module's output over the TP ranks, for modules that compute with bare parameters "
        "split by other entries (Inkling's shared experts); torch's styles split nn.Linear and "
        "nn.Embedding modules, and their row split already sums its output",
        "leaving that module and its parameters whole"),
    "local_params": (
        "it runs a module's forward on its own split bare parameters as local tensors (attention "
        "sinks split by heads); torch's styles split nn.Linear and nn.Embedding modules, not a bare "
        "parameter that a module's forward reads",
        _ONLY_THE_MLP),
    "mla_kv_a_proj": (
        "in multi-head latent attention (DeepSeek-V2, MiniCPM3) the rotary slice of kv_a_proj_with_mqa's "
        "output reaches every head without passing a split layer, so that slice's gradient must be summed "
        "over the TP ranks and the rest's must not; torch's styles act on a module's whole output",
        _ONLY_THE_MLP),
    "unit_colwise": (
        "it splits query/key/value projections by whole heads over a mesh of its own, replicating heads "
        "where there are fewer than TP ranks (MiniCPM5-MoE's key and value heads), and sums their "
        "replicas' gradients; torch's ColwiseParallel splits a Linear's rows evenly over every TP rank",
        _ONLY_THE_MLP),
    "unit_rowwise": (
        "it is the output projection's half of unit_colwise: its input split by whole heads over that "
        "style's own mesh, its gradient scaled by the replicas; torch's RowwiseParallel splits over every TP rank",
        _ONLY_THE_MLP),
    "sequence_parallel": (
        "it splits the hidden states by sequence between blocks, but transformers builds the rotary "
        "tables and the causal mask from the sequence length it is handed, so meshtrain keeps a "
        "Hugging Face model's hidden states whole",
        "leaving the norms whole"),
}


def translate(word: str) -> ParallelStyle | None:
    """The torch style for a translated word (None: the module stays whole)."""
    return STYLES[word]()


def refusal(entries: dict[str, list[str]]) -> str:
    """Why plan entries (word -> the module patterns given it) cannot be translated, and
    what to do instead."""
    reasons, instead = [], []
    for word, keys in entries.items():
        why, way = REFUSED.get(word, (f"not a transformers TP style meshtrain knows (it translates "
                                      f"{', '.join(STYLES)})", "without it"))
        reasons.append(f"{', '.join(keys)} = {word!r}: {why}")
        instead += [way] if way not in instead else []
    return f"{'; '.join(reasons)}. Give [model] hf_tp_plan {' and '.join(instead)}, or use tp = 1"


def plan_words(entries: list[str], where: str) -> dict[str, str]:
    """`[model] hf_tp_plan` entries "pattern=style" as a dict, checked."""
    plan = {}
    for entry in entries:
        key, sep, word = (s.strip() for s in entry.partition("="))
        if word in REFUSED:
            raise HFModelError(f"{where}: {entry!r}: meshtrain does not translate {word!r}: {REFUSED[word][0]} "
                               f"(the styles it translates: {', '.join(STYLES)})")
        if not sep or not key or word not in STYLES:
            raise HFModelError(f"{where}: {entry!r} is not \"module.pattern=style\" with style one of "
                               f"{', '.join(STYLES)}")
        plan[key] = word
    return plan
