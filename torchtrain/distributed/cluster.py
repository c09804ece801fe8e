"""Multi-node runs: what the launcher set up, and the one thing a cluster must provide (docs/cluster.md).

torchrun tells each worker its place: WORLD_SIZE processes in all, LOCAL_WORLD_SIZE on this node,
GROUP_RANK = this node's rank, so the job spans WORLD_SIZE / LOCAL_WORLD_SIZE nodes. Global ranks are
node-major (node n holds ranks n x LOCAL_WORLD_SIZE ... (n + 1) x LOCAL_WORLD_SIZE - 1), which is what
makes the innermost mesh dimensions (tensor parallelism, then FSDP shards) stay inside a node.

Checkpoints are written by every rank into one folder and completed by rank 0 (docs/checkpointing.md),
so with several nodes `job.dump_folder` must be one shared filesystem seen at the same path by every
node. `check_shared_folder` proves it at start-up: rank 0 writes a file with a fresh random token,
every rank reads it back, and a rank that cannot see it stops the job (on every rank, with the same
message) before any step runs, instead of a checkpoint that silently lacks the other nodes' shards.
"""

from __future__ import annotations

import os
import secrets
import socket

import torch.distributed as dist

from torchtrain.config.fields import ConfigError
from torchtrain.utils.logging import logger


def num_nodes() -> int:
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return max(1, world // max(local, 1))


def describe_launch() -> str:
    env = os.environ
    nodes = num_nodes()
    text = f"{nodes} node{'s' if nodes > 1 else ''} x {env.get('LOCAL_WORLD_SIZE', env.get('WORLD_SIZE', 1))} processes"
    if nodes > 1:
        text += f" (rendezvous {env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')})"
    if env.get("SLURM_JOB_ID"):
        text += f", SLURM job {env['SLURM_JOB_ID']}"
        if env.get("SLURM_RESTART_COUNT"):
            text += f" (requeued {env['SLURM_RESTART_COUNT']} times)"
    return text


def check_shared_folder(folder: str) -> None:
    """Every rank must see a file rank 0 writes into `folder` (a collective; ConfigError if not)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    box = [secrets.token_hex(8) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    token = box[0]
    path = os.path.join(folder, f".shared-folder-check-{token}")
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            f.write(token)
    dist.barrier()
    try:
        with open(path) as f:
            seen = f.read() == token
    except OSError:
        seen = False
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, (seen, socket.gethostname()))
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(path)
    blind = [(rank, host) for rank, (ok, host) in enumerate(views) if not ok]
    if blind:
        who = ", ".join(f"rank {r} on {h}" for r, h in blind[:8])
        raise ConfigError(
            f"[job.dump_folder] {os.path.abspath(folder)} is not shared by all nodes: {who} cannot see the file rank 0 "
            f"wrote there. Checkpoints are written into it by every rank; put job.dump_folder (or checkpoint.folder) "
            f"on a filesystem that every node mounts at the same path (docs/cluster.md)"
        )


def check_cluster(checkpoint_folder: str | None) -> None:
    """Log the launch; over several nodes, check that the checkpoint folder (None: checkpoints are off)
    is shared."""
    logger.info("launch: %s", describe_launch())
    if checkpoint_folder is not None and num_nodes() > 1:
        check_shared_folder(checkpoint_folder)
