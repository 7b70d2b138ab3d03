"""Promotion gates and checkpoint checks: pure functions over reports and parsed checkpoint files.

A drafter becomes `champion` only when every gate passes. A gate that could not be measured (no serving
engine ran, or the champion was measured on another eval set or target revision) is "not run" and blocks like a
failed one, since nothing shows the drafter is good enough; `registry.waive_gates` maps the gates allowed to go
unmeasured to why they cannot be measured, and those become "waived", each carrying its reason (a recipe whose engine
cannot be compared says so and why). The very first champion has nothing to regress against: its regression gate
passes. Against a champion, the comparison is paired over the same prompts per eval set (the reference prompts and
each suite of `evaluation.sets`, tasks/registry/comparison.py): a drop beyond `registry.max_regression` fails only
outside the noise (its bootstrap interval below zero), and a version replaces the champion only when some set gains
beyond the noise (the `improvement` gate, its intervals Bonferroni-corrected for the number of sets it reads). Each
gate keeps its measured value and its threshold, so a refusal says by
how much it missed.

The checkpoint checks are what `eaglet doctor` prints (docs/architecture.md §3, §5): the contract against the target,
the tensor names and shapes the engines load, and the aux layer ids written for the export's engine.
No I/O here: tasks/register.py reads the files and calls these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, Optional

from contract.checkpoint import CheckpointContract, ContractMismatch, check_against_target
from contract.config import RegistryConfig
from contract.reports import AcceptanceReport, AgreementCheck, BenchmarkReport, SpeedupRow
from tasks.common.intervals import LEVEL, RESAMPLES, pooled_tau
from tasks.registry.comparison import (Comparison, SetComparison, SuiteRounds, compare_reference, compare_suites,
                                       measured_suites, rounds_of)

PASSED, FAILED, NOT_RUN, WAIVED = "passed", "failed", "not run", "waived"
GateStatus = Literal["passed", "failed", "not run", "waived"]
#: What withholds `champion`: a gate that failed, or one that could not be measured and was not waived.
BLOCKING = (FAILED, NOT_RUN)


@dataclass(frozen=True)
class Gate:
    """One promotion gate's verdict, with what was measured and what it had to reach."""

    name: str
    status: GateStatus
    measured: Any
    threshold: Any
    detail: str = ""
    waived_by: Optional[str] = None  # "registry.waive_gates.<family>: <reason>", when that let it through unmeasured

    @property
    def failed(self) -> bool:
        return self.status == FAILED

    @property
    def blocks(self) -> bool:
        return self.status in BLOCKING

    @property
    def family(self) -> str:
        """The key `registry.waive_gates` takes: a per-engine gate (`speedup[vllm]`) by its family (`speedup`)."""
        return self.name.partition("[")[0]

    def as_json(self) -> dict[str, Any]:
        """The gate as registration.json and the version's tags hold it (`waived_by` only when waived)."""
        data = asdict(self)
        if data["waived_by"] is None:
            del data["waived_by"]
        return data

    def describe(self) -> str:
        """One line for people: name, verdict, measured vs threshold, why, and how a waiver applies."""
        text = f"{self.name}: {self.status} (measured {shown(self.measured)}, threshold {shown(self.threshold)})"
        notes = [note for note in (self.detail, self.waiver_note()) if note]
        return f"{text}: {'; '.join(notes)}" if notes else text

    def waiver_note(self) -> str:
        """An unmeasured gate says how to let it through; a waived one says what let it through."""
        if self.status == NOT_RUN:
            return f"waive with registry.waive_gates: {{{self.family}: <why it cannot be measured>}}"
        if self.status == WAIVED:
            return f"waived by {self.waived_by}"
        return ""


def shown(value: Any) -> str:
    """Floats to four significant digits (a gate line is read, not parsed); the rest as Python writes it."""
    return f"{value:.4g}" if isinstance(value, float) else repr(value)


@dataclass(frozen=True)
class Champion:
    """What the current champion's version tags say about the eval set it was measured on."""

    version: int
    target_revision: Optional[str]
    eval_fingerprint: Optional[str]
    offline_accept_length: Optional[float]
    acceptance: Optional[AcceptanceReport] = None  # its logged reports/acceptance.json: per-prompt rounds to pair
    serving: Optional[BenchmarkReport] = None  # its logged reports/serving.json: the suites replayed on an engine

    def suites(self) -> Optional[SuiteRounds]:
        return measured_suites(self.acceptance, self.serving) if self.acceptance is not None else None


