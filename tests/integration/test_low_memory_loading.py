"""Quantized and low-memory loading on the CPU.

Quantized: `from_pretrained(..., quantization_config=...)` with bitsandbytes (8-bit, 4-bit NF4), optimum-quanto
(int8) and torchao (int8 weight-only) quantizes the same `nn.Linear`s of an archlab model as of the stock model it
converts to (Llama, Mixtral, Bart), which then compute the same logits and greedy tokens; the routers and the MoE's
3-D expert tensors stay in full precision in both. A quantized LM head trains on its forward, a quantized model saves
and reloads (also as remote code without archlab), and QLoRA (`prepare_model_for_kbit_training` + LoRA) trains step
for step like the stock model's. Each backend's tests skip where it is not installed.

Low-memory: `device_map="auto"` offloading part of the weights to disk computes what the model in memory does (blocks
kept whole), training loss included; `dtype="auto"` / float16 loads match the stock models'. docs/sharing.md,
"Quantized and low-memory loading".
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BartConfig,
    BartForConditionalGeneration,
)

from archlab import DecoderConfig, DecoderForCausalLM
from archlab.conversion import convert_checkpoint

from helpers import assert_close_to_scale
from isolated import check, run_without_archlab

# out-features multiples of 32: bitsandbytes' 4-bit CPU kernel packs weights in blocks of 32 rows
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
DECODERS = {"llama": {}, "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)}


def _bnb8():
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True)


def _bnb4():
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)


def _quanto():
    pytest.importorskip("optimum.quanto")
    from transformers import QuantoConfig

    return QuantoConfig(weights="int8")


def _torchao():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


BACKENDS = {"bnb8": _bnb8, "bnb4": _bnb4, "quanto": _quanto, "torchao": _torchao}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (archlab folder, stock folder, Auto class)}: decoders exported to Llama and Mixtral, Bart imported."""
    root = tmp_path_factory.mktemp("quantization")
    torch.manual_seed(0)
    made = {}
    for family, fields in DECODERS.items():
        DecoderForCausalLM(DecoderConfig(**SIZES, num_key_value_heads=2, pad_token_id=0, **fields)).save_pretrained(
            root / family
        )
        convert_checkpoint(root / family, root / f"{family}_stock", to=family)
        made[family] = (root / family, root / f"{family}_stock", AutoModelForCausalLM)
    bart = BartConfig(
        vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
    )  # fmt: skip
    stock = BartForConditionalGeneration(bart)
    with torch.no_grad():
        for parameter in stock.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)  # norms and biases off their initial values
    stock.save_pretrained(root / "bart_stock")
    convert_checkpoint(root / "bart_stock", root / "bart")
    made["bart"] = (root / "bart", root / "bart_stock", AutoModelForSeq2SeqLM)
    return made


def _inputs(family: str) -> dict[str, torch.Tensor]:
    ids = torch.arange(10)[None, :] + torch.tensor([[5], [40]])
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    if family == "bart":
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :6] + 1}
    return {"input_ids": ids, "attention_mask": mask}


def _quantized_names(model: nn.Module) -> set[str]:
    """The parameters a backend replaced (bitsandbytes' and quanto's parameter classes, torchao's tensor subclasses)."""
    return {name for name, p in model.named_parameters() if type(p) not in (nn.Parameter, torch.Tensor)}


