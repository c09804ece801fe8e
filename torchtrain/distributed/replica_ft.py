"""Replica-group fault tolerance (fault.replica_ft): HSDP whose replica groups survive each other.

The contract
------------
* R = parallelism.data_parallel_replicate_degree >= 2 replica groups, each its own job (its own
  run_train.sh / torchrun, `--fault.replica_id g`, FSDP over its own ranks), all reaching one torchft
  lighthouse. Within a group everything is as usual; across groups, FSDP's all-reduce hook averages
  the reduce-scattered gradient shards of the groups taking part in the step (torchft's Manager over
  a gloo or NCCL group per group rank, rebuilt by torchft whenever the membership changes).
* Every step starts with a quorum (before its data is read). The groups in it take part in the step;
  the token count and the loss are summed over them, so the loss and the gradient are those of the
  token mean over the batches of the groups that took part.
* The data: the global batch is dealt over all R x dp data-parallel ranks (`Layout.data_degree`),
  every group's loader holds the same global sample counter, and every step advances it by the full
  global batch. **Rule: a step trains on the share of the groups taking part in it; the share of an
  absent group is skipped, never trained on later and never repeated.** The metrics show it: a step's
  `tokens` and `replica_groups_live`.
* A lost group does not stop the others: if it fails within a step, the step's cross-group
  collectives fail, torchft's commit vote says no, and the step is skipped on every surviving group
  (no update, like a guard skip; its batches are not trained on); the next quorum leaves the lost
  group out (after the lighthouse's heartbeat timeout) and the survivors continue, down to
  `min_replica_groups` (below it, steps are not applied).
* A restarted group (torchrun --max-restarts, or a relaunch) starts as usual (it may resume from the
  newest checkpoint on its own), joins the next quorum, and, being behind, receives the complete live
  training state of the same group rank of a surviving group (torchft's HTTP transport: model and
  optimizer shards, schedule, data position, step and token counters, RNG) before reading data. The
  survivors reload nothing. From then on its state is bitwise the survivors' (the final `state_digest`
  in each group's metrics shows it).
* Checkpoints: one group saves (torchft's participating rank 0: the lowest live replica id) into the
  shared checkpoint folder; every group can resume from it (the data position is one global counter).
  Metrics, logs and hang dumps of group g go to `{dump_folder}/replica_<g>/`.
* The NaN guard works as usual: the loss and the gradients are the same in every group, so every group
  reaches the same verdict.
* A fresh start waits up to replica_timeout_s for all R groups before the first step (else the first
  group to arrive would start alone and the others would heal from it at once).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtrain.config.fault import Fault
from torchtrain.config.fields import ConfigError
from torchtrain.utils.logging import logger


def run_folder(dump_folder: str, fault: Fault) -> str:
    """Where one job writes its metrics, logs and hang dumps: a replica group's own sub-folder."""
    return os.path.join(dump_folder, f"replica_{fault.replica_id}") if fault.replica_ft else dump_folder


def lighthouse_address(fault: Fault) -> str:
    address = fault.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not address:
        raise ConfigError("[fault.lighthouse] replica_ft needs the address of torchft's lighthouse (e.g. "
                          "http://host:29510, where `torchft_lighthouse --min_replicas 1` runs): set fault.lighthouse "
                          "or $TORCHFT_LIGHTHOUSE")
    return address


def check_replica_ft(fault: Fault) -> None:
    """Preflight: torchft is installed and the lighthouse is named."""
    if not fault.replica_ft:
        return
    try:
        _import_torchft()
    except ImportError as e:
        raise ConfigError(f"[fault.replica_ft] needs torchft: pip install \"torchtrain[ft]\" ({e})") from None
    lighthouse_address(fault)


def _to_local(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}