@dataclass(frozen=True)
class GateInputs:
    """Everything the gates read: the stage reports (None when absent) and the candidate's identity."""

    acceptance: AcceptanceReport
    serving: Optional[BenchmarkReport]
    data_contract: Optional[dict[str, Any]]
    target_revision: str
    eval_fingerprint: str
    champion: Optional[Champion]


@dataclass(frozen=True)
class ChampionComparisons:
    """This version against the champion, paired per eval set, computed once for the history gates that read it:
    `reference` (None without a champion or its readable per-prompt rounds) and one per suite of evaluation.sets."""

    reference: Optional[Comparison]
    suites: dict[str, Comparison]


def compare_with_champion(inputs: GateInputs) -> ChampionComparisons:
    """The paired comparisons with the champion's logged reports, where it has readable ones."""
    champion = inputs.champion
    if champion is None or champion.acceptance is None:
        return ChampionComparisons(None, {})
    measured = measured_suites(inputs.acceptance, inputs.serving)
    return ChampionComparisons(compare_reference(inputs.acceptance, champion.acceptance),
                               compare_suites(measured, champion.suites()))


def evaluate_gates(inputs: GateInputs, settings: RegistryConfig) -> list[Gate]:
    """Every gate, in the order a person reads them: data, correctness, quality, serving, history."""
    comparisons = compare_with_champion(inputs)
    gates = [data_contract_gate(inputs.data_contract), greedy_gate(inputs.acceptance),
             accept_length_gate(inputs.acceptance, settings.min_accept_length)]
    gates += serving_gates(inputs.serving, settings)
    gates.append(regression_gate(inputs, comparisons, settings.max_regression))
    gates += suite_regression_gates(inputs, comparisons, settings.max_regression)
    gates.append(improvement_gate(inputs, comparisons))
    return [waived(gate, settings.waive_gates) for gate in gates]


def waived(gate: Gate, waivers: dict[str, str]) -> Gate:
    """The gate as judged, except an unmeasured one whose family the config waives: that one stops blocking, and
    says which waiver let it through and why."""
    reason = waivers.get(gate.family)
    if gate.status == NOT_RUN and reason is not None:
        return replace(gate, status=WAIVED, waived_by=f"registry.waive_gates.{gate.family}: {reason}")
    return gate


def gates_passed(gates: list[Gate]) -> bool:
    """True when nothing blocks `champion`: every gate passed or was waived."""
    return not any(gate.blocks for gate in gates)


def blocking_lines(gates: list[Gate]) -> list[str]:
    """Why the version is not champion, one line per gate that failed or went unmeasured without a waiver."""
    return [gate.describe() for gate in gates if gate.blocks]


def waived_names(gates: list[Gate]) -> list[str]:
    """The gates let through unmeasured by registry.waive_gates: what `registry show` lists per version."""
    return [gate.name for gate in gates if gate.status == WAIVED]


def waivers_used(gates: list[Gate], settings: RegistryConfig) -> dict[str, str]:
    """Gate family -> reason, for the waivers that let a gate through: what the version records (a waiver the
    config names for a gate that was measured let nothing through, so it is not the version's)."""
    return {gate.family: settings.waive_gates[gate.family] for gate in gates if gate.status == WAIVED}


def offline_accept_length(acceptance: AcceptanceReport) -> float:
    """The chain's mean accept length: the number the engines' chain drafting is compared with."""
    return acceptance.chain.mean_accept_length


def speedup_row(rows: list[SpeedupRow], concurrency: Optional[int]) -> tuple[Optional[int], Optional[SpeedupRow]]:
    """(the level `registry.speedup_concurrency` names, or the lowest measured; its row, None when not measured)."""
    if not rows:
        return concurrency, None
    wanted = concurrency or min(row.concurrency for row in rows)
    return wanted, next((row for row in rows if row.concurrency == wanted), None)


# --- the gates ------------------------------------------------------------------------------------------


