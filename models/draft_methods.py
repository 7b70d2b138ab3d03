"""Which draft model each `draft.method` builds, and the one training objective call every method answers.

EAGLE3, EAGLE 3.1 and P-EAGLE are one architecture with flags (models/eagle3.py METHOD_FLAGS) trained by the
training-time test (models/ttt.py); DFlash is its own model (models/dflash.py) trained on anchor blocks
(models/dflash_objective.py). Both objectives return the same TTTOutput (a loss, and per drafted position its loss
and accuracy), so the trainer, its metrics and its evaluation read every method alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

import torch

from models.dflash import DFlashConfig, DFlashDraft
from models.dflash_objective import dflash_forward, sample_anchors
from models.eagle3 import METHOD_FLAGS, Eagle3Config, Eagle3Draft
from models.ttt import TTTBatch, TTTOutput, step_loss, ttt_forward

DraftModel = Union[Eagle3Draft, DFlashDraft]
#: every draft method, EAGLE3's flag sets and DFlash
METHODS = (*METHOD_FLAGS, "dflash")
#: the methods that draft a round's tokens after the first from a mask token
MASKED_METHODS = tuple(method for method, flags in METHOD_FLAGS.items() if flags["parallel_drafting"]) + ("dflash",)
#: the evaluation's fixed anchor draw (training draws from torch's global generator)
EVALUATION_ANCHOR_SEED = 0


def method_config(base: Eagle3Config, method: str, num_layers: int = 1, block_size: int = 4,
                  anchors: int = 512) -> Eagle3Config:
    """The draft config of `method` from the target-derived EAGLE3 config."""
    if method == "dflash":
        return DFlashConfig(**dataclasses.asdict(base), num_layers=num_layers, block_size=block_size, anchors=anchors)
    return base.for_method(method)


def new_draft(config: Eagle3Config) -> DraftModel:
    return DFlashDraft(config) if isinstance(config, DFlashConfig) else Eagle3Draft(config)


def draft_objective(draft: DraftModel, batch: TTTBatch, steps: int, *, normaliser: Optional[int] = None,
                    attention_backend: str = "sdpa", expected_acceptance: bool = True,
                    loss_fn: Callable[..., Any] = step_loss, evaluation: bool = False) -> TTTOutput:
    """The method's training objective on one batch: the TTT over `steps` draft steps, or DFlash's anchor blocks
    (drawn from torch's global generator in training, from a fixed seed in `evaluation`)."""
    if isinstance(draft, DFlashDraft):
        generator = torch.Generator().manual_seed(EVALUATION_ANCHOR_SEED) if evaluation else None
        anchors, keep = sample_anchors(batch.loss_mask, draft.config.anchors, generator)
        return dflash_forward(draft, batch, anchors, keep, normaliser=normaliser,
                              expected_acceptance=expected_acceptance, loss_fn=loss_fn)
    return ttt_forward(draft, batch, steps, normaliser=normaliser, attention_backend=attention_backend,
                       expected_acceptance=expected_acceptance, loss_fn=loss_fn)


def speculative_decoder(target: Any, draft: DraftModel, **settings: Any) -> Any:
    """The reference speculative decoder for a draft of any method (settings: SpeculativeDecoder's)."""
    from models.dflash_decoder import DFlashDecoder
    from models.speculative import SpeculativeDecoder

    if isinstance(draft, DFlashDraft):
        if settings.get("topk", 1) != 1:
            raise ValueError("a DFlash draft drafts a chain: topk must be 1")
        return DFlashDecoder(target, draft, **settings)
    return SpeculativeDecoder(target, draft, **settings)
