"""Every layout trains like plain PyTorch on one process (tests/oracle.py): the same initial
weights bitwise, then losses, gradient norms and every final weight after 8 AdamW steps
with clipping binding, within oracle.K rounding scales of the fp32 reference. 2-D layouts
(FSDP x TP) run on 4 processes; pipeline layouts on 2, 4 or 8."""

import math

import pytest
import torch

from tests import oracle
from tests.conftest import train_layouts
from tests.workers import parity

pytestmark = pytest.mark.slow  # every test here starts processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 4-process torchrun job trains every layout in turn (one start-up, not one per layout),
    then Muon's faulty runs."""
    return train_layouts("tests/workers/parity.py", tmp_path_factory.mktemp("parity"),
                         [*parity.LAYOUTS, *parity.MUON_FAULTS], nproc=4)


def _world(layout: str) -> int:
    dims = parity.PP_LAYOUTS[layout][0]  # ep borrows its ranks from dp_shard: it adds none
    return math.prod(size for name, size in dims.items() if name != "ep")


FAULT_LAYOUT = "pp2_dp2"  # pipeline + data parallel + micro-batches + clipping + schedule: every fault applies
FAULTY = [f"{FAULT_LAYOUT}+{fault}" for fault in parity.FAULTS] + list(parity.MOE_FAULTS) + list(parity.EP_FAULTS)


def _world_of_run(name: str) -> int:
    """LAYOUT or LAYOUT+FAULT: the world size its layout trains on (2-D layouts: 4)."""
    layout = name.partition("+")[0]
    return _world(layout) if layout in parity.PP_LAYOUTS else 4


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory):
    """One torchrun job per world size, each training its pipeline layouts in turn; the
    faulty runs (test_parity_check_catches_each_fault and the MoE ones) come last in the
    job of their world size."""
    out, runs = tmp_path_factory.mktemp("parity_pp"), {}
    for nproc in sorted({_world_of_run(name) for name in [*parity.PP_LAYOUTS, *FAULTY]}):
        names = [name for name in [*parity.PP_LAYOUTS, *FAULTY] if _world_of_run(name) == nproc]
        runs.update(train_layouts("tests/workers/parity.py", out, names, nproc=nproc))
    return runs


_oracles = {}


def oracle_for(overrides: dict, init: dict, accum: int = 1, unclipped: bool = False) -> oracle.Oracle:
    """The plain-PyTorch reference for this model, from the layout's initial weights
    (cached: every layout of one model starts from the same weights, checked below);
    ``unclipped``: with the run without clipping too (only the clipping checks need it)."""
    key = (tuple(sorted(overrides.items())), accum)
    judge = _oracles.get(key)
    if judge is None or (unclipped and judge.unclipped is None):
        def make():
            model = parity.build(overrides, meta=False)
            model.load_state_dict(init, strict=False)  # a tied copy's name is absent: it is tied
            if hasattr(model, "init_buffers"):  # Llama's rotary tables are not parameters
                model.init_buffers()
            return model

        vocab = parity.build(overrides).cfg.vocab_size
        steps = [[(c[:, :-1], c[:, 1:]) for c in tokens.chunk(accum)] for tokens in parity.batches(vocab)]
        moe = overrides.get("family") == "moe"  # the loop's share of balancing the experts
        balancing = dict(expert_bias_rate=parity.build(overrides).cfg.bias_update_rate) if moe else {}
        muon = hidden_matrix_names(make()) if overrides.get("optimizer") == "Muon" else frozenset()
        settings = dict(**oracle_settings(), **balancing, muon=muon)
        if judge is None:
            judge = _oracles[key] = oracle.run_oracle(make, steps, **settings)
        if unclipped:
            judge.unclipped = oracle.run_unclipped(make, steps, **settings)
    return judge


def hidden_matrix_names(model) -> set[str]:
    """What torch.optim.Muon's documentation gives Muon: the 2-D weights of the hidden
    layers, not the embeddings (token, position) nor the output layer."""
    ends = ("tok_embeddings.", "output.", "wte.", "wpe.", "lm_head.")
    return {name for name, p in model.named_parameters() if p.ndim == 2 and not name.startswith(ends)}