def data_contract_gate(report: Optional[dict[str, Any]]) -> Gate:
    """Training data that broke its contract must not ship, whatever the drafter measures."""
    if report is None:
        return Gate("data_contract", FAILED, None, True,
                    "no data contract report (reports/data_contract.json): run the validate stage")
    passed = bool(report.get("passed"))
    violations = report.get("violations") or []
    return Gate("data_contract", PASSED if passed else FAILED, passed, True, "; ".join(violations))


def greedy_gate(acceptance: AcceptanceReport) -> Gate:
    """Speculative decoding must not change greedy outputs; anything but "passed" is unproven."""
    verdict = acceptance.greedy_equivalence
    detail = ""
    if verdict != "passed":
        detail = "evaluate at evaluation.temperature=0 with every output identical to the target's"
    return Gate("greedy_equivalence", PASSED if verdict == "passed" else FAILED, verdict, "passed", detail)


def accept_length_gate(acceptance: AcceptanceReport, minimum: float) -> Gate:
    """Offline chain acceptance: the drafter's quality on held-out prompts, independent of any engine."""
    measured = offline_accept_length(acceptance)
    return Gate("offline_accept_length", PASSED if measured >= minimum else FAILED, measured, minimum,
                "" if measured >= minimum else "registry.min_accept_length not reached")


def serving_gates(report: Optional[BenchmarkReport], settings: RegistryConfig) -> list[Gate]:
    """The benchmark's own checks, then per engine: acceptance vs offline and speedup. "not run" without one."""
    if report is None or not report.measured:
        reason = "no engine ran: " + ((report.skipped if report else None)
                                      or "no benchmark report (benchmark/report.json)")
        thresholds = {"serving_checks": True, "engine_acceptance": settings.agreement_alpha,
                      "speedup": settings.min_speedup}
        return [Gate(name, NOT_RUN, None, threshold, reason) for name, threshold in thresholds.items()]
    failures = report.failures
    gates = [Gate("serving_checks", PASSED if not failures else FAILED, not failures, True, "; ".join(failures))]
    for kind, engine in sorted(report.engines.items()):
        gates.append(engine_acceptance_gate(kind, engine.acceptance_check, settings))
        gates.append(speedup_gate(kind, engine.speedup, settings))
    return gates


#: What each agreement check's measured value is, and what its two compared numbers are.
MEASURED_AS = {"per_position": ("smallest per-position p-value", "mean accept length"),
               "totals": ("p-value of tokens per verify round", "tokens per verify round")}


def engine_acceptance_gate(kind: str, check: AgreementCheck, settings: RegistryConfig) -> Gate:
    """The engine drafts from what the drafter was trained on: on the offline evaluation's prompts its acceptance does
    not differ significantly from the offline decoder's, per draft position (vLLM) or in tokens per verify round
    (SGLang). Too few drafts to tell, or no comparison, is a gate that could not be measured, never a pass; it lets
    the version through only as "waived", when `registry.waive_gates` gives `engine_acceptance` its reason
    (evaluate_gates)."""
    name, alpha = f"engine_acceptance[{kind}]", settings.agreement_alpha
    if check.status in ("skipped", "inconclusive"):
        return Gate(name, NOT_RUN, check.min_p_value, alpha, f"{check.status}: {check.reason or 'not compared'}")
    if check.check is None:  # failed before any comparison ran (an evaluation of another chain length)
        return Gate(name, FAILED, None, alpha, check.reason or "the benchmark compared nothing")
    gap = check.relative_gap
    measured_as, compared = MEASURED_AS[check.check]
    detail = (f"{measured_as}, engine vs offline acceptance on the same prompts"
              + (f" ({compared} engine {check.engine_mean_accept_length:.3f} vs offline "
                 f"{check.offline_mean_accept_length:.3f}, relative gap {gap:.1%})" if gap is not None else ""))
    if check.status == "failed":
        detail = f"{detail}: {check.reason or ''}"
    return Gate(name, PASSED if check.status == "ok" else FAILED, check.min_p_value, alpha, detail)


