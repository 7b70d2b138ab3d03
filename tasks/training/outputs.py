"""What a finished training run leaves behind: engine exports, the accuracy plot, and its MLflow run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch

from contract.checkpoint import ENGINES, CheckpointContract
from contract.config import RunConfig
from contract.config_loading import config_as_yaml
from contract.secrets import redacted_dump
from models.eagle3 import Eagle3Draft
from tasks.common.artifacts import read_json, save_figure
from tasks.common.host_compute import host_compute
from tasks.training.rank_environment import PARENT_RUN_VARIABLE


def export(cfg: RunConfig, draft: Eagle3Draft, manifest: dict[str, Any], steps: int, world_size: int,
           eval_metrics: dict[str, float], compute_dtype: str) -> None:
    """draft/sglang and draft/vllm: the engine-ready checkpoint with its contract (docs/architecture.md §3, §5), in
    the target's dtype (model.dtype: the weights cast to it, config.json's torch_dtype saying it), the dtype the
    engines serve both models in; the trainer's fp32 master weights stay in its checkpoints."""
    from models.draft_checkpoint import save_pretrained
    from tasks.common.artifacts import atomic_directory

    info = read_json(cfg.output_path / "target.json")
    config = draft.config
    contract = CheckpointContract(
        target_id=info["id"], target_revision=info["revision"], tokenizer_hash=info["tokenizer_hash"],
        chat_template_hash=info["chat_template_hash"], reasoning_mode=cfg.regeneration.reasoning,
        chat_template_kwargs=dict(cfg.model.chat_template_kwargs),
        method=config.method, draft_config=config.to_dict(), aux_layer_ids=config.aux_layer_ids,
        fusion_dims=[3 * config.target_hidden_size, config.hidden_size], hidden_size=info["hidden_size"],
        vocab_size=info["vocab_size"], draft_vocab_size=config.draft_vocab_size,
        vocab_mapping_hash=manifest.get("vocab_mapping_sha256"), bos_token_id=info["bos_token_id"],
        eos_token_id=info["eos_token_id"], pad_token_id=info["pad_token_id"],
        training={"mode": cfg.training.mode, "ttt_length": cfg.training.ttt_length, "dtype": compute_dtype,
                  "master_weights": "float32", "steps": steps, "world_size": world_size,
                  "parallelism": cfg.deployment.trainer.strategy, "grad_accumulation": cfg.training.grad_accumulation,
                  "host": host_compute().as_record()},
        versions={"torch": torch.__version__}, evaluation=eval_metrics,
        data={"features_fingerprint": manifest.get("fingerprint"), "regeneration": redacted_dump(cfg)["regeneration"]},
    )
    with atomic_directory(cfg.output_path / "draft") as staging:  # both engines' folders appear together or not at all
        for engine in ENGINES:
            save_pretrained(draft, staging / engine, contract, info["num_hidden_layers"], engine=engine,
                            dtype=getattr(torch, cfg.model.dtype))


def plot_accuracy(metrics: dict[str, float], before: dict[str, float], path: Path) -> Optional[Path]:
    """Bar chart of eval acc_k by depth, trained vs untrained."""
    depths = sorted(int(key.split("_")[1]) for key in metrics if key.startswith("acc_"))
    if not depths:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    if before:
        axis.bar([d - 0.2 for d in depths], [before[f"acc_{d}"] for d in depths], width=0.4, label="untrained")
    axis.bar([d + 0.2 for d in depths], [metrics[f"acc_{d}"] for d in depths], width=0.4, label="trained")
    axis.set_xlabel("draft step k")
    axis.set_ylabel("eval acc_k")
    axis.set_title(f"simulated accept length {metrics.get('simulated_accept_len', 0):.2f}")
    axis.legend()
    return save_figure(figure, path)


class training_tracker:
    """A nested MLflow run for training on rank 0 (inert elsewhere or when tracking is off)."""

    def __init__(self, cfg: RunConfig, env: Any) -> None:
        self.cfg, self.env, self.run = cfg, env, None

    def __enter__(self) -> Any:
        if not (self.cfg.tracking.enabled and self.env.is_main):
            return None
        import mlflow

        from tasks.common.mlflow_store import ensure_experiment, tracking_uri

        active = mlflow.active_run()
        if active is None:
            mlflow.set_tracking_uri(tracking_uri(self.cfg))
            ensure_experiment(tracking_uri(self.cfg), self.cfg.tracking.experiment)
        tags = {"eaglet.run_id": self.cfg.run_id, "eaglet.stage": "train"}
        parent = os.environ.get(PARENT_RUN_VARIABLE)
        if parent:
            tags["mlflow.parentRunId"] = parent
        self.run = mlflow.start_run(run_name=f"{self.cfg.run_id}/train", nested=active is not None, tags=tags)
        mlflow.log_text(config_as_yaml(self.cfg), "config/run.yaml")
        return mlflow

    def __exit__(self, *exc: Any) -> None:
        if self.run is not None:
            import mlflow

            mlflow.end_run("FAILED" if exc[0] else "FINISHED")
