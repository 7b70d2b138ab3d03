"""Reading the offline features the capture stage writes, and the one definition of their on-disk format.

Layout under `<output_dir>/features/`:

    manifest.json                        what was captured, how, from which target (tasks/features/manifest.py)
    capture_report.json                  per-id accounting of the capture stage
    {train,eval}/shard-00000.safetensors records packed along the token axis, no padding

Each shard holds R records and N tokens in total; record r owns rows offsets[r]:offsets[r+1]. Rows are
UNSHIFTED and token-aligned: row t holds token x_t, its loss mask, and the target's states after
consuming x_0..x_t. The trainer does the EAGLE3 shift itself.

    input_ids            int32  [N]
    loss_mask            uint8  [N]          1 on assistant tokens incl. the end-of-turn token
    offsets              int64  [R+1]
    aux_hidden_state     [N, kH]             concat of the aux layers' outputs, ascending ids (k = 3)
      lossless: capture.dtype (bf16 by default)
      compact:  float8_e4m3fn, with
    aux_scale            fp16   [N, k]       (compact) one absmax/448 scale per row and aux layer
    hidden_state         [N, H]              (lossless) final normed state = lm_head input, capture.dtype
    teacher_topk_ids     int32  [N, K]       (compact) top-K of the target distribution over the DRAFT vocab, draft ids
    teacher_topk_logprobs fp16  [N, K]       (compact) their log-probs renormalised over the draft vocab
    target_top1          int32  [N]          (compact) argmax of the target over the FULL vocab (target ids)

Shard metadata (safetensors `__metadata__`): schema, split, mode, record_ids (JSON list), fingerprint of the
capture settings, input_hash of the records' tokens.

Why fp8 e4m3 rather than int8 for compact aux: the three aux layers differ ~10x in scale (SmolLM2: rms 2.7,
6.4, 23) and some rows carry massive activations (absmax ~350 at the high layer). int8 with one absmax
scale per row loses the low layer (median relative L2 error 27%); fp8 keeps a relative precision per
element (~2-3% error), and one scale per row *and layer* ([N, 3], 6 bytes/token) brings every layer to
~2.2% median error (measured on 8 SmolLM2 train records).
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from contract.hashing import hash_file

from models.target_capture import resolve_aux_layer_ids

Tensor = torch.Tensor
SCHEMA_VERSION = 1
SHARD_SCHEMA = f"eaglet.features/{SCHEMA_VERSION}"
STRATEGY = "eagle3"
AUX_CONVENTION = "output of decoder layer i = HF hidden_states[i+1]"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
COMMON_TENSORS = ("input_ids", "loss_mask", "aux_hidden_state")
MODE_TENSORS = {
    "lossless": ("hidden_state",),
    "compact": ("aux_scale", "teacher_topk_ids", "teacher_topk_logprobs", "target_top1"),
}


#: Shards a FeatureSet keeps open (memory-mapped) at once; the trainer's shuffle buffer spans more, reopened as needed.
OPEN_SHARDS = 4


class FeatureError(ValueError):
    """A features directory or shard that cannot be used; the message names the file."""


# --- compact aux ---------------------------------------------------------------------------------------------

def quantise_aux(aux: Tensor, num_layers: int) -> tuple[Tensor, Tensor]:
    """aux [n, kH] -> (fp8 e4m3 [n, kH], fp16 scale [n, k]); scale = absmax/448 per row and aux layer."""
    rows = aux.shape[0]
    segments = aux.float().reshape(rows, num_layers, -1)
    scale = (segments.abs().amax(dim=-1) / FP8_MAX).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero (or fp16-underflowing) segments
    quantised = (segments / scale.float().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantised.reshape(rows, -1), scale


def dequantise_aux(aux: Tensor, scale: Tensor | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """Compact aux rows (fp8 [n, kH] + scale [n, k]) back to `dtype`; lossless rows are only cast."""
    if scale is None:
        if aux.dtype == FP8:
            raise ValueError("fp8 aux rows need their aux_scale to be dequantised")
        return aux.to(dtype)
    rows, layers = scale.shape[0], scale.shape[-1]
    values = aux.to(torch.float32).reshape(rows, layers, -1) * scale.to(torch.float32).reshape(rows, layers, 1)
    return values.reshape(rows, -1).to(dtype)


def dense_teacher(topk_ids: Tensor, topk_logprobs: Tensor, draft_vocab_size: int, renormalise: bool = True) -> Tensor:
    """Compact teacher rows -> probabilities float32 [n, Vd] over the draft vocab, zero outside the top-K.
    With `renormalise`, each row is rescaled to sum to 1 (the top-K carry most, not all, of the mass)."""
    probs = torch.zeros(topk_ids.shape[0], draft_vocab_size, dtype=torch.float32)
    probs.scatter_(1, topk_ids.long(), topk_logprobs.float().exp())
    if renormalise:
        probs /= probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return probs


# --- manifest ------------------------------------------------------------------------------------------------

def read_manifest(features_dir: Path) -> dict[str, Any]:
    path = Path(features_dir) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no features manifest; run the capture stage (or let it finish)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise FeatureError(f"{path}: not valid JSON ({error})") from None


def expected_manifest_fields(cfg: Any, target_info: Any) -> dict[str, Any]:
    """What a manifest must say to be used by this run config and target (target.json content or TargetInfo)."""
    info = target_info.model_dump() if hasattr(target_info, "model_dump") else dict(target_info)
    return {
        "schema_version": SCHEMA_VERSION,
        "strategy": STRATEGY,
        "mode": cfg.capture.mode,
        "aux_layer_ids": resolve_aux_layer_ids(cfg.capture.aux_layer_ids, info["num_hidden_layers"]),
        "target_revision": info["revision"],
        "tokenizer_hash": info["tokenizer_hash"],
        "hidden_size": info["hidden_size"],
        "vocab_size": info["vocab_size"],
        "draft_vocab_size": cfg.capture.draft_vocab_size or info["vocab_size"],
    }


def check_manifest(manifest: Mapping[str, Any], cfg: Any, target_info: Any) -> None:
    """Refuse features captured under another config or target: ValueError naming each field that differs,
    with what this run expects and what the manifest holds."""
    expected = expected_manifest_fields(cfg, target_info)
    wrong = [f"'{name}': expected {value!r}, found {manifest.get(name, '<missing>')!r}"
             for name, value in expected.items() if manifest.get(name) != value]
    if wrong:
        raise ValueError("features manifest does not match this run (rerun the capture stage): " + "; ".join(wrong))


# --- shards --------------------------------------------------------------------------------------------------

def checked_layout(path: Path, metadata: Mapping[str, str], offsets: Tensor | None, rows_of: Mapping[str, int],
                   mode: str | None) -> list[str]:
    """The shard's record ids, after checking its schema, tensors, offsets and row counts; FeatureError names
    the file. `rows_of`: each tensor's row count (read from the header alone when the shard is memory-mapped)."""
    if metadata.get("schema") != SHARD_SCHEMA:
        raise FeatureError(f"{path}: shard schema {metadata.get('schema')!r}, expected {SHARD_SCHEMA!r}")
    mode = mode or metadata.get("mode", "")
    try:
        record_ids = json.loads(metadata["record_ids"])
    except (KeyError, json.JSONDecodeError):
        raise FeatureError(f"{path}: metadata has no readable record_ids") from None
    required = ("offsets", *COMMON_TENSORS, *MODE_TENSORS.get(mode, ()))
    missing = [name for name in required if name not in rows_of]
    if missing or offsets is None:
        raise FeatureError(f"{path}: missing tensors {missing} for mode {mode!r}")
    rows = rows_of["input_ids"]
    if (offsets.numel() != len(record_ids) + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != rows
            or bool((offsets[1:] < offsets[:-1]).any())):
        raise FeatureError(f"{path}: offsets {offsets.tolist()[:8]}... do not describe {len(record_ids)} records "
                           f"over {rows} rows")
    for name in required[1:]:
        if rows_of[name] != rows:
            raise FeatureError(f"{path}: tensor '{name}' has {rows_of[name]} rows, input_ids has {rows}")
    return record_ids


