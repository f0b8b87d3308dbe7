"""Every tensor-parallel style word the installed transformers uses is either translated to
a torch style or refused with a reason (models/hf/tp_styles.py), so a word that a new
transformers release adds fails here rather than in a user's run. Class attributes only:
no model is built. (That the translations train right: tests/test_hf_toml.py.)"""

import pytest
import transformers
from torch.distributed.tensor.parallel import ParallelStyle

from meshtrain.models.hf.tp_styles import REFUSED, STYLES, translate


def words_in_plans() -> dict[str, list[str]]:
    """Style word -> the model types whose config's base_model_tp_plan uses it, over every
    config class transformers has."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    used: dict[str, list[str]] = {}
    for model_type in CONFIG_MAPPING.keys():
        for word in set((getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None) or {}).values()):
            used.setdefault(word, []).append(model_type)
    return used


def unaccounted(used: dict, translated, refused) -> dict[str, list[str]]:
    return {word: types for word, types in used.items() if word not in translated and word not in refused}


@pytest.fixture(scope="module")
def used():
    return words_in_plans()


def test_every_style_in_transformers_plans_is_translated_or_refused(used):
    missing = unaccounted(used, STYLES, REFUSED)
    listed = "; ".join(f"{word!r} (used by {', '.join(types[:5])})" for word, types in missing.items())
    assert not missing, (f"transformers {transformers.__version__} uses tensor-parallel styles that "
                         f"models/hf/tp_styles.py neither translates nor refuses: {listed}")


def test_the_scan_reads_real_plans_and_reports_a_dropped_translation(used):
    # The words the architectures of tests/test_hf_toml.py train with are found ...
    assert {"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce",
            "embedding_rowwise"} <= set(used)
    assert "gpt_neox" in used["embedding_rowwise"] and "qwen3" in used["replicated_with_grad_allreduce"]
    # ... and a translation taken out of the table is reported, with the models using it.
    without = {word: style for word, style in STYLES.items() if word != "embedding_rowwise"}
    assert "gpt_neox" in unaccounted(used, without, REFUSED)["embedding_rowwise"]


def test_every_tp_style_transformers_registers_is_translated_or_refused():
    # The words transformers accepts in a plan, used by its own configs or not (a
    # [model] hf_tp_plan may name any); its expert-parallel styles share the registry.
    from transformers.distributed import tensor_parallel

    registry = tensor_parallel.ALL_PARALLEL_STYLES
    words = [w for w in registry.keys() if type(registry[w]).__module__ == tensor_parallel.__name__]
    assert "colwise" in words and "embedding_rowwise" in words
    missing = [w for w in words if w not in STYLES and w not in REFUSED]
    assert not missing, (f"transformers {transformers.__version__} registers tensor-parallel styles that "
                         f"models/hf/tp_styles.py neither translates nor refuses: {missing}")


def test_tables_are_disjoint_and_translations_are_torch_styles():
    assert not set(STYLES) & set(REFUSED)
    for word in STYLES:
        style = translate(word)
        assert style is None or isinstance(style, ParallelStyle), word
        assert style is None or translate(word) is not style, f"{word}: a style is applied once; each use needs its own"
    for word, (why, instead) in REFUSED.items():
        assert why and instead, word
