"""The reports that cross stage boundaries, typed: `evaluate/acceptance.json` and `benchmark/report.json`.

evaluate writes the acceptance report and benchmark, the gates and register read it; benchmark writes the serving
report and register reads it. As dicts with string keys a renamed field reached the registry as a `None`; here a
writer validates what it writes and a reader loads through `load_report`, so a missing, renamed or extra field fails
at once with the file and the field named. Tables nobody reads across the boundary (levels, rounds, buckets) stay
plain JSON. The JSON shape is the one the stages always wrote: `as_json` leaves out optional fields never set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Report(BaseModel):
    """Base of every stage report: unknown keys are errors, like contract/records.py's records."""

    model_config = ConfigDict(extra="forbid")

    def as_json(self) -> dict[str, Any]:
        """The JSON the stage writes: optional parts that were never set (a tree mode not decoded) stay out."""
        return self.model_dump(mode="json", exclude_unset=True)


# --- evaluate/acceptance.json ---------------------------------------------------------------------------


class PromptAcceptance(Report):
    """One prompt's speculative decoding: what the engine replays of it is compared with this."""

    prompt: str
    rounds: int = Field(ge=0, description="verify rounds (target forwards after the prefill)")
    accepted_per_position: list[float] = Field(description="rounds accepting the draft token at position 1..steps")
    generated_tokens: int = Field(ge=0, description="tokens emitted, the prefill's token included, cut by the "
                                                    "budget or EOS exactly as an engine's completion_tokens")
    source: Optional[str] = Field(default=None, description="the eval set (suite) the prompt came from")
    input_hash: Optional[str] = Field(
        default=None, description="sha256 of the prompt's token ids: two versions' rounds on a prompt are paired "
        "only when both read the same tokens (tasks/registry/comparison.py)")


class PromptTokens(Report):
    """One prompt replayed on an engine that reports, per request, its verify rounds and the tokens it emitted but
    no acceptance per draft position (SGLang's /generate `meta_info`): τ is the tokens of its rounds (all it emitted
    but the prefill's token) over its rounds."""

    prompt: str
    rounds: int = Field(ge=0, description="verify rounds (meta_info.spec_verify_ct)")
    generated_tokens: int = Field(ge=0, description="tokens emitted, the prefill's token included "
                                                    "(meta_info.completion_tokens)")
    source: Optional[str] = Field(default=None, description="the eval set (suite) the prompt came from")
    input_hash: Optional[str] = Field(default=None, description="sha256 of the prompt's token ids, as "
                                      "PromptAcceptance's: what two versions' rows pair on")


class Bucket(Report):
    """The prompts of one source, category, length or turn: pooled τ and its 95 % bootstrap interval over them."""

    rounds: int
    mean_accept_length: float
    prompts: int
    low: float
    high: float


class TauInterval(Report):
    """A mode's pooled τ: the 95 % percentile-bootstrap interval over prompts (tasks/common/intervals.py)."""

    low: float
    high: float
    prompts: int
    level: float = 0.95


class ModeAcceptance(Report):
    """One decoding mode (chain or tree) over every prompt."""

    steps: int
    topk: int
    num_draft_tokens: int
    rounds: int = Field(ge=0)
    mean_accept_length: float
    mean_accept_length_interval: TauInterval
    acceptance_by_depth: list[float]
    accept_length_histogram: dict[str, int]
    accepted_per_position: list[float]
    per_prompt: list[PromptAcceptance]
    mean_drafted_tokens: float
    target_forwards: int
    generated_tokens: int
    tokens_per_target_forward: float
    draft_time_share: float
    draft_seconds: float
    verify_seconds: float
    tokens_per_second: float
    buckets: dict[str, Bucket]
    speedup_vs_target: float


class TargetAlone(Report):
    generated_tokens: int
    tokens_per_second: float


