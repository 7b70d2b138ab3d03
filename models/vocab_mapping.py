"""The draft vocabulary: which Vd of the target's V token ids the drafter predicts.

docs/architecture.md §3 "Vocab mapping".

Counting token frequencies over the loss-masked tokens of the training split, the Vd most frequent ids are
kept (ties broken by the smaller id; when fewer than Vd ids were seen, the smallest unseen ids 0, 1, ...
fill the rest), sorted ascending as `used`. Then

    d2t[i] = used[i] - i        int64 [Vd]   (target_id = i + d2t[i])
    t2d[j] = j in used          bool  [V]

Both go into the draft checkpoint exactly like this (SGLang/vLLM/SpecForge read these names). Vd = V (or
None) is the identity mapping: d2t all zeros, t2d all true.

This module also holds the safetensors writer the features use: it streams tensors to a file with a
canonical (sorted) JSON header, so equal content gives equal bytes and equal hashes across processes
(the safetensors library writes its metadata map in random order).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterable, Mapping, Sequence

import torch

from contract.hashing import hash_file

Tensor = torch.Tensor
MAPPING_SCHEMA = "eaglet.vocab_mapping/1"
SAFETENSORS_DTYPES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
    torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@dataclass
class VocabMapping:
    """d2t int64 [Vd] and t2d bool [V] (see the module docstring)."""

    d2t: Tensor
    t2d: Tensor

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def vocab_size(self) -> int:
        return int(self.t2d.numel())

    @property
    def used_ids(self) -> Tensor:
        """The target ids of the draft vocab, ascending: used[i] = i + d2t[i]."""
        return torch.arange(self.draft_vocab_size, dtype=torch.int64) + self.d2t

    @property
    def is_identity(self) -> bool:
        return self.draft_vocab_size == self.vocab_size

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Target ids of draft ids (any shape)."""
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.int64)
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def target_to_draft_mask(self, target_ids: Tensor) -> Tensor:
        """True where a target id (any shape) is in the draft vocab."""
        target_ids = torch.as_tensor(target_ids, dtype=torch.int64)
        return self.t2d.to(target_ids.device)[target_ids]

    def target_to_draft(self, target_ids: Tensor) -> Tensor:
        """Draft ids of target ids (any shape); -1 where the target id is not in the draft vocab."""
        target_ids = torch.as_tensor(target_ids, dtype=torch.int64)
        t2d = self.t2d.to(target_ids.device)
        draft = torch.cumsum(t2d.to(torch.int64), 0) - 1
        return torch.where(t2d[target_ids], draft[target_ids], torch.full_like(target_ids, -1))


def count_tokens(sequences: Iterable[tuple[Sequence[int], Sequence[int]]], vocab_size: int) -> Tensor:
    """Frequencies int64 [V] of the tokens whose loss mask is 1, over (input_ids, loss_mask) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in sequences:
        ids_tensor = torch.as_tensor(ids, dtype=torch.int64)
        supervised = ids_tensor[torch.as_tensor(mask, dtype=torch.bool)]
        if supervised.numel() and int(supervised.max()) >= vocab_size:
            raise ValueError(f"token id {int(supervised.max())} is outside the target vocab of {vocab_size}")
        counts += torch.bincount(supervised, minlength=vocab_size)
    return counts


def counts_tensor(token_counts: Counter | Mapping[int, int] | Tensor, vocab_size: int) -> Tensor:
    """A Counter {id: count} or a tensor [V] as int64 [V]."""
    if isinstance(token_counts, Tensor):
        if token_counts.shape != (vocab_size,):
            raise ValueError(f"token counts have shape {tuple(token_counts.shape)}, expected ({vocab_size},)")
        return token_counts.to(torch.int64)
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for token_id, count in token_counts.items():
        if not 0 <= int(token_id) < vocab_size:
            raise ValueError(f"token id {token_id} is outside the target vocab of {vocab_size}")
        counts[int(token_id)] = int(count)
    return counts


def build_vocab_mapping(token_counts: Counter | Mapping[int, int] | Tensor, vocab_size: int,
                        draft_vocab_size: int | None) -> VocabMapping:
    """The Vd most frequent ids (ties: smaller id first; unseen ids fill up from 0), sorted ascending."""
    if draft_vocab_size is None or draft_vocab_size == vocab_size:
        return VocabMapping(torch.zeros(vocab_size, dtype=torch.int64), torch.ones(vocab_size, dtype=torch.bool))
    if not 0 < draft_vocab_size < vocab_size:
        raise ValueError(f"capture.draft_vocab_size = {draft_vocab_size} must lie in [1, {vocab_size}] "
                         f"(the target vocab size)")
    counts = counts_tensor(token_counts, vocab_size)
    # A stable sort on descending counts keeps ascending ids within a tie, and puts the unseen ids (count 0)
    # last in ascending order: its first Vd entries are exactly the rule above, padding included.
    order = torch.sort(-counts, stable=True).indices
    used = torch.sort(order[:draft_vocab_size]).values
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return VocabMapping(d2t, t2d)


def mapping_summary(mapping: VocabMapping, token_counts: Tensor | None = None) -> dict[str, Any]:
    """Vd, V and, given the counts, how much of the supervised text the draft vocab covers."""
    summary: dict[str, Any] = {"draft_vocab_size": mapping.draft_vocab_size, "vocab_size": mapping.vocab_size}
    if token_counts is not None:
        total = int(token_counts.sum())
        covered = int(token_counts[mapping.t2d].sum())
        seen = int((token_counts > 0).sum())
        summary.update({
            "counted_tokens": total,
            "distinct_tokens_seen": seen,
            "covered_tokens": covered,
            "coverage": covered / total if total else 0.0,
            "padding_ids": int(((token_counts == 0) & mapping.t2d).sum()),
        })
    return summary


def save_vocab_mapping(mapping: VocabMapping, path: Path, summary: Mapping[str, Any] | None = None) -> str:
    """Write d2t/t2d (+ metadata: schema, Vd, V, counts summary) atomically; returns the file's sha256."""
    metadata = {"schema": MAPPING_SCHEMA, "draft_vocab_size": str(mapping.draft_vocab_size),
                "vocab_size": str(mapping.vocab_size),
                "summary": json.dumps(dict(summary or mapping_summary(mapping)), sort_keys=True)}
    write_safetensors_file(path, {"d2t": mapping.d2t.contiguous(), "t2d": mapping.t2d.contiguous()}, metadata)
    return mapping_hash(path)