def speedup_gate(kind: str, rows: list[SpeedupRow], settings: RegistryConfig) -> Gate:
    """Output tok/s with the drafter over without it, at `speedup_concurrency` (default: the lowest level)."""
    name = f"speedup[{kind}]"
    if not rows:
        return Gate(name, FAILED, None, settings.min_speedup, "the benchmark report has no speedup rows")
    wanted, row = speedup_row(rows, settings.speedup_concurrency)
    if row is None:
        measured_levels = sorted(row.concurrency for row in rows)
        return Gate(name, FAILED, None, settings.min_speedup,
                    f"registry.speedup_concurrency {wanted} was not measured (levels {measured_levels})")
    measured = row.output_tokens_per_s
    detail = f"output tok/s with / without the drafter at concurrency {wanted}"
    if len(row.per_round) > 1:
        detail += f", median of {len(row.per_round)} rounds (min {row.min:.2f}, max {row.max:.2f})"
    if measured is None:
        return Gate(name, FAILED, None, settings.min_speedup, f"{detail}: the baseline produced no tokens")
    return Gate(name, PASSED if measured >= settings.min_speedup else FAILED, measured, settings.min_speedup, detail)


def regression_gate(inputs: GateInputs, comparisons: ChampionComparisons, max_regression: float) -> Gate:
    """No step back from the champion on the reference prompts, compared only on the same target revision and eval
    prompts; the first champion has nothing to regress against, so that counts as passing. With the champion's
    per-prompt rounds, a drop beyond `max_regression` fails only when the paired interval puts it outside the noise."""
    champion = inputs.champion
    measured = offline_accept_length(inputs.acceptance)
    if champion is None:
        return Gate("no_regression", PASSED, measured, None, "no champion yet: nothing to regress against")
    unlike = other_revision(champion, inputs.target_revision) or other_eval_set(champion, inputs.eval_fingerprint)
    if unlike:
        return Gate("no_regression", NOT_RUN, measured, None, unlike)
    if champion.offline_accept_length is None:
        return Gate("no_regression", NOT_RUN, measured, None,
                    f"champion v{champion.version} has no recorded offline accept length: not comparable")
    threshold = champion.offline_accept_length * (1.0 - max_regression)
    context = (f"champion v{champion.version} measured {champion.offline_accept_length:.3f} on the same eval set "
               f"(registry.max_regression {max_regression})")
    return regression_verdict("no_regression", measured, threshold, comparisons.reference, context)


def regression_verdict(name: str, measured: float, threshold: float, comparison: Optional[Comparison],
                       context: str) -> Gate:
    """Failed when τ fell below `threshold` and, where the prompts pair, the paired interval lies below zero: a drop
    inside the noise is reported as such and passes. Without a pairing, the point values decide."""
    below = measured < threshold
    if not isinstance(comparison, SetComparison):
        unpaired = comparison.reason if comparison is not None else "the champion's per-prompt rounds are not readable"
        return Gate(name, FAILED if below else PASSED, measured, threshold,
                    f"{context}; point comparison ({unpaired})")
    detail = f"{context}; paired {comparison.describe()}"
    if below and not comparison.significant_drop:
        detail += ": a drop inside the noise, not a regression"
    return Gate(name, FAILED if below and comparison.significant_drop else PASSED, measured, threshold, detail)


def other_revision(champion: Champion, target_revision: str) -> Optional[str]:
    if champion.target_revision != target_revision:
        return f"champion v{champion.version} was trained for another target revision: not comparable"
    return None


def other_eval_set(champion: Champion, eval_fingerprint: str) -> Optional[str]:
    if champion.eval_fingerprint != eval_fingerprint:
        return f"champion v{champion.version} was evaluated on another eval set: not comparable"
    return None


def unreadable(champion: Champion) -> Optional[str]:
    if champion.acceptance is None:
        return f"champion v{champion.version}'s reports/acceptance.json could not be read: nothing to pair"
    return None


