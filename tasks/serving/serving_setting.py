"""How an engine drafts with the eaglet: the settings the benchmark sweeps and the registry recommends.

A chain drafts `steps` tokens one after the other and verifies `steps + 1` (vLLM's `num_speculative_tokens`,
SGLang's `--speculative-num-steps S --speculative-eagle-topk 1 --speculative-num-draft-tokens S+1`). A tree
(SGLang only) keeps `topk` branches per draft step and verifies the best `num_draft_tokens` of them: more
tokens checked per target forward, for a larger verify batch. Which one pays depends on the drafter's
acceptance and on the engine's step times, so the benchmark measures each on the live engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from models.eagle3 import METHOD_FLAGS


#: The draft methods each engine serves as trained (models/eagle3.py METHOD_FLAGS). SGLang 0.5's llama_eagle3.py reads
#: neither fc_norm nor norm_output: it would load an EAGLE 3.1 export without its fc_norm tensors and carry the
#: pre-norm output, serving another drafter than the one trained; it has no parallel drafting (P-EAGLE) either; its
#: DFlash model loads the layers but drafts with the target's full-vocabulary head, dropping the trained one.
SERVED_METHODS = {"vllm": ("eagle3", "eagle3.1", "peagle", "dflash"), "sglang": ("eagle3",)}
#: The methods vLLM drafts with `parallel_drafting` (all k tokens of a round in one forward pass): the draft's own flag.
PARALLEL_METHODS = tuple(method for method, flags in METHOD_FLAGS.items() if flags["parallel_drafting"])


def export_method(export: Path) -> str:
    """The draft method an export was trained as, from its contract.json (exports from before draft.method, and a
    directory without a contract, are EAGLE3)."""
    path = export / "contract.json"
    if not path.is_file():
        return "eagle3"
    return str(json.loads(path.read_text()).get("method", "eagle3"))


def vllm_speculative_config(method: str, steps: int, model: Optional[str] = None) -> dict[str, Any]:
    """vLLM's --speculative-config for a `method` drafter drafting `steps` tokens: the EAGLE3 methods are vLLM's
    eagle3 (EAGLE 3.1's flags are in the export's config.json), P-EAGLE adds `parallel_drafting`; DFlash is vLLM's
    dflash."""
    config: dict[str, Any] = {"method": "dflash" if method == "dflash" else "eagle3"}
    if model is not None:
        config["model"] = model
    config["num_speculative_tokens"] = steps
    if method in PARALLEL_METHODS:
        config["parallel_drafting"] = True
    return config


def unserved_method(kind: str, method: str) -> Optional[str]:
    """Why `kind` would not serve a `method` drafter as trained; None when it does.
    The benchmark and `eaglet serve` both refuse with it before an engine starts."""
    served = SERVED_METHODS.get(kind, ("eagle3",))
    if method in served:
        return None
    return f"an {method} drafter (draft.method), which {kind} does not serve (it serves {', '.join(served)})"


def engines_serving(method: str) -> str:
    """The engines that serve a `method` drafter as trained, for the refusal's hint."""
    return ", ".join(engine for engine, methods in SERVED_METHODS.items() if method in methods)


@dataclass(frozen=True)
class ServingSetting:
    steps: int
    topk: int = 1
    num_draft_tokens: int = 0   # 0: a chain's steps + 1

    def __post_init__(self) -> None:
        if self.steps < 1 or self.topk < 1:
            raise ValueError(f"a serving setting needs steps >= 1 and topk >= 1, got {self.as_dict()}")
        if self.num_draft_tokens == 0:
            object.__setattr__(self, "num_draft_tokens", self.steps + 1 if self.topk == 1 else self.steps * self.topk + 1)

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def label(self) -> str:
        """`k<steps>` for a chain (the metric names users know from vLLM), `s<S>-t<K>-n<N>` for a tree."""
        if self.is_chain:
            return f"k{self.steps}"
        return f"s{self.steps}-t{self.topk}-n{self.num_draft_tokens}"

    def as_dict(self) -> dict[str, int]:
        return {"steps": self.steps, "topk": self.topk, "num_draft_tokens": self.num_draft_tokens}

    def engine_flags(self, kind: str, method: str = "eagle3") -> dict[str, Any]:
        """What to pass to the engine to serve this setting with a `method` drafter (recorded with the
        recommendation)."""
        if kind == "vllm":
            return {"speculative_config": vllm_speculative_config(method, self.steps)}
        return {"--speculative-num-steps": self.steps, "--speculative-eagle-topk": self.topk,
                "--speculative-num-draft-tokens": self.num_draft_tokens}


def serving_sweep(kind: str, chains: list[int], trees: list[Any], default_steps: int) -> list[ServingSetting]:
    """The settings one engine serves: the chains (default: the offline evaluation's), then on SGLang the trees."""
    sweep = [ServingSetting(steps) for steps in (chains or [default_steps])]
    if kind == "sglang":
        for tree in trees:
            setting = ServingSetting(tree.steps, tree.topk, tree.num_draft_tokens or 0)
            if setting not in sweep:
                sweep.append(setting)
    return sweep


def matching_offline_mode(acceptance: dict[str, Any], setting: ServingSetting) -> Optional[dict[str, Any]]:
    """The evaluate stage's tree result when it decoded exactly this tree setting."""
    tree = acceptance.get("tree") or {}
    measured = (tree.get("steps"), tree.get("topk"), tree.get("num_draft_tokens"))
    return tree if measured == (setting.steps, setting.topk, setting.num_draft_tokens) else None