def load_vocab_mapping(path: Path) -> VocabMapping:
    """Read a mapping written by save_vocab_mapping (or any file with d2t int64 [Vd] and t2d bool [V])."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            d2t, t2d = handle.get_tensor("d2t"), handle.get_tensor("t2d")
    except Exception as error:  # safetensors raises its own error types for bad headers and short files
        raise ValueError(f"{path}: not a readable vocab mapping ({error})") from None
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool or d2t.dim() != 1 or t2d.dim() != 1:
        raise ValueError(f"{path}: expected d2t int64 [Vd] and t2d bool [V], found d2t {d2t.dtype} "
                         f"{tuple(d2t.shape)} and t2d {t2d.dtype} {tuple(t2d.shape)}")
    mapping = VocabMapping(d2t, t2d)
    used = mapping.used_ids
    if int(t2d.sum()) != d2t.numel() or (used.numel() and (int(used.max()) >= t2d.numel() or not bool(t2d[used].all()))):
        raise ValueError(f"{path}: d2t and t2d disagree (t2d has {int(t2d.sum())} true entries for Vd {d2t.numel()})")
    return mapping


def mapping_hash(path: Path) -> str:
    """sha256 of the mapping file's bytes (deterministic: the writer's header is canonical)."""
    return hash_file(path)


# --- safetensors, streamed with a canonical header ------------------------------------------------------------

def safetensors_header(shapes: Mapping[str, tuple[torch.dtype, Sequence[int]]], metadata: Mapping[str, str]) -> tuple[bytes, list[str]]:
    """The 8-byte length + JSON header for tensors laid out in sorted name order; returns (header, order)."""
    order = sorted(shapes)
    header: dict[str, Any] = {"__metadata__": {key: str(value) for key, value in metadata.items()}}
    offset = 0
    for name in order:
        dtype, shape = shapes[name]
        if dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"tensor '{name}': dtype {dtype} has no safetensors name")
        count = 1
        for size in shape:
            count *= int(size)
        size_bytes = count * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": [int(s) for s in shape],
                        "data_offsets": [offset, offset + size_bytes]}
        offset += size_bytes
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # pad so the data starts 8-byte aligned, as the reference writer does
    return struct.pack("<Q", len(text)) + text, order


def write_tensor_bytes(handle: IO[bytes], tensor: Tensor) -> None:
    """Raw little-endian bytes of a CPU tensor, without an intermediate copy of the whole buffer."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        handle.write(memoryview(flat.view(torch.uint8).numpy()))


def write_safetensors(handle: IO[bytes], tensors: Mapping[str, Tensor | Sequence[Tensor]], metadata: Mapping[str, str]) -> None:
    """Write a safetensors file to an open binary handle. A value may be a list of pieces concatenated along
    dim 0: they are written one after the other, never concatenated in memory."""
    pieces = {name: [value] if isinstance(value, Tensor) else list(value) for name, value in tensors.items()}
    shapes = {}
    for name, parts in pieces.items():
        if not parts:
            raise ValueError(f"tensor '{name}' has no pieces")
        dtype, tail = parts[0].dtype, tuple(parts[0].shape[1:])
        for part in parts:
            if part.dtype != dtype or tuple(part.shape[1:]) != tail:
                raise ValueError(f"tensor '{name}': pieces disagree ({part.dtype} {tuple(part.shape)} vs {dtype} [*, {tail}])")
        rows = sum(int(part.shape[0]) for part in parts) if parts[0].dim() else None
        shapes[name] = (dtype, tuple(parts[0].shape) if rows is None else (rows, *tail))
    header, order = safetensors_header(shapes, metadata)
    handle.write(header)
    for name in order:
        for part in pieces[name]:
            write_tensor_bytes(handle, part)


def write_safetensors_file(path: Path, tensors: Mapping[str, Tensor | Sequence[Tensor]], metadata: Mapping[str, str]) -> None:
    """write_safetensors to a temp file beside `path`, fsynced, then renamed onto it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            write_safetensors(handle, tensors, metadata)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp_name, 0o644)
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
