"""Fault tolerance without a restart: replica groups that drop out and rejoin, with torchft.

[fault_tolerance] enable = true splits the data-parallel ranks into `group_size` replica
groups, each launched as a torchrun job of its own (`replica_id` 0 .. group_size-1). Inside a
group everything is as without it (FSDP, tensor parallelism over the group's ranks); across
groups the gradients are averaged through torchft, whose lighthouse (a small server started
once per job, docs/reliability.md) tells each step which groups are alive. Every step:

    quorum   the groups alive agree on who takes part (`Manager.start_quorum`, synchronous): a
             group that is behind -- just restarted -- first loads a live peer's weights,
             optimizer state and schedule over HTTP, then takes part in this very step
    backward FSDP reduce-scatters each gradient inside the group, then its all-reduce hook
             averages the shard over the groups of the quorum (torchft's managed process
             group: a peer that dies mid-step makes the step fail, it does not raise)
    commit   the optimizer steps only when every rank of every group agrees nothing failed
             (`Manager.should_commit`); otherwise the same step runs again with the groups
             left, so the step number on the survivors only ever moves forward

A step's batch is a function of its number, so a step taken again, or taken by a group that
just healed, reads the same data. Each group's loss is the mean over its own tokens and the
groups' gradients are averaged: the global token mean when every group counts as many tokens
(pretraining), a mean of the groups' means when labels are masked (SFT) -- as torchtitan's.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


class NoFaultTolerance:
    """Without [fault_tolerance]: every step is taken once, in order, and always counts."""

    enabled = False

    def steps(self, first: int, last: int):
        return range(first, last + 1)

    def committed(self) -> bool:
        return True

    def replica_groups(self) -> int:
        return 1

    def close(self) -> None:
        pass

    def abandon(self) -> None:
        pass


class FaultTolerance:
    """One torchft Manager for this replica group; see the module docstring."""

    enabled = True

    def __init__(self, cfg, parts: list[nn.Module], optimizer, scheduler, start_step: int):
        import torchft

        ft, comm = cfg.fault_tolerance, cfg.comm
        self.parts, self.optimizer, self.scheduler = parts, optimizer, scheduler
        timeout = timedelta(seconds=comm.train_timeout_seconds)
        backend = torchft.ProcessGroupNCCL if torch.cuda.is_available() and cfg.job.device != "cpu" \
            else torchft.ProcessGroupGloo

        self._pg = backend(timeout=timeout)  # reconfigured by the manager at each new quorum

        def make():
            return torchft.Manager(
                pg=self._pg, min_replica_size=1, load_state_dict=self._load, state_dict=self._state,
                # Synchronous quorum: a group that heals does so before its forward, so it takes part
                # in the same step as everyone and the loop can read the step number the quorum agreed.
                use_async_quorum=False, replica_id=f"meshtrain_{ft.replica_id}", lighthouse_addr=ft.lighthouse,
                rank=dist.get_rank(), world_size=dist.get_world_size(), timeout=timeout,
                quorum_timeout=timedelta(seconds=comm.init_timeout_seconds),
                connect_timeout=timedelta(seconds=comm.init_timeout_seconds),
                # Every group draws the same initial weights from [training] seed: nothing to send.
                init_sync=False)
        # The group's rank 0 serves the manager and writes its address into torchrun's store;
        # the others read it only once it is there. (After a torchrun restart the store still
        # holds the dead attempt's address, which a rank reading early would connect to.)
        if dist.get_rank() == 0:
            self.manager = make()
        dist.barrier()
        if dist.get_rank() != 0:
            self.manager = make()
        self.manager.load_state_dict({"step": start_step, "batches_committed": 0})  # a resumed checkpoint's step
        self._managed = torchft.process_group.ManagedProcessGroup(self.manager)
        # dist.all_reduce takes a registered group only; one per rank, named for the replica dimension.
        self._managed.register("ft_replicas")
        for part in parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.set_all_reduce_hook(self._average_over_groups)
        self._commit: bool | None = None

    def _average_over_groups(self, shard: torch.Tensor) -> None:
        """FSDP's all-reduce hook: this rank's reduce-scattered gradient shard, averaged over
        the same shard of every replica group in the quorum (torchft divides the sum by the
        number of groups taking part)."""
        dist.all_reduce(shard, op=dist.ReduceOp.AVG, group=self._managed)

    def steps(self, first: int, last: int):
        """The step numbers to run, from the quorum: usually first, first+1, ...; a step that
        did not commit comes again; a group that healed jumps to its peers' step. (The
        manager counts from ``first``: it was told the resumed step in __init__.)"""
        while True:
            self.manager.start_quorum()  # healing, when behind, happens here (synchronous quorum)
            self._commit = None
            n = self.manager.current_step() + 1
            if n > last:
                return
            yield n

    def should_commit(self) -> bool:
        """Whether this step counts: every rank of every group in the quorum succeeded. Asked once
        per step, by `CommittingOptimizer.step` or, for a step that skipped its update (a
        non-finite gradient), by `committed`."""
        if self._commit is None:
            self._commit = self.manager.should_commit()
        return self._commit

    def committed(self) -> bool:
        if not self.should_commit() and dist.get_rank() == 0:
            print(f"meshtrain: step {self.manager.current_step() + 1} did not commit (a replica group failed "
                  "during it); the groups left take it again", file=sys.stderr, flush=True)
        return self._commit

    def replica_groups(self) -> int:
        """How many replica groups took part in the step."""
        return self.manager.num_participants()

    def mean_over_groups(self, value: float) -> float:
        """A group's step loss averaged over the groups that took part (the loss of the
        global batch). After a failure, this group's own."""
        t = torch.tensor(value, dtype=torch.float64)
        self.manager.allreduce(t).wait()
        return t.item()

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    def abandon(self) -> None:
        """This group failed (a collective inside it): close its connections to the other
        groups and stop its heartbeat now, so they go on without it at once -- not only once
        this process exits, after the hang report has waited seconds for its peers' records."""
        self._pg.abort()
        self.manager.shutdown(wait=False)

    # ---------------------------------------------------------------- healing: a live peer's state

    def _state(self) -> dict:
        """What a rejoining group needs, as plain tensors: this rank's shards (the same group
        rank of the peer holds the same shards: the groups have one layout)."""
        return {"model": [_local(part.state_dict()) for part in self.parts],
                "optimizer": [_local(opt.state_dict()) for opt in self.optimizer.optimizers],
                "scheduler": self.scheduler.state_dict()}

    def _load(self, state: dict) -> None:
        with torch.no_grad():
            for part, saved in zip(self.parts, state["model"], strict=True):
                for name, tensor in part.state_dict().items():
                    _local_view(tensor).copy_(saved[name])
        for opt, saved in zip(self.optimizer.optimizers, state["optimizer"], strict=True):
            opt.load_state_dict(_as_params(opt, saved))
        self.scheduler.load_state_dict(state["scheduler"])


