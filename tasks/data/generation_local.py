"""The local backend: the target itself, in-process, generating batches with left padding.

Batching is what makes this usable on CPU (see benchmarks/regenerate_batching.py): requests are sorted by
prompt length so a batch pads little, and each batch is one `generate` call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from contract.config import RegenerationConfig
from tasks.data.generation import GenerationReply, GenerationRequest


class LocalGenerator:
    backend = "local"
    streams_records = False

    def __init__(self, target_dir: Path, settings: RegenerationConfig, dtype: str = "float32",
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        from models.target_loading import load_target

        self.model, self.tokenizer = load_target(target_dir, dtype)
        self.template_kwargs = dict(template_kwargs or {})
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.settings = settings
        self.stop_ids = stop_token_ids(self.model, self.tokenizer)
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationReply]:
        prompts = {id(request): self.prompt_ids(request) for request in requests}
        ordered = sorted(requests, key=lambda request: len(prompts[id(request)]))
        replies: dict[int, GenerationReply] = {}
        size = self.settings.batch_size
        for start in range(0, len(ordered), size):
            batch = ordered[start:start + size]
            for request, reply in zip(batch, self.generate_batch(batch, [prompts[id(r)] for r in batch])):
                replies[id(request)] = reply
        return [replies[id(request)] for request in requests]

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, **self.template_kwargs)
        return list(encoded["input_ids"])

    def generate_batch(self, batch: list[GenerationRequest], prompts: list[list[int]]) -> list[GenerationReply]:
        limit = self.max_positions - self.settings.max_new_tokens if self.max_positions else None
        too_long = [limit is not None and len(ids) > limit for ids in prompts]
        runnable = [ids for ids, skip in zip(prompts, too_long) if not skip]
        outputs = iter(self.run_generate(runnable, batch[0].seed) if runnable else [])
        replies = []
        for request, ids, skip in zip(batch, prompts, too_long):
            if skip:
                reason = f"prompt of {len(ids)} tokens leaves no room for {self.settings.max_new_tokens} new tokens"
                replies.append(GenerationReply(request.record_id, request.turn, error=reason))
            else:
                replies.append(self.reply_for(request, next(outputs)))
        return replies

    def run_generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """Left-pad, generate, and return only the new tokens of each row."""
        padded = self.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
        sampling = self.settings.temperature > 0
        options = {"do_sample": sampling}
        if sampling:
            torch.manual_seed(seed)
            options.update(temperature=self.settings.temperature, top_p=self.settings.top_p)
        with torch.no_grad():
            output = self.model.generate(
                input_ids=padded["input_ids"],
                attention_mask=padded["attention_mask"],
                max_new_tokens=self.settings.max_new_tokens,
                eos_token_id=sorted(self.stop_ids),
                pad_token_id=self.tokenizer.pad_token_id,
                **options,
            )
        width = padded["input_ids"].shape[1]
        return [row[width:].tolist() for row in output]

    def reply_for(self, request: GenerationRequest, new_tokens: list[int]) -> GenerationReply:
        """Cut at the first stop token; 'stop' when one was produced, else 'length'."""
        stop_at = next((index for index, token in enumerate(new_tokens) if token in self.stop_ids), None)
        kept = new_tokens if stop_at is None else new_tokens[:stop_at]
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        finish = "stop" if stop_at is not None else "length"
        return GenerationReply(request.record_id, request.turn, text=text, finish_reason=finish,
                               completion_tokens=len(kept) + (stop_at is not None))

    def close(self) -> None:
        del self.model


def stop_token_ids(model, tokenizer) -> set[int]:
    """The target's own end-of-turn ids: its eos plus what its generation config stops on."""
    stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        stops.add(configured)
    elif configured:
        stops.update(configured)
    if not stops:
        raise ValueError("the target defines no eos token: cannot tell where an assistant turn ends")
    return stops