class AcceptanceReport(Report):
    """evaluate/acceptance.json: the drafter's acceptance on held-out prompts, by our reference decoder."""

    prompts: int
    records: int
    temperature: float
    max_new_tokens: int
    drafter: str
    target: TargetAlone
    chain: ModeAcceptance
    tree: Optional[ModeAcceptance] = None
    suites: Optional[ModeAcceptance] = Field(
        default=None, description="the chain over every prompt of evaluation.sets (the reference prompts among "
        "them included), with its buckets per source and category: set only when sets are configured")
    greedy_equivalence: str
    greedy_mismatches: list[dict[str, Any]]
    greedy_rule: Optional[dict[str, Any]] = Field(
        default=None, description="how the greedy outputs were judged (tasks/common/greedy_agreement.py): dtype, "
        "exact (float32) or near-ties allowed, the tolerances, outputs compared and diverged; reports written "
        "before it was recorded have none")


# --- benchmark/report.json ------------------------------------------------------------------------------


class SpeedupRow(Report):
    """Output tok/s with / without the drafter at one concurrency: the median over rounds and its spread."""

    concurrency: int
    output_tokens_per_s: Optional[float]
    min: Optional[float]
    max: Optional[float]
    per_round: list[Optional[float]]


class SpeculativeAcceptance(Report):
    """The engine's own acceptance numbers over benchmark traffic (tasks/serving/spec_counters.py)."""

    window: dict[str, Any]
    mean_accept_length: Optional[float]
    draft_acceptance_rate: Optional[float]
    acceptance_rate_per_position: list[float]


class DraftedVariant(Report):
    """The engine serving with the drafter, over its rounds (the recommended setting's in `EngineReport.eagle3`)."""

    command: list[str]
    log: str
    startup_s: float
    peak_rss_mib: float
    levels: list[dict[str, Any]]
    rounds: list[dict[str, Any]]
    num_speculative_tokens: Optional[int]
    serving_setting: dict[str, Any]
    speculative: SpeculativeAcceptance


class RecommendedSetting(Report):
    steps: int
    topk: int
    num_draft_tokens: Optional[int]
    label: str
    flags: dict[str, Any]


class SuiteServing(Report):
    """One setting on one suite's traffic (`benchmark.per_suite`): speedup per level and the engine's acceptance."""

    speedup: list[SpeedupRow]
    mean_accept_length: Optional[float]


class SweepRow(Report):
    label: str
    setting: dict[str, Any]
    num_speculative_tokens: Optional[int]
    mean_accept_length: Optional[float]
    speedup: list[SpeedupRow]
    suites: dict[str, SuiteServing] = Field(default_factory=dict, description="per suite with benchmark.per_suite")
    predicted_speedup: Optional[float]


AgreementStatus = Literal["ok", "failed", "inconclusive", "skipped"]
AgreementMethod = Literal["per_position", "totals"]


class AgreementCheck(Report):
    """Does the engine draft what the offline decoder drafts (tasks/serving/agreement.py, totals_agreement.py)?
    `check` says which test ran: per draft position (vLLM's counters) or on totals (SGLang's per-request counts);
    None when none could run (skipped, or an engine neither check reads). Whether an unmeasured check may pass is
    the registry's call (registry.waive_gates), never the report's."""

    status: AgreementStatus
    check: Optional[AgreementMethod] = None
    reason: Optional[str] = None
    alpha: Optional[float] = None
    min_drafts: Optional[int] = None
    min_p_value: Optional[float] = None
    engine_mean_accept_length: Optional[float] = None
    offline_mean_accept_length: Optional[float] = None
    relative_gap: Optional[float] = None
    engine_steps: Optional[int] = None
    offline_steps: Optional[int] = None
    prompts: Optional[int] = None
    max_new_tokens: Optional[int] = None
    temperature: Optional[float] = None
    positions: Optional[list[dict[str, Any]]] = None
    totals: Optional[dict[str, Any]] = None
    per_prompt: Optional[list[dict[str, Any]]] = None


