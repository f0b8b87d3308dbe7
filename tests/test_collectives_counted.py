"""The dry run's and the hang check's collective counter (planning/collectives.py) counts
what torch's own counter, `CommDebugMode`, counts on the same TP step: the collectives
the TP plan's hooks issue, and those DTensor issues inside an op's dispatch
(loss_parallel's all-reduces), which a dispatch mode handling DTensor ops itself never
sees."""

import contextlib

import pytest

KINDS = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
         "reduce_scatter_tensor": "reduce-scatter"}


@pytest.mark.parametrize("loss_parallel", [True, False])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_the_counter_counts_what_torchs_comm_debug_mode_counts(fake_world, loss_parallel, sequence_parallel):
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

    from meshtrain.models.llama import Llama
    from meshtrain.parallel.tensor_parallel import apply_tp
    from meshtrain.planning.collectives import CountCollectives, mesh_group_names

    fake_world(2)
    torch.manual_seed(0)
    model = Llama.from_flavor("debug", vocab_size=512)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    apply_tp(model, mesh, model.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel))
    tokens = torch.randint(0, 512, (2, 64))

    def step():
        with loss_parallel_context() if loss_parallel else contextlib.nullcontext():
            F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()

    with CommDebugMode() as torchs:
        step()
    ours = CountCollectives(mesh_group_names(mesh))
    with ours:
        step()
    expected = {("tp", KINDS[op.__name__]): n for op, n in torchs.get_comm_counts().items()}
    assert {key: count for key, (count, _, _) in ours.stats.rows.items()} == expected
    if loss_parallel:  # the log-softmax's max and sum, and the picked logit's sum
        assert expected["tp", "all-reduce"] >= 3
