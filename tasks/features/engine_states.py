"""Target states from a vLLM server (`capture.backend: vllm`): the serving engine does the forward passes.

vLLM's `extract_hidden_states` speculative method keeps the states of the requested layers for every prompt
token, and a hidden-states connector writes them per request to a safetensors file (`hidden_states` [T, k, H],
`token_ids` [T]) whose path comes back in the response's `kv_transfer_params`. vLLM's own connector needs a
GPU; ours (tasks/serving/vllm_plugins/eaglet_hidden_states.py) is loaded from this repository by module path.

What eaglet sends and checks, so that the features are exactly the ones local capture writes:
  - its own rendered token ids (`/v1/completions` with `prompt` = ids, `max_tokens` 1): templates, truncation
    and loss masks stay eaglet's; the ids the engine saved must equal the ids sent, row for row;
  - the layer ids in vLLM's numbering (models/target_capture.vllm_layer_id: our decoder layer i is vLLM's
    i + 1), the three aux layers and then the last layer, whose raw output is normed here with the target's
    final norm (vLLM never stores the normed state);
  - the engine runs the target in `capture.compute_dtype` (default `model.dtype`), with prefix caching off
    (every token's state is computed for the request that asks for it).
Each state file is deleted once read. `capture.verify_fraction` of the records is compared with an in-process
capture afterwards (tasks/features/engine_check.py).

    with serve(capture_launch(cfg, states_dir, log)) as engine:
        source = EngineStates.for_run(cfg, engine, aux_ids)
        source.states(samples)   # [(aux [T, 3H], hidden [T, H]), ...]
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import torch
from safetensors.torch import load_file

from contract.config import RunConfig
from contract.secrets import unredacted_mapping
from models.eagle3 import RMSNorm
from models.target_capture import resolve_aux_layer_ids, vllm_layer_id
from models.target_heads import load_target_heads
from tasks.common.target_info import features_dtype
from tasks.features.preparation import Sample
from tasks.features.state_sources import States
from tasks.serving.engine import EngineLaunch, RunningEngine

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "serving" / "vllm_plugins"
CONNECTOR = "EagletHiddenStatesConnector"
CONNECTOR_MODULE = "eaglet_hidden_states"
LAYER_CONVENTION = ("vLLM id k = the state entering decoder layer k = output of decoder layer k-1 "
                    "(HF hidden_states[k]); eaglet's aux id i is sent as i+1, and the last layer's raw output "
                    "(id N) is normed here with the target's final norm")
#: Where online training's ranks find the engine the train stage started (tasks/features/online.py).
CAPTURE_URL_VARIABLE = "EAGLET_CAPTURE_URL"
REQUEST_TIMEOUT_S = 900.0
STATE_FILE_TIMEOUT_S = 120.0


class EngineCaptureError(RuntimeError):
    """The engine did not return the states of a record as sent (names the record)."""


def engine_layer_ids(aux_ids: list[int], num_layers: int) -> list[int]:
    """The layers asked of the engine, in its numbering: the aux layers, then the last decoder layer's output."""
    return [vllm_layer_id(layer) for layer in aux_ids] + [vllm_layer_id(num_layers - 1)]


def capture_launch(cfg: RunConfig, layer_ids: list[int], states_dir: Path, log_path: Path) -> EngineLaunch:
    """runtime.engines.vllm with `capture.engine_env`, extracting `layer_ids` through our connector into
    `states_dir`; `--dtype` (capture.compute_dtype) comes after the engine's float32 default so it wins."""
    launch = EngineLaunch.from_config("vllm", cfg.runtime.engines["vllm"], model=cfg.output_path / "target",
                                      log_path=log_path)
    launch.env.update(unredacted_mapping(cfg.capture.engine_env, "capture.engine_env"))
    inherited = launch.env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    launch.env["PYTHONPATH"] = os.pathsep.join(part for part in (str(PLUGIN_DIR), inherited) if part)
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    transfer = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(states_dir)}}
    launch.extra_args = [
        "--speculative-config", json.dumps(speculative),
        "--kv-transfer-config", json.dumps(transfer),
        "--max-model-len", str(engine_max_length(cfg)),
        "--no-enable-prefix-caching",
        "--dtype", features_dtype(cfg),
        *launch.extra_args,
    ]  # fmt: skip
    return launch