@pytest.mark.parametrize("family", ["llama", "mixtral", "bart"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_quantized_model_computes_what_the_stock_model_quantized_alike_does(folders, family, backend):
    ours_folder, stock_folder, auto = folders[family]
    ours = auto.from_pretrained(ours_folder, device_map="cpu", quantization_config=BACKENDS[backend]()).eval()
    stock = auto.from_pretrained(stock_folder, device_map="cpu", quantization_config=BACKENDS[backend]()).eval()
    quantized = _quantized_names(ours)
    assert quantized == _quantized_names(stock) and len(quantized) == {"llama": 14, "mixtral": 8, "bart": 32}[family]
    # the LM head, the embeddings, the norms, the router and the 3-D expert tensors stay as they were
    assert not any(name.startswith(("lm_head", "model.embed", "model.shared")) for name in quantized)
    assert not any(".experts." in name or ".gate." in name or "norm" in name for name in quantized)
    inputs = _inputs(family)
    with torch.no_grad():
        assert_close_to_scale(ours(**inputs).logits, stock(**inputs).logits, rtol=1e-5)
        prompt = inputs["input_ids"][1:]
        greedy = dict(max_new_tokens=5, do_sample=False, num_beams=1)
        assert torch.equal(ours.generate(prompt, **greedy), stock.generate(prompt, **greedy))


@pytest.mark.parametrize("backend", ["bnb8", "bnb4", "quanto"])
def test_a_quantized_lm_head_trains_on_its_forward(folders, backend):
    """With the head quantized too (`llm_int8_skip_modules` / `modules_to_not_convert` naming something else) the
    training loss is the evaluation loss; the chunked loss read bitsandbytes' int8 weight as values (~970 for 5.5)
    and failed on its packed 4-bit weight."""
    config = BACKENDS[backend]()
    if backend == "quanto":
        config.modules_to_not_convert = ["nothing"]
    else:
        config.llm_int8_skip_modules = ["nothing"]
    model = AutoModelForCausalLM.from_pretrained(folders["llama"][0], device_map="cpu", quantization_config=config)
    assert "lm_head.weight" in _quantized_names(model)
    ids = torch.arange(10)[None, :] + torch.tensor([[5], [40]])
    with torch.no_grad():
        evaluation = model.eval()(ids, labels=ids).loss
        training = model.train()(ids, labels=ids).loss
    torch.testing.assert_close(training, evaluation, atol=1e-4, rtol=1e-4)  # bitsandbytes' 8-bit rounds inputs


@pytest.mark.parametrize("backend", ["bnb8", "bnb4", "torchao"])
def test_a_quantized_model_saves_and_reloads(folders, backend, tmp_path):
    """(optimum-quanto's models do not serialise through transformers, stock ones neither.)"""
    model = AutoModelForCausalLM.from_pretrained(
        folders["mixtral"][0], device_map="cpu", quantization_config=BACKENDS[backend]()
    ).eval()
    model.save_pretrained(tmp_path / "quantized")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "quantized", device_map="cpu").eval()
    assert _quantized_names(reloaded) == _quantized_names(model)
    inputs = _inputs("mixtral")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model(**inputs).logits, atol=0, rtol=0)


@pytest.mark.slow
def test_a_quantized_folder_loads_as_remote_code_without_archlab(folders, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(folders["mixtral"][0], device_map="cpu", quantization_config=_bnb4())
    model.eval().save_pretrained(tmp_path / "quantized")
    inputs = _inputs("mixtral")
    with torch.no_grad():
        torch.save(model(**inputs).logits, tmp_path / "logits.pt")
    torch.save(inputs, tmp_path / "inputs.pt")
    code = f"""
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "quantized")!r}, trust_remote_code=True, device_map="cpu")
inputs = torch.load({str(tmp_path / "inputs.pt")!r})
reference = torch.load({str(tmp_path / "logits.pt")!r})
with torch.no_grad():
    difference = (model.eval()(**inputs).logits - reference).abs().max().item()
print(type(model.model.layers[0].self_attn.q_proj).__name__, difference, reference.abs().max().item())
"""
    # another process may sum in another order (thread count, CPU): equal to float32 rounding of the logits' scale
    layer, difference, scale = check(run_without_archlab(code, tmp_path / "run")).split()
    assert layer == "Linear4bit"
    assert float(difference) <= 1e-5 * max(1.0, float(scale))


@pytest.mark.parametrize("family", ["mixtral", "bart"])
def test_qlora_trains_like_the_stock_model(folders, family, tmp_path):
    """4-bit base, `prepare_model_for_kbit_training` (gradient checkpointing), LoRA with the same initial weights:
    the same losses over three optimizer steps."""
    peft = pytest.importorskip("peft")
    from transformers import Trainer, TrainingArguments

    config = _bnb4()
    ids = torch.arange(12)[None, :] + torch.tensor([[5], [20], [40], [60]])
    batch = {"input_ids": ids, "labels": ids if family != "bart" else ids[:, :6].contiguous()}
    losses, lora_weights = [], None
    for folder in folders[family][:2]:
        model = folders[family][2].from_pretrained(folder, device_map="cpu", quantization_config=config)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
        lora = peft.LoraConfig(
            task_type="SEQ_2_SEQ_LM" if family == "bart" else "CAUSAL_LM",
            r=4,
            target_modules=["q_proj", "v_proj", "o_proj" if family != "bart" else "out_proj"],
            init_lora_weights=False,  # both factors random: the adapter changes the logits from the first step
        )
        model = peft.get_peft_model(model, lora)
        if lora_weights is None:
            lora_weights = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
        else:  # module names are the stock ones: the stock model starts from the same adapter
            model.load_state_dict(lora_weights, strict=False)
        arguments = TrainingArguments(
            output_dir=str(tmp_path / folder.name), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
            logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        )  # fmt: skip
        trainer = Trainer(
            model=model, args=arguments, train_dataset=[{k: v[i] for k, v in batch.items()} for i in range(4)]
        )
        trainer.train()
        losses.append([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])
    assert len(losses[0]) == 3
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), atol=1e-5, rtol=1e-5)


