"""The mixture-of-experts family on one process, against tests/oracle.py's `moe_forward`
(a token-at-a-time loop over the experts, no code of models/moe): the whole model's loss
and every gradient, with softmax and sigmoid scores, shared experts, a dense first layer
and the balance loss on; and the pieces the loop cannot see (grouped matmuls, the bias,
the counting)."""

import pytest
import torch
import torch.nn.functional as F

from meshtrain.models.llama.model import rotary_angles
from meshtrain.models.moe import MoETransformer
from meshtrain.models.moe import experts
from meshtrain.models.moe.experts import GroupedExperts, grouped_linear, grouped_mm_supported, looped_linear
from meshtrain.models.moe.layer import sequence_balance
from tests import oracle

def small(**overrides) -> MoETransformer:
    torch.manual_seed(0)
    model = MoETransformer.from_flavor("debug", meta=True, n_layers=3, **overrides)
    model.init_weights(seed=0, device="cpu")
    return model


def model_loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def oracle_loss_and_grads(model, tokens):
    """The same weights, every MoE layer's forward replaced by the oracle's loop; the
    balance loss added to the objective by hand (coef * the mean over sequences)."""
    balances = []
    for moe in model.moe_layers().values():
        def loop(x, moe=moe):
            shared = moe.shared_experts
            out, balance = oracle.moe_forward(
                x, gate=moe.router.gate, w1=moe.experts.w1, w2=moe.experts.w2, w3=moe.experts.w3,
                bias=moe.expert_bias, top_k=moe.top_k, score_func=moe.router.score_func,
                route_norm=moe.router.route_norm, route_scale=moe.router.route_scale,
                shared=(shared.w1.weight, shared.w2.weight, shared.w3.weight) if shared is not None else None)
            balances.append(balance.mean())
            return out
        moe.forward = loop
    try:
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        ce = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        (ce + model.cfg.balance_loss_coef * sum(balances)).backward()
        return ce.item(), {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        for moe in model.moe_layers().values():
            del moe.forward


def assert_model_matches_oracle(model, tokens):
    loss, grads = model_loss_and_grads(model, tokens)
    want_loss, want = oracle_loss_and_grads(model, tokens)
    assert loss == pytest.approx(want_loss, rel=1e-6, abs=0)
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def tokens_for(vocab=256, batch=3, seq=17):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("path", ["grouped_mm", "loop"])
def test_forward_and_gradients_match_the_token_loop(monkeypatch, score_func, path):
    """Loss and every gradient (router, experts, shared experts, attention, the dense first
    layer) in fp32 within 1e-5, with a non-zero routing bias and the balance loss on; the
    experts as torch's grouped matmul and as the loop over experts."""
    if path == "loop":
        monkeypatch.setattr(experts, "grouped_mm_supported", lambda x, w: False)
    model = small(score_func=score_func, route_scale=1.5 if score_func == "sigmoid" else 1.0,
                  balance_loss_coef=0.1)
    for moe in model.moe_layers().values():  # a bias that changes choices: the oracle must apply it
        moe.expert_bias.copy_(torch.linspace(-0.05, 0.05, moe.n_experts))
    assert model.cfg.n_dense_layers == 1 and model.cfg.n_shared_experts == 1
    assert_model_matches_oracle(model, tokens_for())


def test_without_shared_experts_or_renormalisation():
    assert_model_matches_oracle(small(n_shared_experts=0, route_norm=False, n_dense_layers=0), tokens_for())


def swap_two_dispatched_rows(forward):
    def broken(self, x_sorted, tokens_per_expert):  # two token copies of different experts trade places
        x_sorted = x_sorted.clone()
        x_sorted[[0, -1]] = x_sorted[[-1, 0]]
        return forward(self, x_sorted, tokens_per_expert)
    return broken


def shift_combined_rows(forward):
    def broken(self, x_sorted, tokens_per_expert):  # the results come back one row off
        return forward(self, x_sorted, tokens_per_expert).roll(1, dims=0)
    return broken


@pytest.mark.parametrize("fault", [swap_two_dispatched_rows, shift_combined_rows])
def test_the_oracle_catches_a_misrouted_token(monkeypatch, fault):
    model = small()
    monkeypatch.setattr(GroupedExperts, "forward", fault(GroupedExperts.forward))
    with pytest.raises(AssertionError):
        assert_model_matches_oracle(model, tokens_for())


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 9, 0], [0, 2, 0, 1]])
def test_grouped_linear_matches_a_matmul_per_row(counts):
    """The loop fallback and torch._grouped_mm (CPU, float32) against each row times its
    expert's weight, forward and backward, empty experts included."""
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 8, generator=g, requires_grad=True)
    w = torch.randn(4, 12, 8, generator=g, requires_grad=True)
    assert grouped_mm_supported(x, w) == hasattr(torch, "_grouped_mm")  # CPU float32: torch's kernel
    expert_of_row = torch.repeat_interleave(torch.arange(4), counts)
    want = torch.stack([x[r] @ w[e].t() for r, e in enumerate(expert_of_row.tolist())])
    upstream = torch.randn(len(x), 12, generator=g)
    (want * upstream).sum().backward()
    want_dx, want_dw = x.grad.clone(), w.grad.clone()
    for fn in (looped_linear, grouped_linear):
        x.grad = w.grad = None
        got = fn(x, w, counts)
        torch.testing.assert_close(got, want)
        (got * upstream).sum().backward()
        torch.testing.assert_close(x.grad, want_dx)
        torch.testing.assert_close(w.grad, want_dw)