def suite_regression_gates(inputs: GateInputs, comparisons: ChampionComparisons, max_regression: float) -> list[Gate]:
    """`no_regression[<suite>]` per suite of evaluation.sets: the same rule as the reference prompts', on the suite's
    prompts; a suite the champion did not measure alike is not comparable and says why."""
    champion = inputs.champion
    measured = measured_suites(inputs.acceptance, inputs.serving)
    gates = []
    for suite, rows in (measured.rows if measured is not None else {}).items():
        name = f"no_regression[{suite}]"
        tau = pooled_tau([rounds_of(row) for row in rows])
        if champion is None:
            gates.append(Gate(name, PASSED, tau, None, "no champion yet: nothing to regress against"))
            continue
        unlike = other_revision(champion, inputs.target_revision) or unreadable(champion)
        comparison = comparisons.suites.get(suite)
        if unlike or not isinstance(comparison, SetComparison):
            reason = unlike or f"champion v{champion.version}: {comparison.reason}"
            gates.append(Gate(name, NOT_RUN, tau, None, reason))
            continue
        threshold = comparison.champion * (1.0 - max_regression)
        context = (f"champion v{champion.version} on the same prompts, both by the {measured.measured_by} "
                   f"(registry.max_regression {max_regression})")
        gates.append(regression_verdict(name, tau, threshold, comparison, context))
    return gates


def improvement_gate(inputs: GateInputs, comparisons: ChampionComparisons) -> Gate:
    """A new champion must be better, not just no worse: some eval set (the reference prompts or a suite) gains
    beyond the noise (the paired interval above zero). A gain inside the noise leaves the champion where it is.
    Reading K sets gives K chances for noise to clear zero, so each set's interval is Bonferroni-corrected
    (`family_level`): the chance that a drafter no better than the champion replaces it stays at the single
    interval's one-sided 2.5 %, whatever K."""
    champion = inputs.champion
    if champion is None:
        return Gate("improvement", PASSED, None, 0.0, "no champion yet: the first version to pass becomes champion")
    unlike = other_revision(champion, inputs.target_revision) or unreadable(champion)
    if unlike:
        return Gate("improvement", NOT_RUN, None, 0.0, unlike)
    candidates: list[Comparison] = list(comparisons.suites.values())
    if other_eval_set(champion, inputs.eval_fingerprint) is None and comparisons.reference is not None:
        candidates.insert(0, comparisons.reference)
    compared = [comparison for comparison in candidates if isinstance(comparison, SetComparison)]
    if not compared:
        reasons = "; ".join(f"{comparison.name}: {comparison.reason}" for comparison in candidates)
        return Gate("improvement", NOT_RUN, None, 0.0,
                    f"no eval set measured alike by this version and champion v{champion.version}"
                    + (f" ({reasons})" if reasons else ""))
    level = family_level(len(compared))
    corrected = {comparison.name: comparison.difference_at(level, RESAMPLES * len(compared)) for comparison in compared}
    best = max(compared, key=lambda comparison: corrected[comparison.name].low)
    lower_bound = corrected[best.name].low
    correction = (f"each set's paired difference at {level:.2%} confidence, Bonferroni over {len(compared)} "
                  f"set{'s' if len(compared) != 1 else ''} (a family-wise {(1.0 - LEVEL) / 2:.1%} one-sided chance of "
                  "replacing an equal champion)")
    listed = "; ".join(comparison.describe(corrected[comparison.name]) for comparison in compared)
    if lower_bound > 0.0:
        return Gate("improvement", PASSED, lower_bound, 0.0,
                    f"{best.name} gains beyond the noise (lower bound of the paired difference; {correction}): "
                    f"{listed}")
    return Gate("improvement", FAILED, lower_bound, 0.0,
                f"no eval set gains beyond the noise, so champion v{champion.version} stays (a gain inside the noise "
                f"does not replace it; {correction}): {listed}")


def family_level(sets: int) -> float:
    """The confidence level of each of `sets` intervals such that all hold together at LEVEL (Bonferroni): "some
    set improves" passes when any lower bound clears zero, so each gets 1/`sets` of the error. For this any-of
    decision Holm's step-down gives the same verdict (its first step is this bound), and unlike a pooled interval it
    needs no common unit across suites measured by different engines."""
    return 1.0 - (1.0 - LEVEL) / sets


# --- checkpoint checks (eaglet doctor) ------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One checkpoint check: the field it looked at, whether it holds, and what was seen."""

    field: str
    ok: bool
    detail: str


