"""One-batch parity of eaglet's DFlash and P-EAGLE objectives against their anchor implementations, fp32 on CPU.

    benchmarks/anchor_parity_env.sh                       # once: the pinned anchor environment (.venv-anchors)
    PYTHONPATH=. .venv-anchors/bin/python benchmarks/anchor_parity.py [--methods dflash peagle] [--seed 0]

Why: eaglet re-implements two published recipes, DFlash (models/dflash.py, models/dflash_objective.py; anchor:
SpecForge 0.2.0) and P-EAGLE (models/eagle3.py with parallel_drafting, models/ttt.py; anchor: speculators 0.9.0).
This runs each pair on the same random batch and weights, with the anchors' random sampling pinned, and says
whether logits, loss, accuracy and gradients agree to fp32 rounding, and where they do not. The anchors are the
released wheels, called through their public classes, never copied.

What is made equal on purpose (eaglet's documented choices), so that the rest can be compared:
  DFlash   the teacher is the one-hot of the dataset token x_{a+k} (eaglet distils a target distribution; SpecForge
           uses hard labels); draft vocab = full vocab (d2t = 0) and eaglet's lm_head and frozen embedding are
           SpecForge's frozen target lm_head and embed_tokens; eaglet's normaliser is the sum of SpecForge's slot
           weights (eaglet's trainer divides by B*T: shown as a rescaling).
  P-EAGLE  speculators packs records into one row after its own EAGLE3 shift (shift_batch, called here); its
           COD sampler keeps a random subset of every chain, so it is pinned to all chains its sampler can draw
           (checked against the sampler); eaglet's step decay is 1 (speculators weighs sampled slots alike) and its
           normaliser speculators' denominator; speculators' KL differs from eaglet's cross-entropy by the teacher's
           entropy, which is added back; draft vocab = full vocab.
Everything else (anchor/chain rules, block or step inputs, RoPE positions, visibility, norms, labels, slot weights,
accuracy) is left to each implementation, so a difference there shows up, and is reported as one: a row marked
DIFFERS is a semantic difference this script has measured and accounts for in full (the "unexplained" rows must
still agree to fp32); FAIL is a disagreement beyond tolerance.

Exits 1 on any FAIL, 0 otherwise (DIFFERS rows do not fail the run; they are printed for a person to judge).
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

# SpecForge's draft package warns at import that flash_attn is absent; this check runs sdpa/eager on CPU by design.
warnings.filterwarnings("ignore", message="flash_attn is not found")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # eaglet is not installed in the anchor environment: import models/ from the repo
    sys.path.insert(0, str(REPO))

from models.dflash import DFlashConfig, DFlashDraft  # noqa: E402
from models.dflash_objective import anchor_candidates, block_inputs, block_visibility, dflash_forward  # noqa: E402
from models.eagle3 import Eagle3Config, Eagle3Draft  # noqa: E402
from models.ttt import TTTBatch, shift_left, step_loss, ttt_forward  # noqa: E402

# Tolerances for fp32: logits of order 1, a loss of order log(V).
LOGIT_ATOL = 1e-5
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4  # of each tensor's largest gradient: the backward sums more terms than the forward
CONTROL_MIN = 1e-2  # a control (a deliberate semantic slip) must move the logits by more than this


@dataclass(frozen=True)
class Dims:
    """A tiny Llama/Qwen3-like target and drafts; DFlash block 4 with 2 layers, P-EAGLE 4 depths with 1 layer."""

    batch: int = 2
    length: int = 48
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    vocab: int = 96
    aux_layers: int = 3
    block: int = 4
    layers: int = 2
    depths: int = 4
    rope_theta: float = 10000.0
    eps: float = 1e-6
    gamma: float = 7.0

    @property
    def mask_id(self) -> int:
        return self.vocab - 1


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] float
    aux: torch.Tensor  # [B, T, 3H]
    lengths: list[int]  # real (unpadded) length of each record
    anchors: torch.Tensor  # [B, N] DFlash's pinned anchors
    keep: torch.Tensor  # [B, N] bool


def make_batch(dims: Dims, generator: torch.Generator, holes: bool = True) -> Batch:
    """Two right-padded records (the second is 40 tokens) with a block running past the end; DFlash's pinned
    anchors cover those cases (record 1 has fewer, so it carries padded, kept-out blocks). With `holes`: prompts of
    6 and 10 tokens and unsupervised tokens inside the responses (a multi-turn record); without: prompts of 2 and
    no holes, where a chain of supervised tokens is never broken."""
    ids = torch.randint(0, dims.mask_id, (dims.batch, dims.length), generator=generator)
    mask = torch.zeros(dims.batch, dims.length)
    lengths = [dims.length, 40]
    if holes:
        mask[0, 6:] = 1
        mask[0, [20, 33, 34]] = 0
        mask[1, 10:40] = 1
        mask[1, 25] = 0
    else:
        mask[0, 2:] = 1
        mask[1, 2:40] = 1
    ids[1, 40:] = 0
    aux = torch.randn(dims.batch, dims.length, dims.aux_layers * dims.hidden, generator=generator)
    aux[1, 40:] = 0
    anchors = torch.tensor([[6, 12, 18, 21, 30, 40, 46],  # 18: block over the hole at 20; 30: over 33-34; 46: past T
                            [10, 22, 26, 37, 0, 0, 0]])  # 22: over the hole at 25; 37: over the padding
    keep = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    return Batch(ids, mask, aux, lengths, anchors, keep)


def linear(generator: torch.Generator, out: int, inp: int) -> torch.Tensor:
    return torch.randn(out, inp, generator=generator) / math.sqrt(inp)


def norm_weight(generator: torch.Generator, size: int) -> torch.Tensor:
    """Random around 1, so a norm applied in the wrong place cannot hide behind unit weights."""
    return 1.0 + 0.2 * torch.randn(size, generator=generator)


def decoder_weights(dims: Dims, generator: torch.Generator, prefix: str, width: int,
                    qk_norm: bool) -> dict[str, torch.Tensor]:
    """One Llama/Qwen3 decoder layer's tensors under eaglet's names; q/k/v read `width` features."""
    h, d = dims.hidden, dims.head_dim
    weights = {
        prefix + "input_layernorm.weight": norm_weight(generator, h),
        prefix + "post_attention_layernorm.weight": norm_weight(generator, h),
        prefix + "self_attn.q_proj.weight": linear(generator, dims.heads * d, width),
        prefix + "self_attn.k_proj.weight": linear(generator, dims.kv_heads * d, width),
        prefix + "self_attn.v_proj.weight": linear(generator, dims.kv_heads * d, width),
        prefix + "self_attn.o_proj.weight": linear(generator, h, dims.heads * d),
        prefix + "mlp.gate_proj.weight": linear(generator, dims.intermediate, h),
        prefix + "mlp.up_proj.weight": linear(generator, dims.intermediate, h),
        prefix + "mlp.down_proj.weight": linear(generator, h, dims.intermediate),
    }
    if qk_norm:
        weights[prefix + "self_attn.q_norm.weight"] = norm_weight(generator, d)
        weights[prefix + "self_attn.k_norm.weight"] = norm_weight(generator, d)
    return weights


@dataclass
class Check:
    """One compared quantity. kind: "check" (must agree within tolerance), "control" (a deliberate slip that must
    NOT agree), "differs" (a measured semantic difference, shown, never failing)."""

    name: str
    eaglet: str
    anchor: str
    difference: float
    tolerance: float
    kind: str = "check"

    @property
    def status(self) -> str:
        if self.kind == "differs":
            return "DIFFERS" if self.difference > self.tolerance else "same"
        if self.kind == "control":
            return "ok" if self.difference > self.tolerance else "FAIL"
        return "ok" if self.difference <= self.tolerance else "FAIL"


def fmt(x: float) -> str:
    return f"{x:.8g}"


def print_checks(title: str, anchor: str, checks: list[Check]) -> None:
    print(f"\n{title}")
    print(f"{'check':62} {'eaglet':>22} {anchor:>22} {'difference':>11} {'tolerance':>10}")
    for check in checks:
        relation = ">" if check.kind == "control" else "<="
        print(f"{check.name:62} {check.eaglet:>22} {check.anchor:>22} {check.difference:11.3e} "
              f"{relation}{check.tolerance:9.1e}  {check.status}")


def gradient_check(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], names: list[str]) -> Check:
    """The worst max|diff| / max|grad| over the tensors both sides train."""
    worst, worst_name = 0.0, ""
    for name in names:
        scale = float(theirs[name].abs().max()) or 1.0
        rel = float((ours[name] - theirs[name]).abs().max()) / scale
        if rel >= worst:
            worst, worst_name = rel, name
    return Check(f"gradients: worst max|diff|/max|grad| ({worst_name})", f"{len(names)} tensors",
                 f"{len(names)} tensors", worst, GRAD_RTOL)


# === DFlash vs SpecForge 0.2.0 ==================================================================================

def dflash_weights(dims: Dims, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """eaglet's DFlash state dict plus the target embedding, every tensor random."""
    h = dims.hidden
    weights = {"fc.weight": linear(generator, h, dims.aux_layers * h), "hidden_norm.weight": norm_weight(generator, h),
               "norm.weight": norm_weight(generator, h), "lm_head.weight": linear(generator, dims.vocab, h),
               "embed_tokens.weight": torch.randn(dims.vocab, h, generator=generator)}
    for i in range(dims.layers):
        weights.update(decoder_weights(dims, generator, f"layers.{i}.", h, qk_norm=True))
    return weights