def oracle_settings() -> dict:
    """parity's optimizer and schedule, as plain-PyTorch arguments."""
    return dict(lr=parity.LR, max_norm=parity.MAX_NORM, betas=parity.BETAS, weight_decay=parity.WEIGHT_DECAY,
                decay_all=False, lr_at=lambda step: oracle.cosine_lr(step, lr=parity.LR, warmup=parity.WARMUP,
                                                                     total=parity.STEPS, min_ratio=parity.MIN_LR_RATIO))


def single_process_init(overrides: dict) -> dict:
    """The initial weights of one process: every layout must start from exactly these."""
    model = parity.build(overrides, meta=False)
    model.init_weights(seed=0)
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("layout", list(parity.LAYOUTS))
def test_layout_matches_plain_pytorch(runs, layout):
    assert_matches(runs[layout], parity.LAYOUTS[layout][2], parity.LAYOUTS[layout][0].get("accum", 1), layout)


def _fsdp_collectives(run: dict, kind: str) -> list[float]:
    """Each rank's count of ``kind`` over the data-parallel dimensions in its first step."""
    return [sum(c for (dim, k), (c, _, _) in rows.items() if k == kind and dim.startswith("dp"))
            for rows in run["collectives"]]


@pytest.mark.parametrize("strategy", ["fsdp4", "shard_grad_op4"])
def test_gradient_sync_step_reduces_once_a_step(runs, strategy):
    """The same numbers either way (test_layout_matches_plain_pytorch): what "step" changes is
    the traffic. Over two micro-batches it reduce-scatters each unit once, not twice; and
    SHARD_GRAD_OP, whose units keep their weights from forward to backward, now keeps them
    into the next micro-batch too: one all-gather of each unit a step, not two, and one more
    in the step's last backward (FSDP2 gathers a unit again there; the dry run sees the
    head's). Fails when hold_gradients does nothing: the numbers still match."""
    every, once = runs[f"{strategy}_accum2"], runs[f"{strategy}_accum2_sync_step"]
    reduced, reduced_once = _fsdp_collectives(every, "reduce-scatter"), _fsdp_collectives(once, "reduce-scatter")
    assert min(reduced_once) > 0 and [2 * n for n in reduced_once] == reduced
    gathered, gathered_once = _fsdp_collectives(every, "all-gather"), _fsdp_collectives(once, "all-gather")
    if strategy == "shard_grad_op4":
        assert [n // 2 + 1 for n in gathered] == gathered_once
    else:  # FULL_SHARD: the second forward finds its units still gathered from the first backward
        assert all(o < n for o, n in zip(gathered_once, gathered))


@pytest.mark.parametrize("layout", list(parity.PP_LAYOUTS))
def test_pipeline_layout_matches_plain_pytorch(pp_runs, layout):
    got = pp_runs[layout]
    for names in got["tied"]:  # e.g. the last stage's copy of the token embedding
        for copy in names[1:]:
            for when in ("init", "final"):
                assert torch.equal(got[when].pop(copy), got[when][names[0]]), f"{layout}: {when} {copy} drifted"
    opts = parity.PP_LAYOUTS[layout][2]
    assert_matches(got, opts.get("model", {}), opts.get("accum", 1), layout)


def test_pipeline_stages_hold_every_layer_once(pp_runs):
    assert pp_runs["pp2_1f1b"]["layers"] == [[0, 1], [2, 3]]
    assert pp_runs["pp2_uneven_accum"]["layers"] == [[0], [1, 2, 3]]
    assert pp_runs["pp2_interleaved"]["layers"] == [[0], [1], [2], [3]]


def assert_matches(got: dict, overrides: dict, accum: int, layout: str) -> None:
    if "loss_function" in got:  # a chunked_loss layout trained through it, the others through F.cross_entropy
        assert got["loss_function"] == ("chunked_cross_entropy" if overrides.get("chunked_loss") else
                                        "_cross_entropy_fp32"), layout
    want_init = single_process_init(overrides)
    assert set(got["init"]) == set(want_init), f"{layout}: parameters missing or extra"
    for name, w in want_init.items():
        assert torch.equal(got["init"][name], w), f"{layout}: initial {name} differs"
    judge = oracle_for(overrides, got["init"], accum)
    DEVIATIONS[layout] = oracle.assert_matches(got["losses"], got["grad_norms"], got["final"], judge, layout)


DEVIATIONS: dict[str, dict] = {}


def test_clipping_binds_in_the_reference():
    """Without clipping the reference lands far outside the tolerance: a layout that
    skipped clipping could not pass (an earlier version's clipping was a no-op)."""
    for overrides in ({}, dict(tie_embeddings=True), dict(family="gpt2")):
        judge = oracle_for(overrides, single_process_init(overrides), unclipped=True)
        assert max(judge.fp32.grad_norms) > parity.MAX_NORM
        oracle.assert_clipping_binds(judge, str(overrides))
        assert judge.fp32.losses[-1] < 0.99 * judge.fp32.losses[0]  # and it learns


def test_clipping_binds_in_the_moe_reference():
    """The mixture of experts' reference clips every step too (torch.nn.utils.clip_grad_norm_
    on the plain model), and without clipping its weights land far outside the tolerance: the
    expert-parallel layouts' norms, summed over weights on two meshes, are checked by it."""
    overrides = dict(family="moe")
    judge = oracle_for(overrides, single_process_init(overrides), unclipped=True)
    assert min(judge.fp32.grad_norms) > parity.MAX_NORM
    dev = oracle.deviations(judge.unclipped.losses, judge.unclipped.grad_norms, judge.unclipped.final, judge)
    assert dev["final"] > 100 * oracle.K, dev


def test_report_deviations(runs, pp_runs):
    """Printed with -s: each layout's largest deviation, in the reference's rounding
    scales, next to the tolerance oracle.K."""
    for name in list(parity.LAYOUTS) + list(parity.PP_LAYOUTS):
        if name in DEVIATIONS:
            d = DEVIATIONS[name]
            print(f"{name:22s} losses {d['losses']:5.2f}  grad norms {d['grad_norms']:5.2f}  "
                  f"weights {d['final']:5.2f} ({d['worst_tensor']})  of K = {oracle.K}")


@pytest.fixture(scope="module")
def faulty_runs(pp_runs):
    return {name: pp_runs[name] for name in FAULTY}


@pytest.mark.parametrize("fault", parity.FAULTS)
def test_parity_check_catches_each_fault(faulty_runs, pp_runs, fault):
    """The same layout passes unbroken (test_pipeline_layout_matches_plain_pytorch) and
    fails with each fault a parallel trainer really has, injected one at a time."""
    got = faulty_runs[f"{FAULT_LAYOUT}+{fault}"]
    with pytest.raises(AssertionError, match="rounding scales from the plain-PyTorch reference"):
        assert_matches(got, {}, 1, f"{FAULT_LAYOUT}+{fault}")
    dev = oracle.deviations(got["losses"], got["grad_norms"], got["final"], oracle_for({}, got["init"]))
    print(f"\n{FAULT_LAYOUT}+{fault}: losses {dev['losses']:.0f}, grad norms {dev['grad_norms']:.0f}, "
          f"weights {dev['final']:.0f} rounding scales (K = {oracle.K})")



@pytest.mark.parametrize("name", parity.MOE_FAULTS)
def test_moe_parity_check_catches_each_fault(faulty_runs, name):
    """A mixture of experts that misroutes one token, balances each rank by its own loads,
    or weighs the balance loss by the micro-batch instead of the global batch fails the
    check its unbroken layout passes."""
    layout = name.partition("+")[0]
    overrides = parity.LAYOUTS[layout][2] if layout in parity.LAYOUTS else parity.PP_LAYOUTS[layout][2]["model"]
    got = faulty_runs[name]
    with pytest.raises(AssertionError, match="rounding scales from the plain-PyTorch reference"):
        assert_matches(got, overrides, 1, name)
    dev = oracle.deviations(got["losses"], got["grad_norms"], got["final"], oracle_for(overrides, got["init"]))
    print(f"\n{name}: losses {dev['losses']:.0f}, grad norms {dev['grad_norms']:.0f}, "
          f"weights {dev['final']:.0f} rounding scales (K = {oracle.K})")


@pytest.mark.parametrize("name", parity.MUON_FAULTS)
def test_muon_parity_check_catches_a_shard_orthogonalised_alone(runs, name):
    """Muon's layouts pass (test_layout_matches_plain_pytorch) only because each matrix is
    orthogonalised whole: Newton-Schulz on each rank's own shard fails the same check."""
    layout = name.partition("+")[0]
    got = runs[name]
    with pytest.raises(AssertionError, match="rounding scales from the plain-PyTorch reference"):
        assert_matches(got, parity.LAYOUTS[layout][2], 1, name)
    dev = oracle.deviations(got["losses"], got["grad_norms"], got["final"],
                            oracle_for(parity.LAYOUTS[layout][2], got["init"]))
    print(f"\n{name}: losses {dev['losses']:.0f}, grad norms {dev['grad_norms']:.0f}, "
          f"weights {dev['final']:.0f} rounding scales (K = {oracle.K})")
EP_LAYOUTS = [name for name, (dims, _, _) in parity.LAYOUTS.items() if dims.get("ep", 1) > 1]


def assert_experts_split(experts: dict, ep: int, tp: int, layout: str) -> None:
    """Every routed-experts weight is split by expert over an "ep" mesh dimension of ep ranks
    (FSDP shards it further over dp_shard / ep) and replicated over tp."""
    assert experts, f"{layout}: no routed experts recorded"
    for name, spec in experts.items():
        assert spec, f"{layout}: {name} is a plain tensor"
        dims, sizes, placements = spec
        assert "ep" in dims and sizes[dims.index("ep")] == ep, f"{layout}: {name} is not split over ep = {ep}: {spec}"
        assert placements[dims.index("ep")] == "S(0)", f"{layout}: {name} is not split by expert: {spec}"
        if tp > 1:
            assert placements[dims.index("tp")] == "R", f"{layout}: {name}: {spec}"


@pytest.mark.parametrize("layout", EP_LAYOUTS)
def test_expert_parallel_layout_splits_the_experts(runs, layout):
    dims = parity.LAYOUTS[layout][0]
    ep = dims.get("resume_ep", dims["ep"])  # a resumed layout ends under its second degree
    assert_experts_split(runs[layout]["experts"], ep, dims.get("tp", 1), layout)


def test_a_real_expert_parallel_step_sends_what_the_dry_run_counts(runs):
    """The all-to-all bytes of moe_ep2_fsdp4's first step, counted on each rank as it ran:
    their mean is the formula the dry run's count is checked against
    (tests/test_expert_parallel.py). A rank sends its own token copies and the results of
    the copies it received; routing decides how many it receives, but over all ranks the
    received are the sent."""
    from tests.test_expert_parallel import ep_all_to_all_bytes

    per_rank = [rows[("ep", "all-to-all")] for rows in runs["moe_ep2_fsdp4"]["collectives"]]
    cfg = parity.build({"family": "moe"}).cfg
    count, payload = ep_all_to_all_bytes(cfg.n_layers - cfg.n_dense_layers, parity.BATCH // 4 * parity.SEQ,
                                         cfg.top_k, cfg.dim, cfg.n_experts)
    assert [c for c, _, _ in per_rank] == [count] * 4
    assert sum(p for _, p, _ in per_rank) == 4 * payload


@pytest.mark.parametrize("name", parity.EP_FAULTS)
def test_expert_split_check_catches_experts_left_whole(faulty_runs, name):
    """With the split left out the numbers still match (plain FSDP is right too): the check
    of where the experts live is what fails."""
    layout = name.partition("+")[0]
    got, dims = faulty_runs[name], parity.LAYOUTS[layout][0]
    assert_matches(got, parity.LAYOUTS[layout][2], 1, name)
    with pytest.raises(AssertionError, match="is not split over ep"):
        assert_experts_split(got["experts"], dims["ep"], dims.get("tp", 1), name)