def load_shard(path: Path, mode: str | None = None) -> tuple[dict[str, Tensor], list[str], dict[str, str]]:
    """Every tensor of a shard, its record ids and metadata, checked for consistency.
    A truncated or corrupt file raises FeatureError naming it."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as error:
        raise FeatureError(f"{path}: unreadable or truncated shard ({error})") from None
    rows_of = {name: int(tensor.shape[0]) for name, tensor in tensors.items()}
    record_ids = checked_layout(path, metadata, tensors.get("offsets"), rows_of, mode)
    return tensors, record_ids, metadata


class ShardReader:
    """One shard, memory-mapped: its record ids and offsets are read on opening (checked like `load_shard`), each
    record's rows only when asked for, so memory holds the records in use rather than the shard."""

    def __init__(self, path: Path, mode: str | None = None) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        try:
            self.handle = safe_open(str(self.path), framework="pt")
            metadata = dict(self.handle.metadata() or {})
            names = list(self.handle.keys())
            rows_of = {name: int(self.handle.get_slice(name).get_shape()[0]) for name in names}
            offsets = self.handle.get_tensor("offsets") if "offsets" in names else None
        except Exception as error:
            raise FeatureError(f"{self.path}: unreadable or truncated shard ({error})") from None
        self.record_ids = checked_layout(self.path, metadata, offsets, rows_of, mode)
        self.offsets = offsets
        self.names = [name for name in names if name != "offsets"]

    def __len__(self) -> int:
        return len(self.record_ids)

    def lengths(self) -> list[int]:
        return (self.offsets[1:] - self.offsets[:-1]).tolist()

    def record(self, index: int) -> dict[str, Any]:
        """One record's dict: its id and every per-token tensor, read from the file for its rows alone."""
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return {"id": self.record_ids[index], **{name: self.handle.get_slice(name)[start:end] for name in self.names}}