def slot_weights(dims: Dims, batch: Batch) -> torch.Tensor:
    """[B, N, block] SpecForge's documented slot weight, written out here: keep * (a+k < T) * loss_mask[a+k] * [k>0]
    * exp(-(k-1)/gamma). Its sum is eaglet's normaliser; it is checked against SpecForge's own denominator."""
    k = torch.arange(dims.block)
    guessed = batch.anchors[..., None] + k
    inside = guessed < dims.length
    supervised = batch.loss_mask.gather(1, guessed.clamp(max=dims.length - 1).flatten(1)).view_as(guessed)
    decay = torch.where(k > 0, torch.exp(-(k - 1).clamp(min=0).float() / dims.gamma), torch.zeros(()))
    return batch.keep[..., None] * inside * supervised * decay


def eaglet_dflash(dims: Dims, weights: dict[str, torch.Tensor]) -> DFlashDraft:
    config = DFlashConfig(
        hidden_size=dims.hidden, intermediate_size=dims.intermediate, num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads, head_dim=dims.head_dim, rms_norm_eps=dims.eps, rope_theta=dims.rope_theta,
        max_position_embeddings=128, vocab_size=dims.vocab, draft_vocab_size=dims.vocab, target_hidden_size=dims.hidden,
        aux_layer_ids=list(range(1, dims.aux_layers + 1)), mask_token_id=dims.mask_id, num_layers=dims.layers,
        block_size=dims.block)
    draft = DFlashDraft(config)
    own = {name: value for name, value in weights.items() if name != "embed_tokens.weight"}
    own["d2t"] = torch.zeros(dims.vocab, dtype=torch.int64)  # identity draft vocabulary
    own["t2d"] = torch.ones(dims.vocab, dtype=torch.bool)
    draft.load_state_dict(own, strict=True)
    draft.attach_embedding(weights["embed_tokens.weight"])
    return draft.float().eval()


