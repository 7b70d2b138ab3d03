"""Where each data source's items come from, and what identifies that content.

The ingest stage reads a source's file; the stage's cache key (flows/stage_cache.py) and DVC (the `sources`
stage of dvc.yaml, `eaglet config sources`) see the same fingerprint: a file by its sha256, an embedded asset by
its package, version and path inside it (an installed package's file does not change within a version, and
hashing ShareGPT V3 on every run would cost seconds). So editing a source file reruns ingest and what follows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from contract.config import DataSource, RunConfig
from contract.hashing import hash_file
from tasks.common.assets import ASSETS, asset_path

ASSET_FORMATS = {"mtbench": "mtbench", "sharegpt-dummy": "sharegpt", "sharegpt-v3": "sharegpt", "humaneval": "humaneval",
                 "chitchat": "chitchat", "gsm8k": "gsm8k", "mbpp": "mbpp", "math500": "math",
                 "alpaca-eval": "alpaca-eval"}


def source_file(source: DataSource) -> tuple[Path, str, str]:
    """The file to read, the format to read it as, and the portable name provenance records."""
    if source.asset is not None:
        fmt = source.format if source.format != "auto" else ASSET_FORMATS[source.asset]
        asset = ASSETS[source.asset]
        portable = f"{asset.distribution}=={asset.version}:{asset.relative_path}"
        return asset_path(source.asset), fmt, portable
    path = Path(source.path or "").expanduser()
    return path, source.format, str(path)


def source_fingerprints(cfg: RunConfig, digest: Callable[[Path], str] = hash_file) -> dict[str, str]:
    """Per source name: `sha256:<hex>` of its file, `asset:<package>==<version>:<path>`, or `missing:<path>`
    (ingest then fails naming the file; the key still changes once it appears)."""
    fingerprints: dict[str, str] = {}
    for source in cfg.data.sources:
        if source.asset is not None:
            asset = ASSETS[source.asset]
            fingerprints[source.name] = f"asset:{asset.distribution}=={asset.version}:{asset.relative_path}"
            continue
        path, _, portable = source_file(source)
        fingerprints[source.name] = f"sha256:{digest(path)}" if path.is_file() else f"missing:{portable}"
    return fingerprints