def engine_max_length(cfg: RunConfig) -> int:
    """Room for the longest record (validation.max_length) and the one token generated, within the target's
    positions (vLLM refuses a longer max_model_len)."""
    config = json.loads((cfg.output_path / "target" / "config.json").read_text())
    positions = config.get("max_position_embeddings")
    wanted = cfg.validation.max_length + 1
    return min(wanted, int(positions)) if positions else wanted


class HeadModel(torch.nn.Module):
    """The target's lm_head alone: what compact mode's teacher needs, without loading the whole target."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head


def final_norm(target_dir: Path, weight: torch.Tensor) -> RMSNorm:
    """The target's final RMSNorm (weight from its safetensors, eps from its config.json)."""
    config = json.loads((target_dir / "config.json").read_text())
    eps = config.get("rms_norm_eps")
    if eps is None:
        raise KeyError(f"{target_dir / 'config.json'}: no rms_norm_eps; only RMSNorm (Llama-style) targets are "
                       "supported by capture.backend vllm")
    norm = RMSNorm(weight.shape[0], float(eps))
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def read_state_file(path: Path) -> dict[str, torch.Tensor]:
    """Wait until the engine has written `path` (it holds `<path>.lock` exclusively until then), load it and
    delete both files."""
    lock = Path(f"{path}.lock")
    deadline = time.monotonic() + STATE_FILE_TIMEOUT_S
    while not lock.exists() and not path.exists():
        if time.monotonic() > deadline:
            raise EngineCaptureError(f"{path}: the engine never wrote this state file")
        time.sleep(0.01)
    if lock.exists():
        with open(lock) as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)
    tensors = load_file(str(path), device="cpu")
    lock.unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    return tensors


@dataclass
class EngineStates:
    """States from a running vLLM engine started by `capture_launch`: `batch_size` records in flight at once."""

    base_url: str
    served_model: str
    layer_ids: list[int]
    norm: RMSNorm
    lm_head: HeadModel
    batch_size: int

    @classmethod
    def for_run(cls, cfg: RunConfig, engine: RunningEngine, layer_ids: list[int]) -> "EngineStates":
        return cls.from_url(cfg, engine.base_url, layer_ids, engine.launch.served_model_name)

    @classmethod
    def from_url(cls, cfg: RunConfig, base_url: str, layer_ids: list[int],
                 served_model: str = "target") -> "EngineStates":
        """States from the engine at `base_url` (started by `capture_launch`, e.g. by another process)."""
        heads = load_target_heads(cfg.output_path / "target")
        return cls(base_url, served_model, layer_ids, final_norm(cfg.output_path / "target", heads.final_norm),
                   HeadModel(heads.lm_head), cfg.capture.engine_concurrency)

    def raw_states(self, sample: Sample, client: httpx.Client) -> torch.Tensor:
        """The engine's states of one record, [T, len(layer_ids), H], checked against the ids sent."""
        payload = {"model": self.served_model, "prompt": sample.input_ids, "max_tokens": 1, "temperature": 0.0}
        response = client.post(f"{self.base_url}/completions", json=payload)
        if response.status_code != 200:
            raise EngineCaptureError(f"record {sample.id} ({sample.key}): POST {self.base_url}/completions answered "
                                     f"HTTP {response.status_code}: {response.text[:300]}")
        transfer = response.json().get("kv_transfer_params") or {}
        if "hidden_states_path" not in transfer:
            raise EngineCaptureError(f"record {sample.id} ({sample.key}): the engine returned no hidden_states_path "
                                     "in kv_transfer_params; is it running extract_hidden_states with our connector?")
        tensors = read_state_file(Path(transfer["hidden_states_path"]))
        return checked_states(sample, tensors, len(self.layer_ids))

    def split(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, k + 1, H] -> (aux [T, k*H], final normed state [T, H])."""
        aux = raw[:, :-1, :].reshape(raw.shape[0], -1)
        with torch.no_grad():
            hidden = self.norm(raw[:, -1, :].float()).to(raw.dtype)
        return aux, hidden

    def states(self, samples: list[Sample]) -> States:
        with self.client() as client, ThreadPoolExecutor(max_workers=self.batch_size) as pool:
            raws = list(pool.map(lambda sample: self.raw_states(sample, client), samples))
        return [self.split(raw) for raw in raws]

    def client(self) -> httpx.Client:
        limits = httpx.Limits(max_connections=self.batch_size)
        return httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False, limits=limits)

    def head_model(self) -> Any:
        return self.lm_head


def checked_states(sample: Sample, tensors: dict[str, torch.Tensor], layers: int) -> torch.Tensor:
    """The file's `hidden_states`, refused unless its token ids are the ones sent and its shape is [T, layers, H]."""
    saved = tensors.get("token_ids")
    states = tensors.get("hidden_states")
    if saved is None or states is None:
        raise EngineCaptureError(f"record {sample.id} ({sample.key}): the state file holds {sorted(tensors)}, "
                                 "expected hidden_states and token_ids")
    saved_ids = [int(token) for token in saved.tolist()]
    if saved_ids != sample.input_ids:
        where = next((i for i, (a, b) in enumerate(zip(saved_ids, sample.input_ids)) if a != b),
                     min(len(saved_ids), len(sample.input_ids)))
        raise EngineCaptureError(f"record {sample.id} ({sample.key}): the engine captured {len(saved_ids)} tokens "
                                 f"for the {len(sample.input_ids)} sent; they differ from position {where}")
    if states.dim() != 3 or states.shape[0] != len(saved_ids) or states.shape[1] != layers:
        raise EngineCaptureError(f"record {sample.id} ({sample.key}): hidden_states has shape {tuple(states.shape)}, "
                                 f"expected [{len(saved_ids)}, {layers}, hidden]")
    return states