class EngineSuites(Report):
    """The suites of evaluation.sets replayed on the engine drafting the evaluation's chain (`evaluation.sets_on:
    engine`), per suite and category, with 95 % bootstrap intervals over units. vLLM: τ from its per-position
    counters, a unit a prompt or a group of `concurrency` prompts of one category replayed together. SGLang: τ from
    each request's verify rounds and tokens, every prompt its own unit; no acceptance by position (`per_position`
    says why)."""

    engine: str
    steps: int
    max_new_tokens: int
    temperature: float
    concurrency: int = Field(ge=1, description="prompts in flight (vLLM: each unit's counters cover this many "
                                               "prompts; SGLang: each prompt still counted alone)")
    unit: str = Field(description="what the intervals resample: prompts, or groups of prompts replayed together")
    prompts: int
    rounds: int = Field(ge=0, description="drafts the engine verified (one per verify round)")
    mean_accept_length: float
    mean_accept_length_interval: TauInterval
    acceptance_by_position: Optional[list[float]] = None  # None: the engine counts no acceptance per position
    accepted_per_position: Optional[list[float]] = None
    per_position: Optional[str] = Field(default=None, description="why acceptance by position is absent (SGLang)")
    buckets: dict[str, Bucket]
    per_prompt: Union[list[PromptAcceptance], list[PromptTokens]] = Field(
        description="one row per unit: a prompt, or a group named by its prompts (PromptTokens: SGLang's prompts)")
    generated_tokens: int
    seconds: float
    tokens_per_second: float


class EngineExecution(Report):
    """How every variant of the engine ran: runtime.engines.<engine> with `auto` resolved
    (tasks/serving/engine_settings.py)."""

    dtype: str = Field(description="--dtype: the target's and the drafter's (neither engine has a draft dtype flag)")
    enforce_eager: bool = Field(description="no CUDA graphs (vLLM --enforce-eager, SGLang --disable-cuda-graph)")
    gpus: Optional[str] = Field(description="the engine's CUDA_VISIBLE_DEVICES; None: the caller's environment")


class EngineReport(Report):
    """One engine: how it ran, baseline, the recommended drafted setting, the sweep and every check."""

    execution: Optional[EngineExecution] = None  # reports written before it was recorded have none
    baseline: dict[str, Any]
    num_speculative_tokens: Optional[int]
    serving_setting: RecommendedSetting
    eagle3: DraftedVariant
    speedup: list[SpeedupRow]
    sweep: list[SweepRow]
    greedy: dict[str, Any]
    acceptance_check: AgreementCheck
    suites: Optional[EngineSuites] = None
    failures: list[str]


class BenchmarkReport(Report):
    """benchmark/report.json: `skipped` (and no engines) when no serving engine ran, else `settings` and engines."""

    skipped: Optional[str] = None
    settings: Optional[dict[str, Any]] = None
    engines: dict[str, EngineReport]
    failures: list[str]
    passed: bool

    @property
    def measured(self) -> bool:
        """At least one engine ran."""
        return not self.skipped and bool(self.engines)


# --- reading --------------------------------------------------------------------------------------------


class ReportError(ValueError):
    """A stage report that is not what its writer writes: names the file and every field at fault."""


ReportType = TypeVar("ReportType", bound=Report)


def load_report(model: type[ReportType], path: Path, writer: str) -> ReportType:
    """The report at `path` as `model`; a ReportError naming the file, each field at fault and the stage to rerun."""
    try:
        return model.model_validate_json(path.read_text(encoding="utf-8"))
    except ValidationError as error:
        raise ReportError(f"{path} is not a {model.__name__} as the {writer} stage writes it (rerun {writer}):\n"
                          + "\n".join(f"  - {field_path(problem['loc'])}: {problem['msg']}"
                                      for problem in error.errors())) from None


def field_path(location: tuple[Any, ...]) -> str:
    """`chain.per_prompt[0].generated_tokens` from pydantic's ('chain', 'per_prompt', 0, 'generated_tokens')."""
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(the whole file)"
