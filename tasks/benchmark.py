"""benchmark stage: serve the target with and without the drafter on a real engine and measure what changes.

For each engine in `benchmark.engines` (vLLM's CPU build here, SGLang on GPU hosts: the same code, with the
engine's own command and metrics), the target `<output_dir>/target` is served from the engine's own
environment (tasks/serving/engine.py) alone ("baseline") and with the EAGLE3 export `draft/<engine>`
("eagle3", `evaluation.steps` speculative tokens, chain), alternating baseline, eagle3, baseline, eagle3, ...
for `benchmark.rounds` rounds: with `benchmark.engine_starts: per_round` one fresh engine at a time, with `once`
each variant's engine started once on its own port and kept up while the rounds alternate between them (no
start-up per round, so more rounds fit the same time; the idle engines hold their memory). Both serve the same requests: one per
supervised assistant turn (the conversation before it) of the held-out records in `data/eval.jsonl` that the
evaluate stage decodes, `benchmark.num_requests` of them (cycling when there are fewer), through the chat
endpoint so the engine applies the chat template. Every concurrency level of `benchmark.concurrency` sends
them all with that many in flight, streaming (tasks/serving/client.py: TTFT, TPOT, ITL, latency, output
tok/s, request/s).

Speedup per level = eagle3 output tok/s / baseline output tok/s of the same round (the two engines ran back
to back); the report gives every round's ratio and their median with min and max, so a shared machine's
noise is visible as spread. Each variant's `levels` are those of its median-throughput round.

`benchmark.num_speculative_tokens` lists chain lengths to serve (default: `evaluation.steps` only); each is
served as `eagle3-k<k>` in every round against the same baselines, the one with the best median speedup at the
speedup gate's level is the recommended setting (the report's `eagle3`, `speedup` and `num_speculative_tokens`),
and every setting carries the speedup predicted from the offline evaluation (tasks/serving/speedup_model.py).
On SGLang `benchmark.sglang_trees` adds draft trees (steps, topk, num_draft_tokens) to the sweep as
`eagle3-s<S>-t<K>-n<N>` (tasks/serving/serving_setting.py); the recommendation may then be a tree.

What the stage checks (a failure is written to the report first, then raised as BenchmarkFailed):
  - every request completed;
  - the drafter drafted: the engine's speculative counters moved;
  - greedy outputs (temperature 0) are identical with and without the drafter, request for request, on float32
    engines; on 16-bit ones they may differ only at a near-tie of the target (its float32 top-2 logit gap at the first
    differing token) and at most `evaluation.max_greedy_mismatch_rate` of them (tasks/serving/greedy_divergence.py);
  - the engine drafts what the offline evaluation `evaluate/acceptance.json` measured, when that exists: its
    prompts (same token ids, budget and temperature) are replayed on the engine drafting the evaluation's chain (the
    first round's, or with `benchmark.replay_engine_env` one started after the rounds with that environment: the
    replays count tokens, not time, so they may have every CPU core the rounds leave to the client) and
    compared with a test at `registry.agreement_alpha`: per draft position on vLLM (tasks/serving/agreement.py), on
    tokens per verify round over SGLang's /generate (tasks/serving/totals_agreement.py). A significant difference
    fails: the engine is not drafting from what the drafter was trained on (aux layer ids, docs/architecture.md §3,
    chat template or vocab mapping). Too few drafts is "inconclusive", no comparison "skipped": the register stage
    blocks `champion` on either unless `registry.waive_gates` gives `engine_acceptance` its reason.

Acceptance: vLLM counts drafts, draft tokens and accepted tokens (also per draft position); counters are
read before and after each level, so each level has its own numbers: mean acceptance length =
accepted / drafts + 1, acceptance rate at position i = accepted_i / drafts. SGLang only exposes gauges
(`sglang:spec_accept_length`, `sglang:spec_accept_rate`: its recent average), read after each level; its agreement
replay reads each request's own verify rounds from `/generate` instead.

Writes
  benchmark/report.json      settings, per engine how it executed (`execution`: dtype, enforce_eager, gpus), per
                             engine and variant: startup time, peak RSS of the engine's
                             process tree, per level throughput and latency percentiles, every round,
                             acceptance over all rounds; speedup per level (median, min, max, per round),
                             greedy comparison, acceptance check, failures (contract/reports.py's
                             BenchmarkReport, validated before it is written)
  benchmark/requests.jsonl   one row per request (engine, variant, round, level, timings, text)
  benchmark/serving.png      output tok/s and TPOT P50 per concurrency, with and without the drafter
  benchmark/logs/<engine>-<variant>[-round<N>].log   engine logs

    .venv/bin/eaglet stage benchmark --config params.yaml benchmark.engines='[vllm]'
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from contract.config import RunConfig
from contract.records import PromptRecord
from contract.reports import AcceptanceReport, BenchmarkReport, load_report
from contract.secrets import unredacted_mapping
from tasks.common.artifacts import read_json, save_figure, write_json, write_jsonl
from tasks.common.greedy_agreement import GreedyRule, first_difference, near_tie_failures
from tasks.common.suite_summary import interval_metrics, metric_name, plot_suites
from tasks.serving.engine import EngineKind, EngineLaunch, RunningEngine, serve, serve_together
from tasks.serving.engine_settings import engine_execution, run_launch
from tasks.data.held_out import eval_prompts, select_records, set_prompts, turn_prefixes
from tasks.serving.client import ChatRequest, RequestResult, Sampling, run_level, summarize_level
from tasks.serving.agreement import (AGREEMENT_CHECKS, agreement_verdict, engine_counts, exact_differences,
                                     offline_counts, run_agreement)
from tasks.serving.totals_agreement import engine_rounds, offline_rounds, replay_generate, totals_verdict
from tasks.serving.generated_replies import GeneratedMemo
from tasks.serving.spec_counters import acceptance, overall_acceptance, speculative_window
from tasks.serving.serving_setting import (ServingSetting, engines_serving, export_method, serving_sweep,
                                          unserved_method)
from tasks.serving.speedup_model import predicted_setting_speedup
from tasks.serving.greedy_divergence import TextDivergences, engines_rule
from tasks.serving.suite_replay import (ReplayMemo, ReplayUnit, replay_memo, replay_suites, replay_units,
                                        suites_summary, unit_size)

VARIANTS = ("baseline", "eagle3")
#: One short request before measuring, so no level pays the engine's first-request costs.
WARMUP_MAX_TOKENS = 8
MEMORY_SAMPLE_INTERVAL_S = 0.5
OFFLINE_ACCEPTANCE = Path("evaluate") / "acceptance.json"
SNIPPET_CHARS = 80


class BenchmarkFailed(RuntimeError):
    """A check failed; the report was written and `result` holds it."""

    def __init__(self, message: str, result: "BenchmarkResult") -> None:
        super().__init__(message)
        self.result = result


@dataclass
class BenchmarkResult:
    report_path: Path
    requests_path: Path
    plot_path: Optional[Path]
    report: dict[str, Any]
    suite_plots: list[Path] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        """Flat numbers for MLflow: per engine, per level and variant, and the acceptance."""
        return flat_metrics(self.report)

    def reports(self) -> list[Path]:
        return [path for path in (self.report_path, self.plot_path, *self.suite_plots) if path is not None]


@dataclass
class VariantRun:
    """One engine process (baseline or eagle3, one round) and what it measured."""

    variant: str
    report: dict[str, Any]
    results: dict[int, list[RequestResult]] = field(default_factory=dict)  # by concurrency
    round: int = 1
    suites: Optional[dict[str, Any]] = None  # the suites' replay on this engine (rows, seconds, units), if it ran them
    suite_results: dict[str, dict[int, list[RequestResult]]] = field(default_factory=dict)  # per_suite traffic


def run(cfg: RunConfig) -> BenchmarkResult:
    """Benchmark every engine of `benchmark.engines`; write benchmark/report.json; raise on a failed check."""
    settings = cfg.benchmark
    out = cfg.output_path
    if not settings.engines:  # a run without a serving engine (e.g. CI-size configs): say so, gate nothing
        report = {"skipped": "benchmark.engines is empty (e.g. benchmark.engines=[vllm])", "engines": {},
                  "failures": [], "passed": True}
        (out / "benchmark" / "logs").mkdir(parents=True, exist_ok=True)  # a declared DVC out, even when empty
        return write_outputs(out / "benchmark", report, [])
    check_inputs(cfg)
    records = select_records(out / "data" / "eval.jsonl", cfg.evaluation.max_prompts, cfg.evaluation.sources)
    requests = build_requests(records, settings.num_requests)
    if settings.per_suite:
        requests += suite_requests(cfg, start=len(requests))
    steps = cfg.evaluation.steps  # the offline evaluation's chain length: both measure the same drafting
    sampling = Sampling(temperature=settings.temperature, max_tokens=settings.max_tokens,
                        chat_template_kwargs=dict(cfg.model.chat_template_kwargs))
    agreement = AgreementRun(agreement_prompts(cfg), cfg.evaluation.max_new_tokens, cfg.evaluation.temperature, steps,
                             suite_units(cfg), settings.suite_engine, settings.suite_concurrency)

    engines: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    for kind in settings.engines:
        sweep = serving_sweep(kind, settings.num_speculative_tokens, settings.sglang_trees, steps)
        replay = agreement if kind in AGREEMENT_CHECKS else agreement.without_prompts()
        in_rounds = replay.without_prompts() if settings.replay_engine_env else replay
        if settings.engine_starts == "once":
            baselines, drafted = measure_resident(cfg, kind, requests, sampling, sweep, in_rounds)
        else:
            baselines, drafted = measure_per_round(cfg, kind, requests, sampling, sweep, in_rounds)
        if settings.replay_engine_env:
            replay_on_own_engine(cfg, kind, replay, drafted)
        engines[kind] = engine_report(cfg, kind, baselines, drafted, steps, requests)
        measured_runs = baselines + flattened(drafted)
        rows += [row for measured in measured_runs for row in request_rows(kind, measured)]

    report = {
        "settings": {
            "concurrency": list(settings.concurrency), "rounds": settings.rounds,
            "engine_starts": settings.engine_starts, "num_requests": settings.num_requests,
            "max_tokens": settings.max_tokens, "temperature": settings.temperature,
            "num_speculative_tokens": settings.num_speculative_tokens or [steps],
            "sglang_trees": [tree.model_dump() for tree in settings.sglang_trees],
            "offline_steps": steps, "eval_records": len(records),
            "distinct_prompts": len({request.prompt_id for request in requests if request.suite is None}),
            "per_suite": settings.per_suite,
            "replay_engine_env": sorted(settings.replay_engine_env),  # the names: the values are secret
            "suite_requests": {suite: len(members) for suite, members in by_suite(requests).items()},
        },
        "engines": engines,
    }
    report["failures"] = [failure for kind in engines for failure in engines[kind]["failures"]]
    report["passed"] = not report["failures"]
    result = write_outputs(out / "benchmark", report, rows)
    if report["failures"]:
        message = "\n".join(report["failures"])
        raise BenchmarkFailed(f"{message}\nreport: {result.report_path}", result)
    return result


# --- inputs ---------------------------------------------------------------------------------------------


def check_inputs(cfg: RunConfig) -> None:
    """Refuse before starting any engine (a start costs tens of seconds) when an input is missing."""
    out, engines = cfg.output_path, cfg.benchmark.engines
    unconfigured = [kind for kind in engines if kind not in cfg.runtime.engines]
    if unconfigured:
        raise ValueError(f"benchmark.engines names {', '.join(unconfigured)} but runtime.engines does not configure "
                         f"it (python of the engine's environment, port)")
    needed = [(out / "target", "run the target stage"), (out / "data" / "eval.jsonl", "run the validate stage")]
    for kind in engines:
        needed.append((out / "draft" / kind, "run the train stage (it exports draft/sglang and draft/vllm)"))
    for path, hint in needed:
        if not path.exists():
            raise FileNotFoundError(f"benchmark needs {path}: {hint}")
    for kind in engines:
        refuse_unserved_method(kind, out / "draft" / kind)
    offline_report(cfg)  # a stale or hand-edited evaluation report fails here, not after the engines ran


def refuse_unserved_method(kind: str, export: Path) -> None:
    """A drafter whose method the engine does not serve is refused before the engine starts, naming both."""
    path = export / "contract.json"
    if not path.is_file():
        raise FileNotFoundError(f"benchmark needs {path}: run the train stage (every export carries its contract)")
    method = export_method(export)
    reason = unserved_method(kind, method)
    if reason is not None:
        raise ValueError(f"{export} is {reason}: benchmark it on {engines_serving(method)}")


def offline_report(cfg: RunConfig) -> Optional[AcceptanceReport]:
    """The offline evaluation the engines are compared with; None before the evaluate stage ran."""
    path = cfg.output_path / OFFLINE_ACCEPTANCE
    return load_report(AcceptanceReport, path, "evaluate") if path.is_file() else None


def build_requests(records: list[PromptRecord], count: int) -> list[ChatRequest]:
    """`count` chat requests, one per supervised assistant turn of the records (the evaluate stage's prompts,
    so the engine's acceptance compares with the offline one), cycling through them when there are fewer."""
    prompts = [(f"{record.id}#turn{turn}", [{"role": message.role, "content": message.content or ""}
                                            for message in prefix])
               for record in records for turn, prefix in enumerate(turn_prefixes(record), start=1)]
    if not prompts:
        raise ValueError(f"none of the {len(records)} eval records has a supervised assistant turn as messages "
                         "(pre-templated text cannot be sent to a chat endpoint)")
    requests = []
    for index in range(count):
        prompt_id, messages = prompts[index % len(prompts)]
        requests.append(ChatRequest(index=index, prompt_id=prompt_id, messages=messages))
    return requests


def suite_requests(cfg: RunConfig, start: int) -> list[ChatRequest]:
    """`benchmark.per_suite`: `benchmark.num_requests` chat requests per suite of evaluation.sets, from the suite's
    records (spread over its categories as the evaluation chooses them), numbered on from `start`."""
    from tasks.data.held_out import read_records, stratified

    records = read_records(cfg.output_path / "data" / "eval.jsonl")
    requests: list[ChatRequest] = []
    for item in cfg.evaluation.sets:
        chosen = stratified([record for record in records if record.source == item.source], item.records)
        for request in build_requests(chosen, cfg.benchmark.num_requests):
            requests.append(replace(request, index=start + len(requests), suite=item.source))
    return requests


def by_suite(requests: list[ChatRequest]) -> dict[str, list[ChatRequest]]:
    """The per-suite traffic, suite by suite in order (the reference prompts' requests left out)."""
    grouped: dict[str, list[ChatRequest]] = {}
    for request in requests:
        if request.suite is not None:
            grouped.setdefault(request.suite, []).append(request)
    return grouped


# --- serving and measuring ------------------------------------------------------------------------------


def engine_launch(cfg: RunConfig, kind: EngineKind, variant: str, draft: Optional[Path], setting: ServingSetting,
                  round_number: int = 1) -> EngineLaunch:
    """The engine from runtime.engines (dtype, eager or CUDA graphs, GPUs: tasks/serving/engine_settings.py), on
    the run's target, logging to benchmark/logs/<engine>-<variant>.log (`-round<N>` added from the second round on)."""
    suffix = f"-round{round_number}" if round_number > 1 else ""
    log_path = cfg.output_path / "benchmark" / "logs" / f"{kind}-{variant}{suffix}.log"
    log_path.unlink(missing_ok=True)  # start_engine appends; this run's log holds only this run
    launch = run_launch(cfg, kind, model=cfg.output_path / "target", log_path=log_path, draft=draft,
                        num_speculative_tokens=setting.steps, topk=setting.topk,
                        num_draft_tokens=setting.num_draft_tokens)
    launch.startup_timeout_s = cfg.benchmark.startup_timeout_s
    return launch


@dataclass(frozen=True)
class AgreementRun:
    """The offline evaluation's prompts, budget, temperature and chain length, replayed on the drafting engine; with
    `evaluation.sets_on: engine` the suites' units too (tasks/serving/suite_replay.py), on `suite_engine` with
    `suite_concurrency` prompts in flight."""

    prompts: list[Any]
    max_tokens: int
    temperature: float
    steps: int
    suite_units: list[ReplayUnit] = field(default_factory=list)
    suite_engine: Optional[str] = None
    suite_concurrency: int = 1

    def on(self, setting: ServingSetting, round_number: int) -> Optional["AgreementRun"]:
        """Itself for the engine drafting the evaluation's chain in the first round; None for every other."""
        wanted = (self.prompts or self.suite_units) and setting == ServingSetting(self.steps) and round_number == 1
        return self if wanted else None

    def without_prompts(self) -> "AgreementRun":
        """The same settings, replaying nothing (an engine no agreement check can measure)."""
        return AgreementRun([], self.max_tokens, self.temperature, self.steps)


def suite_units(cfg: RunConfig) -> list[ReplayUnit]:
    """With `evaluation.sets_on: engine`, the suites' prompts (rendered as evaluate renders them) in units of
    `benchmark.suite_concurrency` on vLLM, of one on SGLang (benchmark.suite_engine); none otherwise."""
    from tasks.common.target_info import load_tokenizer

    settings = cfg.evaluation
    if settings.sets_on != "engine":
        return []
    out = cfg.output_path
    tokenizer = load_tokenizer(out / "target", cfg.model)
    prompts = set_prompts(out / "data" / "eval.jsonl", tokenizer, cfg.validation.max_length, settings.sets)
    return replay_units(prompts, unit_size(cfg.benchmark.suite_engine, cfg.benchmark.suite_concurrency))


def agreement_prompts(cfg: RunConfig) -> list[Any]:
    """The offline evaluation's prompts, rendered and tokenised exactly as evaluate renders them; none without an
    offline evaluation to agree with."""
    from tasks.common.target_info import load_tokenizer

    out = cfg.output_path
    if not (out / OFFLINE_ACCEPTANCE).is_file():
        return []
    tokenizer = load_tokenizer(out / "target", cfg.model)
    return eval_prompts(out / "data" / "eval.jsonl", tokenizer, cfg.validation.max_length, cfg.evaluation.max_prompts,
                        cfg.evaluation.sources)


def variant_name(setting: ServingSetting, sweep: list[ServingSetting]) -> str:
    return "eagle3" if len(sweep) == 1 else f"eagle3-{setting.label}"


Drafted = dict[ServingSetting, list[VariantRun]]


def measure_per_round(cfg: RunConfig, kind: EngineKind, requests: list[ChatRequest], sampling: Sampling,
                      sweep: list[ServingSetting], agreement: "AgreementRun") -> tuple[list[VariantRun], Drafted]:
    """`benchmark.engine_starts: per_round`: a fresh engine per variant and round, one at a time, alternating
    without, with (each setting), without, with, ..."""
    draft = cfg.output_path / "draft" / kind
    baselines: list[VariantRun] = []
    drafted: Drafted = {setting: [] for setting in sweep}
    for round_number in range(1, cfg.benchmark.rounds + 1):
        baselines.append(measure_variant(cfg, kind, "baseline", requests, sampling, None,
                                         ServingSetting(agreement.steps), round_number))
        for setting in sweep:
            drafted[setting].append(measure_variant(cfg, kind, variant_name(setting, sweep), requests, sampling, draft,
                                                    setting, round_number, agreement.on(setting, round_number)))
    return baselines, drafted


def measure_resident(cfg: RunConfig, kind: EngineKind, requests: list[ChatRequest], sampling: Sampling,
                     sweep: list[ServingSetting], agreement: "AgreementRun") -> tuple[list[VariantRun], Drafted]:
    """`benchmark.engine_starts: once`: every variant's engine is started once (own port, all at the same time)
    and kept up; each round measures them one after the other on the same live engines, so the rounds cost no
    start-ups."""
    draft = cfg.output_path / "draft" / kind
    variants = [("baseline", None, ServingSetting(agreement.steps))]
    variants += [(variant_name(setting, sweep), draft, setting) for setting in sweep]
    baselines: list[VariantRun] = []
    drafted: Drafted = {setting: [] for setting in sweep}
    launches = []
    for offset, (variant, variant_draft, setting) in enumerate(variants):
        launch = engine_launch(cfg, kind, variant, variant_draft, setting)
        launch.port += offset
        launches.append(launch)
    with serve_together(launches) as engines:
        live = []
        for (variant, variant_draft, setting), (engine, startup_s) in zip(variants, engines):
            warm_up(engine, requests[0])
            live.append((variant, variant_draft, setting, engine, startup_s))
        for round_number in range(1, cfg.benchmark.rounds + 1):
            for variant, variant_draft, setting, engine, startup_s in live:
                drafting = agreement.on(setting, round_number) if variant_draft is not None else None
                measured = measure_levels(cfg, kind, engine, variant, requests, sampling, variant_draft is not None,
                                          startup_s, round_number, drafting)
                (baselines if variant_draft is None else drafted[setting]).append(measured)
    return baselines, drafted


def measure_variant(cfg: RunConfig, kind: EngineKind, variant: str, requests: list[ChatRequest],
                    sampling: Sampling, draft: Optional[Path], setting: ServingSetting,
                    round_number: int = 1, agreement: Optional["AgreementRun"] = None) -> VariantRun:
    """Start the engine, warm it up, run every concurrency level, stop it."""
    launch = engine_launch(cfg, kind, variant, draft, setting, round_number)
    started = time.monotonic()
    with serve(launch) as engine:
        startup_s = time.monotonic() - started
        warm_up(engine, requests[0])
        return measure_levels(cfg, kind, engine, variant, requests, sampling, draft is not None, startup_s,
                              round_number, agreement)


def measure_levels(cfg: RunConfig, kind: EngineKind, engine: RunningEngine, variant: str,
                   requests: list[ChatRequest], sampling: Sampling, speculative: bool, startup_s: float,
                   round_number: int, agreement: Optional["AgreementRun"] = None) -> VariantRun:
    """Every concurrency level on a started, warmed-up engine, with the peak RSS of its process tree; then, on the
    engine that drafts the offline evaluation's chain (first round), the agreement run."""
    measured = VariantRun(variant=variant, round=round_number, report={
        "command": engine.command, "log": str(engine.log_path), "startup_s": startup_s, "levels": [],
    })
    reference = [request for request in requests if request.suite is None]
    with PeakMemory(engine.pid) as memory:
        for concurrency in cfg.benchmark.concurrency:
            level, results = measure_level(engine, kind, reference, sampling, concurrency, speculative)
            measured.report["levels"].append(level)
            measured.results[concurrency] = results
        for suite, traffic in by_suite(requests).items():
            for concurrency in cfg.benchmark.concurrency:
                level, results = measure_level(engine, kind, traffic, sampling, concurrency, speculative)
                measured.report.setdefault("suite_levels", {}).setdefault(suite, []).append(level)
                measured.suite_results.setdefault(suite, {})[concurrency] = results
    measured.report["peak_rss_mib"] = memory.peak_bytes / 2**20
    if agreement is not None:
        replay_on(engine, kind, agreement, measured)
    return measured


def replay_on(engine: RunningEngine, kind: EngineKind, agreement: AgreementRun, measured: VariantRun) -> None:
    """The suites' replay and the agreement run on `engine`, kept on `measured` (the run of the engine drafting
    the evaluation's chain, first round)."""
    memo = replay_memo(kind)
    if agreement.suite_units and kind == agreement.suite_engine:
        replayed = replay_suites(engine, kind, agreement.suite_units, agreement.max_tokens, agreement.temperature,
                                 memo, agreement.suite_concurrency)
        measured.suites = {**replayed, "units": agreement.suite_units}
    if agreement.prompts:
        measured.report["agreement"] = replay_agreement(engine, kind, agreement, memo)


def replay_on_own_engine(cfg: RunConfig, kind: EngineKind, agreement: AgreementRun, drafted: Drafted) -> None:
    """`benchmark.replay_engine_env`: after the speed rounds, one engine drafting the evaluation's chain, with that
    environment added, replays what `replay_on` would have replayed on the first round's engine. Its command, log
    and start-up go into that run's report as `replay_engine`."""
    chain = ServingSetting(agreement.steps)
    if not drafted.get(chain) or agreement.on(chain, 1) is None:
        return
    launch = engine_launch(cfg, kind, "replay", cfg.output_path / "draft" / kind, chain)
    launch.env.update(unredacted_mapping(cfg.benchmark.replay_engine_env, "benchmark.replay_engine_env"))
    measured = drafted[chain][0]
    started = time.monotonic()
    with serve(launch) as engine:
        startup_s = time.monotonic() - started
        replay_on(engine, kind, agreement, measured)
    measured.report["replay_engine"] = {"command": engine.command, "log": str(engine.log_path),
                                        "startup_s": startup_s}


def replay_agreement(engine: RunningEngine, kind: EngineKind, agreement: AgreementRun,
                     memo: ReplayMemo) -> list[dict[str, Any]]:
    """The evaluation's prompts on the engine, read the way its agreement check needs them; the reference prompts the
    suite replay already sent alone (the default's are a subset of its MT-bench suite) are read from `memo`
    (suite_replay.replay_memo(kind)), not generated again."""
    if isinstance(memo, GeneratedMemo):
        return replay_generate(engine.root_url, agreement.prompts, agreement.max_tokens, agreement.temperature, memo)
    return run_agreement(engine, kind, agreement.prompts, agreement.max_tokens, agreement.temperature, memo)


def warm_up(engine: RunningEngine, request: ChatRequest) -> None:
    sampling = Sampling(temperature=0.0, max_tokens=WARMUP_MAX_TOKENS)
    results, _ = asyncio.run(run_level(engine.base_url, engine.launch.served_model_name, [request], sampling, 1))
    if not results[0].ok:
        raise RuntimeError(f"{engine.launch.kind} warm-up request failed: {results[0].error}\nlog: {engine.log_path}")


def measure_level(engine: RunningEngine, kind: EngineKind, requests: list[ChatRequest], sampling: Sampling,
                  concurrency: int, speculative: bool) -> tuple[dict[str, Any], list[RequestResult]]:
    """One concurrency level: the client's statistics, and the engine's acceptance over exactly this level."""
    before = engine.read_metrics()
    results, wall_s = asyncio.run(
        run_level(engine.base_url, engine.launch.served_model_name, requests, sampling, concurrency)
    )
    after = engine.read_metrics()
    level = {"concurrency": concurrency, **summarize_level(results, wall_s)}
    if speculative:
        window = speculative_window(kind, before, after)
        level["speculative"] = {"window": window, **acceptance(kind, window)}
    return level, results


class PeakMemory:
    """Samples the resident memory of a process and all its descendants in a background thread.

    RSS is summed over the tree, so pages shared between processes (libraries) count once per process:
    an upper bound, the same way for both variants.
    """

    def __init__(self, pid: int, interval_s: float = MEMORY_SAMPLE_INTERVAL_S) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="engine-memory", daemon=True)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            self.peak_bytes = max(self.peak_bytes, tree_rss_bytes(self.pid))
            if self._stop.wait(self.interval_s):
                return


