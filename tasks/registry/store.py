"""The MLflow model registry as eaglet uses it: aliases (never stages), version tags, promotion, download.

Every registered version gets `candidate`; `champion` moves only through the gates or a forced promotion
(with a reason, recorded as a tag), and the champion it replaces keeps `previous`.
`models:/NAME@champion` downloads to a folder SGLang or vLLM loads as it is.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from contract.checkpoint import ENGINES, EXPORT_FILES
from contract.config import RunConfig
from contract.reports import AcceptanceReport, BenchmarkReport, ReportType
from tasks.common.artifacts import atomic_directory
from tasks.registry.gates import WAIVED, Champion

CANDIDATE, CHAMPION, PREVIOUS = "candidate", "champion", "previous"
TAG_GATES_PASSED = "eaglet.gates_passed"
TAG_GATES = "eaglet.gates"
TAG_FAILED_GATES = "eaglet.failed_gates"
TAG_EVAL_FINGERPRINT = "eaglet.eval_fingerprint"
TAG_ACCEPT_LENGTH = "eaglet.offline_accept_length"
TAG_SPEEDUP = "eaglet.speedup"
TAG_RECOMMENDED_SERVING = "eaglet.recommended_serving"
#: JSON {gate family: reason} of the registry.waive_gates entries that let a gate through unmeasured ({}: none).
TAG_WAIVERS = "eaglet.waivers"
#: Why a version whose gates passed was not promoted: the champion moved after its comparison (promote_if_unchanged).
TAG_PROMOTION_REFUSED = "eaglet.promotion_refused"
TAG_TARGET_REVISION = "contract.target_revision"
#: The draft method (contract.method): versions of every method share one model name, told apart by this tag.
TAG_METHOD = "contract.method"
#: Where a version's evaluation report lies among its logged model's artifacts (tasks/register.py logs it).
ACCEPTANCE_ARTIFACT = "reports/acceptance.json"
SERVING_ARTIFACT = "reports/serving.json"


def alias_version(client: Any, name: str, alias: str) -> Optional[int]:
    """The version holding `alias`, None when nobody (or no registered model) does."""
    from mlflow.exceptions import MlflowException

    try:
        aliases = client.get_registered_model(name).aliases
    except MlflowException:
        return None
    version = aliases.get(alias)
    return int(version) if version is not None else None


def aliases_of(client: Any, name: str, version: int) -> list[str]:
    aliases = client.get_registered_model(name).aliases
    return sorted(alias for alias, held in aliases.items() if int(held) == version)


def current_champion(client: Any, name: str) -> Optional[Champion]:
    """The champion's eval-set identity and offline acceptance, from its version tags."""
    version = alias_version(client, name, CHAMPION)
    if version is None:
        return None
    tags = client.get_model_version(name, str(version)).tags
    accept_length = tags.get(TAG_ACCEPT_LENGTH)
    return Champion(version, tags.get(TAG_TARGET_REVISION), tags.get(TAG_EVAL_FINGERPRINT),
                    float(accept_length) if accept_length not in (None, "none") else None,
                    logged_report(name, version, AcceptanceReport, ACCEPTANCE_ARTIFACT),
                    logged_report(name, version, BenchmarkReport, SERVING_ARTIFACT))


def logged_report(name: str, version: int, model: type[ReportType], artifact: str) -> Optional[ReportType]:
    """One of the version's logged reports (the per-prompt rounds the gates pair with the candidate's); None when
    it cannot be fetched or no longer validates, which the gates report as not comparable."""
    import mlflow
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory(prefix="eaglet-champion-") as staging:
        try:
            fetched = mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}/{artifact}",
                                                          dst_path=staging)
            return model.model_validate_json(Path(fetched).read_text(encoding="utf-8"))
        except (MlflowException, OSError, ValidationError):
            return None


