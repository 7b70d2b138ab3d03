"""Capturing the target's hidden states that an EAGLE3 drafter is trained on (docs/architecture.md §3 "Features").

For tokens x_0..x_{T-1}, row t of the capture holds the target's states after consuming x_0..x_t:

    aux_hidden_state[t] = concat(h[id0][t], h[id1][t], h[id2][t])   # ascending ids, width 3H
    hidden_state[t]     = norm(h[N-1][t])                             # the lm_head input, width H

where h[i] is *the output of decoder layer i* (0-indexed), i.e. HF's `output_hidden_states[i + 1]`
(index 0 there is the embedding output). Note that HF's `output_hidden_states[-1]` is the *normed* final
state (transformers ties it to `last_hidden_state`), so it is not the raw output of the last layer.

The states are read with forward hooks on the decoder layers and the final norm (`model.model.layers[i]`,
`model.model.norm` for every supported family: models/target_families.py) while the base
model runs under no_grad (the lm_head is not applied). Records of different length are batched with right
padding and an attention mask; the padded rows are cut away again, so what comes back per record is
exactly what a single-record forward pass gives.

`teacher_topk` applies the lm_head to captured final states to build the sparse teacher of compact mode.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from models.target_families import family_of_model, submodule

Tensor = torch.Tensor


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE3's default aux layers `[1, N//2 - 1, N - 4]` (outputs of those decoder layers, 0-indexed).
    For N < 8 they repeat or leave the range; `resolve_aux_layer_ids` refuses that."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def resolve_aux_layer_ids(aux_layer_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """The configured ids (or the defaults), checked: in range [0, N) and strictly ascending.

    Engines capture each layer once, in layer order, so a repeated or unordered id could never be served.
    """
    configured = aux_layer_ids is not None
    ids = [int(i) for i in aux_layer_ids] if configured else default_aux_layer_ids(num_layers)
    origin = "capture.aux_layer_ids" if configured else f"the default aux layers [1, N//2 - 1, N - 4] = {ids}"
    hint = "" if configured else f" for a target with N = {num_layers} decoder layers; set capture.aux_layer_ids"
    if not ids:
        raise ValueError("capture.aux_layer_ids is empty; give at least one decoder layer id")
    for position, layer_id in enumerate(ids):
        if not 0 <= layer_id < num_layers:
            raise ValueError(f"{origin}: id {layer_id} at position {position} is out of range: the target has "
                             f"{num_layers} decoder layers (ids 0..{num_layers - 1}){hint}")
        if position and layer_id <= ids[position - 1]:
            raise ValueError(f"{origin} must be strictly ascending: {layer_id} at position {position} follows "
                             f"{ids[position - 1]} (got {ids}){hint}")
    return ids


def vllm_layer_id(layer_id: int) -> int:
    """vLLM numbers the state *entering* decoder layer k (k = 0: the embedding output), so the output of our
    decoder layer i is vLLM's i + 1 (the same numbering as HF's `output_hidden_states`)."""
    return layer_id + 1


def decoder_parts(model: Any) -> tuple[Any, Any, Any]:
    """(base model, its decoder layers, its final norm) of an HF *ForCausalLM, where its family's row in
    models/target_families.py says they are."""
    family = family_of_model(model)
    base = submodule(model, family.layers.rsplit(".", 1)[0])
    layers = submodule(model, family.layers)
    norm = submodule(model, family.final_norm)
    if base is None or layers is None or norm is None:
        raise TypeError(f"{type(model).__name__} ({family.model_type}): expected {family.layers} and "
                        f"{family.final_norm}; capture hooks cannot be placed")
    return base, layers, norm


def layer_output(output: Any) -> Tensor:
    """A decoder layer returns a tensor (transformers 5) or a tuple whose first item is the hidden state."""
    return output[0] if isinstance(output, (tuple, list)) else output


@contextmanager
def captured_outputs(model: Any, layer_ids: Sequence[int]) -> Iterator[dict[Any, Tensor]]:
    """Forward hooks that record the outputs of decoder layers `layer_ids` (the aux states) while open;
    with `"norm"` among the ids, also the final norm's output (the lm_head input)."""
    _, layers, norm = decoder_parts(model)
    captured: dict[Any, Tensor] = {}
    modules = {layer_id: norm if layer_id == "norm" else layers[layer_id] for layer_id in layer_ids}
    handles = [module.register_forward_hook(lambda _m, _a, out, key=key: captured.__setitem__(key, layer_output(out)))
               for key, module in modules.items()]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def capture_padded(model: Any, input_ids: Tensor, aux_layer_ids: Sequence[int],
                   attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Run the base model on input_ids [B, T]; return (aux [B, T, k*H], hidden [B, T, H]) in the model dtype.

    Rows beyond each record's length (where attention_mask is 0) hold padding garbage: slice them away.
    """
    base, layers, _ = decoder_parts(model)
    ids = resolve_aux_layer_ids(aux_layer_ids, len(layers))
    device = next(model.parameters()).device
    with captured_outputs(model, [*ids, "norm"]) as captured, torch.no_grad():
        base(input_ids=input_ids.to(device),
             attention_mask=None if attention_mask is None else attention_mask.to(device),
             use_cache=False)
    missing = [i for i in [*ids, "norm"] if i not in captured]
    if missing:
        raise RuntimeError(f"capture hooks did not fire for {missing}: the model skipped those modules")
    aux = torch.cat([captured[i] for i in ids], dim=-1)
    return aux, captured["norm"]


def every_layer_output(model: Any, input_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """One record's raw output of every decoder layer, [N, T, H], and the final normed state [T, H]: what an
    engine's states are compared against to tell which layer each of its slots holds."""
    base, layers, _ = decoder_parts(model)
    device = next(model.parameters()).device
    ids = torch.as_tensor(list(input_ids), dtype=torch.long).reshape(1, -1).to(device)
    keys = [*range(len(layers)), "norm"]
    with captured_outputs(model, keys) as captured, torch.no_grad():
        base(input_ids=ids, use_cache=False)
    return torch.stack([captured[i][0] for i in range(len(layers))]), captured["norm"][0]


def capture_states(model: Any, input_ids: Tensor | Sequence[Sequence[int]], aux_layer_ids: Sequence[int],
                   pad_token_id: int = 0) -> Any:
    """The features of one record or of a batch of records.

    input_ids LongTensor [1, T] (or [T]) -> (aux [T, 3H], hidden [T, H]).
    A list of token-id sequences (any lengths) -> a list of (aux [T_i, 3H], hidden [T_i, H]), computed in one
    right-padded forward pass with an attention mask; padding rows are not returned.
    """
    if isinstance(input_ids, Tensor):
        ids = input_ids.reshape(1, -1) if input_ids.dim() == 1 else input_ids
        if ids.shape[0] != 1:
            raise ValueError(f"capture_states takes one record as a [1, T] tensor (got {tuple(ids.shape)}); "
                             "pass a list of sequences for a batch")
        aux, hidden = capture_padded(model, ids.long(), aux_layer_ids)
        return aux[0], hidden[0]
    sequences = [torch.as_tensor(sequence, dtype=torch.long).reshape(-1) for sequence in input_ids]
    if not sequences:
        return []
    lengths = [len(sequence) for sequence in sequences]
    if min(lengths) == 0:
        raise ValueError("capture_states: a record has no tokens")
    batch = torch.full((len(sequences), max(lengths)), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, sequence in enumerate(sequences):
        batch[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1
    aux, hidden = capture_padded(model, batch, aux_layer_ids, attention_mask=mask)
    return [(aux[row, :length], hidden[row, :length]) for row, length in enumerate(lengths)]


def teacher_topk(model: Any, hidden: Tensor, draft_ids: Tensor, k: int,
                 chunk_rows: int = 256) -> tuple[Tensor, Tensor, Tensor]:
    """The sparse teacher of compact features, from final normed states hidden [T, H].

    logits = lm_head(hidden) (full vocab, fp32). Returns
      topk_ids      int32 [T, k']  DRAFT ids of the k' = min(k, Vd) most likely draft-vocab tokens,
      topk_logprobs fp16  [T, k']  their log-probs renormalised over the draft vocab
                                    (log_softmax(logits[:, draft_ids]), docs/architecture.md §3 "Teacher"),
      target_top1   int32 [T]      argmax over the FULL vocab (target ids), so a trainer can mask positions
                                    whose target top-1 lies outside the draft vocab.
    `draft_ids` is the ascending list of target ids in the draft vocab (draft id i -> target id draft_ids[i]).
    """
    head = model.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output embeddings (lm_head)")
    weight = head.weight
    k = min(k, int(draft_ids.numel()))
    ids, logprobs, top1 = [], [], []
    columns = draft_ids.to(weight.device)
    with torch.no_grad():
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = hidden[start:start + chunk_rows].to(device=weight.device, dtype=weight.dtype)
            logits = head(rows).float()
            top1.append(logits.argmax(dim=-1).to(torch.int32).cpu())
            draft_logprobs = torch.log_softmax(logits[:, columns], dim=-1)
            values, indices = draft_logprobs.topk(k, dim=-1)
            ids.append(indices.to(torch.int32).cpu())
            logprobs.append(values.to(torch.float16).cpu())
    if not ids:
        return (torch.zeros(0, k, dtype=torch.int32), torch.zeros(0, k, dtype=torch.float16),
                torch.zeros(0, dtype=torch.int32))
    return torch.cat(ids), torch.cat(logprobs), torch.cat(top1)
