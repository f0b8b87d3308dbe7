"""A multi-process job whose ranks are forked from a process that has already imported
torch, instead of started by torchrun as fresh interpreters.

Each torchrun rank spends about 5 CPU-seconds importing torch (torch._dynamo included,
which FSDP2 and the meta-device initialisation pull in) before it does any work, and the
launcher imports torch too: train.py's debug_2d, 10 steps on 4 ranks, takes 28 s on the
2-core CI machine under torchrun and 10 s forked. One forkserver per pytest worker
(multiprocessing's, started on first use) imports torch and meshtrain once; every rank is
a fork of it. The process group is the one torchrun's ranks build: gloo over a TCPStore,
which this process hosts as torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE), so no
port is picked and handed over.

`forked_python` runs one such process without torchrun's environment, as `python script
...` would: a single-process train.py run costs its work, not another 5 CPU-seconds of
imports.

What this is not: torchrun, nor a fresh interpreter. Tests of what the launcher does --
restarts, signals, a rank killed, the report of a failed job, the command line a user types
-- use the real one (tests/conftest.py `torchrun`), and tests of an interpreter's own
start-up (what it imports before refusing a typo, a signal during its imports) start a real
one. Jobs here are ones whose proof is what the ranks compute.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What every rank imports anyway, imported once in the forkserver (should it fail to
# import, multiprocessing skips it and each rank imports what it needs, as before).
PRELOAD = ["tests.forked_ranks_preload"]
_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _rank_main(argv: list[str], env: dict, out: str, err: str, cwd: str) -> None:
    """One process: its environment, its output to its own two files, ``argv`` run as
    ``python *argv`` runs it -- a script, ``-m`` and a module, or ``-c`` and code -- as
    __main__ (exit code: SystemExit's, 1 for an exception, whose traceback multiprocessing
    prints to stderr)."""
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(handle, fd)
        os.close(handle)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(cwd)
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[:0] = [argv[1], *argv[2:]], [cwd]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv, sys.path[:0] = ["-c", *argv[2:]], [cwd]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            script = Path(cwd) / argv[0]
            sys.argv = list(argv)
            sys.path.insert(0, str(script.parent))
            runpy.run_path(str(script), run_name="__main__")
    finally:  # a forked process leaves by os._exit: run what an interpreter runs at exit (run_lock's release)
        atexit._run_exitfuncs()


def _run(argv: list[str], envs: list[dict], timeout: float, cwd: str) -> tuple[list[int], str, str]:
    """One forked process per environment, all running ``argv``; returns their exit codes
    and their stdout and stderr, one process after another. Stops them all as soon as one
    fails; raises subprocess.TimeoutExpired after ``timeout`` seconds, the processes killed."""
    ctx = _forkserver()
    with tempfile.TemporaryDirectory() as tmp:
        out = [os.path.join(tmp, f"stdout{i}") for i in range(len(envs))]
        err = [os.path.join(tmp, f"stderr{i}") for i in range(len(envs))]
        procs = []
        for i, env in enumerate(envs):
            proc = ctx.Process(target=_rank_main, args=(argv, env, out[i], err[i], str(cwd)))
            proc.start()
            procs.append(proc)
        deadline = time.monotonic() + timeout
        try:
            while any(p.exitcode is None for p in procs) and all(p.exitcode in (None, 0) for p in procs):
                if time.monotonic() > deadline:
                    _stop(procs)
                    raise subprocess.TimeoutExpired(argv, timeout, _read(out), _read(err))
                multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], 0.2)
        finally:
            _stop(procs)  # one failed (or the wait did): the others are stopped
        return [p.exitcode for p in procs], _read(out), _read(err)


def forked_python(*argv: str, env: dict | None = None, timeout: float = 300,
                  cwd: str | Path = ROOT) -> subprocess.CompletedProcess:
    """``python *argv`` (a script, ``-m`` and a module, or ``-c`` and code, then the
    arguments) as one process forked from the forkserver, with ``env`` as its whole environment (this one's when None),
    as subprocess.run(..., capture_output=True, text=True) returns it: exit code and all.
    For runs whose proof is what the program does; a test of the interpreter's own start-up
    (what is imported, how soon, a signal during it) needs a real one."""
    codes, out, err = _run(list(argv), [dict(os.environ if env is None else env)], timeout, str(cwd))
    return subprocess.CompletedProcess([sys.executable, *argv], codes[0], out, err)


def forked_ranks(script: str, *args: str, nproc: int = 4, timeout: int = 300,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """``script`` on ``nproc`` forked ranks; a CompletedProcess as subprocess.run returns
    it, with every rank's stdout (and stderr) one rank after another: ranks appending to
    one file land inside each other's lines. The job fails (exit 1) as torchrun's does when
    a rank fails: the others are stopped, as torchrun stops them. Raises
    subprocess.TimeoutExpired after ``timeout`` seconds, the ranks killed."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, nproc + 1, is_master=True, wait_for_workers=False)
    base = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {}),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "forked", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    envs = [{**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)} for rank in range(nproc)]
    codes, out, err = _run([script, *args], envs, timeout, str(ROOT))
    return subprocess.CompletedProcess([script, *args], 0 if all(c == 0 for c in codes) else 1, out, err)


def _stop(ranks, grace: float = 10.0) -> None:
    """SIGTERM the ranks still running, SIGKILL those still there after ``grace`` seconds."""
    for p in ranks:
        if p.exitcode is None:
            p.terminate()
    end = time.monotonic() + grace
    for p in ranks:
        p.join(max(0.0, end - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


def _read(paths: list[str]) -> str:
    return "".join(Path(p).read_text(errors="replace") for p in paths if os.path.exists(p))
