"""The EAGLE3 draft model: one Llama decoder layer that reads the target's fused hidden states.

Read top to bottom, this is docs/architecture.md §3's forward:

    g = fc(aux)                                        # Linear(3H -> H), skipped when the input is width H
                                                       #   EAGLE 3.1: fc(concat(fc_norm[i](aux_i))), one RMSNorm
                                                       #   per aux state
    e = embed_tokens(ids)                              # frozen copy of the target's embedding (not exported)
    x = concat(input_layernorm(e), hidden_norm(g))     # width 2H, embedding first
    a = o_proj(attn(q_proj(x), k_proj(x), v_proj(x)))
    r = g + a                                          # the residual is the hidden g, not x
    h_out = r + mlp(post_attention_layernorm(r))       # pre-norm output: the next draft step's hidden input
                                                       #   EAGLE 3.1 (norm_output): norm(h_out) is, instead
    logits = lm_head(norm(h_out))                      # width Vd (draft vocabulary)

The method (`draft.method`) is a set of flags on the config (`METHOD_FLAGS`): `eagle3` has none, `eagle3.1` sets
vLLM's `fc_norm` and `norm_output` (read by its llama_eagle3.py), `peagle` sets `parallel_drafting`: P-EAGLE drafts
all k tokens of a round in one forward pass, the slots after the first reading a mask token (`mask_token_id`) and a
learned mask state `mask_hidden` [1, 3H] through fc, instead of the previous slot's token and output
(`mask_inputs`; vLLM serves it as method eagle3 with `parallel_drafting`).

The attention is split in two so the training-time test (models/ttt.py) can add its extra keys:
`project_qkv` returns rotated queries, keys and values, `finish` applies o_proj, the residual and the MLP.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from models.target_families import family_of, text_config_of


#: The draft methods of this architecture and the config flags each sets (vLLM's names for them).
METHOD_FLAGS: dict[str, dict[str, bool]] = {
    "eagle3": {"fc_norm": False, "norm_output": False, "parallel_drafting": False},
    "eagle3.1": {"fc_norm": True, "norm_output": True, "parallel_drafting": False},
    "peagle": {"fc_norm": False, "norm_output": False, "parallel_drafting": True},
}


@dataclass
class Eagle3Config:
    """Everything that shapes the draft; the Llama fields are copied from the target."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]
    rope_scaling: Optional[dict[str, Any]] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int | list[int]] = None
    pad_token_id: Optional[int] = None
    hidden_act: str = "silu"
    fc_norm: bool = False  # EAGLE 3.1: an RMSNorm per aux state before fc
    norm_output: bool = False  # EAGLE 3.1: the next step reads the normed output, not the pre-norm one
    parallel_drafting: bool = False  # P-EAGLE: later slots read the mask token and mask_hidden
    mask_token_id: Optional[int] = None  # P-EAGLE: the token id of every slot after a round's first
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def method(self) -> str:
        """The draft method these flags make (METHOD_FLAGS); "custom" for a mix no method names."""
        flags = {"fc_norm": self.fc_norm, "norm_output": self.norm_output, "parallel_drafting": self.parallel_drafting}
        return next((name for name, wanted in METHOD_FLAGS.items() if wanted == flags), "custom")

    def for_method(self, method: str) -> "Eagle3Config":
        """This config drafting as `method` (a name of METHOD_FLAGS)."""
        if method not in METHOD_FLAGS:
            raise ValueError(f"draft.method '{method}' is not one of {', '.join(METHOD_FLAGS)}")
        return replace(self, **METHOD_FLAGS[method])

    @classmethod
    def from_target(cls, target_config: Any, draft_vocab_size: int, aux_layer_ids: list[int]) -> "Eagle3Config":
        """The draft's fields from an HF target config of any supported family (models/target_families.py): its
        attention shape, norm epsilon and RoPE (theta and scaling); the MLP is dense, as wide as the family says."""
        text = text_config_of(target_config)
        family = family_of(getattr(text, "model_type", None))
        heads = text.num_attention_heads
        rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
        scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return cls(
            hidden_size=text.hidden_size,
            intermediate_size=family.draft_intermediate_size(text),
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", heads) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            rms_norm_eps=text.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=text.max_position_embeddings,
            vocab_size=text.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=text.hidden_size,
            aux_layer_ids=list(aux_layer_ids),
            bos_token_id=text.bos_token_id,
            eos_token_id=text.eos_token_id,
            pad_token_id=text.pad_token_id,
            hidden_act=getattr(text, "hidden_act", "silu"),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(config: Eagle3Config) -> torch.Tensor:
    """The target's RoPE frequencies: Llama's, with Llama-3's long-context scaling or YaRN (gpt-oss) when the
    target uses them. YaRN also scales cos/sin: `rope_attention_scaling`."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = rope_kind(config)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        smooth = (original / wavelength - low) / (high - low)
        scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
        middle = (wavelength <= original / low) & (wavelength >= original / high)
        inv_freq = torch.where(middle, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "yarn":
        return yarn_parameters(config)[0]
    elif kind not in (None, "default"):
        raise ValueError(f"rope_type '{kind}' is not supported by the EAGLE3 draft (default, llama3 and yarn are)")
    return inv_freq.float()


def rope_kind(config: Eagle3Config) -> Optional[str]:
    scaling = config.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type"))


def yarn_parameters(config: Eagle3Config) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and cos/sin scale, computed by transformers' own RoPE initialiser (the target's code)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    llama = LlamaConfig(hidden_size=config.num_attention_heads * config.head_dim, head_dim=config.head_dim,
                        num_attention_heads=config.num_attention_heads,
                        max_position_embeddings=config.max_position_embeddings,
                        rope_parameters={**(config.rope_scaling or {}), "rope_theta": config.rope_theta})
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS["yarn"](llama, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


def rope_attention_scaling(config: Eagle3Config) -> float:
    """The factor on cos/sin: 1 except for YaRN."""
    return yarn_parameters(config)[1] if rope_kind(config) == "yarn" else 1.0


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Apply RoPE to x [B, heads, T, head_dim] at integer positions [B, T] (cos/sin times `scale`)."""
    angles = positions[:, None, :, None].float() * inv_freq[None, None, None, :]
    cos = (torch.cat([angles.cos(), angles.cos()], dim=-1) * scale).to(x.dtype)
    sin = (torch.cat([angles.sin(), angles.sin()], dim=-1) * scale).to(x.dtype)
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated_half * sin


class DraftAttention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        width = 2 * config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def split_heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, heads, self.head_dim).transpose(1, 2)


class DraftMLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """The single decoder layer (`midlayer` in the checkpoint)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)
        self.dropout = nn.Dropout(0.0)  # on the attention and MLP outputs while training (Eagle3Draft.set_dropout)


@dataclass
class StepProjections:
    """Rotated queries [B, heads, T, d], keys and values [B, kv_heads, T, d] of one draft step."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


class Eagle3Draft(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps) for _ in range(3)) \
            if config.fc_norm else None
        self.midlayer = DraftLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        # P-EAGLE's learned input state of the masked slots, in the aux width (fc projects it), randn as speculators
        self.mask_hidden = nn.Parameter(torch.randn(1, 3 * config.target_hidden_size)) \
            if config.parallel_drafting else None
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.rope_scale = rope_attention_scaling(config)
        self.embed_tokens: Optional[nn.Embedding] = None

    def attach_embedding(self, weight: torch.Tensor) -> None:
        """Inject the target's token embedding, frozen; it is never saved with the draft."""
        embedding = nn.Embedding.from_pretrained(weight.detach().clone(), freeze=True)
        object.__setattr__(self, "embed_tokens", embedding)

    def initialise_from_target(self, lm_head_weight: torch.Tensor, final_norm_weight: torch.Tensor) -> None:
        """Start lm_head from the target's rows of the draft vocabulary and norm from the target's final
        norm: the draft then begins where the target's own head would put it (faster, steadier training)."""
        used = torch.arange(self.config.draft_vocab_size) + self.d2t.cpu()
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight[used].to(self.lm_head.weight.dtype))
            self.norm.weight.copy_(final_norm_weight.to(self.norm.weight.dtype))

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    def set_dropout(self, probability: float) -> None:
        """Residual dropout of the decoder layer, active in train mode only (a training setting: the engines
        run the layer without it, and nothing of it is saved)."""
        self.midlayer.dropout.p = probability

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """g = fc(aux), each aux state normed first with fc_norm (EAGLE 3.1); an input already of width H (a previous
        step's carried output) passes through."""
        if aux.shape[-1] == self.config.hidden_size:
            return aux
        if self.fc_norm is not None:
            states = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(state) for norm, state in zip(self.fc_norm, states)], dim=-1)
        return self.fc(aux)

    def mask_inputs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """P-EAGLE: what every slot after a round's first reads, shaped like `ids` [B, T]: the mask token and
        fc(mask_hidden) (vLLM's `combine_hidden_states` of it), whatever the previous slot drafted."""
        if self.mask_hidden is None or self.config.mask_token_id is None:
            raise RuntimeError(f"a {self.config.method} draft has no mask inputs (P-EAGLE only, with mask_token_id)")
        hidden = self.project(self.mask_hidden)
        return (torch.full_like(ids, self.config.mask_token_id),
                hidden.reshape(1, 1, -1).expand(*ids.shape, hidden.shape[-1]))

    def carry(self, h_out: torch.Tensor) -> torch.Tensor:
        """What the next draft step reads as its hidden input: h_out, or norm(h_out) with norm_output (EAGLE 3.1)."""
        return self.norm(h_out) if self.config.norm_output else h_out

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise RuntimeError("attach the target's embedding (attach_embedding) before running the draft")
        return self.embed_tokens(ids)

    def project_qkv(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> StepProjections:
        """x = concat(input_layernorm(e), hidden_norm(g)) and its rotated q, k, v."""
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(self.embed(ids)), layer.hidden_norm(hidden)], dim=-1)
        attention = layer.self_attn
        queries = attention.split_heads(attention.q_proj(x), attention.heads)
        keys = attention.split_heads(attention.k_proj(x), attention.kv_heads)
        values = attention.split_heads(attention.v_proj(x), attention.kv_heads)
        return StepProjections(rotate(queries, positions, self.inv_freq, self.rope_scale),
                               rotate(keys, positions, self.inv_freq, self.rope_scale), values)

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """r = g + o_proj(attn); h_out = r + mlp(post_attention_layernorm(r)). attended: [B, heads, T, d]."""
        layer = self.midlayer
        batch, _, length, _ = attended.shape
        merged = attended.transpose(1, 2).reshape(batch, length, -1)
        residual = hidden + layer.dropout(layer.self_attn.o_proj(merged))
        return residual + layer.dropout(layer.mlp(layer.post_attention_layernorm(residual)))

    def logits(self, h_out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of a step's output."""
        return self.lm_head(self.norm(h_out))

    def forward(self, aux: torch.Tensor, ids: torch.Tensor, positions: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One causal step over a sequence: (h_out, logits). The training-time test lives in models/ttt.py."""
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        hidden = self.project(aux)
        step = self.project_qkv(ids, hidden, positions)
        groups = step.queries.shape[1] // step.keys.shape[1]
        attended = F.scaled_dot_product_attention(
            step.queries, step.keys.repeat_interleave(groups, 1), step.values.repeat_interleave(groups, 1), is_causal=True
        )
        h_out = self.finish(hidden, attended)
        return h_out, self.logits(h_out)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token id of each draft id: i + d2t[i]."""
        return draft_ids + self.d2t[draft_ids]
