"""A tiny random Llama target with a ChatML tokenizer trained in-process: the stand-in for a real target.

Built in seconds, downloads nothing, and shaped like SmolLM2 (ChatML template, `<|im_end|>` as eos).
"""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello, how are you today? I am fine, thank you.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a Python function that adds two numbers: def add(a, b): return a + b",
    "Tell me a story about a small bird that learns to fly over the sea.",
    "The quick brown fox jumps over the lazy dog 0123456789.",
    "user assistant system",
]


def build_tokenizer():
    """A byte-level BPE tokenizer with ChatML specials (ids 0, 1, 2) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_target(directory: Path, num_layers: int = 6, hidden_size: int = 64, seed: int = 0) -> Path:
    """Save a random LlamaForCausalLM and its tokenizer as an HF directory; returns `directory`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=2,  # head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... (not 16)
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


#: A reasoning template in the manner of Qwen3's: the turns after the last user message show their reasoning in
#: think tags (from `reasoning_content`, or split off a content that carries it); earlier assistant turns show only
#: their answer; `enable_thinking=false` pre-fills an empty think block in the generation prompt.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set content = message['content'] -%}{%- set reasoning = '' -%}"
    "{%- if message.reasoning_content is string -%}{%- set reasoning = message.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{ '<|im_start|>assistant\n<think>' + reasoning + '</think>' + content + '<|im_end|>\n' }}"
    "{%- else -%}{{ '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}{%- endif -%}"
    "{%- else -%}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think></think>' }}{%- endif -%}"
    "{%- endif -%}"
)
THINK_TOKENS = ["<think>", "</think>"]


def build_thinking_target(directory: Path, seed: int = 0) -> Path:
    """The tiny target with the reasoning template and `<think>`/`</think>` as tokens of their own."""
    import torch
    from transformers import AutoModelForCausalLM

    build_tiny_target(directory, seed=seed)
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(THINK_TOKENS)
    tokenizer.chat_template = THINKING_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    torch.manual_seed(seed)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