# ---- offloading (accelerate) and half-precision loads ---------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "mixtral", "bart"])
def test_a_model_offloaded_to_disk_computes_what_it_does_in_memory(folders, family, tmp_path):
    """`device_map="auto"` with `max_memory` for about half the weights: the rest goes to `offload_folder`, blocks
    whole (`_no_split_modules`); logits, greedy or beam tokens and the training loss (which read an offloaded head's
    meta weight: ~1e23 or nan) are those of the model in memory."""
    folder, _, auto = folders[family]
    in_memory = auto.from_pretrained(folder).eval()
    size = sum(p.numel() * p.element_size() for p in in_memory.parameters())
    offloaded = auto.from_pretrained(
        folder, device_map="auto", max_memory={"cpu": size // 2}, offload_folder=tmp_path / "offload"
    ).eval()
    assert set(offloaded.hf_device_map.values()) == {"cpu", "disk"}, offloaded.hf_device_map
    block = {"llama": "PreNormBlock", "mixtral": "PreNormBlock", "bart": "Seq2SeqEncoderLayer"}[family]
    assert block in offloaded._no_split_modules
    for name, module in offloaded.named_modules():  # no device inside a block
        if type(module).__name__ in offloaded._no_split_modules:
            assert not any(key.startswith(f"{name}.") for key in offloaded.hf_device_map), name
    inputs = _inputs(family)
    prompt = inputs["input_ids"][1:]
    search = dict(max_new_tokens=5, do_sample=False, num_beams=2 if family == "bart" else 1)
    labels = inputs.get("decoder_input_ids", inputs["input_ids"])
    with torch.no_grad():
        torch.testing.assert_close(offloaded(**inputs).logits, in_memory(**inputs).logits, atol=0, rtol=0)
        assert torch.equal(offloaded.generate(prompt, **search), in_memory.generate(prompt, **search))
        in_memory.train(), offloaded.train()  # no dropout in these configs
        torch.testing.assert_close(
            offloaded(**inputs, labels=labels).loss, in_memory(**inputs, labels=labels).loss, atol=1e-6, rtol=1e-6
        )


@pytest.mark.parametrize("family", ["llama", "mixtral", "bart"])
@pytest.mark.parametrize("dtype", ["auto", torch.float16])
def test_half_precision_loads_compute_what_the_stock_models_do(folders, family, dtype, tmp_path):
    """A bfloat16 save loads as bfloat16 with `dtype="auto"` (float16 when asked), the RoPE frequencies kept in float32
    as Llama keeps them; the same logits as the stock model loaded alike."""
    ours_folder, stock_folder, auto = folders[family]
    for name, folder in (("ours", ours_folder), ("stock", stock_folder)):
        auto.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(tmp_path / name)
    ours, stock = (auto.from_pretrained(tmp_path / name, dtype=dtype).eval() for name in ("ours", "stock"))
    expected = torch.bfloat16 if dtype == "auto" else dtype
    assert {p.dtype for p in ours.parameters()} == {expected} and ours.config.dtype == expected
    assert {b.dtype for b in ours.buffers()} == {b.dtype for b in stock.buffers()}
    inputs = _inputs(family)
    with torch.no_grad():
        assert_close_to_scale(ours(**inputs).logits.float(), stock(**inputs).logits.float(), rtol=1e-2)
