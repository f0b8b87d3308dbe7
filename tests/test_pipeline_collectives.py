"""SHARD_GRAD_OP under a pipeline gathers each FSDP unit once per optimizer step, however
many micro-batches the schedule runs; FULL_SHARD re-gathers per micro-batch. Both reduce
gradients once per step. The measured table is printed (pytest -s) and kept in
docs/pipeline.md."""

import json

import pytest

from tests.forked_ranks import forked_ranks
from tests.workers import pp_collectives

pytestmark = pytest.mark.slow  # every test here starts processes


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_collectives") / "counts.json"
    proc = forked_ranks("tests/workers/pp_collectives.py", str(out), nproc=4, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = json.loads(out.read_text())
    print("\nstage strategy       micro-batches units all-gathers reduce-scatters")
    for r in rows:
        print(f"{r['stage']:>5} {r['strategy']:<14} {r['microbatches']:>13} {r['fsdp_units']:>5} "
              f"{r['all_gathers']:>11} {r['reduce_scatters']:>15}")
    return rows


def _by(rows, stage, strategy):
    return {r["microbatches"]: r for r in rows if r["stage"] == stage and r["strategy"] == strategy}


@pytest.mark.parametrize("stage", [0, 1])
def test_shard_grad_op_gathers_once_per_unit_whatever_the_micro_batches(rows, stage):
    got = _by(rows, stage, "SHARD_GRAD_OP")
    assert set(got) == set(pp_collectives.MICRO_BATCHES)
    for r in got.values():
        assert r["all_gathers"] == r["fsdp_units"] > 0
        assert r["reduce_scatters"] == r["fsdp_units"]


@pytest.mark.parametrize("stage", [0, 1])
def test_full_shard_gathers_grow_with_micro_batches_but_reduction_stays_once(rows, stage):
    got = _by(rows, stage, "FULL_SHARD")
    gathers = [got[n]["all_gathers"] for n in sorted(got)]
    assert gathers == sorted(set(gathers)), f"all-gathers should grow with micro-batches: {gathers}"
    assert gathers[0] > got[min(got)]["fsdp_units"]
    assert all(r["reduce_scatters"] == r["fsdp_units"] for r in got.values())
