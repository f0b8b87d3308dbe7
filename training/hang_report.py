"""A hang that explains itself: when a collective times out, which ranks are behind, where.

Every rank keeps a cheap account of where it is (`where`): the step, the phase and
micro-batch (told by `faults.step_phase`, which the step already sets), its mesh
coordinates (its pipeline stage among them) and, per process group, how many collectives
it has issued -- the sequence number gloo and NCCL keep anyway, so counting costs nothing.
When a collective times out, the run folder's `hang/` gets:

- `rank{R}.txt` and `rank{R}.json` from every rank: that account, and the Python stacks of
  all its threads (faulthandler). A rank that sees the timeout writes them as the error
  surfaces. A rank that stalled sees nothing -- it is busy, not waiting -- so a watchdog
  thread writes its files once it has made no progress (no phase entered or left, no
  collective issued) for the collective timeout; they are removed if it moves on again.
- `summary.txt`: the ranks behind, from the records. Rank A waits for rank B when, in a
  group they share, A has issued more collectives than B. The ranks behind are those that
  others wait for and that themselves wait for no one (a stalled or dead rank); a rank
  without a record died or is stuck without letting Python run. The rank that reports the
  timeout waits briefly for the records, writes the summary and prints it.

Afterwards, `meshtrain hang-report RUN_FOLDER` (`python -m meshtrain.training.hang_report`)
prints it again from the records. NCCL's flight recorder answers the same question for
NCCL alone; this works for every backend that counts (gloo, NCCL), and the tests run gloo.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

FOLDER = "hang"
_watch: HangWatch | None = None  # this process's, while training runs


def collectives_issued() -> dict[str, dict]:
    """Per process group this rank is in: its description, ranks and collectives issued so far."""
    import torch.distributed as dist

    groups = {}
    for group in list(dist.distributed_c10d._world.pg_map):  # only the groups this rank belongs to
        try:
            issued = group._get_sequence_number_for_group()
        except RuntimeError:  # a backend that keeps no count ("does not yet support sequence numbers")
            issued = None
        groups[dist.distributed_c10d._get_process_group_name(group)] = {
            "desc": group.group_desc, "ranks": dist.get_process_group_ranks(group), "issued": issued}
    return groups


class Where:
    """Where this rank is: the last phase entered (`faults.step_phase` tells it), whether it
    is still inside, the micro-batch (training/step.py sets it), and ``moves``, counting
    phases entered and left, which the watchdog reads as progress."""

    def __init__(self):
        self.step: int | None = None
        self.phase, self.inside, self.micro_batch, self.moves = "start-up", False, None, 0

    def entered(self, step: int, phase: str) -> None:
        self.step, self.phase, self.inside, self.micro_batch = step, phase, True, None
        self.moves += 1

    def left(self) -> None:
        self.inside = False
        self.moves += 1

    def record(self) -> dict:
        return {"step": self.step, "phase": self.phase, "inside_phase": self.inside, "micro_batch": self.micro_batch}


where = Where()  # this process's


class HangWatch:
    """This rank's watchdog and record writer (see the module's docstring)."""

    def __init__(self, run_dir: Path, mesh, timeout: float):
        import torch.distributed as dist

        self.folder = Path(run_dir) / FOLDER
        self.rank, self.world_size, self.timeout = dist.get_rank(), dist.get_world_size(), timeout
        self.mesh = dict(zip(mesh.mesh_dim_names or (), mesh.get_coordinate() or ()))
        # The pipeline's group carries its sends and receives, which gloo counts with the
        # collectives (NCCL does not): a middle stage issues twice an end's. Not compared.
        self.pipeline_group = (dist.distributed_c10d._get_process_group_name(mesh.get_group("pp"))
                               if "pp" in self.mesh else None)
        self.since = time.time()  # records older than this are an earlier run's
        self.wrote = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshtrain-hang-watch", daemon=True)

    def poll_seconds(self) -> float:
        return min(max(self.timeout / 10, 0.1), 5.0)

    def _progress(self):
        return where.moves, sum(g["issued"] or 0 for g in collectives_issued().values())

    def _watch(self) -> None:
        last, quiet_since = None, time.monotonic()
        while not self._stop.wait(self.poll_seconds()):
            try:
                now = self._progress()
            except RuntimeError:  # a group created or destroyed under us: look again next time
                continue
            if now != last:
                last, quiet_since = now, time.monotonic()
                if self.wrote:  # it was slow, not stuck
                    self.remove()
            elif not self.wrote and time.monotonic() - quiet_since >= self.timeout:
                try:
                    self.write(f"no progress (no phase entered or left, no collective issued) for "
                               f"{time.monotonic() - quiet_since:.0f} s; the collective timeout is {self.timeout:g} s")
                except OSError as why:  # a full disk: say so once, and let training go on
                    print(f"meshtrain: warning: rank {self.rank}: no hang record written: {why}", file=sys.stderr)
                    return

    def start(self) -> HangWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        global _watch
        if _watch is self:
            _watch = None
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def remove(self) -> None:
        for suffix in (".json", ".txt"):
            (self.folder / f"rank{self.rank}{suffix}").unlink(missing_ok=True)
        self.wrote = False

    def write(self, why: str, err: BaseException | None = None) -> None:
        """hang/rank{R}.json (the account) and hang/rank{R}.txt (it, the error, every thread's stack)."""
        record = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                  "why": why, **where.record(), "mesh": self.mesh, "pipeline_group": self.pipeline_group,
                  "groups": collectives_issued()}
        self.folder.mkdir(parents=True, exist_ok=True)
        text = self.folder / f"rank{self.rank}.txt"
        with open(text, "w") as fh:
            fh.write(f"rank {self.rank} (host {record['host']}, pid {record['pid']}): {why}\n"
                     f"at {describe_where(record)}\ncollectives issued per process group:\n")
            for name, group in record["groups"].items():
                fh.write(f"  {group_label(name, group)}: {group['issued']}\n")
            if err is not None:
                fh.write("\nthe error:\n" + "".join(traceback.format_exception(err)))
            fh.write("\nPython stacks of every thread (faulthandler):\n")
            fh.flush()
            faulthandler.dump_traceback(file=fh, all_threads=True)
        _write_atomically(self.folder / f"rank{self.rank}.json", json.dumps(record, indent=1))
        self.wrote = True

    def records(self, wait: float) -> dict[int, dict]:
        """Every rank's record of this run, waiting up to ``wait`` seconds for missing ones."""
        deadline = time.monotonic() + wait
        while True:
            found = read_records(self.folder, since=self.since)
            if len(found) >= self.world_size or time.monotonic() >= deadline:
                return found
            time.sleep(0.2)

    def report(self, err: BaseException) -> str:
        """On a rank whose collective failed: its record, then the summary (written and returned)."""
        self.stop()
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        self.write(f"a collective failed: {first}", err)
        # After a timeout a stalled rank's watchdog writes within a poll or two. After a peer
        # closed its connection (it died), there is no stalled rank to wait for: the live ones
        # write as their own errors surface, some only once this rank exits and closes its
        # connections -- waiting for them would outlast torchrun's 30 s grace, ending in SIGKILL.
        wait = 1.0 if peer_gone(err) else 2 * self.poll_seconds() + 5
        text = summarize(self.records(wait=wait), self.world_size)
        _write_atomically(self.folder / "summary.txt", text)
        return text


