"""evaluate stage: the trained drafter's acceptance on held-out prompts, measured by our reference decoder.

Reads the target, the exported drafter `draft/sglang` (its contract is checked against the target) and the
held-out records `data/eval.jsonl` (MT-bench for the embedded default). Every supervised assistant turn of a
record is one prompt: the conversation up to that turn's generation prompt, so turn 2 of MT-bench sees
turn 1 as the target wrote it.

Each prompt is decoded by the target alone (HF `generate`, which shares none of the speculative decoder's
cache, mask and position code, so a bug there cannot agree with itself) and by speculative decoding
(models/speculative.py) as a chain (`evaluation.steps` S, topk 1, S + 1 tokens: what vLLM's
`num_speculative_tokens` = S runs) and, when `evaluation.topk` > 1, as a dynamic tree (topk K, steps S,
`num_draft_tokens` N, like SGLang's flags).
Greedy (temperature 0) outputs computed in float32 must equal the target's token for token: a mismatch fails the stage
after the report is written, naming the prompts. In bfloat16/float16 other kernel shapes flip near-tie argmaxes, so
each differing output is judged by the target's float32 top-2 logit gap at its first differing token
(tasks/common/greedy_agreement.py): the stage fails on a divergence that is not a near-tie and on a mismatch rate
above `evaluation.max_greedy_mismatch_rate`; `greedy_mismatches` lists every divergence with its position, margin
and near-tie verdict, `greedy_rule` the rule applied. Those are the reference prompts (`evaluation.max_prompts`
records of `evaluation.sources`). The suites of `evaluation.sets` (MT-bench's categories, GSM8K, HumanEval, ...: records
spread over each suite's categories) are decoded as the chain alone, their prompts among the reference ones not
twice, and reported as the `suites` section: τ per suite and category with 95 % bootstrap intervals over prompts
(tasks/common/intervals.py). With `evaluation.sets_on: engine` the suites are the benchmark stage's to measure on
vLLM (tasks/serving/suite_replay.py) and this stage decodes the reference prompts alone.

Writes `evaluate/acceptance.json` (contract/reports.py's AcceptanceReport, validated before writing; per mode: mean
acceptance length, acceptance by depth, accepted-length histogram, drafted tokens per round, draft/verify time split,
tokens per target forward; per prompt the rounds, accepted tokens per position and tokens emitted, which the
benchmark's engine agreement checks compare with; buckets by source, category and prompt length), `evaluate/acceptance_by_depth.png` and `evaluate/accept_length_histogram.png`.

    .venv/bin/eaglet stage evaluate --config params.yaml
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from contract.config import RunConfig
from contract.reports import AcceptanceReport, ModeAcceptance
from tasks.common.artifacts import read_json, save_figure, write_json
from tasks.common.greedy_agreement import (GreedyRule, TargetMargins, first_difference, greedy_rule, judged,
                                           model_dtype, near_tie_failures)
from tasks.common.intervals import PromptRounds, tau_interval
from tasks.common.suite_summary import bucket_names, bucket_report, interval_metrics, plot_suites, prompt_hash
from tasks.common.progress import advance, progress_bar
from tasks.common.target_info import load_target_model, load_tokenizer
from tasks.data.held_out import EvalPrompt, eval_prompts, set_prompts

class GreedyMismatch(RuntimeError):
    """Speculative decoding changed a greedy output: the decoder or the drafter's contract is broken."""


@dataclass
class DecodeMode:
    """One speculative configuration, named as the report names it."""

    name: str
    steps: int
    topk: int
    num_draft_tokens: int


