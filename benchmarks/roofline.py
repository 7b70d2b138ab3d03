"""How far from this host's matmul peak each compute stage of a finished run ran: the table `eaglet run` ends with.

    .venv/bin/python benchmarks/roofline.py --config params.yaml [overrides]

Reads the run's target config and its stages' own reports: regenerate's `data/regenerate_report.json`, capture's
`features/capture_report.json`, train's `train/summary.json` (a stage without its report, or whose report has no
rate, is left out). Measures this host's fp32 and bf16 matmul peaks, prints the table and writes
`<output_dir>/roofline.json` and `roofline.png` (tasks/common/roofline.py says how the FLOPs are counted). Run it
on the host that ran the stages, or the shares compare one machine's rates with another's peaks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from contract.config_loading import load_config
from tasks.common.artifacts import read_json
from tasks.common.roofline import RooflineUnavailable, write_roofline

#: Each compute stage's report under output_dir, and the field of it that holds its numbers (None: the top level).
STAGE_REPORTS: dict[str, tuple[str, str | None]] = {
    "regenerate": ("data/regenerate_report.json", "metrics"),
    "capture": ("features/capture_report.json", "metrics"),
    "train": ("train/summary.json", None),
}


def summaries_on_disk(output_dir: Path) -> dict[str, dict[str, float]]:
    """The numbers of each compute stage's report that exists, as the pipeline's stage summaries hold them."""
    summaries = {}
    for stage, (relative, field) in STAGE_REPORTS.items():
        path = output_dir / relative
        if not path.is_file():
            continue
        report: dict[str, Any] = read_json(path)
        numbers = report.get(field, {}) if field else report
        summaries[stage] = {key: float(value) for key, value in numbers.items() if isinstance(value, (int, float))}
    return summaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("params.yaml"))
    parser.add_argument("overrides", nargs="*", help="section.field=value, as for eaglet run")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    try:
        roofline = write_roofline(cfg, summaries_on_disk(cfg.output_path))
    except RooflineUnavailable as error:
        raise SystemExit(f"roofline: not computed: {error}") from None
    print(roofline.table, flush=True)
    print(json.dumps({"roofline": str(roofline.json_path), "plot": str(roofline.png_path)}))


if __name__ == "__main__":
    main()
