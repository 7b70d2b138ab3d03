"""The benchmark's greedy comparison (text with the drafter against text without it) judged as the engines' dtype
allows: tasks/common/greedy_agreement.py's rule, applied to what a chat endpoint returns.

The engines return text, so a request whose two texts differ is re-tokenised with the target's tokenizer (both
texts; greedy text made of whole tokens tokenises back to the ids the engine generated), its chat request rendered as
the engine renders it (the chat template with the generation prompt and the run's template variables), and the
target's float32 top-2 gap read after the prompt and the tokens both texts share. The target is loaded here, in
float32, the first time a 16-bit comparison has a divergence to judge: the engines have stopped by then, and a
benchmark whose outputs all agree loads nothing. A float32 comparison is exact and loads nothing either.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from contract.chat_rendering import template_kwargs
from contract.config import RunConfig
from tasks.common.greedy_agreement import (FLOAT32_NAMES, GreedyRule, TargetMargins, first_difference, greedy_rule,
                                           judged, served_dtype)
from tasks.serving.client import ChatRequest


def engines_rule(cfg: RunConfig, commands: Sequence[Sequence[str]]) -> GreedyRule:
    """The rule for outputs of engines started with `commands` (baselines and drafted, every round): exact only
    when every one serves float32."""
    served = sorted({served_dtype(command) for command in commands})
    if served and all(dtype in FLOAT32_NAMES for dtype in served):
        return greedy_rule("float32", cfg.evaluation)
    return greedy_rule("/".join(served) or "auto", cfg.evaluation)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The token ids an engine prefills for a chat request: the rendered template, tokenised without extra specials
    (the template writes its own)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **template_kwargs(tokenizer))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class TextDivergences:
    """Judges requests whose greedy text differs with and without the drafter: first differing token, the target's
    float32 top-2 gap there, near-tie or not."""

    def __init__(self, cfg: RunConfig, requests: Sequence[ChatRequest], rule: GreedyRule) -> None:
        from tasks.common.target_info import load_target_model

        self.cfg = cfg
        self.rule = rule
        self.messages = {request.index: request.messages for request in requests}
        self._tokenizer: Optional[Any] = None
        self.margins = TargetMargins(lambda: load_target_model(cfg, cfg.output_path / "target", "float32"))

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from tasks.common.target_info import load_tokenizer

            self._tokenizer = load_tokenizer(self.cfg.output_path / "target", self.cfg.model)
        return self._tokenizer

    def judge(self, request_index: int, baseline_text: str, drafted_text: str) -> dict[str, Any]:
        """`token_position` (of the first differing token, re-tokenised), `margin` and `near_tie` of one request."""
        if request_index not in self.messages:
            raise KeyError(f"request {request_index} is not one of the {len(self.messages)} benchmark requests")
        tokenizer = self.tokenizer()
        plain = list(tokenizer(baseline_text, add_special_tokens=False)["input_ids"])
        drafted = list(tokenizer(drafted_text, add_special_tokens=False)["input_ids"])
        position = first_difference(plain, drafted)
        shared = chat_prompt_ids(tokenizer, self.messages[request_index]) + plain[:position]
        return judged({"token_position": position}, self.margins.gap(shared), self.rule)
