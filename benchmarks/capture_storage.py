"""Offline feature storage: bytes/token of lossless and compact captures of the same records vs SpecForge.

    .venv/bin/python benchmarks/capture_storage.py [--records 16] [--config params.yaml] [--run-dir artifacts/embedded-default]

Takes the first N records of `<run-dir>/data/train.jsonl` and the materialised target of that run (after
`make run`; when `target/` is absent it is materialised with the target stage), runs the capture stage in
both modes into a temp dir, and prints bytes/token of each next to SpecForge's `(3H + H) * 2 + 16`
bytes/token (bf16 aux + bf16 final hidden + int64 ids and mask; docs/architecture.md §8) and the ratios.
It also writes the same lossless tensors the way SpecForge stores them, one torch.save pickle per sample,
and measures that.
Target: lossless <= 1x SpecForge's formula, compact <= 0.5x.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from contract.config_loading import load_config
from tasks import capture, target
from tasks.common.artifacts import link_or_copy
from tasks.features.shards import FeatureSet, dequantise_aux


def prepare_run(source_run: Path, work: Path, records: int, config: Path | None, mode: str) -> object:
    """A run dir under `work` sharing the source run's target, with the first `records` train records."""
    run_dir = work / mode
    cfg = load_config(config, [f"output_dir={run_dir}", f"capture.mode={mode}", "tracking.enabled=false"])
    if not (source_run / "target.json").is_file():
        target.run(cfg.model_copy(update={"output_dir": str(source_run)}))
    for path in (source_run / "target").iterdir():
        link_or_copy(path, run_dir / "target" / path.name)
    link_or_copy(source_run / "target.json", run_dir / "target.json")
    lines = (source_run / "data" / "train.jsonl").read_text(encoding="utf-8").splitlines()[:records]
    (run_dir / "data").mkdir(parents=True, exist_ok=True)
    (run_dir / "data" / "train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (run_dir / "data" / "eval.jsonl").write_text("", encoding="utf-8")
    return cfg


def pickle_per_sample_bytes(features_dir: Path, out_dir: Path) -> tuple[int, int]:
    """(bytes, tokens) of the lossless features re-saved as one torch.save file per sample."""
    out_dir.mkdir(parents=True, exist_ok=True)
    total, tokens = 0, 0
    for index, record in enumerate(FeatureSet(features_dir, "train")):
        path = out_dir / f"data_{index}.ckpt"
        torch.save({"input_ids": record["input_ids"].long(), "loss_mask": record["loss_mask"].long(),
                    "hidden_state": record["hidden_state"].clone(), "aux_hidden_state": record["aux_hidden_state"].clone()}, path)
        total += path.stat().st_size
        tokens += int(record["input_ids"].numel())
    return total, tokens


def compact_quality(lossless_dir: Path, compact_dir: Path) -> tuple[float, float, float]:
    """(median, max relative L2 error of dequantised aux rows per layer, mean teacher mass in the top-K)."""
    errors, masses = [], []
    for exact, compact in zip(FeatureSet(lossless_dir, "train"), FeatureSet(compact_dir, "train")):
        want = exact["aux_hidden_state"].float().reshape(len(exact["input_ids"]), 3, -1)
        got = dequantise_aux(compact["aux_hidden_state"], compact["aux_scale"]).reshape(want.shape)
        errors.append(((got - want).norm(dim=-1) / want.norm(dim=-1)).flatten())
        masses.append(compact["teacher_topk_logprobs"].float().exp().sum(-1))
    error = torch.cat(errors)
    return float(error.median()), float(error.max()), float(torch.cat(masses).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=16)
    parser.add_argument("--config", type=Path, default=Path("params.yaml"))
    parser.add_argument("--run-dir", type=Path, default=Path("artifacts/embedded-default"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="eaglet-capture-bench-"))
    results = {}
    for mode in ("lossless", "compact"):
        cfg = prepare_run(args.run_dir, work, args.records, args.config, mode)
        started = time.perf_counter()
        result = capture.run(cfg)
        seconds = time.perf_counter() - started
        results[mode] = result.manifest
        split = result.manifest["splits"]["train"]
        print(f"[{mode}] {split['records']} records, {split['tokens']} tokens in {seconds:.1f} s "
              f"({split['tokens'] / seconds:.0f} tokens/s incl. model load)")
    manifest = results["lossless"]
    hidden = manifest["hidden_size"]
    specforge = manifest["specforge_bytes_per_token"]
    pickle_bytes, pickle_tokens = pickle_per_sample_bytes(work / "lossless" / "features", work / "pickles")
    median_error, max_error, mass = compact_quality(work / "lossless" / "features", work / "compact" / "features")

    print(f"\ntarget {manifest['target_id']}: H = {hidden}, V = {manifest['vocab_size']}, "
          f"Vd = {manifest['draft_vocab_size']}, aux layers {manifest['aux_layer_ids']}")
    print(f"{'storage':58s} {'bytes/token':>12s} {'vs SpecForge':>13s}")
    print(f"{'SpecForge formula (3H+H)*2+16':58s} {specforge:12.1f} {1.0:12.3f}x")
    print(f"{'SpecForge layout measured: one torch.save pickle/sample':58s} {pickle_bytes / pickle_tokens:12.1f} "
          f"{pickle_bytes / pickle_tokens / specforge:12.3f}x")
    for mode in ("lossless", "compact"):
        split = results[mode]["splits"]["train"]
        label = {"lossless": f"eaglet lossless ({results[mode]['dtype']} aux + hidden, packed shards)",
                 "compact": f"eaglet compact (fp8 aux + scales, top-{results[mode]['compact_topk']} teacher)"}[mode]
        print(f"{label:58s} {split['bytes_per_token']:12.1f} {split['ratio_to_specforge']:12.3f}x")
    print(f"\ncompact aux: relative L2 error per row and layer median {median_error:.4f}, max {max_error:.4f}; "
          f"teacher mass kept in the top-{results['compact']['compact_topk']}: {mass:.3f}")
    print(f"(targets: lossless <= 1x, compact <= 0.5x; features under {work})")


if __name__ == "__main__":
    main()