# How gloo and NCCL word a collective whose peer process is gone (as opposed to one that
# timed out waiting for a live peer).
PEER_GONE_WORDS = ("connection closed", "connection reset", "broken pipe")


def peer_gone(err: BaseException) -> bool:
    text = str(err).lower()
    return any(word in text for word in PEER_GONE_WORDS)


def watch(run_dir: Path, mesh, timeout: float) -> HangWatch:
    """Start this rank's watch for the training loop (``timeout``: the collective timeout
    now; `faults.set_collective_timeout` changes it). Stop it when the loop ends."""
    global _watch
    _watch = HangWatch(run_dir, mesh, timeout)
    return _watch.start() if _watch.world_size > 1 else _watch  # one rank alone waits for no other


def current() -> HangWatch | None:
    return _watch


def read_records(folder: Path, since: float = 0.0) -> dict[int, dict]:
    records = {}
    for path in Path(folder).glob("rank*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):  # being replaced right now
            continue
        if record.get("time", 0) >= since:
            records[record["rank"]] = record
    return records


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def group_label(name: str, group: dict) -> str:
    ranks = ",".join(map(str, group["ranks"]))
    return f"group {name} ({group['desc']}, ranks {ranks})"


def describe_where(record: dict) -> str:
    if record["step"] is None:
        return "start-up"
    text = f"step {record['step']}, {'' if record['inside_phase'] else 'after '}{record['phase']}"
    if record["inside_phase"] and record["micro_batch"] is not None:
        text += f", micro-batch {record['micro_batch']}"
    if "pp" in record["mesh"]:
        text += f", pipeline stage {record['mesh']['pp']}"
    return text


def waits(records: dict[int, dict]) -> tuple[dict[int, dict[int, str]], dict[int, list[str]]]:
    """(rank -> {rank it waits for: in which group}, rank -> how it is behind, per group).
    A waits for B when, in a group both belong to, A issued more collectives than B, or
    B left no record (it died: whatever A is doing with the group, it waits for B). The
    pipeline's group is left out (see HangWatch: its counts hold sends and receives)."""
    pipeline = {record.get("pipeline_group") for record in records.values()}
    groups: dict[str, tuple[dict, dict[int, int]]] = {}
    for rank, record in records.items():
        for name, group in record["groups"].items():
            if group["issued"] is not None and name not in pipeline:
                groups.setdefault(name, (group, {}))[1][rank] = group["issued"]
    waits_for: dict[int, dict[int, str]] = {rank: {} for rank in records}
    lags: dict[int, list[str]] = {}
    for name, (group, issued) in sorted(groups.items()):
        for rank in issued:
            waits_for[rank].update({r: group["desc"] for r in group["ranks"] if r not in records})
        most = max(issued.values())
        for rank, count in issued.items():
            for other, other_count in issued.items():
                if count > other_count:
                    waits_for[rank][other] = group["desc"]
            if count < most:
                ahead = ", ".join(f"rank {r} {c}" for r, c in sorted(issued.items()) if c > count)
                lags.setdefault(rank, []).append(f"{group_label(name, group)}: rank {rank} issued {count} "
                                                 f"collectives, {ahead}")
    return waits_for, lags


def summarize(records: dict[int, dict], world_size: int) -> str:
    """Which ranks are behind, and where every rank is, as text."""
    waits_for, lags = waits(records)
    missing = [r for r in range(world_size) if r not in records]
    waited_on = {other for targets in waits_for.values() for other in targets}
    behind = sorted(r for r in records if r in waited_on and not waits_for[r])  # waited for, waiting for none
    lines = [f"hang report: {len(records)} of {world_size} ranks wrote a record (hang/rank*.txt: stacks)"]
    if behind or missing:
        names = ", ".join(f"rank {r}" for r in sorted(behind + missing))
        lines.append(f"behind: {names}")
    elif lags:
        lines.append("behind: none alone -- the ranks wait for each other in a cycle (collectives issued in a "
                     "different order on different ranks?): " + ", ".join(f"rank {r}" for r in sorted(lags)))
    else:
        lines.append("behind: none -- every rank issued as many collectives as the others in each group")
    for rank in missing:
        lines.append(f"  rank {rank}: no record -- it died, or is stuck where Python cannot run")
    for rank in behind:
        record = records[rank]
        lines.append(f"  rank {rank}: {describe_where(record)}; {record['why']}")
        lines += [f"    {lag}" for lag in lags.get(rank, [])]
    lines.append("every rank:")
    for rank in sorted(records):
        record, targets = records[rank], waits_for[rank]
        waiting = "; waits for " + ", ".join(f"rank {r} ({targets[r]})" for r in sorted(targets)) if targets else ""
        lines.append(f"  rank {rank}: {describe_where(record)}{waiting}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: meshtrain hang-report RUN_FOLDER\n\nWhich ranks were behind, and where, when a "
              "collective of the run timed out: the summary of its hang/ records.",
              file=sys.stdout if {"-h", "--help"} & set(argv) else sys.stderr)
        return 0 if {"-h", "--help"} & set(argv) else 2
    folder = Path(argv[0]) / FOLDER
    records = read_records(folder)
    if not records:
        print(f"meshtrain: error: no hang records in {folder} (written when a collective times out)",
              file=sys.stderr)
        return 2
    # The records of the latest hang: those written within a minute of the newest.
    newest = max(r["time"] for r in records.values())
    records = {rank: r for rank, r in records.items() if r["time"] >= newest - 60}
    world_size = max(max(g["ranks"]) for r in records.values() for g in r["groups"].values()) + 1
    print(summarize(records, world_size), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