class CommittingOptimizer:
    """`Optimizers` whose step updates the weights only when the quorum commits the step."""

    def __init__(self, optimizers, ft: FaultTolerance):
        self.inner, self.ft = optimizers, ft

    def step(self) -> None:
        if self.ft.should_commit():
            self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _local(tree):
    """``tree`` with each DTensor replaced by this rank's local shard (a copy)."""
    if isinstance(tree, DTensor):
        return tree.to_local().detach().clone()
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local(v) for v in tree)
    return tree


def _local_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _as_params(opt: torch.optim.Optimizer, saved: dict) -> dict:
    """A peer's optimizer state dict (plain local tensors) with each per-parameter tensor
    made a DTensor like its parameter, as `load_state_dict` expects."""
    params = [p for group in opt.param_groups for p in group["params"]]
    state = {}
    for index, entry in saved["state"].items():
        p = params[index]
        state[index] = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                              stride=p.stride())
                        if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.to_local().shape
                        else v for k, v in entry.items()}
    return {"state": state, "param_groups": saved["param_groups"]}


def open_fault_tolerance(cfg, parts: list[nn.Module], optimizer, scheduler, start_step: int):
    """A `FaultTolerance` with [fault_tolerance] enable, else a `NoFaultTolerance`."""
    if not cfg.fault_tolerance.enable:
        return NoFaultTolerance()
    # torchft's Rust side logs every quorum and commit at INFO, several lines a step: warnings only,
    # unless RUST_LOG says otherwise. Read when torchft is first imported.
    os.environ.setdefault("RUST_LOG", "warn")
    return FaultTolerance(cfg, parts, optimizer, scheduler, start_step)
