"""Loading target models with transformers, including the dequantisation of a GGUF file.

transformers can read a GGUF checkpoint but refuses to `save_pretrained` the quantized object, so the
weights are copied into a fresh `*ForCausalLM` built from the same config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def dequantise_gguf(directory: Path, gguf_file: str) -> tuple[Any, Any]:
    """Return (fp32 model, tokenizer) read from a GGUF file; the model is a plain HF model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict())
    model.tie_weights()
    model.eval()
    return model, tokenizer


def load_target(directory: Path, dtype: str = "float32", trust_remote_code: bool = False) -> tuple[Any, Any]:
    """Load a materialised target directory (safetensors only) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        directory,
        dtype=getattr(torch, dtype),
        use_safetensors=True,
        trust_remote_code=trust_remote_code,
    )
    model.eval()
    return model, tokenizer