def tree_rss_bytes(pid: int) -> int:
    """RSS of `pid` and its descendants; processes that exit while being read count as 0."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue
    return total


# --- checks ---------------------------------------------------------------------------------------------


def engine_report(cfg: RunConfig, kind: str, baselines: list[VariantRun], drafted: Drafted,
                  steps: int, requests: Sequence[ChatRequest]) -> dict[str, Any]:
    """One engine: the baseline, every drafted setting against it, the recommended setting and every check.
    `eagle3` and `speedup` are those of the recommended setting (what the speedup gate judges); the engine's
    acceptance is compared with the offline evaluation at its own chain length `steps`. Greedy texts that differ
    are judged by the rule of the engines' --dtype (`requests`: what they answered; serving/greedy_divergence.py)."""
    failures = [failure for measured in baselines for failure in failed_requests(kind, measured)]
    rule = engines_rule(cfg, [measured.report["command"] for measured in baselines + flattened(drafted)])
    judge = None if rule.exact else TextDivergences(cfg, requests, rule)
    evaluation = offline_report(cfg)
    offline = evaluation.as_json() if evaluation is not None else None
    per_setting = {}
    for setting, runs in drafted.items():
        failures += [failure for measured in runs for failure in failed_requests(kind, measured)]
        per_setting[setting] = setting_report(cfg, kind, baselines, runs, setting, judge)
        if per_setting[setting]["drafting_problem"]:
            failures.append(per_setting[setting]["drafting_problem"])
    greedy = judged_greedy(kind, merged_greedy([entry["greedy"] for entry in per_setting.values()]), rule)
    failures += greedy.get("failures", [])
    offline_chain = ServingSetting(steps)
    if offline_chain in per_setting:
        contract = check_agreement(cfg, kind, drafted[offline_chain], steps)
    else:
        chains = sorted(setting.steps for setting in per_setting if setting.is_chain)
        contract = {"status": "skipped", "reason": f"benchmark.num_speculative_tokens {chains} does not include "
                    f"evaluation.steps {steps}, the chain the offline evaluation measured"}
    if contract["status"] == "failed":
        failures.append(contract["reason"])
    best = recommended_setting(cfg, per_setting)
    suites = engine_suites(cfg, kind, drafted.get(offline_chain, []), steps)
    flags = best.engine_flags(kind, export_method(cfg.output_path / "draft" / kind))
    return {
        "execution": engine_execution(cfg, kind).as_report(),
        "baseline": combine_rounds(baselines),
        "num_speculative_tokens": best.steps if best.is_chain else None,
        "serving_setting": {**best.as_dict(), "label": best.label, "flags": flags},
        "eagle3": per_setting[best]["eagle3"],
        "speedup": per_setting[best]["speedup"],
        "sweep": [{"label": setting.label, "setting": setting.as_dict(),
                   "num_speculative_tokens": setting.steps if setting.is_chain else None,
                   "mean_accept_length": entry["eagle3"]["speculative"]["mean_accept_length"],
                   "speedup": entry["speedup"], "suites": entry["suites"],
                   "predicted_speedup": predicted_setting_speedup(offline, setting) if offline is not None else None}
                  for setting, entry in per_setting.items()],
        "greedy": greedy,
        "acceptance_check": contract,
        **({"suites": suites} if suites is not None else {}),
        "failures": failures,
    }


