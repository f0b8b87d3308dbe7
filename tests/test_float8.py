"""[float8] composes with tensor parallelism and FSDP: each layout's float8 step equals
torchao's own Float8Linear on a plain single-process Llama trained by a hand-written loop
(tests/oracle.py: AdamW, clip_grad_norm_, F.cross_entropy), from the same weights.

Float8 keeps 3 mantissa bits, so no rounding-scale tolerance like test_parity's holds:
two runs whose fp32 sums differ in the last bit round a few values to neighbouring float8
numbers. A data-parallel rank scales its own share of the batch (a tensorwise scale of an
activation is the maximum over what the rank holds), so the reference runs each rank's
share as a micro-batch of its own, as gradient accumulation does. The yardstick is
float8's own effect, the distance between the fp32 and the
float8 reference: at the first step (same weights) each layout's loss lies within a tenth
of it from the float8 reference and its gradient norm within a half. The fp32 layout
beside them (float8 off) sits a whole effect away and fails the same check
(test_the_check_fails_when_float8_is_off). torch's CPU float8 matmul runs it all.

Also checked: FSDP's float8 all-gather gathers float8 (FSDP's own records), and each
layout's second step is finite.
"""

from __future__ import annotations

import pytest
import torch

from tests import oracle
from tests.conftest import train_layouts
from tests.test_parity import oracle_settings
from tests.workers import float8_parity, parity

pytestmark = pytest.mark.slow  # one 4-process torchrun start-up for every layout

FLOAT8_LAYOUTS = [name for name, (_, recipe, _) in float8_parity.LAYOUTS.items() if recipe]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return train_layouts("tests/workers/float8_parity.py", tmp_path_factory.mktemp("float8"),
                         float8_parity.LAYOUTS, nproc=4)


_first_steps = {}


def first_step(init: dict, recipe: str | None, shares: int = 1) -> oracle.Run:
    """One step of the plain model, converted by torchao itself when ``recipe`` is given,
    over the batch cut into ``shares`` micro-batches (one per data-parallel rank)."""
    if (recipe, shares) not in _first_steps:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        model = parity.build({}, meta=False)
        model.load_state_dict(init, strict=False)
        model.init_buffers()
        if recipe:
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                       module_filter_fn=lambda module, name: name != "output")
        tokens = parity.batches(model.cfg.vocab_size)[0]
        step = [(t[:, :-1], t[:, 1:]) for t in tokens.chunk(shares)]
        _first_steps[recipe, shares] = oracle.train(model, [step], **oracle_settings())
    return _first_steps[recipe, shares]


def deviations(run: dict, recipe: str, dims: dict) -> dict:
    """First-step distances of ``run`` from the float8 reference, and float8's own effect."""
    shares = dims.get("dp_shard", 1) * dims.get("dp_replicate", 1)
    f8, fp32 = first_step(run["init"], recipe, shares), first_step(run["init"], None)
    return {"loss": abs(run["losses"][0] - f8.losses[0]), "loss_effect": abs(fp32.losses[0] - f8.losses[0]),
            "norm": abs(run["grad_norms"][0] - f8.grad_norms[0]),
            "norm_effect": abs(fp32.grad_norms[0] - f8.grad_norms[0])}


def matches_float8(d: dict) -> bool:
    return d["loss"] <= d["loss_effect"] / 10 and d["norm"] <= d["norm_effect"] / 2


@pytest.mark.parametrize("layout", FLOAT8_LAYOUTS)
def test_float8_layout_matches_torchao_on_one_process(runs, layout):
    run, (dims, recipe, _) = runs[layout], float8_parity.LAYOUTS[layout]
    assert all(torch.equal(run["init"][k], v) for k, v in runs["fp32_dp2_tp2"]["init"].items())  # same start
    d = deviations(run, recipe, dims)
    assert d["loss_effect"] > 0 and matches_float8(d), (layout, d)
    assert len(run["losses"]) == float8_parity.STEPS and all(torch.isfinite(torch.tensor(run["losses"])))


def test_the_check_fails_when_float8_is_off(runs):
    """The fp32 layout, judged as if it were float8: a whole float8 effect away."""
    d = deviations(runs["fp32_dp2_tp2"], "tensorwise", float8_parity.LAYOUTS["fp32_dp2_tp2"][0])
    assert not matches_float8(d), d


def test_fsdp_float8_all_gather_gathers_float8_weights(runs):
    for layout in ("allgather_dp2_tp2", "allgather_fsdp4"):
        gathered = runs[layout]["all_gather_dtypes"]
        block = {name: dtype for name, dtype in gathered.items() if ".attention.w" in name or ".feed_forward." in name}
        assert block and set(block.values()) == {"torch.float8_e4m3fn"}, (layout, gathered)
        assert gathered["output.weight"] == "torch.float32"  # the output head stays in high precision
    assert "torch.float8_e4m3fn" not in runs["tensorwise_dp2_tp2"]["all_gather_dtypes"].values()