def _from_local(received: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """DTensors again, placed like this rank's live ones (the same group rank holds the same shard)."""
    out = {}
    for k, v in received.items():
        like = live.get(k)
        if isinstance(like, DTensor):
            v = DTensor.from_local(v.to(like.device), like.device_mesh, like.placements, shape=like.shape,
                                   stride=like.stride(), run_check=False)
        elif isinstance(like, torch.Tensor) and isinstance(v, torch.Tensor):
            v = v.to(like.device)
        out[k] = v
    return out


def state_digest(states: dict[str, Any], group: dist.ProcessGroup | None = None) -> str:
    """A hash of the whole training state of this replica group (every rank's shards), equal across
    groups exactly when their states are bitwise equal. A collective over the group's ranks."""
    h = hashlib.sha256()
    for key in sorted(states):
        for name, value in sorted(_to_local(states[key].state_dict()).items()):
            h.update(name.encode())
            if isinstance(value, torch.Tensor):
                h.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
            else:
                h.update(pickle.dumps(value))
    mine = h.hexdigest()
    every = [mine] * (dist.get_world_size(group) if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(every, mine, group=group)
    return hashlib.sha256("".join(every).encode()).hexdigest()[:16]


class _Unactionable(logging.Filter):
    """torchft warns at every new quorum that it cannot reset the NCCL flight recorder (always so on CPU)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in record.getMessage()


def _import_torchft():
    """torchft, with its logs at a useful level: its Rust side logs every quorum at INFO (RUST_LOG, read
    when the module loads), its Python side a flight-recorder warning per quorum on CPU."""
    os.environ.setdefault("RUST_LOG", "warn")
    import torchft

    logging.getLogger("torchft.manager").addFilter(_Unactionable())
    # the healing group's load of the streamed state: torch warns that the received buffer is read-only
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    return torchft


class ReplicaGroups:
    """This job's membership in the replica groups (the contract in the module docstring).
    `states`: the Stateful training states (checkpoint/state.py `training_states`)."""

    def __init__(self, cfg: Fault, groups: int, replica_id: int, device: torch.device, states: dict[str, Any]):
        torchft = _import_torchft()
        from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

        self.cfg, self.groups, self.replica_id, self.states = cfg, groups, replica_id, states
        timeout = timedelta(seconds=cfg.replica_timeout_s)
        # torchft's Manager publishes its address in the job's store (MASTER_ADDR:MASTER_PORT) under fixed
        # keys; torchrun keeps that store across restarts, so a restarted group could read the address of
        # its dead predecessor's manager. Group rank 0 clears the keys before any rank looks for them.
        if dist.get_rank() == 0:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timeout, wait_for_workers=False)
            for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
                store.delete_key(key)
        dist.barrier()
        pg = torchft.ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else torchft.ProcessGroupGloo(timeout=timeout)
        # Synchronous quorum: a group that must heal receives the live state before the step reads data.
        # init_sync=False: initial weights are identical in every group already (param_init.py).
        self.manager = torchft.Manager(
            pg=pg, min_replica_size=cfg.min_replica_groups, load_state_dict=self._load, state_dict=self._state,
            use_async_quorum=False, replica_id=f"torchtrain_replica_{replica_id}",
            lighthouse_addr=lighthouse_address(cfg), init_sync=False, timeout=timeout, quorum_timeout=timeout,
            connect_timeout=timeout)
        self.live = 0
        self.lost_steps = 0
        self.healed = False
        self._first = True

    # ------------------------------------------------------------------ live state transfer
    def _state(self) -> dict[str, Any]:
        return {key: _to_local(s.state_dict()) for key, s in self.states.items()}

    def _load(self, state: dict[str, Any]) -> None:
        for key, stateful in self.states.items():
            received = state[key]
            if key in ("dataloader", "rng"):  # {"dp_rank_<r>" / "rank_<r>": a JSON tensor}, the same rank's
                stateful.load_state_dict(next(iter(received.values())))
            else:
                stateful.load_state_dict(_from_local(received, stateful.state_dict()))
        self.healed = True

    # ------------------------------------------------------------------ the step
    def install(self, model_parts: list[nn.Module]) -> None:
        """Average FSDP's reduce-scattered gradients across the groups taking part in the step."""
        from torch.distributed.distributed_c10d import ReduceOp
        from torch.distributed.fsdp import FSDPModule

        def all_reduce(output: torch.Tensor) -> None:
            self.manager.allreduce(output, reduce_op=ReduceOp.AVG).wait()

        for part in model_parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.set_all_reduce_hook(all_reduce)

    def begin_step(self, step: int, wait_for_all: bool = False) -> bool:
        """The quorum of the step after `step` (call before reading its data). A group behind the others
        receives the live training state here: True when it did (its loader must start a new iteration)."""
        self.healed = False
        wait_for_all = wait_for_all or self._first
        deadline = time.monotonic() + self.cfg.replica_timeout_s
        while True:
            self.manager.start_quorum()
            self.live = self.manager.num_participants()
            if not wait_for_all or self.live >= self.groups or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if self._first and self.live < self.groups:
            logger.warning("replica groups: starting with %d of %d groups (the others did not join within "
                           "fault.replica_timeout_s = %gs)", self.live, self.groups, self.cfg.replica_timeout_s)
        self._first = False
        if self.healed:
            logger.warning("replica group %d rejoined: received the live training state after step %d from a "
                           "surviving group instead of continuing from step %d (%d of %d groups live)", self.replica_id,
                           self.states["train_state"].step, step, self.live, self.groups)
        return self.healed

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over the groups in the quorum, in place (left as it is if a group fails meanwhile:
        the step is then not committed)."""
        from torch.distributed.distributed_c10d import ReduceOp

        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return tensor

    def commit(self) -> bool:
        """Whether every cross-group collective of the step succeeded with enough groups (agreed by this
        group's ranks): if not, the step must not be applied (counted in `replica_lost_steps`)."""
        committed = self.manager.should_commit()
        self.lost_steps += int(not committed)
        return committed

    @property
    def saver(self) -> bool:
        """This group writes the checkpoints (the lowest live replica group)."""
        return self.manager.participating_rank() == 0

    def record(self) -> dict[str, Any]:
        return {"replica_groups_live": self.live, "replica_lost_steps": self.lost_steps}

    def close(self) -> None:
        self.manager.shutdown(wait=False)