def engine_suites(cfg: RunConfig, kind: str, runs: list[VariantRun], steps: int) -> Optional[dict[str, Any]]:
    """The suites as the engine drafting the evaluation's chain measured them (first round), None when it did not."""
    replay = next((measured.suites for measured in runs if measured.suites is not None), None)
    if replay is None:
        return None
    return suites_summary(kind, replay, replay["units"], steps, cfg.evaluation.max_new_tokens,
                          cfg.evaluation.temperature, cfg.benchmark.suite_concurrency)


def setting_report(cfg: RunConfig, kind: str, baselines: list[VariantRun], runs: list[VariantRun],
                   setting: ServingSetting, judge: Optional[TextDivergences] = None) -> dict[str, Any]:
    """One drafted setting over its rounds, against the baselines of the same rounds."""
    eagle3 = combine_rounds(runs)
    eagle3["num_speculative_tokens"] = setting.steps if setting.is_chain else None
    eagle3["serving_setting"] = setting.as_dict()
    eagle3["speculative"] = overall_acceptance(kind, [level for measured in runs for level in measured.report["levels"]])
    greedy = compare_greedy_rounds(baselines, runs, judge) if cfg.benchmark.temperature == 0 else {
        "status": "skipped", "reason": "temperature > 0: outputs are sampled"}
    return {"eagle3": eagle3, "greedy": greedy, "drafting_problem": drafting_check(kind, eagle3["speculative"]),
            "speedup": speedups([measured.report["levels"] for measured in baselines],
                                [measured.report["levels"] for measured in runs]),
            "suites": suite_serving(kind, baselines, runs)}