def one_hot_teacher(dims: Dims, batch: Batch) -> TTTBatch:
    """Teacher row t = one-hot of x_{t+1} (the last row has no next token and is never read), all in the draft
    vocab: eaglet's distillation loss on it is SpecForge's cross-entropy against the dataset token."""
    nxt = torch.zeros_like(batch.input_ids)
    nxt[:, :-1] = batch.input_ids[:, 1:]
    probs = F.one_hot(nxt, dims.vocab).float()
    probs[:, -1] = 0
    return TTTBatch(input_ids=batch.input_ids, loss_mask=batch.loss_mask, aux_hidden_state=batch.aux,
                    target_probs=probs, target_top1=nxt,
                    target_top1_in_draft=torch.ones_like(batch.input_ids, dtype=torch.bool))


def eaglet_block_logits(draft: DFlashDraft, dims: Dims, batch: Batch,
                        visible: Optional[torch.Tensor] = None, shift: int = 0) -> torch.Tensor:
    """[B, N, block, V] every slot's logits through the objective's own pieces (block_inputs, block_visibility,
    context, block_forward, logits): dflash_forward scores only supervised slots, the table wants them all.
    `visible` and `shift` (added to the block positions) exist for the controls."""
    size, length = batch.input_ids.shape
    positions = torch.arange(length).expand(size, -1)
    context = draft.context(batch.aux, positions)
    ids, slot_positions = block_inputs(draft, batch.input_ids, batch.anchors)
    if visible is None:
        visible = block_visibility(batch.anchors, dims.block, length)
    hidden = draft.block_forward(ids, slot_positions + shift, context, visible)
    return draft.logits(hidden).view(size, batch.anchors.shape[1], dims.block, -1)


def specforge_dflash(dims: Dims, weights: dict[str, torch.Tensor]) -> Any:
    """SpecForge's training wrapper (OnlineDFlashModel) around its DFlashDraftModel, with eaglet's weights and
    eaglet's lm_head / embedding as its frozen target head / embedding. Tensor names coincide (both follow Qwen3's
    module names): load_state_dict(strict=True) fails loudly on a rename on either side."""
    from transformers import Qwen3Config
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.draft.dflash import DFlashDraftModel

    config = Qwen3Config(
        vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.intermediate,
        num_hidden_layers=dims.layers, num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
        head_dim=dims.head_dim, rms_norm_eps=dims.eps, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": dims.rope_theta}, attention_bias=False)
    config.layer_types = ["full_attention"] * dims.layers
    config.num_target_layers = dims.aux_layers + 3
    config.block_size = dims.block
    config.dflash_config = {"mask_token_id": dims.mask_id, "target_layer_ids": list(range(1, dims.aux_layers + 1))}
    config._attn_implementation = "sdpa"
    draft = DFlashDraftModel(config).float()
    draft.load_state_dict({name: value for name, value in weights.items()
                           if name not in ("lm_head.weight", "embed_tokens.weight")}, strict=True)
    lm_head = torch.nn.Linear(dims.hidden, dims.vocab, bias=False)
    lm_head.weight.data.copy_(weights["lm_head.weight"])
    embed = torch.nn.Embedding(dims.vocab, dims.hidden)
    embed.weight.data.copy_(weights["embed_tokens.weight"])
    embed.requires_grad_(False)  # frozen in both trainers
    model = OnlineDFlashModel(draft, lm_head, embed, dims.mask_id, block_size=dims.block, attention_backend="sdpa",
                              num_anchors=512, loss_decay_gamma=dims.gamma, objective_chunk_blocks=0,
                              loss_type="dflash")
    return model.eval()


def specforge_candidates(model: Any, batch: Batch) -> torch.Tensor:
    """[B, T] bool: SpecForge's anchor candidates, read from its own sampler with room for all of them."""
    sampled, keep = type(model)._sample_anchor_positions(model, batch.input_ids.shape[1], batch.loss_mask, "cpu")
    candidates = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    for row in range(sampled.shape[0]):
        candidates[row, sampled[row][keep[row]]] = True
    return candidates


def specforge_run(model: Any, dims: Dims, batch: Batch) -> tuple[float, float, float, torch.Tensor, dict]:
    """(loss, accuracy, loss denominator, logits [B, N, block, V], gradients) from SpecForge's forward on the
    pinned anchors; the logits are its lm_head's output, caught by a hook."""
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().clone()))
    model._sample_anchor_positions = lambda *args, **kwargs: (batch.anchors.clone(), batch.keep.clone())
    try:
        model.zero_grad(set_to_none=True)
        loss, accuracy, metrics = model(input_ids=batch.input_ids, hidden_states=batch.aux,
                                        loss_mask=batch.loss_mask)
        loss.backward()
    finally:
        hook.remove()
        del model._sample_anchor_positions
    if len(captured) != 1:
        raise RuntimeError(f"expected one lm_head call (objective_chunk_blocks=0), got {len(captured)}")
    logits = captured[0].view(dims.batch, batch.anchors.shape[1], dims.block, -1)
    grads = {name: p.grad.detach().clone() for name, p in model.draft_model.named_parameters() if p.grad is not None}
    grads["lm_head.weight"] = model.lm_head.weight.grad.detach().clone()
    return float(loss.detach()), float(accuracy), float(metrics["loss_terms"][1]), logits, grads


