"""[fault_tolerance]: replica groups that drop out and rejoin without stopping the others
(torchft; training/fault_tolerance.py).

The proof runs for real: torchft's lighthouse, and two replica groups of two ranks each, each
its own torchrun job with gloo, asking for their first quorum together. Group 1's rank 1
SIGKILLs itself before step KILL_STEP (or before its second step, when a slow start-up made
it join later), once the two groups have committed a step together; torchrun restarts group 1, which rejoins from group 0's live state. Group 0 must keep
committing steps while group 1 is down, and every loss either group logs must equal a plain
PyTorch run that at each step trained on the shares of the global batch whose groups took
part -- both halves, or the survivor's half alone.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import oracle
from tests.conftest import ROOT
from meshtrain.training.config import ConfigError
from meshtrain.training.config_loader import parse_args

STEPS, KILL_STEP, STEP_SECONDS = 60, 4, 0.25
GROUP = ("--config", "debug_2d", "--parallelism.tp=1", "--parallelism.dp_shard=2", f"--training.steps={STEPS}",
         "--training.seq_len=64", "--metrics.log_freq=1", "--fault_tolerance.enable=true",
         "--fault_tolerance.group_size=2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lighthouse_binary() -> str:
    """torchft's lighthouse, installed beside this Python (a virtual environment's bin/) or on PATH."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    return str(beside) if beside.exists() else shutil.which("torchft_lighthouse")


# ---------------------------------------------------------------- refusals: one line, the key and the file

def refusal(tmp_path, text: str, *flags: str) -> str:
    path = tmp_path / "ft.toml"
    path.write_text('extends = "debug_2d"\n' + text)
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(path), *flags])
    message = str(err.value)
    assert "\n" not in message and str(path) in message, message
    return message


def test_a_replica_id_outside_the_groups_is_refused_naming_the_key_and_file(tmp_path):
    message = refusal(tmp_path, "[fault_tolerance]\nenable = true\ngroup_size = 2\nreplica_id = 2\n")
    assert "[fault_tolerance] replica_id = 2" in message and "0 .. 1" in message, message


def test_a_lighthouse_address_torchft_cannot_dial_is_refused(tmp_path):
    message = refusal(tmp_path, '[fault_tolerance]\nenable = true\nlighthouse = "localhost:29510"\n')
    assert '[fault_tolerance] lighthouse = "localhost:29510"' in message and "http://HOST:PORT" in message, message


@pytest.mark.parametrize("key,value", [("pp", 2), ("dp_replicate", 2), ("ep", 2)])
def test_a_layout_the_replica_groups_cannot_serve_is_refused(tmp_path, key, value):
    message = refusal(tmp_path, f"[fault_tolerance]\nenable = true\n[parallelism]\n{key} = {value}\n")
    assert "[fault_tolerance] enable = true" in message and f"[parallelism] {key} = {value}" in message, message


