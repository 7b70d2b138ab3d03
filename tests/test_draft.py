"""The EAGLE3 draft on the tiny target: it learns (overfits a handful of records), and its checkpoint
round-trips in the engines' format with the contract checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from contract.chat_rendering import render_with_spans, tokenize_with_mask
from contract.checkpoint import CheckpointContract, ContractMismatch
from contract.records import Message
from models.draft_checkpoint import EXPECTED_TENSORS, engine_layer_ids, load_pretrained, save_pretrained
from models.eagle3 import Eagle3Config, Eagle3Draft
from models.teacher import teacher_from_hidden
from models.ttt import TTTBatch, ttt_forward

AUX_LAYERS = [1, 2, 3]
CONVERSATIONS = [
    [("What is the capital of France?", "The capital of France is Paris.")],
    [("Hello, how are you today?", "I am fine, thank you.")],
    [("Tell me a story about a small bird.", "A small bird learns to fly over the sea.")],
    [("Write a Python function that adds two numbers.", "def add(a, b): return a + b")],
]


def features(model, tokenizer) -> TTTBatch:
    """Token-aligned features of the conversations, from a real forward pass of the tiny target."""
    samples = []
    for turns in CONVERSATIONS:
        messages = []
        for question, answer in turns:
            messages += [Message(role="user", content=question), Message(role="assistant", content=answer)]
        samples.append(tokenize_with_mask(tokenizer, render_with_spans(tokenizer, messages), 512))
    length = max(len(sample.input_ids) for sample in samples)
    ids = torch.full((len(samples), length), tokenizer.pad_token_id)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample.input_ids)] = torch.tensor(sample.input_ids)
        mask[row, : len(sample.loss_mask)] = torch.tensor(sample.loss_mask)
    with torch.no_grad():
        states = model(ids, attention_mask=(mask >= 0).long(), output_hidden_states=True).hidden_states
    aux = torch.cat([states[layer + 1] for layer in AUX_LAYERS], dim=-1)
    t2d = torch.ones(model.config.vocab_size, dtype=torch.bool)
    probs, top1, in_draft = teacher_from_hidden(states[-1], model.lm_head.weight, t2d)
    return TTTBatch(ids, mask, aux, probs, top1, in_draft)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir: Path):
    """The tiny target with a peaked next-token distribution, like a trained LM (random init is near uniform)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model, AutoTokenizer.from_pretrained(tiny_target_dir)


def new_draft(model) -> Eagle3Draft:
    torch.manual_seed(0)
    config = Eagle3Config.from_target(model.config, draft_vocab_size=model.config.vocab_size, aux_layer_ids=AUX_LAYERS)
    draft = Eagle3Draft(config)
    draft.attach_embedding(model.get_input_embeddings().weight)
    return draft


def test_a_draft_overfits_a_handful_of_records(tiny) -> None:
    model, tokenizer = tiny
    batch = features(model, tokenizer)
    draft = new_draft(model)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    with torch.no_grad():
        untrained = ttt_forward(draft, batch, steps=3)
    for _ in range(300):
        optimizer.zero_grad()
        output = ttt_forward(draft, batch, steps=3)
        output.loss.backward()
        optimizer.step()
    with torch.no_grad():
        trained = ttt_forward(draft, batch, steps=3)
    assert trained.acc[0] > 0.9, trained.metrics()
    assert trained.simulated_accept_len > untrained.simulated_accept_len + 1.0
    assert trained.loss < untrained.loss and trained.expected_accept[0] > 0.9


def contract_for(model, target_info: dict) -> CheckpointContract:
    config = model.config
    return CheckpointContract(
        target_id="tiny", target_revision=target_info["revision"], tokenizer_hash=target_info["tokenizer_hash"],
        chat_template_hash="t", draft_config={}, aux_layer_ids=AUX_LAYERS, fusion_dims=[3 * config.hidden_size, config.hidden_size],
        hidden_size=config.hidden_size, vocab_size=config.vocab_size, draft_vocab_size=config.vocab_size,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )


TARGET_INFO = {"revision": "rev-1", "tokenizer_hash": "tok-1"}