@dataclass
class ModeTotals:
    """Rounds and timings of one mode over all prompts, and per bucket."""

    mode: DecodeMode
    accept_lengths: list[int] = field(default_factory=list)
    drafted_tokens: list[int] = field(default_factory=list)
    target_forwards: int = 0
    generated_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    wall_seconds: float = 0.0
    buckets: dict[str, list[PromptRounds]] = field(default_factory=dict)
    prompts: list[PromptRounds] = field(default_factory=list)
    per_prompt: list[dict[str, Any]] = field(default_factory=list)

    def add(self, prompt: EvalPrompt, stats: Any, seconds: float) -> None:
        self.accept_lengths += stats.accept_lengths
        self.drafted_tokens += stats.drafted_tokens
        self.target_forwards += stats.target_forwards
        self.generated_tokens += stats.generated_tokens
        self.draft_seconds += stats.draft_seconds
        self.verify_seconds += stats.verify_seconds
        self.wall_seconds += seconds
        accepted = accepted_counts(stats.accept_lengths, self.mode.steps)
        self.per_prompt.append({"prompt": prompt.key, "rounds": stats.rounds, "accepted_per_position": accepted,
                                "generated_tokens": stats.generated_tokens, "source": prompt.source,
                                "input_hash": prompt_hash(prompt.input_ids)})
        rounds = PromptRounds(float(sum(stats.accept_lengths)), float(len(stats.accept_lengths)))
        self.prompts.append(rounds)
        for bucket in bucket_names(prompt.source, prompt.category, prompt.length_bucket, prompt.turn):
            self.buckets.setdefault(bucket, []).append(rounds)

    def report(self, target_tokens_per_second: float) -> ModeAcceptance:
        """The mode's section of the report; its speed against the target alone at `target_tokens_per_second`."""
        rounds = len(self.accept_lengths)
        histogram = {str(length): self.accept_lengths.count(length) for length in range(1, self.mode.steps + 2)}
        by_depth = [count / rounds if rounds else 0.0 for count in accepted_counts(self.accept_lengths, self.mode.steps)]
        busy = self.draft_seconds + self.verify_seconds
        tokens_per_second = self.generated_tokens / self.wall_seconds if self.wall_seconds else 0.0
        interval = tau_interval(self.prompts)
        return ModeAcceptance.model_validate({
            "steps": self.mode.steps, "topk": self.mode.topk, "num_draft_tokens": self.mode.num_draft_tokens,
            "rounds": rounds, "mean_accept_length": mean(self.accept_lengths),
            "mean_accept_length_interval": {"low": interval.low, "high": interval.high, "prompts": interval.prompts},
            "acceptance_by_depth": by_depth, "accept_length_histogram": histogram,
            "accepted_per_position": accepted_counts(self.accept_lengths, self.mode.steps),
            "per_prompt": self.per_prompt,
            "mean_drafted_tokens": mean(self.drafted_tokens),
            "target_forwards": self.target_forwards, "generated_tokens": self.generated_tokens,
            "tokens_per_target_forward": self.generated_tokens / self.target_forwards if self.target_forwards else 0.0,
            "draft_time_share": self.draft_seconds / busy if busy else 0.0,
            "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds,
            "tokens_per_second": tokens_per_second,
            "buckets": {name: bucket_report(values) for name, values in sorted(self.buckets.items())},
            "speedup_vs_target": tokens_per_second / target_tokens_per_second if target_tokens_per_second else 0.0,
        })


def accepted_counts(accept_lengths: list[int], steps: int) -> list[int]:
    """Rounds that accepted the draft token at each position 1..steps (position d needs d accepted tokens): the
    counts engines report per position (vLLM's spec_decode_num_accepted_tokens_per_pos)."""
    return [sum(length - 1 >= depth for length in accept_lengths) for depth in range(1, steps + 1)]


def mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass
class EvaluationResult:
    report_path: Path
    report: dict[str, Any]
    plots: list[Path]

    def summary(self) -> dict[str, float]:
        numbers: dict[str, float] = {"prompts": float(self.report["prompts"]),
                                     "greedy_mismatches": float(len(self.report["greedy_mismatches"])),
                                     "target_tokens_per_second": self.report["target"]["tokens_per_second"]}
        for name in ("chain", "tree", "suites"):
            mode = self.report.get(name)
            if not mode:
                continue
            numbers.update(interval_metrics(name, mode))
            numbers[f"{name}_tokens_per_target_forward"] = mode["tokens_per_target_forward"]
            numbers[f"{name}_tokens_per_second"] = mode["tokens_per_second"]
            for depth, rate in enumerate(mode["acceptance_by_depth"], start=1):
                numbers[f"{name}_acceptance_depth_{depth}"] = rate
        return numbers

    def reports(self) -> list[Path]:
        return [self.report_path, *self.plots]


def decode_modes(cfg: RunConfig) -> list[DecodeMode]:
    """The chain always (the engines' chain settings compare with it), the tree when topk > 1."""
    settings = cfg.evaluation
    modes = [DecodeMode("chain", settings.steps, 1, settings.steps + 1)]
    if settings.topk > 1:
        modes.append(DecodeMode("tree", settings.steps, settings.topk, settings.num_draft_tokens))
    return modes


