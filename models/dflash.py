"""The DFlash draft model: Qwen3-style layers that draft a whole block of tokens in one non-causal pass.

A round drafts k tokens from a block [x_a, MASK, ..., MASK] (k + 1 slots, positions a..a+k), where x_a is the token
the target has just chosen and the target's fused states of every committed position before it are the context:

    c = hidden_norm(fc(aux))                           # once per context position, shared by all layers
    per layer (pre-norm, as Qwen3):
        h' = input_layernorm(h)
        q = q_norm(q_proj(h'))                         # block slots only
        k = k_norm([k_proj(c); k_proj(h')])            # context first, then the block: the context is extra keys
        v = [v_proj(c); v_proj(h')]                    #   and values in every layer, never a residual stream
        h = h + o_proj(attn(rope(q), rope(k), v))      # a slot sees the whole context and its whole block
        h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                          # slot j >= 1 guesses x_{a+j} (draft vocab, then d2t)

The embedding is the target's, frozen and never exported (as for EAGLE3). Unlike SpecForge's DFlash, whose head is
the target's frozen full-vocabulary lm_head, eaglet's head covers the draft vocabulary and trains (started from the
target's rows), so the teacher, the d2t/t2d mapping and the export stay those of EAGLE3 (vLLM reads d2t for dflash).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from models.eagle3 import DraftMLP, Eagle3Config, RMSNorm, rope_attention_scaling, rope_inverse_frequencies, rotate


@dataclass
class DFlashConfig(Eagle3Config):
    """The EAGLE3 draft's target-derived fields plus DFlash's own: its depth, its training block and mask token."""

    num_layers: int = 1
    block_size: int = 4  # slots per training block: the anchor token and block_size - 1 masked guesses
    anchors: int = 512  # training blocks per record at most

    @property
    def method(self) -> str:
        return "dflash"


class DFlashAttention(nn.Module):
    """Qwen3 attention with q/k norms; its keys and values are the context's, then the block's."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def split_heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, heads, self.head_dim).transpose(1, 2)


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)
        self.dropout = nn.Dropout(0.0)


@dataclass
class LayerContext:
    """One layer's context keys (normed, rotated) and values [B, kv_heads, S, head_dim]."""

    keys: torch.Tensor
    values: torch.Tensor


class DFlashDraft(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        if config.mask_token_id is None:
            raise ValueError("a DFlash draft needs its mask_token_id (draft.mask_token_id or the tokenizer's)")
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.rope_scale = rope_attention_scaling(config)
        self.embed_tokens: Optional[nn.Embedding] = None

    # The target-facing helpers EAGLE3's trainer, decoder and export call, with the same meaning.
    def attach_embedding(self, weight: torch.Tensor) -> None:
        """Inject the target's token embedding, frozen; it is never saved with the draft."""
        embedding = nn.Embedding.from_pretrained(weight.detach().clone(), freeze=True)
        object.__setattr__(self, "embed_tokens", embedding)

    def initialise_from_target(self, lm_head_weight: torch.Tensor, final_norm_weight: torch.Tensor) -> None:
        """lm_head from the target's rows of the draft vocabulary, norm from the target's final norm."""
        used = torch.arange(self.config.draft_vocab_size) + self.d2t.cpu()
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight[used].to(self.lm_head.weight.dtype))
            self.norm.weight.copy_(final_norm_weight.to(self.norm.weight.dtype))

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    def set_dropout(self, probability: float) -> None:
        """Residual dropout of every layer, in train mode only."""
        for layer in self.layers:
            layer.dropout.p = probability

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise RuntimeError("attach the target's embedding (attach_embedding) before running the draft")
        return self.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    # DFlash's own forward.
    def context(self, aux: torch.Tensor, positions: torch.Tensor) -> list[LayerContext]:
        """Every layer's keys and values of context positions: aux [B, S, 3H] at integer positions [B, S]."""
        fused = self.hidden_norm(self.fc(aux))
        result = []
        for layer in self.layers:
            attention = layer.self_attn
            keys = attention.k_norm(attention.split_heads(attention.k_proj(fused), attention.kv_heads))
            values = attention.split_heads(attention.v_proj(fused), attention.kv_heads)
            result.append(LayerContext(rotate(keys, positions, self.inv_freq, self.rope_scale), values))
        return result

    def block_forward(self, ids: torch.Tensor, positions: torch.Tensor, context: list[LayerContext],
                      visible: torch.Tensor) -> torch.Tensor:
        """The last layer's output of block slots ids [B, Q] at positions [B, Q]; `visible` [B, Q, S + Q] (bool)
        says which context keys and which block slots each slot attends to."""
        hidden = self.embed(ids)
        mask = visible[:, None]
        for layer, layer_context in zip(self.layers, context):
            attention = layer.self_attn
            normed = layer.input_layernorm(hidden)
            queries = attention.q_norm(attention.split_heads(attention.q_proj(normed), attention.heads))
            keys = attention.k_norm(attention.split_heads(attention.k_proj(normed), attention.kv_heads))
            values = attention.split_heads(attention.v_proj(normed), attention.kv_heads)
            queries = rotate(queries, positions, self.inv_freq, self.rope_scale)
            keys = torch.cat([layer_context.keys, rotate(keys, positions, self.inv_freq, self.rope_scale)], dim=2)
            values = torch.cat([layer_context.values, values], dim=2)
            groups = attention.heads // attention.kv_heads
            attended = F.scaled_dot_product_attention(queries, keys.repeat_interleave(groups, 1),
                                                      values.repeat_interleave(groups, 1), attn_mask=mask)
            batch, _, length, _ = attended.shape
            merged = attended.transpose(1, 2).reshape(batch, length, -1)
            hidden = hidden + layer.dropout(attention.o_proj(merged))
            hidden = hidden + layer.dropout(layer.mlp(layer.post_attention_layernorm(hidden)))
        return hidden

    def draft_block(self, context: list[LayerContext], root: int, steps: int) -> torch.Tensor:
        """Inference: the draft-vocab log-probs [steps, Vd] of slots 1..steps of the block [root, MASK x steps],
        placed right after the context (batch 1), attending to all of it and the whole block."""
        start = context[0].keys.shape[2]
        device = context[0].keys.device
        ids = torch.full((1, steps + 1), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = root
        positions = torch.arange(start, start + steps + 1, device=device)[None]
        visible = torch.ones(1, steps + 1, start + steps + 1, dtype=torch.bool, device=device)
        hidden = self.block_forward(ids, positions, context, visible)
        return torch.log_softmax(self.logits(hidden[0, 1:]).float(), dim=-1)
