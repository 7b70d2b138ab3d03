"""How far from the machine each compute stage ran: its tokens/s times the FLOPs a token costs, against the matmul
rate this host reaches in each dtype.

A stage's tokens/s alone says little (180 tokens/s is fast for one target and slow for another); as a share of
what the host's matmul reaches it says how much of the machine the stage used, so whether a faster kernel, a
better dtype or a better schedule is what to look for. The peaks are measured here, never assumed: bf16 runs
~10x fp32 on CPUs with AMX and slower than fp32 on AVX2-only ones (tasks/common/host_compute.py).

FLOPs are counted for the weight matmuls only (2 per weight per token). Attention scores, softmax, norms, RoPE and
sampling are left out: they grow with the context and are small beside the weights at these lengths, so a share
of peak is a slight lower bound. The peaks are this host's CPU: a stage that ran on an accelerator or on a remote
server reads against the wrong machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from contract.config import RunConfig
from models.target_families import family_of
from tasks.common.artifacts import read_json, save_figure, write_json
from tasks.common.host_compute import host_compute

#: The dtypes whose matmul peak each stage is compared with, by the names the table prints.
PEAK_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: The compute stages and the key of their summary that holds the tokens/s they ran at.
RATE_KEYS: dict[str, str] = {"regenerate": "tokens_per_second", "capture": "capture_tokens_per_second",
                             "train": "tokens_per_second"}
#: The matmul the peaks are measured on: 1,024 tokens through a SmolLM2-wide (576) layer of 8,192 outputs.
PEAK_SHAPE = {"m": 1024, "k": 576, "n": 8192}
JSON_NAME = "roofline.json"
PNG_NAME = "roofline.png"


class RooflineUnavailable(RuntimeError):
    """The roofline cannot be computed for this run; the message says why."""


@dataclass(frozen=True)
class TargetShape:
    """The sizes of the target's config.json that the weight matmuls depend on."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "TargetShape":
        """From an HF config.json (a multimodal one's `text_config`); head_dim defaults to hidden / heads. The MLP
        width is what one token passes through, as the family table says (a routed-expert target: its active
        experts), which is also the draft's MLP width."""
        text = config.get("text_config") or config
        heads = text["num_attention_heads"]
        mlp_width = family_of(config.get("model_type")).draft_intermediate_size(SimpleNamespace(**text))
        return cls(hidden_size=text["hidden_size"], intermediate_size=mlp_width,
                   num_hidden_layers=text["num_hidden_layers"], num_attention_heads=heads,
                   num_key_value_heads=text.get("num_key_value_heads") or heads,
                   head_dim=text.get("head_dim") or text["hidden_size"] // heads, vocab_size=text["vocab_size"])


def read_target_shape(output_dir: Path) -> TargetShape:
    """The run's materialised target's shape, or RooflineUnavailable naming the missing file."""
    path = output_dir / "target" / "config.json"
    if not path.is_file():
        raise RooflineUnavailable(f"{path} is missing (the target stage has not run)")
    return TargetShape.from_config(read_json(path))


def decoder_layer_weights(shape: TargetShape, input_width: int) -> int:
    """Weights of one decoder layer's q, k, v (reading `input_width`), o and gate/up/down MLP matrices."""
    query_width = shape.num_attention_heads * shape.head_dim
    key_value_width = shape.num_key_value_heads * shape.head_dim
    attention = input_width * (query_width + 2 * key_value_width) + query_width * shape.hidden_size
    mlp = 3 * shape.hidden_size * shape.intermediate_size
    return attention + mlp


def target_forward_flops(shape: TargetShape, with_lm_head: bool) -> int:
    """One token through every decoder layer of the target, and its full-vocabulary lm_head when asked."""
    layers = 2 * shape.num_hidden_layers * decoder_layer_weights(shape, shape.hidden_size)
    lm_head = 2 * shape.hidden_size * shape.vocab_size if with_lm_head else 0
    return layers + lm_head


def draft_training_flops(shape: TargetShape, draft_vocab_size: int, ttt_length: int,
                         supervised_share: float = 1.0) -> int:
    """One token's draft forward and backward (backward = 2 x forward): fc (3H -> H) once, then per TTT step the
    draft's decoder layer, whose q, k, v read [embedding, hidden] (2H), and its lm_head over the draft vocab, which
    runs at supervised positions only (models/ttt.py): on `supervised_share` of the tokens."""
    fc = 2 * 3 * shape.hidden_size * shape.hidden_size
    layer = 2 * decoder_layer_weights(shape, 2 * shape.hidden_size)
    lm_head = supervised_share * 2 * shape.hidden_size * draft_vocab_size
    return round(3 * (fc + ttt_length * (layer + lm_head)))


def stage_flops_per_token(shape: TargetShape, cfg: RunConfig, supervised_share: float = 1.0) -> dict[str, int]:
    """FLOPs per token of each compute stage. Regenerate samples, so it adds the lm_head (its rate counts the
    generated tokens: the prompts' prefill is left out); capture stores states only, unless compact mode computes
    the teacher's top-K there. Train computes the full-vocabulary teacher from lossless states (offline once per
    record, in its first epoch: the trainer keeps what it settled, so per trained token it is 1/epochs of a pass),
    and online it also runs the target's forward that capture would have, every time. The teacher and the draft's
    lm_head run at the supervised rows only (tasks/features/batches.taught_rows): `supervised_share` of the tokens
    (the train stage's summary measures it)."""
    compact = cfg.capture.mode == "compact"
    capture = target_forward_flops(shape, with_lm_head=compact)
    teacher_passes = 1.0 if cfg.training.mode == "online" else 1.0 / cfg.training.epochs
    teacher = 0 if compact else round(supervised_share * teacher_passes * 2 * shape.hidden_size * shape.vocab_size)
    draft_vocab_size = cfg.capture.draft_vocab_size or shape.vocab_size
    train = teacher + draft_training_flops(shape, draft_vocab_size, cfg.training.ttt_length, supervised_share)
    if cfg.training.mode == "online":
        train += capture
    return {"regenerate": target_forward_flops(shape, with_lm_head=True), "capture": capture, "train": train}


def measure_matmul_peak(dtype: torch.dtype, m: int = 1024, k: int = 576, n: int = 8192,
                        seconds: float = 0.5) -> float:
    """GFLOP/s of `a @ b.T` ([m, k] x [n, k]) on the CPU in `dtype`: one warm-up, then repeats until `seconds`
    have passed, and the best repeat's rate (the least disturbed by anything else on the host)."""
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(m, k, generator=generator).to(dtype)
    right = torch.randn(n, k, generator=generator).to(dtype)
    with torch.no_grad():
        torch.matmul(left, right.T)  # the warm-up: oneDNN picks and caches its kernel on the first call
        best = float("inf")
        started = time.perf_counter()
        while True:
            before = time.perf_counter()
            torch.matmul(left, right.T)
            after = time.perf_counter()
            best = min(best, after - before)
            if after - started >= seconds:
                break
    return 2 * m * k * n / best / 1e9


def measure_peaks(seconds: float = 0.5) -> dict[str, float]:
    """The matmul peak of every dtype in PEAK_DTYPES, at PEAK_SHAPE."""
    return {name: measure_matmul_peak(dtype, seconds=seconds, **PEAK_SHAPE) for name, dtype in PEAK_DTYPES.items()}


def native_peaks(peaks: dict[str, float], native_bf16_matmul: bool) -> dict[str, float]:
    """The peaks a stage is read against: bf16's only where the CPU computes it natively (elsewhere bf16 is
    converted in software, far below fp32, and no stage runs in it: a share of it would read as several hundred %)."""
    return {dtype: peak for dtype, peak in peaks.items() if dtype != "bf16" or native_bf16_matmul}


def stage_rates(summaries: dict[str, dict[str, float]]) -> dict[str, float]:
    """tokens/s of each compute stage whose summary has a rate (a stage that computed nothing reports 0)."""
    rates = {}
    for stage, key in RATE_KEYS.items():
        rate = summaries.get(stage, {}).get(key, 0.0)
        if rate > 0:
            rates[stage] = float(rate)
    return rates


def roofline_rows(output_dir: Path, cfg: RunConfig, summaries: dict[str, dict[str, float]],
                  peaks: dict[str, float]) -> list[dict[str, Any]]:
    """One row per compute stage with a measured rate: tokens/s, FLOPs per token, achieved GFLOP/s and its share
    of each dtype's peak. A stage missing from `summaries` or without a rate has no row."""
    rates = stage_rates(summaries)
    if not rates:
        return []
    share = summaries.get("train", {}).get("supervised_share", 1.0)
    flops = stage_flops_per_token(read_target_shape(output_dir), cfg, supervised_share=share)
    rows = []
    for stage, tokens_per_second in rates.items():
        achieved = tokens_per_second * flops[stage] / 1e9
        rows.append({"stage": stage, "tokens_per_second": tokens_per_second, "flops_per_token": flops[stage],
                     "achieved_gflops": achieved,
                     "share_of_peak": {dtype: achieved / peak for dtype, peak in peaks.items()}})
    return rows


def format_roofline(rows: list[dict[str, Any]], peaks: dict[str, float], host_line: str) -> str:
    """A plain-text table; its first line names the host and the measured peaks it is read against."""
    peak_text = ", ".join(f"{dtype} {peak:,.1f}" for dtype, peak in peaks.items())
    lines = [f"roofline on {host_line}; matmul peak GFLOP/s: {peak_text}",
             f"{'stage':<12}{'tokens/s':>12}{'MFLOP/token':>14}{'GFLOP/s':>10}"
             + "".join(f"{'% ' + dtype + ' peak':>14}" for dtype in peaks)]
    for row in rows:
        shares = "".join(f"{100 * row['share_of_peak'][dtype]:>13.1f}%" for dtype in peaks)
        lines.append(f"{row['stage']:<12}{row['tokens_per_second']:>12,.1f}{row['flops_per_token'] / 1e6:>14,.1f}"
                     f"{row['achieved_gflops']:>10,.1f}{shares}")
    return "\n".join(lines)


def plot_roofline(rows: list[dict[str, Any]], peaks: dict[str, float], path: Path) -> Path:
    """Achieved GFLOP/s per stage as bars, each dtype's peak as a line (log scale: peaks differ ~10x by dtype)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    achieved = [row["achieved_gflops"] for row in rows]
    bars = axis.bar([row["stage"] for row in rows], achieved, color="tab:blue")
    axis.bar_label(bars, labels=[f"{value:,.1f}" for value in achieved])
    for (dtype, peak), style in zip(peaks.items(), ("--", ":", "-.")):
        axis.axhline(peak, linestyle=style, color="black", label=f"{dtype} matmul peak {peak:,.0f} GFLOP/s")
    axis.set(yscale="log", ylabel="GFLOP/s (weight matmuls)",
             title="achieved GFLOP/s per stage against the host's peaks")
    axis.set_ylim(bottom=min(achieved + list(peaks.values())) / 10)  # a decade of bar below the smallest value
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(peaks), fontsize="small")
    axis.grid(axis="y", alpha=0.3)
    return save_figure(figure, path)


@dataclass(frozen=True)
class Roofline:
    """A run's roofline as written: the printed table and the files that hold it."""

    table: str
    json_path: Path
    png_path: Path


def write_roofline(cfg: RunConfig, summaries: dict[str, dict[str, float]]) -> Roofline:
    """Measure the peaks, compute the rows of `summaries`, write `<output_dir>/roofline.json` and `roofline.png`.
    Raises RooflineUnavailable, before spending a second on the peaks, when there is nothing to compare."""
    if not stage_rates(summaries):
        raise RooflineUnavailable(f"no compute stage ({', '.join(RATE_KEYS)}) measured a rate in this run")
    read_target_shape(cfg.output_path)  # a missing target fails here, not after the measurement
    host = host_compute()
    peaks = native_peaks(measure_peaks(), host.native_bf16_matmul)
    rows = roofline_rows(cfg.output_path, cfg, summaries, peaks)
    json_path = cfg.output_path / JSON_NAME
    write_json(json_path, {"host": host.as_record(), "peak_gflops": peaks, "peak_matmul_shape": PEAK_SHAPE,
                           "rows": rows})
    png_path = plot_roofline(rows, peaks, cfg.output_path / PNG_NAME)
    return Roofline(format_roofline(rows, peaks, host.describe()), json_path, png_path)