def target_checks(contract: CheckpointContract, target_info: dict[str, Any]) -> list[Check]:
    """docs/architecture.md §5's load-time check (check_against_target), one line per field it refuses."""
    compared = "hidden_size, vocab_size, bos/eos/pad_token_id, tokenizer_hash, target_revision"
    try:
        check_against_target(contract, target_info)
    except ContractMismatch as error:
        lines = [line.strip()[2:] for line in str(error).splitlines() if line.strip().startswith("- ")]
        fields = [line.partition(": ") for line in lines]  # "<field>: checkpoint has X, target has Y"
        return [Check(f"target.{field}", False, detail) for field, _, detail in fields]
    return [Check("target", True, f"{compared} match {target_info.get('id')}")]


def expected_tensors(config: dict[str, Any]) -> dict[str, tuple[str, list[int]]]:
    """Name -> (dtype kind, shape) of every tensor the engines load (docs/architecture.md §3), from config.json."""
    from models.dflash_checkpoint import dflash_tensor_shapes, is_dflash_export

    if is_dflash_export(config):
        return dflash_tensor_shapes(config)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    target_hidden = config.get("target_hidden_size") or hidden
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    attention = "midlayer.self_attn."
    return {
        "fc.weight": ("float", [hidden, 3 * target_hidden]),
        "midlayer.input_layernorm.weight": ("float", [hidden]),
        "midlayer.hidden_norm.weight": ("float", [hidden]),
        attention + "q_proj.weight": ("float", [heads * head_dim, 2 * hidden]),
        attention + "k_proj.weight": ("float", [kv_heads * head_dim, 2 * hidden]),
        attention + "v_proj.weight": ("float", [kv_heads * head_dim, 2 * hidden]),
        attention + "o_proj.weight": ("float", [hidden, heads * head_dim]),
        "midlayer.post_attention_layernorm.weight": ("float", [hidden]),
        "midlayer.mlp.gate_proj.weight": ("float", [inner, hidden]),
        "midlayer.mlp.up_proj.weight": ("float", [inner, hidden]),
        "midlayer.mlp.down_proj.weight": ("float", [hidden, inner]),
        "norm.weight": ("float", [hidden]),
        "lm_head.weight": ("float", [config["draft_vocab_size"], hidden]),
        "d2t": ("int64", [config["draft_vocab_size"]]),
        "t2d": ("bool", [config["vocab_size"]]),
        **(fc_norm_tensors(target_hidden) if config.get("fc_norm") else {}),
        **(mask_tensors(target_hidden) if config.get("eagle_config", {}).get("eaglet_parallel_drafting") else {}),
    }


def fc_norm_tensors(target_hidden: int) -> dict[str, tuple[str, list[int]]]:
    """EAGLE 3.1's RMSNorm weights, one per aux state (config `fc_norm`)."""
    return {f"fc_norm.{index}.weight": ("float", [target_hidden]) for index in range(3)}


def mask_tensors(target_hidden: int) -> dict[str, tuple[str, list[int]]]:
    """P-EAGLE's learned state of the masked slots, in the aux width (vLLM refuses a parallel drafter without it)."""
    return {"mask_hidden": ("float", [1, 3 * target_hidden])}


def dtype_kind(safetensors_dtype: str) -> str:
    """Group safetensors dtype names ("F32", "BF16", "I64", "BOOL") the way the format allows them."""
    if safetensors_dtype in ("F64", "F32", "F16", "BF16"):
        return "float"
    return {"I64": "int64", "BOOL": "bool"}.get(safetensors_dtype, safetensors_dtype)


def tensor_checks(config: dict[str, Any], tensors: dict[str, tuple[str, list[int]]]) -> list[Check]:
    """Every expected tensor present with its shape; nothing else (vLLM rejects unknown names)."""
    expected = expected_tensors(config)
    checks = []
    for name, (kind, shape) in expected.items():
        if name not in tensors:
            checks.append(Check(f"tensor {name}", False, f"missing (expected {kind} {shape})"))
            continue
        found_kind, found_shape = dtype_kind(tensors[name][0]), list(tensors[name][1])
        ok = found_kind == kind and found_shape == shape
        checks.append(Check(f"tensor {name}", ok, f"{tensors[name][0]} {found_shape}"
                            + ("" if ok else f", expected {kind} {shape}")))
    unknown = sorted(set(tensors) - set(expected))
    checks.append(Check("tensor names", not unknown, f"unexpected {unknown}" if unknown else "no unknown tensors"))
    return checks


