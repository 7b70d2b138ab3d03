"""The roofline report (tasks/common/roofline.py): the FLOP model against a hand count and against the real modules'
weights, rows from stage summaries, the table, the plot and the peak measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.config import RunConfig
from tasks.common.roofline import (RooflineUnavailable, TargetShape, format_roofline, measure_matmul_peak,
                                   plot_roofline, roofline_rows, stage_flops_per_token, write_roofline)

#: A tiny HF Llama config.json: H 8, MLP 16, 2 layers, 2 query heads and 1 kv head (head_dim absent: 8 / 2 = 4), V 40.
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 40,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "tie_word_embeddings": False}
PEAKS = {"fp32": 100.0, "bf16": 400.0}


def run_with_target(tmp_path: Path, **sections: dict) -> RunConfig:
    """A run config whose output_dir holds the tiny target's config.json (draft vocab 10, TTT length 3)."""
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(TINY_LLAMA))
    return RunConfig.model_validate({"output_dir": str(tmp_path), "capture": {"draft_vocab_size": 10},
                                     "training": {"ttt_length": 3}, **sections})


def test_the_flops_per_token_equal_a_hand_count(tmp_path: Path) -> None:
    cfg = run_with_target(tmp_path)
    target_layer = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 16      # q, k, v, o, gate/up/down: 576 weights
    target_layers = 2 * 2 * target_layer                            # 2 FLOPs per weight, 2 layers
    lm_head = 2 * 8 * 40
    draft_layer = 16 * 8 + 16 * 4 + 16 * 4 + 8 * 8 + 3 * 8 * 16      # q, k, v read [embedding, hidden]: 2H = 16
    draft_step = 2 * draft_layer + 2 * 8 * 10                        # the layer and the draft lm_head (Vd 10)
    fc = 2 * 3 * 8 * 8
    flops = stage_flops_per_token(TargetShape.from_config(TINY_LLAMA), cfg)
    assert flops == {"regenerate": target_layers + lm_head, "capture": target_layers,
                     "train": lm_head + 3 * (fc + 3 * draft_step)}
    assert flops == {"regenerate": 2944, "capture": 2304, "train": 15904}


def test_compact_capture_moves_the_teacher_from_train_to_capture_and_online_training_adds_the_target(
        tmp_path: Path) -> None:
    shape = TargetShape.from_config(TINY_LLAMA)
    compact = stage_flops_per_token(shape, run_with_target(tmp_path, capture={"draft_vocab_size": 10,
                                                                              "mode": "compact"}))
    assert compact["capture"] == 2304 + 640 and compact["train"] == 15904 - 640
    online = stage_flops_per_token(shape, RunConfig.model_validate({"output_dir": str(tmp_path), "capture": {
        "draft_vocab_size": 10}, "training": {"ttt_length": 3, "mode": "online"}}))
    assert online["train"] == 15904 + 2304


def test_offline_training_settles_the_teacher_once_so_its_pass_is_spread_over_the_epochs(tmp_path: Path) -> None:
    shape = TargetShape.from_config(TINY_LLAMA)
    four_epochs = stage_flops_per_token(shape, run_with_target(tmp_path, training={"ttt_length": 3, "epochs": 4}))
    assert four_epochs["train"] == 15904 - 640 + 160, "the 640-FLOP teacher pass once per record, in 4 epochs"
    online = RunConfig.model_validate({"output_dir": str(tmp_path), "capture": {"draft_vocab_size": 10},
                                       "training": {"ttt_length": 3, "epochs": 4, "mode": "online"}})
    assert stage_flops_per_token(shape, online)["train"] == 15904 + 2304, "online: the teacher every time"


def test_the_teacher_and_the_draft_head_count_at_the_supervised_share_the_train_summary_measures(
        tmp_path: Path) -> None:
    """Both run at supervised rows only (tasks/features/batches.taught_rows, models/ttt.py): at half the tokens
    supervised, half their FLOPs; the train stage's `supervised_share` sets the train row's FLOPs."""
    cfg = run_with_target(tmp_path)
    half = stage_flops_per_token(TargetShape.from_config(TINY_LLAMA), cfg, supervised_share=0.5)
    fc, draft_layer, draft_head, teacher = 2 * 3 * 8 * 8, 2 * 704, 2 * 8 * 10, 2 * 8 * 40
    assert half["train"] == teacher // 2 + 3 * (fc + 3 * (draft_layer + draft_head // 2)) == 14864
    assert half["capture"] == 2304 and half["regenerate"] == 2944, "the target's stages are not scaled"
    rows = roofline_rows(tmp_path, cfg, {"train": {"tokens_per_second": 1e6, "supervised_share": 0.5}}, PEAKS)
    assert rows[0]["flops_per_token"] == 14864 and rows[0]["achieved_gflops"] == pytest.approx(14.864)