@dataclass
class ShardEntry:
    path: Path
    records: int
    tokens: int
    bytes: int
    sha256: str | None


class FeatureSet:
    """The records of one split, shard after shard, as dicts of tensors (see the module docstring).

        features = FeatureSet(cfg.output_path / "features", "train")
        check_manifest(features.manifest, cfg, target_info)
        for record in features:             # {"id", "input_ids", "loss_mask", "aux_hidden_state", ...}
            aux = features.aux_rows(record)  # float32 [T, 3H], dequantised in compact mode

    Opening checks every shard listed in the manifest exists with the recorded size (truncation);
    `verify=True` also compares sha256. Reading a shard checks its header, offsets and row counts.
    """

    def __init__(self, features_dir: Path | str, split: str, verify: bool = False) -> None:
        self.features_dir = Path(features_dir)
        self.split = split
        self.manifest = read_manifest(self.features_dir)
        splits = self.manifest.get("splits", {})
        if split not in splits:
            raise KeyError(f"{self.features_dir / 'manifest.json'}: no split '{split}' (has {sorted(splits)})")
        self.info = splits[split]
        self.mode = self.manifest["mode"]
        self.shards: list[ShardEntry] = []
        for entry in self.info["shards"]:
            shard = ShardEntry(self.features_dir / entry["file"], entry["records"], entry["tokens"], entry["bytes"],
                               entry.get("sha256"))
            if not shard.path.is_file():
                raise FeatureError(f"{shard.path}: shard listed in the manifest is missing")
            size = shard.path.stat().st_size
            if size != shard.bytes:
                raise FeatureError(f"{shard.path}: {size} bytes on disk, the manifest records {shard.bytes} "
                                   "(truncated or rewritten)")
            if verify and shard.sha256 and hash_file(shard.path) != shard.sha256:
                raise FeatureError(f"{shard.path}: content does not match the manifest's sha256 (corrupt)")
            self.shards.append(shard)
        self._starts = [0]
        for shard in self.shards:
            self._starts.append(self._starts[-1] + shard.records)
        self._open: OrderedDict[int, ShardReader] = OrderedDict()

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def tokens(self) -> int:
        return sum(shard.tokens for shard in self.shards)

    def _reader(self, index: int) -> ShardReader:
        """Shard `index` opened; the least recently used of more than OPEN_SHARDS is closed again."""
        reader = self._open.get(index)
        if reader is None:
            shard = self.shards[index]
            reader = ShardReader(shard.path, self.mode)
            if len(reader) != shard.records:
                raise FeatureError(f"{shard.path}: {len(reader)} records, the manifest records {shard.records}")
            self._open[index] = reader
            while len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)
        self._open.move_to_end(index)
        return reader

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for index in range(len(self.shards)):
            reader = self._reader(index)
            for position in range(len(reader)):
                yield reader.record(position)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"record {index} of {len(self)}")
        index %= len(self)
        shard = bisect.bisect_right(self._starts, index) - 1
        return self._reader(shard).record(index - self._starts[shard])

    def records(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The records at these positions (the trainer's batch)."""
        return [self[index] for index in indices]

    def index(self) -> list[tuple[str, int]]:
        """(record id, token count) of every record, in order (each shard's header and offsets only)."""
        entries: list[tuple[str, int]] = []
        for shard in range(len(self.shards)):
            reader = self._reader(shard)
            entries.extend(zip(reader.record_ids, reader.lengths()))
        return entries

    def shard_of(self) -> list[int]:
        """The shard each record lies in, in record order (what a shard-aware shuffle groups by)."""
        return [shard for shard, entry in enumerate(self.shards) for _ in range(entry.records)]

    def aux_rows(self, record: Mapping[str, Tensor], dtype: torch.dtype = torch.float32) -> Tensor:
        """The record's aux rows as `dtype` (dequantised in compact mode)."""
        return dequantise_aux(record["aux_hidden_state"], record.get("aux_scale"), dtype)