def test_fault_tolerance_without_torchft_installed_says_how_to_install_it(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    message = refusal(tmp_path, "[fault_tolerance]\nenable = true\n")
    assert '"meshtrain[ft]"' in message and "torchft" in message, message


def test_no_lighthouse_at_the_address_is_said_before_any_process_group(tmp_path):
    from meshtrain.training import recipe

    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg, _ = parse_args(["--config", "debug_2d", "--fault_tolerance.enable=true",
                         f"--fault_tolerance.lighthouse={address}", f"--job.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r'\[fault_tolerance\] lighthouse = "http://127\.0\.0\.1:\d+": no lighthouse '
                                          r"answers there"):
        recipe._check_inputs(cfg)


# ---------------------------------------------------------------- a group killed and restarted

def group(out: Path, port: int, replica: int, kill_step: int, lighthouse: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           f"--max-restarts={1 if kill_step else 0}",
           "tests/workers/ft_replica.py", str(out / f"records{replica}.jsonl"), str(STEP_SECONDS), str(kill_step),
           *GROUP, f"--job.output_dir={out}", "--job.name=ft", f"--fault_tolerance.replica_id={replica}",
           f"--fault_tolerance.lighthouse={lighthouse}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(out / f"group{replica}.log", "w"),
                            stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def killed_and_restarted(tmp_path_factory):
    """Group 0 trains throughout; group 1 is killed before KILL_STEP and restarted by
    torchrun. Returns each group's records (one dict per committed step)."""
    out = tmp_path_factory.mktemp("ft")
    port = free_port()
    lighthouse = subprocess.Popen([lighthouse_binary(), "--min_replicas", "1", "--quorum_tick_ms", "100",
                                   "--join_timeout_ms", "10000", "--bind", f"[::]:{port}"],
                                  stdout=open(out / "lighthouse.log", "w"), stderr=subprocess.STDOUT)
    try:
        time.sleep(0.5)  # the lighthouse binds its port
        groups = [group(out, port, 0, 0, f"http://localhost:{port}"),
                  group(out, port, 1, KILL_STEP, f"http://localhost:{port}")]
        codes = [g.wait(timeout=400) for g in groups]
    finally:
        lighthouse.terminate()
        lighthouse.wait()
    logs = "\n".join((out / f"group{i}.log").read_text()[-3000:] for i in range(2))
    assert codes == [0, 0], logs
    records = [[json.loads(line) for line in (out / f"records{i}.jsonl").read_text().splitlines()] for i in range(2)]
    return records, logs


@pytest.mark.slow
def test_the_survivors_keep_committing_steps_while_the_killed_group_restarts(killed_and_restarted):
    (survivor, restarted), logs = killed_and_restarted
    assert {r["attempt"] for r in survivor} == {0}, "the survivor was restarted"
    assert {r["attempt"] for r in restarted} == {0, 1}, f"group 1 was not killed and restarted: {restarted}"
    steps = [r["step"] for r in survivor]
    assert steps == list(range(steps[0], STEPS + 1)), f"the survivor's steps are not each step once, in order: {steps}"
    last = max((r for r in restarted if r["attempt"] == 0), key=lambda r: r["step"])  # before it died
    first = min((r for r in restarted if r["attempt"] == 1), key=lambda r: r["step"])  # once back
    alone = [r for r in survivor if last["step"] < r["step"] < first["step"]]
    # The steps between were the survivor's alone, committed while group 1 was down, not after.
    assert len(alone) >= 3, f"the survivor committed {len(alone)} steps while group 1 was down\n{logs}"
    assert all(r["replica_groups"] == 1 and last["time"] < r["time"] < first["time"] for r in alone), alone
    assert restarted[-1]["step"] == STEPS and restarted[-1]["replica_groups"] == 2, "group 1 did not rejoin"


def reference_steps(survivor, restarted):
    """Which shares of each global batch were trained on: both halves where two groups took
    part, else the half of the one group that logged the step."""
    shares = {}
    for replica, records in ((0, survivor), (1, restarted)):
        for r in records:
            took = (0, 1) if r["replica_groups"] == 2 else (replica,)
            assert shares.setdefault(r["step"], took) == took, f"step {r['step']}: groups disagree on who took part"
    assert sorted(shares) == list(range(1, STEPS + 1)), f"steps nobody committed: {sorted(shares)}"
    return [shares[n] for n in range(1, STEPS + 1)]


@pytest.mark.slow
def test_losses_equal_a_plain_run_that_lost_the_dead_groups_share(killed_and_restarted):
    from meshtrain.training.data import build_dataloader

    (survivor, restarted), _ = killed_and_restarted
    shares = reference_steps(survivor, restarted)
    assert shares.count((0,)) >= 3 and shares[-1] == (0, 1), shares  # some steps lost a share, and it came back
    cfg, _ = parse_args(list(GROUP))
    t, o, s = cfg.training, cfg.optimizer, cfg.lr_scheduler
    halves, _ = build_dataloader(t, dp_rank=0, dp_size=2)  # half r: replica group r's share
    loaders = [halves, build_dataloader(t, dp_rank=1, dp_size=2)[0]]
    steps = [[mb for r in took for mb in loaders[r].batch(n)] for n, took in enumerate(shares)]
    from meshtrain.training.data import build_tokenizer
    from meshtrain.training.recipe import build_model

    shape = build_model(cfg, build_tokenizer(t.tokenizer).vocab_size)

    def make():
        model = type(shape)(shape.cfg)
        model.init_weights(seed=t.seed)
        return model

    lr_at = lambda step: oracle.cosine_lr(step, lr=o.lr, warmup=s.warmup_steps, total=t.steps,  # noqa: E731
                                          min_ratio=s.min_lr_ratio)
    reference = oracle.run_oracle(make, steps, lr=o.lr, max_norm=t.max_norm, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, decay_all=False, lr_at=lr_at)
    noise, ref = reference.noise(), reference.fp32
    for key in ("loss", "grad_norm"):
        scale = noise["losses" if key == "loss" else "grad_norms"] + 4 * oracle.ULP
        for replica, records in enumerate((survivor, restarted)):
            for r in records:
                want = (ref.losses if key == "loss" else ref.grad_norms)[r["step"] - 1]
                off = abs(r[key] - want) / abs(want) / scale
                assert off <= oracle.K, (f"group {replica}, step {r['step']} ({r['replica_groups']:.0f} groups): "
                                         f"{key} {r[key]:.6f}, the plain run's {want:.6f}: {off:.0f} rounding scales")
