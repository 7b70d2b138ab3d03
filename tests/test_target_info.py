"""target.json as the stages after `target` read it (tasks/common/target_info.py): every field it pins is required."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.common.target_info import read_target_info

TARGET_JSON = {
    "id": "HuggingFaceTB/SmolLM2-135M-Instruct", "source": "hub", "revision": "0" * 64, "converter_version": "1",
    "architecture": "LlamaForCausalLM", "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
    "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "eos_token": "<|im_end|>",
    "tokenizer_hash": "1" * 64, "chat_template_hash": None, "files": ["config.json", "model.safetensors"],
}


def test_a_target_json_without_model_type_is_refused_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "target.json").write_text(json.dumps(TARGET_JSON))
    assert read_target_info(tmp_path).model_type == "llama"
    (tmp_path / "target.json").write_text(json.dumps({k: v for k, v in TARGET_JSON.items() if k != "model_type"}))
    with pytest.raises(ValueError, match=r"target\.json: not a target\.json this eaglet reads \(model_type: Field "
                                         r"required\); rerun the target stage"):
        read_target_info(tmp_path)
