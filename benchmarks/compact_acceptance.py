"""What compact features cost in acceptance: the same draft trained on lossless vs compact features.

    .venv/bin/python benchmarks/compact_acceptance.py --output-dir artifacts/embedded-default [--epochs 3]

Needs a run whose validate stage is done (target/, data/train.jsonl, data/eval.jsonl). Captures lossless
features (if missing) and compact ones into `<output-dir>-compact`, trains one draft on each with the
same seed, order and steps, and evaluates both on the lossless eval features (the true teacher).
Goal (issue 4): compact <= 0.5x the bytes of SpecForge's format with acceptance within 2% of lossless.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch
import yaml

from contract.config import RunConfig
from models.eagle3 import Eagle3Config, Eagle3Draft
from models.teacher import Teacher
from models.target_loading import load_target
from models.ttt import ttt_forward
from models.vocab_mapping import load_vocab_mapping
from tasks import capture
from tasks.features.batches import collate
from tasks.features.shards import FeatureSet
from tasks.train import evaluate_features


def run_config(output_dir: Path, mode: str) -> RunConfig:
    params = yaml.safe_load(Path("params.yaml").read_text())
    params.update(output_dir=str(output_dir), tracking={"enabled": False})
    params.setdefault("capture", {})["mode"] = mode
    return RunConfig.model_validate(params)


def compact_run_dir(lossless_dir: Path) -> Path:
    """A sibling run dir sharing target/ and data/ with the lossless run."""
    compact = lossless_dir.with_name(lossless_dir.name + "-compact")
    compact.mkdir(exist_ok=True)
    for name in ("target", "target.json", "data"):
        link = compact / name
        if not link.exists():
            os.symlink((lossless_dir / name).resolve(), link)
    return compact


def new_draft(cfg: RunConfig, target, vocab, seed: int) -> Eagle3Draft:
    torch.manual_seed(seed)
    ids = json.loads((cfg.output_path / "features" / "manifest.json").read_text())["aux_layer_ids"]
    draft = Eagle3Draft(Eagle3Config.from_target(target.config, vocab.draft_vocab_size, ids))
    draft.set_vocab_mapping(vocab.d2t, vocab.t2d)
    draft.attach_embedding(target.get_input_embeddings().weight)
    draft.initialise_from_target(target.get_output_embeddings().weight, target.model.norm.weight)
    return draft


def train(draft: Eagle3Draft, features: FeatureSet, lm_head: torch.Tensor, epochs: int, steps: int, seed: int,
          learning_rate: float) -> float:
    optimizer = torch.optim.AdamW(draft.parameters(), lr=learning_rate)
    teacher = Teacher(lm_head, draft.t2d)
    order = list(range(len(features)))
    started, tokens = time.perf_counter(), 0
    for epoch in range(epochs):
        random.Random(seed + epoch).shuffle(order)
        for index in order:
            record = features[index]
            batch = collate([record], teacher)
            optimizer.zero_grad()
            ttt_forward(draft, batch, steps).loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
            optimizer.step()
            tokens += len(record["input_ids"])
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="artifacts/embedded-default")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="init + data-order seeds, averaged")
    args = parser.parse_args()
    lossless_dir = Path(args.output_dir)
    compact_dir = compact_run_dir(lossless_dir)
    lossless_cfg, compact_cfg = run_config(lossless_dir, "lossless"), run_config(compact_dir, "compact")
    for cfg in (lossless_cfg, compact_cfg):
        capture.run(cfg)
    target, _ = load_target(lossless_dir / "target")
    lm_head = target.get_output_embeddings().weight.detach()
    vocab = load_vocab_mapping(lossless_dir / "vocab" / "vocab_mapping.safetensors")
    truth = FeatureSet(lossless_dir / "features", "eval")
    results: dict[str, list[dict[str, float]]] = {"lossless": [], "compact": []}
    for seed in args.seeds:
        for name, cfg in (("lossless", lossless_cfg), ("compact", compact_cfg)):
            features = FeatureSet(cfg.output_path / "features", "train")
            draft = new_draft(cfg, target, vocab, seed)
            speed = train(draft, features, lm_head, args.epochs, args.steps, seed, args.learning_rate)
            manifest = json.loads((cfg.output_path / "features" / "manifest.json").read_text())
            row = {"seed": seed, "bytes_per_token": manifest["bytes_per_token"], "ratio_to_specforge": manifest["ratio_to_specforge"],
                   "train_tokens_per_s": speed, **evaluate_features(draft, truth, Teacher(lm_head, draft.t2d), args.steps)}
            results[name].append(row)
            print(name, json.dumps({key: round(value, 4) for key, value in row.items()}), flush=True)
    mean = {name: sum(row["simulated_accept_len"] for row in rows) / len(rows) for name, rows in results.items()}
    first = {name: rows[0] for name, rows in results.items()}
    change = (mean["compact"] - mean["lossless"]) / mean["lossless"]
    print(f"bytes/token: lossless {first['lossless']['bytes_per_token']:.0f} ({first['lossless']['ratio_to_specforge']:.3f}x "
          f"SpecForge), compact {first['compact']['bytes_per_token']:.0f} ({first['compact']['ratio_to_specforge']:.3f}x SpecForge)")
    print(f"eval simulated accept length over seeds {args.seeds}: lossless {mean['lossless']:.3f}, "
          f"compact {mean['compact']:.3f} ({change:+.1%}; goal within 2%)")


if __name__ == "__main__":
    main()