def test_bf16_is_a_peak_to_read_against_only_where_the_cpu_has_bf16_units() -> None:
    from tasks.common.roofline import native_peaks

    assert native_peaks(PEAKS, native_bf16_matmul=True) == PEAKS
    assert native_peaks({"fp32": 128.2, "bf16": 14.6}, native_bf16_matmul=False) == {"fp32": 128.2}


def test_the_flop_model_counts_the_weights_the_real_modules_hold() -> None:
    """2 FLOPs per weight of every Linear: the target's layers and lm_head, and the draft (one TTT step, x3 for
    forward and backward) as models/eagle3.py builds it from the target."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.eagle3 import Eagle3Config, Eagle3Draft

    def linear_weights(module: torch.nn.Module) -> int:
        return sum(layer.weight.numel() for layer in module.modules() if isinstance(layer, torch.nn.Linear))

    shape = TargetShape.from_config(TINY_LLAMA)
    config = LlamaConfig(**TINY_LLAMA)
    draft = Eagle3Draft(Eagle3Config.from_target(config, draft_vocab_size=10, aux_layer_ids=[0, 0, 1]))
    flops = stage_flops_per_token(shape, RunConfig.model_validate({"capture": {"draft_vocab_size": 10},
                                                                   "training": {"ttt_length": 1}}))
    assert flops["regenerate"] == 2 * linear_weights(LlamaForCausalLM(config))
    assert flops["train"] == 2 * 8 * 40 + 3 * 2 * linear_weights(draft)


def test_rows_come_from_the_summaries_and_skip_stages_without_a_rate(tmp_path: Path) -> None:
    cfg = run_with_target(tmp_path)
    summaries = {"ingest": {"ok": 3.0}, "regenerate": {"ok": 3.0, "tokens_per_second": 1e6},
                 "capture": {"ok": 3.0, "capture_tokens_per_second": 0.0}, "train": {"tokens_per_second": 2e6}}
    rows = roofline_rows(tmp_path, cfg, summaries, PEAKS)
    assert [row["stage"] for row in rows] == ["regenerate", "train"], "capture computed nothing; ingest has no rate"
    regenerate, train = rows
    assert regenerate["flops_per_token"] == 2944 and regenerate["achieved_gflops"] == pytest.approx(2.944)
    assert regenerate["share_of_peak"] == pytest.approx({"fp32": 0.02944, "bf16": 0.00736})
    assert train["tokens_per_second"] == 2e6 and train["achieved_gflops"] == pytest.approx(2e6 * 15904 / 1e9)
    assert roofline_rows(tmp_path / "nowhere", cfg, {"ingest": {"ok": 3.0}}, PEAKS) == [], "nothing to read"


def test_the_table_names_the_host_and_the_peaks_then_one_line_per_stage(tmp_path: Path) -> None:
    cfg = run_with_target(tmp_path)
    rows = roofline_rows(tmp_path, cfg, {"capture": {"capture_tokens_per_second": 5e5}}, PEAKS)
    lines = format_roofline(rows, PEAKS, "Test CPU; flags avx2").splitlines()
    assert lines[0].startswith("roofline on Test CPU; flags avx2;")
    assert "fp32 100.0" in lines[0] and "bf16 400.0" in lines[0]
    assert "% fp32 peak" in lines[1] and "% bf16 peak" in lines[1]
    assert len(lines) == 3 and lines[2].split() == ["capture", "500,000.0", "0.0", "1.2", "1.2%", "0.3%"]


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    cfg = run_with_target(tmp_path)
    rows = roofline_rows(tmp_path, cfg, {"regenerate": {"tokens_per_second": 1e6}, "train": {"tokens_per_second": 2e6}},
                         PEAKS)
    path = plot_roofline(rows, PEAKS, tmp_path / "roofline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_a_rate_or_a_target_says_why_before_measuring(tmp_path: Path) -> None:
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path)})
    with pytest.raises(RooflineUnavailable, match="no compute stage"):
        write_roofline(cfg, {"ingest": {"ok": 3.0}})
    with pytest.raises(RooflineUnavailable, match="config.json is missing"):
        write_roofline(cfg, {"train": {"tokens_per_second": 10.0}})
    assert list(tmp_path.iterdir()) == [], "nothing written"


def test_the_matmul_peak_is_a_positive_rate() -> None:
    import torch

    assert measure_matmul_peak(torch.float32, m=16, k=8, n=32, seconds=0.05) > 0


def test_a_routed_expert_target_counts_the_experts_a_token_passes_through() -> None:
    """Qwen3-MoE: 2 experts per token of width 6 are an MLP of width 12, not the config's dense intermediate_size."""
    moe = {**TINY_LLAMA, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "intermediate_size": 99,
           "moe_intermediate_size": 6, "num_experts_per_tok": 2, "num_experts": 8}
    assert TargetShape.from_config(moe).intermediate_size == 12
    assert TargetShape.from_config(TINY_LLAMA).intermediate_size == 16