def test_bias_chooses_but_does_not_weigh():
    """A large bias on expert 0 sends every token there, yet its weight stays its score."""
    model = small(n_shared_experts=0, route_norm=False)
    moe = next(iter(model.moe_layers().values()))
    x = torch.randn(10, model.cfg.dim)
    scores = F.linear(x, moe.router.gate).softmax(-1)
    bias = torch.zeros(moe.n_experts)
    bias[0] = 10.0
    weights, chosen, _ = moe.router(x, bias)
    assert (chosen == 0).any(dim=-1).all()
    torch.testing.assert_close(weights, scores.gather(-1, chosen))


def test_bias_moves_against_the_load_after_each_step():
    model = small(bias_update_rate=0.01)
    moe = next(iter(model.moe_layers().values()))
    moe.tokens_per_expert.copy_(torch.tensor([8, 0, 4, 4, 4, 4, 4, 4]))  # mean 4
    model.after_optimizer_step()
    assert moe.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0, 0, 0, 0, 0, 0])
    assert moe.tokens_per_expert.sum() == 0  # counted afresh each step
    assert model.metrics()["moe/load_max_over_mean/layer1"] == 2.0


def test_sequence_balance_is_one_when_even_and_e_over_k_when_collapsed():
    n_experts, k, seq = 4, 2, 4
    even = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    uniform = torch.full((seq, n_experts), 0.25)
    assert sequence_balance(even, uniform, 1).item() == pytest.approx(1.0)
    collapsed = torch.tensor([[0, 1]] * seq)
    peaked = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * seq)
    assert sequence_balance(collapsed, peaked, 1).item() == pytest.approx(n_experts / k)


def test_loads_are_counted_once_per_training_forward():
    """Not in evaluation (no gradient), and not again when activation checkpointing
    recomputes the block in backward."""
    from torch.utils.checkpoint import checkpoint

    model = small()
    moe = next(iter(model.moe_layers().values()))
    x = torch.randn(2, 5, model.cfg.dim, requires_grad=True)
    with torch.no_grad():
        moe(x)
    assert moe.tokens_per_expert.sum() == 0
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.tokens_per_expert.sum() == 2 * 5 * moe.top_k


def test_balance_loss_reaches_the_router_only_through_its_gradient():
    """The forward's output does not depend on the coefficient; the router's gradient does."""
    tokens = tokens_for()
    off, on = small(balance_loss_coef=0.0), small(balance_loss_coef=1.0)
    loss_off, grads_off = model_loss_and_grads(off, tokens)
    loss_on, grads_on = model_loss_and_grads(on, tokens)
    assert loss_on == loss_off
    name = "layers.1.feed_forward.router.gate"
    assert not torch.allclose(grads_on[name], grads_off[name])