def dflash_parity(dims: Dims, seed: int) -> list[Check]:
    generator = torch.Generator().manual_seed(seed)
    batch = make_batch(dims, generator, holes=True)
    weights = dflash_weights(dims, generator)
    print(f"\n[DFlash] B={dims.batch} T={dims.length} H={dims.hidden} heads={dims.heads}/{dims.kv_heads} "
          f"head_dim={dims.head_dim} V={dims.vocab} block={dims.block} layers={dims.layers} gamma={dims.gamma}; "
          f"pinned anchors {batch.anchors.tolist()} keep {batch.keep.int().tolist()}")

    weight = slot_weights(dims, batch)
    normaliser = float(weight.sum())
    draft = eaglet_dflash(dims, weights)
    output = dflash_forward(draft, one_hot_teacher(dims, batch), batch.anchors, batch.keep, gamma=dims.gamma,
                            normaliser=normaliser)
    output.loss.backward()
    our_grads = {name: p.grad.detach().clone() for name, p in draft.named_parameters() if p.grad is not None}
    our_loss = float(output.loss.detach())
    with torch.no_grad():
        ours = eaglet_block_logits(draft, dims, batch)
        default_loss = float(dflash_forward(draft, one_hot_teacher(dims, batch), batch.anchors, batch.keep,
                                            gamma=dims.gamma).loss)  # eaglet's trainer default: normaliser B*T

    model = specforge_dflash(dims, weights)
    their_loss, their_acc, their_den, theirs, their_grads = specforge_run(model, dims, batch)
    their_candidates = specforge_candidates(model, batch)
    our_candidates = anchor_candidates(batch.loss_mask)

    supervised = weight > 0
    our_supervised = torch.tensor([0.0] + output.supervised)
    our_acc = sum(a * n for a, n in zip(output.acc, output.supervised)) / max(sum(output.supervised), 1.0)
    kept = batch.keep[..., None, None].expand_as(ours)
    slot_kept = batch.keep[..., None].expand(-1, -1, dims.block)
    labels = (batch.anchors[..., None] + torch.arange(dims.block)).clamp(max=dims.length - 1)
    labels = batch.input_ids.gather(1, labels.flatten(1)).view_as(labels)
    our_hits = (ours.argmax(-1) == labels) & supervised
    their_hits = (theirs.argmax(-1) == labels) & supervised
    tokens = dims.batch * dims.length

    checks = [
        Check("anchor candidates (positions differing)", f"{int(our_candidates.sum())} candidates",
              f"{int(their_candidates.sum())} candidates", float((our_candidates != their_candidates).sum()), 0.0),
        Check("slot-weight sum (normaliser vs SpecForge denominator)", fmt(normaliser), fmt(their_den),
              abs(normaliser - their_den), 1e-5 * their_den),
        Check("scored slots per k (eaglet rows vs SpecForge weight>0)", str(our_supervised.int().tolist()),
              str(supervised.sum(dim=(0, 1)).tolist()),
              float((our_supervised - supervised.sum(dim=(0, 1))).abs().sum()), 0.0),
        Check("logits, kept blocks, all slots: max |diff|", "", "", float((ours - theirs).abs()[kept].max()),
              LOGIT_ATOL),
        Check(f"argmax, kept blocks, all {int(slot_kept.sum())} slots (differing)", "", "",
              float((ours.argmax(-1) != theirs.argmax(-1))[slot_kept].sum()), 0.0),
        Check("loss: |diff| / |SpecForge|", fmt(our_loss), fmt(their_loss),
              abs(our_loss - their_loss) / abs(their_loss), LOSS_RTOL),
        Check("loss, eaglet default normaliser B*T, times B*T/sum(w)", fmt(default_loss * tokens / normaliser),
              fmt(their_loss), abs(default_loss * tokens / normaliser - their_loss) / their_loss, LOSS_RTOL),
        Check("accuracy (supervised slots): |diff|", fmt(our_acc), fmt(their_acc), abs(our_acc - their_acc), 1e-6),
        Check("argmax hits per slot k (differing slots)", str(our_hits.sum(dim=(0, 1)).tolist()),
              str(their_hits.sum(dim=(0, 1)).tolist()), float((our_hits != their_hits).sum()), 0.0),
    ]
    if set(our_grads) != set(their_grads):
        checks.append(Check(f"trained tensors: eaglet only {sorted(set(our_grads) - set(their_grads))}, SpecForge "
                            f"only {sorted(set(their_grads) - set(our_grads))}", "", "", math.inf, 0.0))
    checks.append(gradient_check(our_grads, their_grads, sorted(set(our_grads) & set(their_grads))))

    # Controls: eaglet with a deliberate slip must move away from SpecForge, or the check could not see one.
    length = dims.length
    through_anchor = block_visibility(batch.anchors + 1, dims.block, length)  # context t <= a
    through_anchor[..., length:] = block_visibility(batch.anchors, dims.block, length)[..., length:]
    with torch.no_grad():
        slips = {"control: context t <= a (must differ)": eaglet_block_logits(draft, dims, batch, through_anchor),
                 "control: block positions a+k+1 (must differ)": eaglet_block_logits(draft, dims, batch, shift=1)}
    for name, logits in slips.items():
        checks.append(Check(name, "", "", float((logits - theirs).abs()[kept].max()), CONTROL_MIN, kind="control"))
    print_checks("DFlash: eaglet vs SpecForge 0.2.0 (OnlineDFlashModel, sdpa)", "SpecForge", checks)

    def weighted_ce(logits: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
        return (ce.view_as(labels) * weight).sum(-1)

    our_ce, their_ce = weighted_ce(ours.detach()), weighted_ce(theirs)
    print("\nper block (kept blocks; slot k>=1 guesses x[a+k]; w = slot weight):")
    print(f"{'rec':>3} {'blk':>3} {'anchor':>6} {'weights w_1..w_k':>22} {'max|dlogit|':>12} "
          f"{'sum w*CE eaglet':>16} {'sum w*CE SpecForge':>19}")
    for row in range(dims.batch):
        for block in range(batch.anchors.shape[1]):
            if not batch.keep[row, block]:
                continue
            w = " ".join(f"{float(x):.3f}" for x in weight[row, block, 1:])
            diff = float((ours[row, block] - theirs[row, block]).abs().max())
            print(f"{row:>3} {block:>3} {int(batch.anchors[row, block]):>6} {w:>22} {diff:12.3e} "
                  f"{float(our_ce[row, block]):16.6f} {float(their_ce[row, block]):19.6f}")
    invalid = theirs[~batch.keep]
    print(f"kept-out blocks: {int((~batch.keep).sum())} (weight 0 on both sides, not compared; SpecForge feeds them "
          f"all-MASK and lets them attend nowhere, finite logits: {bool(torch.isfinite(invalid).all())})")
    print(f"eaglet's trainer default divides by B*T = {tokens} tokens, not sum(w) = {normaliser:.6f}: its loss here is "
          f"{default_loss:.7g} = SpecForge's x {normaliser / tokens:.6f} (the same gradient direction per batch)")
    return checks


# === P-EAGLE vs speculators 0.9.0 ===============================================================================

def peagle_weights(dims: Dims, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """eaglet's P-EAGLE state dict, the target embedding and the verifier's final norm and head (the teacher)."""
    h = dims.hidden
    weights = {"fc.weight": linear(generator, h, dims.aux_layers * h), "norm.weight": norm_weight(generator, h),
               "lm_head.weight": linear(generator, dims.vocab, h),
               "mask_hidden": torch.randn(1, dims.aux_layers * h, generator=generator),
               "midlayer.hidden_norm.weight": norm_weight(generator, h),
               "embed_tokens.weight": torch.randn(dims.vocab, h, generator=generator),
               "verifier_norm.weight": norm_weight(generator, h),
               "verifier_lm_head.weight": 3 * linear(generator, dims.vocab, h)}  # a peaked teacher
    weights.update(decoder_weights(dims, generator, "midlayer.", 2 * h, qk_norm=False))
    return weights


TEACHER_ONLY = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")


def speculators_name(eaglet_name: str) -> str:
    """eaglet Eagle3Draft tensor name -> speculators PEagleDraftModel name: the one decoder layer is `midlayer`
    in eaglet (EAGLE3's checkpoint name) and `layers.0` in speculators."""
    return eaglet_name.replace("midlayer.", "layers.0.", 1)


def eaglet_peagle(dims: Dims, weights: dict[str, torch.Tensor]) -> Eagle3Draft:
    config = Eagle3Config(
        hidden_size=dims.hidden, intermediate_size=dims.intermediate, num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads, head_dim=dims.head_dim, rms_norm_eps=dims.eps, rope_theta=dims.rope_theta,
        max_position_embeddings=128, vocab_size=dims.vocab, draft_vocab_size=dims.vocab, target_hidden_size=dims.hidden,
        aux_layer_ids=list(range(1, dims.aux_layers + 1)), parallel_drafting=True, mask_token_id=dims.mask_id)
    assert config.method == "peagle"
    draft = Eagle3Draft(config)
    own = {name: value for name, value in weights.items() if name not in TEACHER_ONLY}
    own["d2t"] = torch.zeros(dims.vocab, dtype=torch.int64)
    own["t2d"] = torch.ones(dims.vocab, dtype=torch.bool)
    draft.load_state_dict(own, strict=True)
    draft.attach_embedding(weights["embed_tokens.weight"])
    return draft.float().eval()


def speculators_peagle(dims: Dims, weights: dict[str, torch.Tensor]) -> Any:
    """speculators' PEagleDraftModel on a Llama layer config with eager attention (its CPU path), eaglet's
    weights under its names, and the same embedding, lm_head and verifier head."""
    from transformers import LlamaConfig
    from speculators.models.peagle import PEagleSpeculatorConfig
    from speculators.models.peagle.core import PEagleDraftModel

    layer = LlamaConfig(
        hidden_size=dims.hidden, intermediate_size=dims.intermediate, num_hidden_layers=1,
        num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads, head_dim=dims.head_dim,
        vocab_size=dims.vocab, rms_norm_eps=dims.eps, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": dims.rope_theta})
    layer._attn_implementation = "eager"
    config = PEagleSpeculatorConfig(transformer_layer_config=layer, draft_vocab_size=dims.vocab,
                                    eagle_aux_hidden_state_layer_ids=list(range(1, dims.aux_layers + 1)),
                                    mask_token_id=dims.mask_id)
    model = PEagleDraftModel(config).float()
    state = {speculators_name(name): value for name, value in weights.items()}
    state["mask_hidden"] = weights["mask_hidden"].view(1, 1, -1)
    model.load_state_dict(state, strict=True)
    return model.eval()


@dataclass
class Packed:
    """speculators' view of the batch: every record shifted by its own shift_batch, then packed into one row."""

    input_ids: torch.Tensor  # [1, S]
    hidden_states: torch.Tensor  # [1, S, 3H]
    verifier_last_hidden_states: torch.Tensor  # [1, S, H]
    loss_mask: torch.Tensor  # [1, S]
    document_ids: torch.Tensor  # [1, S]
    offsets: list[int] = field(default_factory=list)  # packed index of each record's shifted position 0


def pack_for_speculators(batch: Batch, verifier_last: torch.Tensor) -> Packed:
    from speculators.models.eagle3.data import shift_batch

    parts: dict[str, list[torch.Tensor]] = {"input_ids": [], "hidden_states": [], "verifier_last_hidden_states": [],
                                            "loss_mask": [], "document_ids": []}
    offsets, offset = [], 0
    for record, length in enumerate(batch.lengths):
        shifted = shift_batch({
            "input_ids": batch.input_ids[record, :length], "hidden_states": batch.aux[record, :length],
            "verifier_last_hidden_states": verifier_last[record, :length],
            "loss_mask": batch.loss_mask[record, :length], "lengths": torch.tensor([length]),
            "position_ids": torch.arange(length)})
        for key in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask"):
            parts[key].append(shifted[key])
        size = shifted["input_ids"].shape[0]
        parts["document_ids"].append(torch.full((size,), record, dtype=torch.long))
        offsets.append(offset)
        offset += size
    packed = {key: torch.cat(values)[None] for key, values in parts.items()}
    return Packed(**packed, offsets=offsets)


def chain_elements(loss_mask: torch.Tensor, depths: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor_pos, depth) of every element speculators' COD sampler can draw on a packed shifted row, depth-major
    like its sampler: depth 0 at every position; depth d >= 1 at anchor p when the shifted loss mask is 1 at each
    of p+1..p+d (a chain stops at the first unsupervised token). Checked against the sampler's own draws."""
    valid = loss_mask[0] > 0
    size = valid.shape[0]
    anchors, depth = [torch.arange(size)], [torch.zeros(size, dtype=torch.long)]
    alive = torch.ones(size, dtype=torch.bool)
    for d in range(1, depths):
        target = torch.arange(size) + d
        alive = alive & (target < size) & valid[target.clamp(max=size - 1)]
        anchors.append(torch.arange(size)[alive])
        depth.append(torch.full((int(alive.sum()),), d, dtype=torch.long))
    return torch.cat(anchors), torch.cat(depth)


def sampler_coverage(loss_mask: torch.Tensor, depths: int, chain: set[tuple[int, int]]) -> tuple[int, int]:
    """(elements speculators' sampler drew outside `chain`, elements of `chain` it never drew) over 16 draws at
    default and full ratios: the first must be 0 for `chain` to be the sampler's element set."""
    from speculators.models.peagle.data import generate_cod_sample_indices

    state = torch.get_rng_state()
    drawn: set[tuple[int, int]] = set()
    outside = 0
    for seed in range(16):
        torch.manual_seed(seed)
        ratio = (0.7, 0.2) if seed % 2 else (1.0, 1.0)
        anchors, depth = generate_cod_sample_indices(loss_mask.shape[1], loss_mask, num_depths=depths,
                                                     down_sample_ratio=ratio[0], down_sample_ratio_min=ratio[1])
        elements = set(zip(anchors.tolist(), depth.tolist()))
        outside += len(elements - chain)
        drawn |= elements
    torch.set_rng_state(state)
    return outside, len(chain - drawn)


def peagle_case(dims: Dims, seed: int, holes: bool) -> list[Check]:
    generator = torch.Generator().manual_seed(seed)
    batch = make_batch(dims, generator, holes=holes)
    weights = peagle_weights(dims, generator)
    verifier_last = torch.randn(dims.batch, dims.length, dims.hidden, generator=generator)
    K, T = dims.depths, dims.length

    model = speculators_peagle(dims, weights)
    with torch.no_grad():  # the teacher, by speculators' own verifier head, read by both sides
        teacher_logits = model.verifier_lm_head(model.verifier_norm(verifier_last))
    probs = torch.softmax(teacher_logits.float(), dim=-1)
    top1 = probs.argmax(-1)

    # speculators, on all chains (its sampler pinned), with the eager KL loss (its CPU path).
    import speculators.models.peagle.core as peagle_core
    from speculators.losses import resolve_loss_config

    packed = pack_for_speculators(batch, verifier_last)
    anchor_pos, depth = chain_elements(packed.loss_mask, K)
    chain = set(zip(anchor_pos.tolist(), depth.tolist()))
    outside, never_drawn = sampler_coverage(packed.loss_mask, K, chain)
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().clone()))
    original = peagle_core.generate_cod_sample_indices
    peagle_core.generate_cod_sample_indices = lambda *args, **kwargs: (anchor_pos.clone(), depth.clone())
    try:
        model.zero_grad(set_to_none=True)
        _, their_loss_t, metrics = model(
            hidden_states=packed.hidden_states, input_ids=packed.input_ids, document_ids=packed.document_ids,
            loss_mask=packed.loss_mask, verifier_last_hidden_states=packed.verifier_last_hidden_states,
            loss_config=resolve_loss_config("kl_div", "eager"), num_depths=K)
        their_loss_t.backward()
    finally:
        peagle_core.generate_cod_sample_indices = original
        hook.remove()
    their_loss = float(their_loss_t.detach())
    theirs = captured[0][0]  # [elements, V]
    their_grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    their_trained = {name for name, p in model.named_parameters() if p.requires_grad}

    # Their elements -> (record, position t, depth): packed anchor p is record r's shifted position t = p - offset.
    record_of = torch.zeros(packed.input_ids.shape[1], dtype=torch.long)
    for record, offset in enumerate(packed.offsets[1:], start=1):
        record_of[offset:] = record
    element_record = record_of[anchor_pos]
    element_t = anchor_pos - torch.tensor(packed.offsets)[element_record]
    element_scored = packed.loss_mask[0, anchor_pos + depth] > 0
    denominator = float(element_scored.sum()) + 1e-5  # speculators' denominator: sum of the mask, plus its epsilon

    # eaglet: the TTT with parallel drafting, every step's scored logits caught through its loss_fn.
    draft = eaglet_peagle(dims, weights)
    ttt_batch = TTTBatch(input_ids=batch.input_ids, loss_mask=batch.loss_mask, aux_hidden_state=batch.aux,
                         target_probs=probs, target_top1=top1,
                         target_top1_in_draft=torch.ones_like(batch.input_ids, dtype=torch.bool))
    step_logits: list[torch.Tensor] = []

    def catching_loss(logits: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        step_logits.append(logits.detach().clone())
        return step_loss(logits, *args, **kwargs)

    draft.zero_grad(set_to_none=True)
    output = ttt_forward(draft, ttt_batch, K, decay=1.0, normaliser=denominator, loss_fn=catching_loss)
    output.loss.backward()
    our_loss = float(output.loss.detach())
    our_grads = {speculators_name(name): p.grad.detach().clone().view_as(model.get_parameter(speculators_name(name)))
                 for name, p in draft.named_parameters() if p.grad is not None}
    our_trained = {speculators_name(name) for name, p in draft.named_parameters() if p.requires_grad}

    # eaglet's scored slot (record b, position t, step k) learns teacher row t+1+k where x_{t+1+k} is supervised.
    ours_at: dict[tuple[int, int, int], torch.Tensor] = {}
    for k in range(K):
        rows = (shift_left(batch.loss_mask, 1 + k) > 0).nonzero().tolist()
        if len(rows) != step_logits[k].shape[0]:
            raise RuntimeError(f"step {k}: {step_logits[k].shape[0]} scored rows, expected {len(rows)}")
        for (b, t), logit in zip(rows, step_logits[k]):
            ours_at[(b, t, k)] = logit
    common = [(int(element_record[e]), int(element_t[e]), int(depth[e]), e)
              for e in range(anchor_pos.shape[0]) if element_scored[e]]
    missing = [key for key in common if key[:3] not in ours_at]
    in_common = {key[:3] for key in common}
    only_eaglet = [key for key in ours_at if key not in in_common]

    def cross_entropy(logit: torch.Tensor, b: int, t: int, k: int) -> float:
        return float(-(probs[b, t + 1 + k] * torch.log_softmax(logit.float(), -1)).sum())

    def entropy(b: int, t: int, k: int) -> float:
        return float(-torch.special.xlogy(probs[b, t + 1 + k], probs[b, t + 1 + k]).sum())

    logit_diff = max((float((ours_at[key[:3]] - theirs[key[3]]).abs().max()) for key in common
                      if key[:3] in ours_at), default=math.inf)
    entropy_term = sum(entropy(b, t, k) for b, t, k, _ in common) / denominator
    extra_term = sum(cross_entropy(ours_at[key], *key) for key in only_eaglet) / denominator
    common_loss = sum(cross_entropy(ours_at[key[:3]], *key[:3]) for key in common if key[:3] in ours_at) / denominator

    our_counts = [int(n) for n in output.supervised]
    their_counts = [int(float(metrics[f"position_{d}_acc_total"])) for d in range(K)]
    their_acc = [float(metrics[f"position_{d}_acc_sum"]) / max(n, 1) for d, n in enumerate(their_counts)]
    common_hits = [0] * K
    for b, t, k, _ in common:
        if (b, t, k) in ours_at:
            common_hits[k] += int(int(ours_at[(b, t, k)].argmax()) == int(top1[b, t + 1 + k]))
    their_hits = [int(float(metrics[f"position_{d}_acc_sum"])) for d in range(K)]
    extra_per_step = [sum(1 for key in only_eaglet if key[2] == k) for k in range(K)]

    label = "contiguous supervision" if not holes else "prompts and holes"
    print(f"\n[P-EAGLE, {label}] records {batch.lengths} tokens, packed shifted row of {packed.input_ids.shape[1]}; "
          f"depths {K}; {len(chain)} chain elements pinned ({len(common)} scored)")
    kind = "check" if not holes else "differs"
    checks = [
        Check("speculators sampler draws outside the pinned chain set", "", "16 draws", float(outside), 0.0),
        Check("scored elements speculators has and eaglet lacks", "", "", float(len(missing)), 0.0),
        Check("logits on every scored element: max |diff|", "", "", logit_diff, LOGIT_ATOL),
        Check("argmax hits per depth on those elements (differing)", str(common_hits), str(their_hits),
              float(sum(abs(a - b) for a, b in zip(common_hits, their_hits))), 0.0),
        Check("loss, eaglet formula on speculators' elements, minus teacher entropy",
              fmt(common_loss - entropy_term), fmt(their_loss),
              abs(common_loss - entropy_term - their_loss) / their_loss, LOSS_RTOL),
        Check("scored slots per depth (eaglet rows vs speculators' chains)", str(our_counts), str(their_counts),
              float(sum(abs(a - b) for a, b in zip(our_counts, their_counts))), 0.0, kind=kind),
        Check("loss: eaglet objective minus teacher entropy, rel. diff", fmt(our_loss - entropy_term), fmt(their_loss),
              abs(our_loss - entropy_term - their_loss) / their_loss, LOSS_RTOL, kind=kind),
        Check("accuracy per depth: max |diff|", " ".join(f"{a:.3f}" for a in output.acc),
              " ".join(f"{a:.3f}" for a in their_acc), max(abs(a - b) for a, b in zip(output.acc, their_acc)), 1e-6,
              kind=kind),
    ]
    if holes:
        checks.append(Check("loss unexplained once eaglet-only slots are removed, rel.",
                            fmt(our_loss - entropy_term - extra_term), fmt(their_loss),
                            abs(our_loss - entropy_term - extra_term - their_loss) / their_loss, LOSS_RTOL))
    else:
        shared = sorted(our_trained & their_trained)
        checks.append(gradient_check(our_grads, their_grads, shared))
    print_checks(f"P-EAGLE ({label}): eaglet vs speculators 0.9.0 (PEagleDraftModel, eager, kl_div)", "speculators",
                 checks)
    print(f"teacher entropy term sum(L*H(p))/den = {entropy_term:.7g} (speculators' KL = eaglet's CE - H(p); "
          f"no gradient); {never_drawn} chain elements never drawn in 16 sampler draws")
    if only_eaglet:
        print(f"eaglet-only slots per step k: {extra_per_step} ({len(only_eaglet)} in all, adding "
              f"{extra_term:.7g} to eaglet's loss): eaglet trains slot k at t whenever x_(t+1+k) is supervised; "
              f"speculators' chain from t stops at the first unsupervised token among x_(t+2)..x_(t+1+k)")
    if not holes:
        print(f"trained tensors: eaglet only {sorted(our_trained - their_trained)}, speculators only "
              f"{sorted(their_trained - our_trained)} (not compared)")
    return checks


def peagle_parity(dims: Dims, seed: int) -> list[Check]:
    return peagle_case(dims, seed, holes=False) + peagle_case(dims, seed, holes=True)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", choices=("dflash", "peagle"), default=["dflash", "peagle"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a check this small gains nothing from more, and must not crowd the machine

    import transformers
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    print(f"anchors: specforge {installed('specforge')}, speculators {installed('speculators')} "
          f"(transformers {transformers.__version__}, torch {torch.__version__}); seed {args.seed}")
    dims = Dims()
    checks: list[Check] = []
    if "dflash" in args.methods:
        checks += dflash_parity(dims, args.seed)
    if "peagle" in args.methods:
        checks += peagle_parity(dims, args.seed)

    failed = [check.name for check in checks if check.status == "FAIL"]
    differs = [check.name for check in checks if check.status == "DIFFERS"]
    print()
    if differs:
        print(f"SEMANTIC DIFFERENCES (measured, fully accounted for): {'; '.join(differs)}")
    print("PARITY OK" if not failed else f"PARITY FAILED: {'; '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