def target_info_for(model) -> dict:
    config = model.config
    return {**TARGET_INFO, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
            "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id}


def test_save_load_gives_identical_logits_and_the_engine_format(tmp_path: Path, tiny) -> None:
    model, tokenizer = tiny
    draft = new_draft(model)
    torch.nn.init.normal_(draft.fc.weight, std=0.05)
    info = target_info_for(model)
    directory = save_pretrained(draft, tmp_path / "draft", contract_for(model, info), num_target_layers=6, engine="sglang")
    loaded, contract = load_pretrained(directory, target_info=info)
    loaded.attach_embedding(model.get_input_embeddings().weight)
    batch = features(model, tokenizer)
    with torch.no_grad():
        assert torch.equal(draft(batch.aux_hidden_state, batch.input_ids)[1], loaded(batch.aux_hidden_state, batch.input_ids)[1])
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
        assert handle.get_tensor("d2t").dtype == torch.int64 and handle.get_tensor("t2d").dtype == torch.bool
    assert names == set(EXPECTED_TENSORS) and "embed_tokens.weight" not in names
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False and config["draft_vocab_size"] == model.config.vocab_size
    assert config["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert contract.engine == "sglang" and contract.draft_config["aux_layer_ids"] == AUX_LAYERS


def test_an_eagle31_draft_norms_each_aux_state_carries_its_normed_output_and_round_trips(tmp_path: Path, tiny) -> None:
    """EAGLE 3.1 (draft.method eagle3.1): fc reads concat(fc_norm[i](aux_i)), the next step reads norm(h_out); the
    export writes fc_norm.{0,1,2}.weight and vLLM's flags, and loads back as the same method with the same logits."""
    from models.draft_checkpoint import FC_NORM_TENSORS
    from tasks.registry.doctor import inspect_checkpoint

    model, tokenizer = tiny
    torch.manual_seed(0)
    config = Eagle3Config.from_target(model.config, draft_vocab_size=model.config.vocab_size, aux_layer_ids=AUX_LAYERS)
    draft = Eagle3Draft(config.for_method("eagle3.1"))
    draft.attach_embedding(model.get_input_embeddings().weight)
    for norm in draft.fc_norm:
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    assert draft.config.method == "eagle3.1" and config.method == "eagle3"
    batch = features(model, tokenizer)
    aux = batch.aux_hidden_state
    with torch.no_grad():
        states = aux.chunk(3, dim=-1)
        normed = [state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * norm.weight
                  for state, norm in zip(states, draft.fc_norm)]
        torch.testing.assert_close(draft.project(aux), draft.fc(torch.cat(normed, dim=-1)))
        h_out, logits = draft(aux, batch.input_ids)
        torch.testing.assert_close(draft.carry(h_out), draft.norm(h_out))
        assert torch.equal(Eagle3Draft(config).carry(h_out), h_out), "EAGLE3 carries the pre-norm output"

    info = target_info_for(model)
    directory = save_pretrained(draft, tmp_path / "draft", contract_for(model, info), num_target_layers=6, engine="vllm")
    exported = json.loads((directory / "config.json").read_text())
    assert exported["fc_norm"] is True and exported["norm_output"] is True
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        assert set(handle.keys()) == set(EXPECTED_TENSORS) | set(FC_NORM_TENSORS)
    loaded, contract = load_pretrained(directory, target_info=info)
    loaded.attach_embedding(model.get_input_embeddings().weight)
    assert loaded.config.method == "eagle3.1" and contract.draft_config["fc_norm"] is True
    with torch.no_grad():
        assert torch.equal(logits, loaded(aux, batch.input_ids)[1])
    checks = inspect_checkpoint(directory, {**info, "num_hidden_layers": 6, "id": "tiny"})
    tensor_checks = [check for check in checks if check.field.startswith("tensor")]
    assert all(check.ok for check in tensor_checks), [check for check in tensor_checks if not check.ok]
    assert any(check.field == "tensor fc_norm.2.weight" for check in tensor_checks)

    exported.pop("fc_norm")  # a config that lost the flag no longer matches its tensors: refused, naming them
    (directory / "config.json").write_text(json.dumps(exported))
    with pytest.raises(ValueError, match=r"unexpected tensors \['fc_norm.0.weight'.*method custom"):
        load_pretrained(directory)


def test_a_peagle_draft_exports_its_mask_state_and_token_and_round_trips(tmp_path: Path, tiny) -> None:
    """P-EAGLE (draft.method peagle): the export carries mask_hidden [1, 3H] and config mask_token_id, marks itself for
    the engine command (vLLM's parallel_drafting), loads back as the same method, and the doctor checks both."""
    from models.draft_checkpoint import MASK_TENSORS
    from tasks.serving.serving_setting import export_method
    from tasks.registry.doctor import inspect_checkpoint
    from tasks.serving.engine import EngineLaunch, engine_command

    model, tokenizer = tiny
    torch.manual_seed(0)
    config = Eagle3Config.from_target(model.config, draft_vocab_size=model.config.vocab_size, aux_layer_ids=AUX_LAYERS)
    config = config.for_method("peagle")
    config.mask_token_id = 3
    draft = Eagle3Draft(config)
    draft.attach_embedding(model.get_input_embeddings().weight)
    assert draft.config.method == "peagle" and list(draft.mask_hidden.shape) == [1, 3 * model.config.hidden_size]
    ids = torch.tensor([[5, 6, 7]])
    mask_ids, mask_hidden = draft.mask_inputs(ids)
    assert mask_ids.tolist() == [[3, 3, 3]] and list(mask_hidden.shape) == [1, 3, model.config.hidden_size]
    torch.testing.assert_close(mask_hidden[0, 2], draft.fc(draft.mask_hidden)[0])

    info = target_info_for(model)
    contract = contract_for(model, info).model_copy(update={"method": "peagle"})
    directory = save_pretrained(draft, tmp_path / "draft", contract, num_target_layers=6, engine="vllm")
    exported = json.loads((directory / "config.json").read_text())
    assert exported["mask_token_id"] == 3 and exported["eagle_config"]["eaglet_parallel_drafting"] is True
    assert export_method(directory) == "peagle"
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        assert set(handle.keys()) == set(EXPECTED_TENSORS) | set(MASK_TENSORS)
    loaded, _ = load_pretrained(directory, target_info=info)
    assert loaded.config.method == "peagle" and loaded.config.mask_token_id == 3
    assert torch.equal(loaded.mask_hidden, draft.mask_hidden)
    checks = inspect_checkpoint(directory, {**info, "num_hidden_layers": 6, "id": "tiny"})
    assert all(check.ok for check in checks), [check for check in checks if not check.ok]
    assert {"tensor mask_hidden", "config.mask_token_id"} <= {check.field for check in checks}

    launch = EngineLaunch(kind="vllm", model=tmp_path, python="python", port=1, log_path=tmp_path / "log",
                          draft=directory, num_speculative_tokens=3)
    command = engine_command(launch)
    spec = json.loads(command[command.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(directory), "num_speculative_tokens": 3, "parallel_drafting": True}

    exported["mask_token_id"] = model.config.vocab_size  # not a row of the target's embedding: the doctor says so
    (directory / "config.json").write_text(json.dumps(exported))
    bad = [check for check in inspect_checkpoint(directory, {**info, "num_hidden_layers": 6, "id": "tiny"}) if not check.ok]
    assert [check.field for check in bad] == ["config.mask_token_id"]


def test_a_dflash_draft_exports_vllms_layout_round_trips_and_the_doctor_counts_every_tensor(tmp_path: Path,
                                                                                          tiny) -> None:
    """DFlash (draft.method dflash): config.json as vLLM's DFlashDraftModel reads it (dflash_config with the mask token
    and the trained layer ids as they are, no eagle_config), Qwen3 tensor names without embed_tokens, the same logits
    after a round trip, vLLM's dflash speculative config; the doctor names a missing tensor (vLLM would load without
    it) and a mask token outside the target's vocabulary."""
    from safetensors.torch import load_file, save_file

    from models.dflash_objective import block_inputs, block_visibility
    from models.draft_methods import method_config, new_draft as new_method_draft
    from models.dflash_checkpoint import dflash_tensor_names
    from tasks.registry.doctor import inspect_checkpoint
    from tasks.serving.engine import EngineLaunch, engine_command
    from tasks.serving.serving_setting import export_method

    model, _ = tiny
    torch.manual_seed(0)
    base = Eagle3Config.from_target(model.config, draft_vocab_size=model.config.vocab_size, aux_layer_ids=AUX_LAYERS)
    config = method_config(base, "dflash", num_layers=2, block_size=4, anchors=64)
    config.mask_token_id = 3
    draft = new_method_draft(config)
    draft.attach_embedding(model.get_input_embeddings().weight)
    info = target_info_for(model)
    contract = contract_for(model, info).model_copy(update={"method": "dflash", "draft_config": config.to_dict()})
    directory = save_pretrained(draft, tmp_path / "draft", contract, num_target_layers=6, engine="vllm")
    exported = json.loads((directory / "config.json").read_text())
    assert exported["architectures"] == ["DFlashDraftModel"] and "eagle_config" not in exported
    assert exported["dflash_config"]["mask_token_id"] == 3 and exported["dflash_config"]["target_layer_ids"] == AUX_LAYERS
    assert exported["num_hidden_layers"] == 2 and exported["block_size"] == 4 and export_method(directory) == "dflash"
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        assert set(handle.keys()) == set(dflash_tensor_names(config)) and "layers.1.self_attn.k_norm.weight" in handle.keys()

    loaded, _ = load_pretrained(directory, target_info=info)
    loaded.attach_embedding(model.get_input_embeddings().weight)
    assert loaded.config.method == "dflash" and loaded.config.num_layers == 2 and loaded.config.anchors == 64
    aux = torch.randn(1, 10, 3 * model.config.hidden_size)
    ids, anchors = torch.randint(0, 50, (1, 10)), torch.tensor([[4]])
    outputs = []
    for each in (draft, loaded):
        slots, positions = block_inputs(each, ids, anchors)
        context = each.context(aux, torch.arange(10)[None])
        outputs.append(each.logits(each.block_forward(slots, positions, context, block_visibility(anchors, 4, 10))))
    torch.testing.assert_close(outputs[0], outputs[1])

    target = {**info, "num_hidden_layers": 6, "id": "tiny"}
    checks = inspect_checkpoint(directory, target)
    assert all(check.ok for check in checks), [check for check in checks if not check.ok]
    assert {"tensor layers.1.self_attn.k_norm.weight", "dflash_config.target_layer_ids", "eagle_config",
            "config.dflash_config.mask_token_id"} <= {check.field for check in checks}
    launch = EngineLaunch(kind="vllm", model=tmp_path, python="python", port=1, log_path=tmp_path / "log",
                          draft=directory, num_speculative_tokens=3)
    command = engine_command(launch)
    spec = json.loads(command[command.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(directory), "num_speculative_tokens": 3}

    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    exported["dflash_config"]["mask_token_id"] = model.config.vocab_size
    (directory / "config.json").write_text(json.dumps(exported))
    bad = {check.field: check.detail for check in inspect_checkpoint(directory, target) if not check.ok}
    assert set(bad) == {"tensor layers.1.self_attn.k_norm.weight", "config.dflash_config.mask_token_id"}, bad
    assert bad["tensor layers.1.self_attn.k_norm.weight"].startswith("missing")


def test_engine_exports_differ_only_in_the_layer_id_convention(tmp_path: Path, tiny) -> None:
    model, _ = tiny
    draft = new_draft(model)
    info = target_info_for(model)
    configs = {}
    for engine in ("sglang", "vllm"):
        save_pretrained(draft, tmp_path / engine, contract_for(model, info), num_target_layers=6, engine=engine)
        configs[engine] = json.loads((tmp_path / engine / "config.json").read_text())
    assert configs["sglang"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert configs["vllm"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    for config in configs.values():
        config["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")
    assert configs["sglang"] == configs["vllm"]
    assert (tmp_path / "sglang" / "model.safetensors").read_bytes() == (tmp_path / "vllm" / "model.safetensors").read_bytes()
    assert engine_layer_ids([1, 14, 26], 30, "vllm") is None, "SmolLM2's defaults are left to the engine"
    assert engine_layer_ids([1, 14, 25], 30, "vllm") == [2, 15, 26]


@pytest.mark.parametrize("field, value", [("revision", "rev-2"), ("tokenizer_hash", "tok-2"), ("vocab_size", 999),
                                          ("hidden_size", 128), ("eos_token_id", 7)])
def test_a_checkpoint_for_another_target_is_refused(tmp_path: Path, tiny, field: str, value) -> None:
    model, _ = tiny
    info = target_info_for(model)
    directory = save_pretrained(new_draft(model), tmp_path / "draft", contract_for(model, info), num_target_layers=6)
    name = {"revision": "target_revision"}.get(field, field)
    with pytest.raises(ContractMismatch, match=name):
        load_pretrained(directory, target_info={**info, field: value})