def test_planning_flavors_build_on_meta():
    models = {name: MoETransformer.from_flavor(name, meta=True)
              for name in ("qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3_671b")}
    sizes = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    assert models["qwen3_30b_a3b"].active_parameters() == pytest.approx(3.3e9, rel=0.02)      # "A3B": 3.3B
    assert models["qwen3_235b_a22b"].active_parameters() == pytest.approx(22e9, rel=0.02)     # "A22B"
    assert sizes["qwen3_30b_a3b"] == pytest.approx(30.5e9, rel=0.01)      # published: 30.5B
    assert sizes["qwen3_235b_a22b"] == pytest.approx(235e9, rel=0.01)     # published: 235B
    assert sizes["deepseek_v3_671b"] == pytest.approx(671e9, rel=0.05)    # GQA, not MLA: a little more


def test_a_pipeline_stage_counts_only_the_schedules_forwards(tmp_path):
    """torch's pipeline stages run an extra forward on their first step to infer shapes
    (parallel/pipeline.py `inferring_stage_metadata`): the loads and gradients of a
    one-stage schedule over two micro-batches equal the plain model's over the batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshtrain.parallel.pipeline import build_schedule

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        piped, plain = small(), small()
        tokens = tokens_for(batch=4)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        scale = 1.0 / labels.numel()
        loss = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum") * scale
        for model in (piped, plain):
            model.set_loss_scale(scale)
        loss(plain(inputs), labels).backward()
        schedule = build_schedule("GPipe", [(0, piped)], init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))["pp"],
                                  n_microbatches=2, n_stages=1, device=torch.device("cpu"), loss_fn=loss)
        schedule.step(inputs, target=labels)
    finally:
        dist.destroy_process_group()
    for (name, a), b in zip(piped.moe_layers().items(), plain.moe_layers().values()):
        assert a.tokens_per_expert.tolist() == b.tokens_per_expert.tolist(), name
    for name, p in piped.named_parameters():
        torch.testing.assert_close(p.grad, plain.get_parameter(name).grad, msg=lambda m: f"{name}: {m}")


def test_all_dense_layers_give_a_twin_of_the_same_active_size():
    """`[moe] n_dense_layers = n_layers` with ffn_hidden = top_k x moe_hidden (Qwen3-30B-A3B:
    6,144 = 8 x 768): the dense twin bench/gpu_check.py times beside the MoE step has the
    MoE's active parameters, less the routers it no longer needs."""
    moe = MoETransformer.from_flavor("qwen3_30b_a3b", meta=True, n_layers=3)
    dense = MoETransformer.from_flavor("qwen3_30b_a3b", meta=True, n_layers=3, n_dense_layers=3)
    assert not dense.moe_layers() and len(moe.moe_layers()) == 3
    routers = sum(p.numel() for layer in moe.moe_layers().values() for n, p in layer.named_parameters()
                  if not n.startswith("experts."))
    assert sum(p.numel() for p in dense.parameters()) == moe.active_parameters() - routers


@pytest.mark.slow  # inductor compiles the block on CPU (about half a minute)
def test_a_compiled_checkpointed_block_routes_counts_and_computes_as_eager():
    """[compile] with [activation_checkpoint] "full", as parallelize composes them: the block
    compiled whole (fullgraph) with its experts as bf16 grouped matmuls, counting each
    forward's loads once although backward recomputes the block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from meshtrain.parallel.activation_checkpoint import apply_compile

    def block_run(compiled: bool):
        torch.manual_seed(0)
        model = MoETransformer.from_flavor("debug", meta=True, n_layers=2, n_dense_layers=0)
        model.init_weights(seed=0, device="cpu")
        model.to(torch.bfloat16)
        block = checkpoint_wrapper(model.layers["1"], preserve_rng_state=False)
        run = apply_compile(torch.nn.ModuleDict({"1": block}))[0] if compiled else block  # parallelize's compile
        x = torch.randn(2, 32, model.cfg.dim, dtype=torch.bfloat16, requires_grad=True)
        out = run(x, rotary_angles(model.rope)[:32])  # the bf16 table, as the model passes it
        out.float().square().sum().backward()
        return out.detach().float(), x.grad.float(), model.layers["1"].feed_forward.tokens_per_expert.clone()

    eager, compiled = block_run(False), block_run(True)
    assert torch.equal(compiled[2], eager[2]) and compiled[2].sum() == 2 * 32 * 2  # T x k, counted once
    torch.testing.assert_close(compiled[0], eager[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(compiled[1], eager[1], rtol=5e-2, atol=5e-2)