@contextmanager
def online_capture_engine(cfg: RunConfig) -> Iterator[None]:
    """For online training with `capture.backend: vllm`: the engine, started for the train stage, its URL in
    CAPTURE_URL_VARIABLE (inherited by torchrun's ranks) while it runs; nothing otherwise."""
    if cfg.training.mode != "online" or cfg.capture.backend != "vllm" or CAPTURE_URL_VARIABLE in os.environ:
        yield
        return
    from tasks.common.target_info import read_target_info

    info = read_target_info(cfg.output_path)
    layer_ids = engine_layer_ids(resolve_aux_layer_ids(cfg.capture.aux_layer_ids, info.num_hidden_layers),
                                 info.num_hidden_layers)
    states_dir = cfg.output_path / "train" / ".engine-states"
    with capture_engine(cfg, layer_ids, states_dir, "train-capture-vllm.log") as engine:
        os.environ[CAPTURE_URL_VARIABLE] = engine.base_url
        try:
            yield
        finally:
            os.environ.pop(CAPTURE_URL_VARIABLE, None)


@contextmanager
def capture_engine(cfg: RunConfig, layer_ids: list[int], states_dir: Path, log_name: str) -> Iterator[RunningEngine]:
    """The engine `capture_launch` describes, ready; stopped afterwards and its state folder removed (the capture
    stage's and online training's one way to run it)."""
    from tasks.serving.engine import serve

    launch = capture_launch(cfg, layer_ids, states_dir, cfg.output_path / "logs" / log_name)
    try:
        with serve(launch) as engine:
            yield engine
    finally:
        shutil.rmtree(states_dir, ignore_errors=True)


def engine_version(engine: RunningEngine) -> str:
    """What the engine says it is (`GET /version`), or 'unknown'."""
    try:
        response = httpx.get(f"{engine.root_url}/version", timeout=10.0, trust_env=False)
        return str(response.json().get("version", "unknown"))
    except (httpx.HTTPError, ValueError):
        return "unknown"