def config_checks(config: dict[str, Any], contract: CheckpointContract) -> list[Check]:
    """config.json agrees with its contract: architecture, vocab sizes, fusion dims."""
    from models.dflash_checkpoint import ARCHITECTURE as DFLASH_ARCHITECTURE

    target_hidden = config.get("target_hidden_size") or config.get("hidden_size")
    dflash = contract.method == "dflash"
    aux_count = len(contract.aux_layer_ids) if dflash else 3
    pairs = [
        ("config.architectures", config.get("architectures"),
         [DFLASH_ARCHITECTURE] if dflash else ["LlamaForCausalLMEagle3"]),
        ("config.vocab_size", config.get("vocab_size"), contract.vocab_size),
        ("config.draft_vocab_size", config.get("draft_vocab_size"), contract.draft_vocab_size),
        ("config.target_hidden_size", target_hidden, contract.hidden_size),
        ("contract.fusion_dims", contract.fusion_dims, [aux_count * (target_hidden or 0), config.get("hidden_size")]),
    ]
    checks = [Check(name, found == wanted, f"{found!r}" + ("" if found == wanted else f", expected {wanted!r}"))
              for name, found, wanted in pairs]
    masked = (config.get("eagle_config") or {}).get("eaglet_parallel_drafting") or dflash
    if masked:
        name = "config.dflash_config.mask_token_id" if dflash else "config.mask_token_id"
        mask = (config.get("dflash_config") or {}).get("mask_token_id") if dflash else config.get("mask_token_id")
        fits = isinstance(mask, int) and 0 <= mask < (contract.vocab_size or 0)
        checks.append(Check(name, fits, f"{mask!r}" + ("" if fits else
                            f": {contract.method} needs a token id below the target's vocab_size {contract.vocab_size}")))
    return checks


def layer_id_checks(config: dict[str, Any], contract: CheckpointContract, num_target_layers: int) -> list[Check]:
    """The engine captures the trained layers only if eagle_config is written in its convention
    (docs/architecture.md §3)."""
    from models.draft_checkpoint import engine_layer_ids

    if contract.method == "dflash":
        return dflash_layer_id_checks(config, contract)
    eagle = config.get("eagle_config") or {}
    trained = eagle.get("eaglet_aux_layer_ids")
    written = eagle.get("eagle_aux_hidden_state_layer_ids")
    wanted = engine_layer_ids(contract.aux_layer_ids, num_target_layers, contract.engine)
    engine = contract.engine or "no engine (SGLang convention)"
    return [
        Check("eagle_config.eaglet_aux_layer_ids", trained == contract.aux_layer_ids,
              f"{trained} (contract aux_layer_ids {contract.aux_layer_ids})"),
        Check("eagle_config.eagle_aux_hidden_state_layer_ids", written == wanted,
              f"{written if written is not None else 'absent'} for {engine}; expected "
              f"{wanted if wanted is not None else 'absent (engine default)'}"),
    ]


def dflash_layer_id_checks(config: dict[str, Any], contract: CheckpointContract) -> list[Check]:
    """vLLM's dflash reads dflash_config.target_layer_ids (outputs of those layers: eaglet's ids as they are), and an
    eagle_config's layer ids would override them."""
    written = (config.get("dflash_config") or {}).get("target_layer_ids")
    return [
        Check("dflash_config.target_layer_ids", written == contract.aux_layer_ids,
              f"{written} (contract aux_layer_ids {contract.aux_layer_ids})"),
        Check("eagle_config", "eagle_config" not in config,
              "absent" if "eagle_config" not in config else "present: vLLM would read its layer ids instead"),
    ]


def checkpoint_checks(config: dict[str, Any], contract: CheckpointContract,
                      tensors: dict[str, tuple[str, list[int]]], target_info: dict[str, Any]) -> list[Check]:
    """Everything `eaglet doctor` checks, in reading order."""
    return (target_checks(contract, target_info) + config_checks(config, contract)
            + layer_id_checks(config, contract, target_info["num_hidden_layers"]) + tensor_checks(config, tensors))