def promote_version(client: Any, name: str, version: int, reason: Optional[str] = None,
                    forced: bool = False) -> Optional[int]:
    """`version` becomes champion, the champion it replaces keeps `previous`; returns that previous version."""
    previous = alias_version(client, name, CHAMPION)
    if previous == version:
        return None
    if previous is not None:
        client.set_registered_model_alias(name, PREVIOUS, str(previous))
    client.set_registered_model_alias(name, CHAMPION, str(version))
    if alias_version(client, name, CANDIDATE) == version:
        client.delete_registered_model_alias(name, CANDIDATE)
    client.set_model_version_tag(name, str(version), "eaglet.promotion", "forced" if forced else "gates")
    client.set_model_version_tag(name, str(version), "eaglet.promoted_at", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    if reason:
        client.set_model_version_tag(name, str(version), "eaglet.promotion_reason", reason)
    return previous


@dataclass(frozen=True)
class Promotion:
    """What came of moving `champion` to a version that passed its gates: promoted (the champion it replaced, if
    any), or refused because the champion moved after the comparison, and why."""

    promoted: bool
    previous: Optional[int] = None
    refused: Optional[str] = None


def promote_if_unchanged(client: Any, name: str, version: int, gated_against: Optional[int]) -> Promotion:
    """Promote `version` only if `champion` is still the version it was gated against (None: no champion then).

    The compare-and-set half of the promotion guard (tasks/registry/promotion_lock.py): under the file lock the
    re-read always agrees; on a store elsewhere another run may have promoted in between, and replacing its champion
    unseen is what the gates exist to prevent, so the version stays candidate and records why."""
    current = alias_version(client, name, CHAMPION)
    if current != gated_against:
        reason = (f"champion moved from {version_label(gated_against)} to {version_label(current)} after "
                  f"v{version} was gated against {version_label(gated_against)} (another run promoted it): v{version} "
                  f"stays candidate; register it again to be gated against {version_label(current)}")
        client.set_model_version_tag(name, str(version), TAG_PROMOTION_REFUSED, reason)
        return Promotion(False, refused=reason)
    return Promotion(True, previous=promote_version(client, name, version))


def version_label(version: Optional[int]) -> str:
    return f"v{version}" if version is not None else "no champion"


def registry_client(cfg: RunConfig) -> Any:
    """A client on the config's store (the registry lives in the same sqlite database)."""
    from mlflow import MlflowClient

    from tasks.common.mlflow_store import tracking_uri

    return MlflowClient(tracking_uri=tracking_uri(cfg))


def version_rows(client: Any, name: str) -> list[dict[str, str]]:
    """One row per version, newest first, as `eaglet registry show` prints them."""
    aliases = client.get_registered_model(name).aliases
    by_version: dict[int, list[str]] = {}
    for alias, version in aliases.items():
        by_version.setdefault(int(version), []).append(alias)
    rows = []
    for version in sorted(client.search_model_versions(f"name='{name}'"), key=lambda item: -int(item.version)):
        tags = version.tags
        rows.append({
            "version": str(version.version),
            "aliases": ", ".join(sorted(by_version.get(int(version.version), []))),
            "method": tags.get(TAG_METHOD, "eagle3"),
            "offline accept length": number_cell(tags.get(TAG_ACCEPT_LENGTH, "?")),
            "speedup": tags.get(TAG_SPEEDUP, "?"),
            "gates passed": {"true": "yes", "false": "no"}.get(tags.get(TAG_GATES_PASSED, ""), "?"),
            "waived gates": waived_cell(tags.get(TAG_GATES)),
            "target revision": tags.get(TAG_TARGET_REVISION, "?")[:12],
            "created": time.strftime("%Y-%m-%d %H:%M", time.localtime(version.creation_timestamp / 1000)),
        })
    return rows


def waived_cell(gates_tag: Optional[str]) -> str:
    """The gates `registry.waive_gates` let through unmeasured, from the version's stored verdicts ("?" without)."""
    if gates_tag is None:
        return "?"
    waived = [gate["name"] for gate in json.loads(gates_tag) if gate["status"] == WAIVED]
    return ", ".join(waived) or "none"


def number_cell(text: str) -> str:
    """A float tag with three decimals; anything else ("none", "?") as it is."""
    try:
        return f"{float(text):.3f}"
    except ValueError:
        return text


def download_drafter(cfg_or_uri: RunConfig | str, model_name: str, alias: Optional[str] = CHAMPION,
                     engine: str = "sglang", dst: Optional[Path] = None, version: Optional[int] = None) -> Path:
    """`models:/NAME@ALIAS`'s folder for one engine (config.json, model.safetensors, contract.json) under
    `dst` (a new temp dir when None); returns the folder to pass to SGLang or vLLM. `version` picks a version by
    number instead of an alias (`eaglet serve --version N`)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    from tasks.common.mlflow_store import hand_credentials_to_mlflow, tracking_uri

    if isinstance(cfg_or_uri, str):
        uri = hand_credentials_to_mlflow(cfg_or_uri, "the tracking URI")
    else:
        uri = tracking_uri(cfg_or_uri)
    client = mlflow.MlflowClient(uri)
    try:
        if version is not None:
            client.get_model_version(model_name, str(version))
        else:
            client.get_model_version_by_alias(model_name, alias)
    except MlflowException as error:
        which = f"version {version}" if version is not None else f"alias '{alias}'"
        raise LookupError(f"no version of {model_name} has {which} in {uri}: {error.message}") from None
    model_uri = f"models:/{model_name}/{version}" if version is not None else f"models:/{model_name}@{alias}"
    # MLflow resolves `models:/NAME/N` against its global registry, not the registry_uri passed below (a numbered
    # version of a run's sqlite store was "not found" from any other directory): ask this store where N lies.
    source = client.get_model_version_download_uri(model_name, str(version)) if version is not None else model_uri
    destination = Path(dst) if dst is not None else Path(tempfile.mkdtemp(prefix="eaglet-drafter-"))
    with atomic_directory(destination / engine) as staging:
        fetched = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"{source}/{engine}",
                                                           dst_path=str(staging), tracking_uri=uri, registry_uri=uri))
        for path in list(fetched.iterdir()):
            os.replace(path, staging / path.name)
        fetched.rmdir()
        missing = [name for name in EXPORT_FILES if not (staging / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{model_uri}/{engine} lacks {', '.join(missing)}: "
                                    "not a drafter registered by eaglet")
    return destination / engine
