"""The torchrun command lines of the trainer's ranks, on one node or on several.

One node:   python -m torch.distributed.run --standalone --nproc_per_node=P -m tasks.train --config launch.yaml
N nodes:    python -m torch.distributed.run --nnodes=N --nproc_per_node=P --node_rank=R --rdzv_backend=c10d
                --rdzv_endpoint=HOST:PORT --rdzv_id=ID -m tasks.train --config launch.yaml      (on every node)

Every node runs the same config file (`<output_dir>/train/launch.yaml`, secrets redacted) from the same repository
path; the c10d rendezvous assigns the global ranks, so rank 0 (which writes checkpoints and logs to MLflow) may
land on any node. What rank 0 needs besides the file comes through the environment: the parent MLflow run, and a
tracking URI whose credentials are redacted in the file (tasks/training/rank_environment.py).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from contract.config import RunConfig
from tasks.training.rank_environment import PARENT_RUN_VARIABLE, TRACKING_URI_VARIABLE


def launch_config_path(cfg: RunConfig) -> Path:
    """Where the ranks' config is written: inside output_dir, which every node sees."""
    return cfg.output_path.resolve() / "train" / "launch.yaml"


def torchrun_command(cfg: RunConfig, node_rank: int) -> list[str]:
    """The argv that starts node `node_rank`'s ranks."""
    trainer = cfg.deployment.trainer
    command = [sys.executable, "-m", "torch.distributed.run"]
    if trainer.nnodes == 1:
        command += ["--standalone", f"--nproc_per_node={trainer.nproc_per_node}"]
    else:
        command += [f"--nnodes={trainer.nnodes}", f"--nproc_per_node={trainer.nproc_per_node}",
                    f"--node_rank={node_rank}", "--rdzv_backend=c10d", f"--rdzv_endpoint={trainer.rdzv_endpoint}",
                    f"--rdzv_id={trainer.rdzv_id or cfg.run_id}"]
    return command + ["-m", "tasks.train", "--config", str(launch_config_path(cfg))]


def other_node_commands(cfg: RunConfig, parent_run_id: str | None) -> dict[int, str]:
    """node rank -> the shell line to run on that node (every node but this one), from the folder eaglet runs in
    (the same path on every node)."""
    trainer = cfg.deployment.trainer
    environment = [f"{PARENT_RUN_VARIABLE}={shlex.quote(parent_run_id)}"] if parent_run_id else []
    if cfg.tracking.enabled and cfg.tracking.tracking_uri and "@" in cfg.tracking.tracking_uri:
        environment.append(f'{TRACKING_URI_VARIABLE}="$YOUR_TRACKING_URI"')  # the secret is never printed
    commands = {}
    for node in range(trainer.nnodes):
        if node == trainer.node_rank:
            continue
        line = " ".join(shlex.quote(part) for part in torchrun_command(cfg, node))
        commands[node] = f"cd {shlex.quote(str(Path.cwd()))} && " + " ".join([*environment, line])
    return commands