def load_drafter(cfg: RunConfig, target: Any) -> Any:
    """The exported SGLang drafter, checked against the target's contract, on the target's device."""
    from models.draft_checkpoint import load_pretrained

    out = cfg.output_path
    directory = out / "draft" / "sglang"
    if not (directory / "model.safetensors").is_file():
        raise FileNotFoundError(f"{directory}: no exported drafter; run the train stage first")
    draft, _ = load_pretrained(directory, read_json(out / "target.json"))
    draft.to(next(target.parameters()).device)
    draft.attach_embedding(target.get_input_embeddings().weight)
    draft.eval()
    return draft


def run(cfg: RunConfig) -> EvaluationResult:
    from models.draft_methods import speculative_decoder
    from models.speculative import target_generate

    out = cfg.output_path
    settings = cfg.evaluation
    tokenizer = load_tokenizer(out / "target", cfg.model)
    target = load_target_model(cfg, out / "target")
    target.eval()
    draft = load_drafter(cfg, target)
    prompts = eval_prompts(out / "data" / "eval.jsonl", tokenizer, cfg.validation.max_length, settings.max_prompts,
                           settings.sources)
    offline_sets = settings.sets if settings.sets_on == "offline" else []  # else the benchmark replays them
    suite_prompts = set_prompts(out / "data" / "eval.jsonl", tokenizer, cfg.validation.max_length, offline_sets)
    suite_keys = {prompt.key for prompt in suite_prompts}
    reference_keys = {prompt.key for prompt in prompts}
    suite_only = [prompt for prompt in suite_prompts if prompt.key not in reference_keys]
    eos = target.generation_config.eos_token_id if target.generation_config is not None else tokenizer.eos_token_id
    modes = decode_modes(cfg)
    decoders = {mode.name: speculative_decoder(target, draft, steps=mode.steps, topk=mode.topk,
                                               num_draft_tokens=mode.num_draft_tokens) for mode in modes}
    totals = {mode.name: ModeTotals(mode) for mode in modes}
    suites = ModeTotals(modes[0]) if offline_sets else None  # the chain, over every set's prompts
    baseline_tokens, baseline_seconds = 0, 0.0
    mismatches: list[dict[str, Any]] = []
    shared_prefixes: list[list[int]] = []  # per mismatch: the prompt and the tokens both outputs share
    with progress_bar("evaluate", len(prompts) * (1 + len(modes)) + len(suite_only)) as bar:
        for index, prompt in enumerate(prompts):
            started = time.perf_counter()
            generator = seeded(cfg.runtime.seed + index)
            expected = target_generate(target, prompt.input_ids, settings.max_new_tokens, settings.temperature, eos,
                                       generator)
            baseline_seconds += time.perf_counter() - started
            baseline_tokens += len(expected)
            advance(bar, 1)
            for mode in modes:
                started = time.perf_counter()
                tokens, stats = decoders[mode.name].generate(prompt.input_ids, settings.max_new_tokens,
                                                             settings.temperature, eos, seeded(cfg.runtime.seed + index))
                seconds = time.perf_counter() - started
                totals[mode.name].add(prompt, stats, seconds)
                if suites is not None and mode is modes[0] and prompt.key in suite_keys:
                    suites.add(prompt, stats, seconds)
                if settings.temperature == 0.0 and tokens != expected:
                    mismatches.append(mismatch(prompt, mode, expected, tokens))
                    shared_prefixes.append(prompt.input_ids + expected[:mismatches[-1]["position"]])
                advance(bar, 1)
        for index, prompt in enumerate(suite_only, start=len(prompts)):
            started = time.perf_counter()
            _, stats = decoders[modes[0].name].generate(prompt.input_ids, settings.max_new_tokens,
                                                        settings.temperature, eos, seeded(cfg.runtime.seed + index))
            suites.add(prompt, stats, time.perf_counter() - started)
            advance(bar, 1)
    target_rate = baseline_tokens / baseline_seconds if baseline_seconds else 0.0
    rule = greedy_rule(model_dtype(target), settings)
    mismatches = judged_mismatches(target, mismatches, shared_prefixes, rule)  # the stage's last use of the target
    failures = greedy_failures(mismatches, len(prompts) * len(modes), rule)
    report = AcceptanceReport(
        prompts=len(prompts), records=len({prompt.id for prompt in prompts}), temperature=settings.temperature,
        max_new_tokens=settings.max_new_tokens, drafter=str(out / "draft" / "sglang"),
        target={"generated_tokens": baseline_tokens, "tokens_per_second": target_rate},
        **{name: mode_totals.report(target_rate) for name, mode_totals in totals.items()},
        **({"suites": suites.report(target_rate)} if suites is not None else {}),
        greedy_equivalence="not checked (temperature > 0)" if settings.temperature else
                           ("passed" if not failures else "failed"),
        greedy_mismatches=mismatches,
        greedy_rule=None if settings.temperature else rule.summary(mismatches, len(prompts) * len(modes)),
    ).as_json()
    report_path = out / "evaluate" / "acceptance.json"
    write_json(report_path, report)
    plots = plot_acceptance(report, out / "evaluate")
    if failures:
        raise GreedyMismatch(f"{'; '.join(failures)}; see {report_path}")
    return EvaluationResult(report_path, report, plots)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mismatch(prompt: EvalPrompt, mode: DecodeMode, expected: list[int], actual: list[int]) -> dict[str, Any]:
    position = first_difference(expected, actual)
    return {"prompt": prompt.key, "mode": mode.name, "position": position,
            "expected": expected[position:position + 8], "actual": actual[position:position + 8]}