def recommended_setting(cfg: RunConfig, per_setting: dict[ServingSetting, dict[str, Any]]) -> ServingSetting:
    """The setting with the best median speedup at the level the speedup gate judges (the lowest by default)."""
    wanted = cfg.registry.speedup_concurrency or min(cfg.benchmark.concurrency)

    def median_speedup(setting: ServingSetting) -> float:
        row = next((row for row in per_setting[setting]["speedup"] if row["concurrency"] == wanted), None)
        return row["output_tokens_per_s"] if row and row["output_tokens_per_s"] is not None else float("-inf")

    return max(per_setting, key=median_speedup)


def merged_greedy(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Several greedy comparisons (rounds, settings) as one verdict."""
    if all(part["status"] == "skipped" for part in parts):
        return parts[0]
    mismatches = [mismatch for part in parts for mismatch in part.get("mismatches", [])]
    return {"status": "failed" if mismatches else "ok", "compared": sum(part.get("compared", 0) for part in parts),
            "mismatches": mismatches}


def combine_rounds(runs: list[VariantRun]) -> dict[str, Any]:
    """One variant over its rounds: per concurrency the level of the median-throughput round (a real
    measurement, not an average of percentiles), the median start-up, the largest peak RSS, every round kept."""
    levels = []
    for index, level in enumerate(runs[0].report["levels"]):
        by_rate = sorted((measured.report["levels"][index] for measured in runs),
                         key=lambda candidate: candidate["output_tokens_per_s"])
        levels.append(by_rate[(len(by_rate) - 1) // 2])
    return {
        "command": runs[0].report["command"], "log": runs[0].report["log"],
        "startup_s": statistics.median(measured.report["startup_s"] for measured in runs),
        "peak_rss_mib": max(measured.report["peak_rss_mib"] for measured in runs),
        "levels": levels,
        "rounds": [{"round": measured.round, **measured.report} for measured in runs],
    }


def speedups(baseline_rounds: list[list[dict[str, Any]]], eagle3_rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Output tok/s with the drafter over without it, per concurrency level: one ratio per round (each round's
    pair of engines ran back to back), reported as the median with its spread."""
    rows = []
    for index, level in enumerate(baseline_rounds[0]):
        ratios = []
        for plain_levels, drafted_levels in zip(baseline_rounds, eagle3_rounds):
            base = plain_levels[index]["output_tokens_per_s"]
            ratios.append(drafted_levels[index]["output_tokens_per_s"] / base if base > 0 else None)
        measured = [ratio for ratio in ratios if ratio is not None]
        rows.append({"concurrency": level["concurrency"],
                     "output_tokens_per_s": statistics.median(measured) if measured else None,
                     "min": min(measured) if measured else None, "max": max(measured) if measured else None,
                     "per_round": ratios})
    return rows


def failed_requests(kind: str, measured: VariantRun) -> list[str]:
    failures = []
    traffic = [(None, measured.results)] + list(measured.suite_results.items())
    for suite, per_level in traffic:
        for concurrency, results in per_level.items():
            failed = [result for result in results if not result.ok]
            if failed:
                served = f" of suite {suite}" if suite else ""
                failures.append(f"{kind} {measured.variant} (round {measured.round}): {len(failed)} of {len(results)} "
                                f"requests{served} failed at concurrency {concurrency}, first: {failed[0].prompt_id}: "
                                f"{failed[0].error}")
    return failures


def suite_serving(kind: str, baselines: list[VariantRun], runs: list[VariantRun]) -> dict[str, dict[str, Any]]:
    """`benchmark.per_suite`: per suite, the setting's speedup per level over the same rounds' baselines and the
    engine's acceptance on that suite's traffic ({} without per-suite traffic)."""
    served: dict[str, dict[str, Any]] = {}
    for suite in runs[0].report.get("suite_levels", {}):
        drafted_levels = [measured.report["suite_levels"][suite] for measured in runs]
        served[suite] = {
            "speedup": speedups([measured.report["suite_levels"][suite] for measured in baselines], drafted_levels),
            "mean_accept_length": overall_acceptance(kind, [level for levels in drafted_levels
                                                             for level in levels])["mean_accept_length"],
        }
    return served


def drafting_check(kind: str, speculative: dict[str, Any]) -> Optional[str]:
    """A message when the engine reports no drafting at all (the drafter was not used)."""
    if kind == "vllm" and speculative["window"]["drafts"] <= 0:
        return ("vllm eagle3: the engine made no drafts (vllm:spec_decode_num_drafts_total did not move); "
                "the drafter was not used: see the engine log")
    if kind == "sglang" and not speculative["mean_accept_length"]:
        return "sglang eagle3: sglang:spec_accept_length is absent or 0; the drafter was not used: see the engine log"
    return None


def flattened(drafted: Drafted) -> list[VariantRun]:
    return [measured for runs in drafted.values() for measured in runs]


def compare_greedy_rounds(baselines: list[VariantRun], eagle3s: list[VariantRun],
                          judge: Optional[TextDivergences] = None) -> dict[str, Any]:
    """Every round's pair compared; any mismatch in any round counts."""
    return merged_greedy([compare_greedy(baseline, eagle3, judge) for baseline, eagle3 in zip(baselines, eagle3s)])


def compare_greedy(baseline: VariantRun, eagle3: VariantRun, judge: Optional[TextDivergences] = None) -> dict[str, Any]:
    """Request for request at every level: the text with the drafter against the text without it. With a `judge`
    (16-bit engines) each differing request also gets its first differing token, the target's gap there and
    whether that is a near-tie."""
    mismatches = []
    compared = 0
    for concurrency, plain_results in baseline.results.items():
        for plain, drafted in zip(plain_results, eagle3.results[concurrency]):
            if not (plain.ok and drafted.ok):
                continue
            compared += 1
            if plain.text == drafted.text:
                continue
            at = first_difference(plain.text, drafted.text)
            mismatches.append({
                "prompt_id": plain.prompt_id, "request": plain.index, "concurrency": concurrency,
                "round": baseline.round, "variant": eagle3.variant, "first_difference": at, "baseline": plain.text[max(0, at - 20):at + SNIPPET_CHARS],
                "eagle3": drafted.text[max(0, at - 20):at + SNIPPET_CHARS],
                **(judge.judge(plain.index, plain.text, drafted.text) if judge is not None else {}),
            })
    return {"status": "failed" if mismatches else "ok", "compared": compared, "mismatches": mismatches}


def judged_greedy(kind: str, greedy: dict[str, Any], rule: GreedyRule) -> dict[str, Any]:
    """The merged comparison under `rule`: its summary, its `failures` and a status that says whether it passed
    (a 16-bit comparison passes with near-tie divergences under the mismatch-rate threshold)."""
    if greedy["status"] == "skipped":
        return greedy
    failures = greedy_failures(kind, greedy["mismatches"], greedy["compared"], rule)
    return {**greedy, "status": "failed" if failures else "ok", "rule": rule.summary(greedy["mismatches"],
            greedy["compared"]), "failures": failures}


def greedy_failures(kind: str, mismatches: list[dict[str, Any]], compared: int, rule: GreedyRule) -> list[str]:
    if not mismatches:
        return []
    if rule.exact:
        return [mismatch_message(kind, mismatches)]
    return [f"{kind}: {failure}" for failure in near_tie_failures(mismatches, compared, rule, describe_request)]


def describe_request(row: dict[str, Any]) -> str:
    return (f"{row['prompt_id']} (request {row['request']}, concurrency {row['concurrency']}, round {row['round']}, "
            f"{row['variant']}, token {row['token_position']})")


def mismatch_message(kind: str, mismatches: list[dict[str, Any]]) -> str:
    ids = sorted({mismatch["prompt_id"] for mismatch in mismatches})
    return (f"{kind}: greedy output with the drafter differs from the output without it for {len(mismatches)} "
            f"request(s), prompts {', '.join(ids)} (first differing character per request in the report); "
            f"speculative decoding at temperature 0 on float32 engines must not change the output")


def check_agreement(cfg: RunConfig, kind: str, runs: list[VariantRun], steps: int) -> dict[str, Any]:
    """The engine's agreement run against the offline evaluation of the same drafter: per position on vLLM
    (tasks/serving/agreement.py), on totals on SGLang (tasks/serving/totals_agreement.py). A check that could not
    measure anything says so ("skipped", "inconclusive"): whether that may pass is the registry's call
    (`registry.waive_gates`), not the benchmark's, so a waiver never reruns the engines."""
    offline = offline_report(cfg)
    if offline is None:
        return {"status": "skipped", "reason": f"no offline evaluation at {cfg.output_path / OFFLINE_ACCEPTANCE}"}
    chain = offline.chain
    if chain.steps != steps:
        return {"status": "failed", "reason": (
            f"{kind}: the offline evaluation ({cfg.output_path / OFFLINE_ACCEPTANCE}) is not of this drafter's chain "
            f"of {steps} steps: rerun the evaluate stage")}
    method = AGREEMENT_CHECKS.get(kind)
    if method is None:
        return {"status": "inconclusive", "reason": (
            f"{kind} reports neither per-position acceptance counters nor per-request verify rounds")}
    rows = next((measured.report["agreement"] for measured in runs if "agreement" in measured.report), None)
    if rows is None:
        return {"status": "skipped", "reason": f"{kind}: no agreement run at evaluation.steps {steps}"}
    settings = cfg.registry
    if method == "totals":
        verdict = totals_verdict(engine_rounds(rows), offline_rounds(chain.per_prompt), settings.agreement_alpha,
                                 settings.agreement_min_drafts)
    else:
        verdict = agreement_verdict(engine_counts(rows), offline_counts(chain), steps, settings.agreement_alpha,
                                    settings.agreement_min_drafts)
        offline_rows = {row.prompt: row.model_dump() for row in chain.per_prompt}
        verdict["per_prompt"] = [{"prompt": row["prompt"], "engine": row, "offline": offline_rows.get(row["prompt"])}
                                 for row in rows]
        if settings.agreement_exact and offline.temperature == 0.0:
            exact_check(verdict)
    verdict.update(check=method, engine_steps=steps, offline_steps=chain.steps, prompts=len(rows),
                   max_new_tokens=offline.max_new_tokens, temperature=offline.temperature)
    if verdict["status"] == "failed":
        verdict["reason"] = mismatch_hint(cfg.output_path, kind, verdict["reason"])
    return verdict


def exact_check(verdict: dict[str, Any]) -> None:
    """registry.agreement_exact: the verdict fails when any prompt's rounds differ at all from the offline decoder's."""
    differing = exact_differences(verdict["per_prompt"])
    verdict["exact"] = {"prompts": len(verdict["per_prompt"]), "differing": len(differing)}
    if differing and verdict["status"] != "failed":
        verdict.update(status="failed", reason=(
            f"{len(differing)} of {len(verdict['per_prompt'])} prompts drafted otherwise than offline "
            f"(registry.agreement_exact): {'; '.join(differing[:3])}"))


def mismatch_hint(out: Path, kind: str, differences: str) -> str:
    """The agreement failure, with the export's layer ids next to the trained ones and where else to look."""
    draft = out / "draft" / kind
    eagle_config = read_json(draft / "config.json").get("eagle_config", {}) if (draft / "config.json").is_file() else {}
    engine_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids", "absent (engine default)")
    trained_ids = eagle_config.get("eaglet_aux_layer_ids", "unknown")
    return (
        f"{kind}: the engine's acceptance differs from the offline decoder's on the same prompts: {differences}. "
        f"The engine is not drafting from what the drafter was trained on. Check (1) the aux layer-id convention "
        f"(docs/architecture.md §3): {draft}/config.json has eagle_config.eagle_aux_hidden_state_layer_ids = "
        f"{engine_ids} for trained layers {trained_ids} (vLLM captures the output of layer id - 1, SGLang of layer "
        f"id); (2) the chat template and model.chat_template_kwargs the engine renders with are the target's "
        f"({out}/target/chat_template.jinja); (3) the vocab mapping (d2t/t2d) in {draft}/model.safetensors is the "
        f"one trained with ({out}/vocab/vocab_mapping.safetensors)"
    )


# --- outputs --------------------------------------------------------------------------------------------


def request_rows(kind: str, measured: VariantRun) -> list[dict[str, Any]]:
    rows = []
    traffic = [(None, measured.results)] + list(measured.suite_results.items())
    for suite, concurrency, results in ((suite, level, results) for suite, per_level in traffic
                                        for level, results in per_level.items()):
        for result in results:
            rows.append({
                "engine": kind, "variant": measured.variant, "round": measured.round, "concurrency": concurrency,
                "suite": suite,
                "request": result.index,
                "prompt_id": result.prompt_id, "output_tokens": result.output_tokens,
                "content_chunks": result.content_chunks, "ttft_s": result.ttft_s, "tpot_s": result.tpot_s,
                "latency_s": result.latency_s, "finish_reason": result.finish_reason, "error": result.error,
                "text": result.text,
            })
    return rows


def write_outputs(directory: Path, report: dict[str, Any], rows: list[dict[str, Any]]) -> BenchmarkResult:
    """report.json (checked against contract/reports.py's BenchmarkReport first: what register reads), the
    per-request rows and the plot."""
    report = BenchmarkReport.model_validate(report).as_json()
    report_path = directory / "report.json"
    requests_path = directory / "requests.jsonl"
    write_jsonl(requests_path, rows)
    plot_path = plot_serving(report, directory / "serving.png")
    suite_plots = [plot_suites(engine["suites"], directory / f"acceptance_by_suite_{kind}.png", f"{kind} engine",
                               engine["suites"]["unit"])
                   for kind, engine in report["engines"].items() if "suites" in engine]
    write_json(report_path, report)
    return BenchmarkResult(report_path=report_path, requests_path=requests_path, plot_path=plot_path, report=report,
                           suite_plots=suite_plots)


def plot_serving(report: dict[str, Any], path: Path) -> Optional[Path]:
    """Output tok/s and TPOT P50 against concurrency, with and without the drafter, per engine (a note when
    no engine ran: the plot is a declared output either way)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not report["engines"]:
        figure, axis = plt.subplots(figsize=(6, 1.5))
        axis.axis("off")
        axis.text(0.5, 0.5, f"no serving benchmark: {report['skipped']}", ha="center", va="center")
        return save_figure(figure, path)

    figure, (throughput, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, engine in report["engines"].items():
        for variant in VARIANTS:
            levels = engine[variant]["levels"]
            concurrency = [level["concurrency"] for level in levels]
            style = "-o" if variant == "eagle3" else "--s"
            label = f"{kind} {'with' if variant == 'eagle3' else 'without'} drafter"
            throughput.plot(concurrency, [level["output_tokens_per_s"] for level in levels], style, label=label)
            tpot.plot(concurrency, [level["tpot_ms"]["p50"] for level in levels], style, label=label)
    throughput.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    tpot.set(xlabel="concurrency", ylabel="TPOT P50 (ms)", title="time per output token")
    for axis in (throughput, tpot):
        axis.set_xticks(report["settings"]["concurrency"])
        axis.legend()
        axis.grid(alpha=0.3)
    return save_figure(figure, path)


LEVEL_METRICS = {
    "output_tokens_per_s": ("output_tokens_per_s",),
    "requests_per_s": ("requests_per_s",),
    "ttft_p50_ms": ("ttft_ms", "p50"),
    "ttft_p99_ms": ("ttft_ms", "p99"),
    "tpot_p50_ms": ("tpot_ms", "p50"),
    "tpot_p99_ms": ("tpot_ms", "p99"),
    "itl_p50_ms": ("itl_ms", "p50"),
    "latency_p50_ms": ("latency_ms", "p50"),
}


def flat_metrics(report: dict[str, Any]) -> dict[str, float]:
    """`<engine>_c<concurrency>_<variant>_<metric>`, speedups, acceptance and memory; numbers only."""
    metrics: dict[str, Any] = {"passed": float(report["passed"]), "failures": len(report["failures"])}
    for kind, engine in report["engines"].items():
        for variant in VARIANTS:
            metrics[f"{kind}_{variant}_peak_rss_mib"] = engine[variant]["peak_rss_mib"]
            metrics[f"{kind}_{variant}_startup_s"] = engine[variant]["startup_s"]
            for level in engine[variant]["levels"]:
                prefix = f"{kind}_c{level['concurrency']}_{variant}"
                for name, path in LEVEL_METRICS.items():
                    metrics[f"{prefix}_{name}"] = dig(level, path)
                if "speculative" in level:
                    accept_length = level["speculative"]["mean_accept_length"]
                    metrics[f"{kind}_c{level['concurrency']}_mean_accept_length"] = accept_length
        for row in engine["speedup"]:
            metrics[f"{kind}_c{row['concurrency']}_speedup"] = row["output_tokens_per_s"]
            metrics[f"{kind}_c{row['concurrency']}_speedup_min"] = row["min"]
            metrics[f"{kind}_c{row['concurrency']}_speedup_max"] = row["max"]
        metrics[f"{kind}_recommended_num_speculative_tokens"] = engine["num_speculative_tokens"]
        for name, value in engine["serving_setting"].items():
            if name in ("steps", "topk", "num_draft_tokens"):
                metrics[f"{kind}_recommended_{name}"] = value
        for setting in engine["sweep"]:
            label = setting["label"]
            metrics[f"{kind}_{label}_mean_accept_length"] = setting["mean_accept_length"]
            metrics[f"{kind}_{label}_predicted_speedup"] = setting["predicted_speedup"]
            for row in setting["speedup"]:
                metrics[f"{kind}_{label}_c{row['concurrency']}_speedup"] = row["output_tokens_per_s"]
            for suite, served in setting.get("suites", {}).items():
                metrics[f"{kind}_{label}_{metric_name(suite)}_mean_accept_length"] = served["mean_accept_length"]
                for row in served["speedup"]:
                    metrics[f"{kind}_{label}_{metric_name(suite)}_c{row['concurrency']}_speedup"] = \
                        row["output_tokens_per_s"]
        speculative = engine["eagle3"]["speculative"]
        metrics[f"{kind}_mean_accept_length"] = speculative["mean_accept_length"]
        metrics[f"{kind}_draft_acceptance_rate"] = speculative["draft_acceptance_rate"]
        for position, rate in enumerate(speculative["acceptance_rate_per_position"]):
            metrics[f"{kind}_acceptance_rate_pos{position}"] = rate
        metrics[f"{kind}_greedy_mismatches"] = len(engine["greedy"].get("mismatches", []))
        if "suites" in engine:
            metrics.update(interval_metrics(f"{kind}_suites", engine["suites"]))
            metrics[f"{kind}_suites_tokens_per_second"] = engine["suites"]["tokens_per_second"]
    return {name: float(value) for name, value in metrics.items() if value is not None}


def dig(data: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        data = data[key]
    return data