def judged_mismatches(target: Any, mismatches: list[dict[str, Any]], shared_prefixes: list[list[int]],
                      rule: GreedyRule) -> list[dict[str, Any]]:
    """Each mismatch with the target's float32 top-2 gap at its first differing token (after `shared_prefixes`) and
    whether that is a near-tie. A 16-bit target is upcast in place: call it after the last decode."""
    margins = TargetMargins(lambda: target)
    return [judged(row, margins.gap(ids), rule) for row, ids in zip(mismatches, shared_prefixes)]


def greedy_failures(mismatches: list[dict[str, Any]], compared: int, rule: GreedyRule) -> list[str]:
    """Why the greedy outputs fail `rule`: in float32 any mismatch, else those that are no near-tie or too many."""
    if not mismatches:
        return []
    if not rule.exact:
        return near_tie_failures(mismatches, compared, rule, describe_mismatch)
    listed = ", ".join(describe_mismatch(item) for item in mismatches[:10])
    return [f"speculative decoding changed {len(mismatches)} greedy output(s) computed in float32, where it must "
            f"change none: {listed}"]


def describe_mismatch(item: dict[str, Any]) -> str:
    return f"{item['prompt']} ({item['mode']}, first difference at token {item['position']})"


def plot_acceptance(report: dict[str, Any], directory: Path) -> list[Path]:
    """Acceptance rate by depth and the accepted-length histogram, one series per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [name for name in ("chain", "tree") if name in report]
    paths = []
    figure, axis = plt.subplots(figsize=(6, 3.5))
    for offset, name in enumerate(modes):
        rates = report[name]["acceptance_by_depth"]
        axis.bar([depth + 0.4 * offset - 0.2 for depth in range(1, len(rates) + 1)], rates, width=0.4, label=name)
    axis.set_xticks(range(1, max(len(report[name]["acceptance_by_depth"]) for name in modes) + 1))
    axis.set_xlabel("draft depth d")
    axis.set_ylabel("share of rounds accepting >= d")
    axis.set_ylim(0, 1)
    axis.legend()
    axis.set_title("Acceptance by depth (held-out prompts)")
    paths.append(save_figure(figure, directory / "acceptance_by_depth.png"))
    figure, axis = plt.subplots(figsize=(6, 3.5))
    for offset, name in enumerate(modes):
        histogram = report[name]["accept_length_histogram"]
        lengths = [int(length) for length in histogram]
        axis.bar([length + 0.4 * offset - 0.2 for length in lengths], list(histogram.values()), width=0.4,
                 label=f"{name} (mean {report[name]['mean_accept_length']:.2f})")
    axis.set_xticks([int(length) for length in report[modes[0]]["accept_length_histogram"]])
    axis.set_xlabel("accepted length per round (drafts + bonus)")
    axis.set_ylabel("rounds")
    axis.legend()
    paths.append(save_figure(figure, directory / "accept_length_histogram.png"))
    paths.append(plot_suites(report.get("suites") or report["chain"], directory / "acceptance_by_suite.png"))
    return paths
