"""Remote-code export: every registered model class saves a folder that loads anywhere.

- In a fresh process where archlab cannot be imported, `Auto*.from_pretrained(folder, trust_remote_code=True)`
  gives logits identical to the in-process model's; the same folder loads with archlab and no remote code.
- The bundle is the full flat closure of sibling imports, byte-identical to the sources, and imports nothing but
  torch, transformers and huggingface_hub (checked statically over the whole `modeling/` folder).
- Saving is deterministic (same source -> same bytes), also when re-saved from the remote-code classes.
- `auto_map` lists every head, so a causal LM folder loads as a classifier or a base model without archlab.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import archlab.modeling
from archlab import registration

from helpers import LLAMA4_ATTENTION, LLAMA4_EXPERTS, tiny_config_for
from isolated import check, run_without_archlab

# one test worker (pytest-xdist) runs the module: its tests share the saved cases (`saved`) and the one fresh
# interpreter that loads them all (`exported`)
pytestmark = pytest.mark.xdist_group("remote_code")

MODELING = Path(archlab.modeling.__file__).resolve().parent
ALLOWED_TOP_LEVEL = {"torch", "transformers", "huggingface_hub", "__future__"} | set(sys.stdlib_module_names)

# (model class, overrides): catalogue variants whose code lives in other sibling files or branches
VARIANTS = {
    "moe": ("DecoderForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "moe-shared-expert": (
        "DecoderForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=16,
            mlp_layer_types=["dense", "sparse"],
        ),
    ),
    # DeepSeek-V3's router with its balancing buffers, gated attention, a QK-norm gain per head, μP's multipliers
    "sigmoid-router-gated-mup": (
        "DecoderForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            router_score_function="sigmoid",
            router_correction_bias=True,
            router_bias_update_rate=0.001,
            attention_output_gate="headwise",
            use_qk_norm=True,
            qk_norm_scope="per_head",
            norm_type="layer_norm",
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            logit_scale=0.5,
        ),
    ),
    # DeepSeek-V3's latent attention; GPT-OSS's sinks and biased, clamped experts; Apertus's xIELU
    "latent-attention": (
        "DecoderForCausalLM",
        dict(
            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
        ),
    ),
    "gpt-oss-layers": (
        "DecoderForCausalLM",
        dict(
            attention_sinks=True,
            attention_bias=True,
            num_local_experts=4,
            num_experts_per_tok=2,
            router_bias=True,
            expert_bias=True,
            swiglu_limit=7.0,
            swiglu_up_offset=1.0,
            hidden_act="quick_gelu",
        ),
    ),
    # Llama 4's layers: chunked attention, a NoPE layer with temperature tuning, a QK-norm without a gain, experts
    # weighing their input
    "llama4-layers": ("DecoderForCausalLM", {**LLAMA4_ATTENTION, **LLAMA4_EXPERTS}),
    "xielu": ("DecoderForCausalLM", dict(mlp_type="plain", hidden_act="xielu")),
    "layernorm-gelu-alibi": (
        "DecoderForCausalLM",
        dict(
            norm_type="layer_norm",
            mlp_type="plain",
            hidden_act="gelu",
            position_embedding_type="alibi",
        ),
    ),
    "parallel-relative-qknorm": (
        "DecoderForCausalLM",
        dict(
            norm_position="parallel",
            position_embedding_type="relative_bias",
            use_qk_norm=True,
        ),
    ),
    "sandwich-window-softcap": (
        "DecoderForCausalLM",
        dict(
            norm_position="sandwich",
            norm_type="offset_rms_norm",
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
    ),
    "olmo2-output-norm-projection-qknorm": (
        "DecoderForCausalLM",
        dict(norm_position="output", use_qk_norm=True, qk_norm_scope="projection"),
    ),
    "seq2seq-pre-gated-relative": (
        "Seq2SeqForConditionalGeneration",
        dict(
            norm_position="pre",
            norm_type="rms_norm",
            mlp_type="gated",
            activation_function="silu",
            position_embedding_type="relative_bias",
        ),
    ),
}


def _cases() -> list:
    cases = [
        pytest.param(auto.__name__, config_class, model_class, {}, id=model_class.__name__)
        for auto, config_class, model_class in registration.MODEL_REGISTRY
    ]
    by_name = {entry[2].__name__: entry for entry in registration.MODEL_REGISTRY}
    for name, (class_name, overrides) in VARIANTS.items():
        auto, config_class, model_class = by_name[class_name]
        cases.append(pytest.param(auto.__name__, config_class, model_class, overrides, id=name))
    return cases


CASES = _cases()
# the Auto classes a causal LM's folder is opened with, without archlab
CAUSAL_LM_AS = (
    "AutoModel",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
)

# the Auto classes a masked LM's folder is opened with for fine-tuning, without archlab (BERT's heads)
MASKED_LM_AS = (
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
)


def _inputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    input_ids = torch.randint(3, vocab, (2, 7), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :2] = model.config.pad_token_id  # left padding in the second row
    attention_mask[1, :2] = 0
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "decoder_input_ids" in inspect.signature(model.forward).parameters:
        inputs["decoder_input_ids"] = torch.randint(3, vocab, (2, 5), generator=generator)
    return inputs


def _output(outputs) -> torch.Tensor:
    """The logits (a QA model's start logits), else the hidden states."""
    names = ("logits", "start_logits", "last_hidden_state")
    return next(getattr(outputs, name) for name in names if getattr(outputs, name, None) is not None)


RUNNER = """
import json
import torch
import transformers
from safetensors.torch import load_file, save_file

torch.set_num_threads(1)
results = {}
for job in json.load(open("jobs.json")):
    auto = getattr(transformers, job["auto"])
    try:
        model = auto.from_pretrained(job["folder"], trust_remote_code=True).eval()
    except Exception as error:
        results[job["name"]] = {"error": f"{type(error).__name__}: {error}"}
        continue
    inputs = load_file(job["inputs"])
    with torch.no_grad():
        outputs = model(**inputs)
    names = ("logits", "start_logits", "last_hidden_state")
    tensor = next(getattr(outputs, name) for name in names if getattr(outputs, name, None) is not None)
    save_file({"output": tensor.contiguous()}, job["output"])
    model.save_pretrained(job["resave"])
    results[job["name"]] = {"class": type(model).__name__, "module": type(model).__module__}
json.dump(results, open("results.json", "w"))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Every case saved with its inputs and in-process reference output (one thread: bit-reproducible)."""
    root = tmp_path_factory.mktemp("remote_code")
    jobs, cases = [], {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for param in CASES:
            auto_name, config_class, model_class, overrides = param.values
            name = param.id
            torch.manual_seed(0)
            model = model_class(tiny_config_for(config_class, **overrides)).eval()
            folder = root / f"saved_{name}"
            sources = {path.name: path.read_bytes() for path in MODELING.glob("*.py")}
            model.save_pretrained(folder)
            inputs = _inputs(model)
            with torch.no_grad():
                reference = _output(model(**inputs))
            save_file(inputs, root / f"inputs_{name}.safetensors")
            cases[name] = dict(
                model=model, folder=folder, inputs=inputs, reference=reference, auto=auto_name, sources=sources
            )  # the source bytes at save time
            jobs.append(
                dict(
                    name=name,
                    auto=auto_name,
                    folder=str(folder),
                    inputs=str(root / f"inputs_{name}.safetensors"),
                    output=str(root / f"output_{name}.safetensors"),
                    resave=str(root / f"resaved_{name}"),
                )
            )
    finally:
        torch.set_num_threads(threads)
    # the family auto_map: a causal LM folder opened as a base model and as a classifier
    for auto_name in CAUSAL_LM_AS:
        jobs.append(
            dict(
                name=f"causal_as_{auto_name}",
                auto=auto_name,
                folder=str(cases["DecoderForCausalLM"]["folder"]),
                inputs=str(root / "inputs_DecoderForCausalLM.safetensors"),
                output=str(root / f"output_causal_as_{auto_name}.safetensors"),
                resave=str(root / f"resaved_causal_as_{auto_name}"),
            )
        )
    # a masked LM's folder opened as a base model: its encoder (as BertModel from a BERT folder), not an
    # encoder-decoder with a random decoder
    jobs.append(
        dict(
            name="masked_lm_as_AutoModel",
            auto="AutoModel",
            folder=str(cases["EncoderForMaskedLM"]["folder"]),
            inputs=str(root / "inputs_EncoderForMaskedLM.safetensors"),
            output=str(root / "output_masked_lm_as_AutoModel.safetensors"),
            resave=str(root / "resaved_masked_lm_as_AutoModel"),
        )
    )
    # and as BERT's fine-tuning heads (the classifier's weights new, the encoder's kept)
    for auto_name in MASKED_LM_AS:
        jobs.append(
            dict(
                name=f"masked_lm_as_{auto_name}",
                auto=auto_name,
                folder=str(cases["EncoderForMaskedLM"]["folder"]),
                inputs=str(root / "inputs_EncoderForMaskedLM.safetensors"),
                output=str(root / f"output_masked_lm_as_{auto_name}.safetensors"),
                resave=str(root / f"resaved_masked_lm_as_{auto_name}"),
            )
        )
    return dict(root=root, cases=cases, jobs=jobs)


@pytest.fixture(scope="module")
def exported(saved) -> dict:
    """All remote-code loads of `saved` in ONE isolated process (archlab not importable); what it reported."""
    root = saved["root"]
    (root / "jobs.json").write_text(json.dumps(saved["jobs"]))
    check(run_without_archlab(RUNNER, root))
    return dict(saved, results=json.loads((root / "results.json").read_text()))


def _case_ids() -> list[str]:
    return [param.id for param in CASES]


@pytest.mark.slow  # one fresh interpreter for all cases: ~5 s idle, longer on a loaded machine
@pytest.mark.parametrize("name", _case_ids())
def test_loads_without_archlab_with_identical_logits(exported, name):
    case, result = exported["cases"][name], exported["results"][name]
    assert "error" not in result, result.get("error")
    assert result["class"] == type(case["model"]).__name__
    assert result["module"].startswith("transformers_modules."), result["module"]
    remote = load_file(exported["root"] / f"output_{name}.safetensors")["output"]
    assert torch.equal(remote, case["reference"])


@pytest.mark.parametrize("name", _case_ids())
def test_same_folder_loads_with_archlab_without_remote_code(saved, name):
    case = saved["cases"][name]
    model = getattr(transformers, case["auto"]).from_pretrained(case["folder"]).eval()
    assert type(model) is type(case["model"])  # archlab's own class, not a copy from the folder
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            assert torch.equal(_output(model(**case["inputs"])), case["reference"])
    finally:
        torch.set_num_threads(threads)


def _sibling_closure(start: Path) -> set[str]:
    """File names reached from `start` through `from .x import y`, anywhere in the file (also inside functions)."""
    seen, todo = set(), [start.name]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in ast.walk(ast.parse((start.parent / name).read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                todo.append(f"{node.module}.py")
    return seen


@pytest.mark.parametrize("name", _case_ids())
def test_bundle_is_the_full_closure_byte_for_byte(saved, name):
    case = saved["cases"][name]
    model_file = Path(sys.modules[type(case["model"]).__module__].__file__)
    config_file = Path(sys.modules[type(case["model"].config).__module__].__file__)
    expected = _sibling_closure(model_file) | _sibling_closure(config_file)
    bundled = {path.name for path in case["folder"].glob("*.py")}
    assert bundled == expected
    for file_name in bundled:
        assert (case["folder"] / file_name).read_bytes() == case["sources"][file_name]


@pytest.mark.slow
@pytest.mark.parametrize("name", _case_ids())
def test_resaving_from_remote_code_gives_the_same_bytes(exported, name):
    """Same source -> same bytes, also for someone without archlab who fine-tunes and saves again."""
    case = exported["cases"][name]
    resaved = Path(exported["root"] / f"resaved_{name}")
    original = {path.name: path.read_bytes() for path in case["folder"].glob("*.py")}
    assert {path.name: path.read_bytes() for path in resaved.glob("*.py")} == original
    original_map = json.loads((case["folder"] / "config.json").read_text())["auto_map"]
    assert json.loads((resaved / "config.json").read_text())["auto_map"] == original_map


def test_saving_twice_gives_identical_bytes(tmp_path):
    config_class, model_class = registration.MODEL_REGISTRY[0][1:]
    torch.manual_seed(0)
    model = model_class(tiny_config_for(config_class))
    model.save_pretrained(tmp_path / "a")
    model.save_pretrained(tmp_path / "b")
    names = sorted(path.name for path in (tmp_path / "a").iterdir())
    assert names == sorted(path.name for path in (tmp_path / "b").iterdir())
    for file_name in names:
        assert (tmp_path / "a" / file_name).read_bytes() == (tmp_path / "b" / file_name).read_bytes(), file_name


@pytest.mark.slow
@pytest.mark.parametrize("auto_name", CAUSAL_LM_AS)
def test_causal_lm_folder_opens_as_every_head_without_archlab(exported, auto_name):
    case = exported["cases"]["DecoderForCausalLM"]
    auto_map = json.loads((case["folder"] / "config.json").read_text())["auto_map"]
    assert {
        entry[0].__name__ for entry in registration.MODEL_REGISTRY if entry[1] is type(case["model"].config)
    } <= set(auto_map) - {"AutoConfig"}
    result = exported["results"][f"causal_as_{auto_name}"]
    assert "error" not in result, result.get("error")
    if auto_name == "AutoModel":  # the base model's hidden states are the causal LM's, before its head
        hidden = load_file(exported["root"] / f"output_causal_as_{auto_name}.safetensors")["output"]
        with torch.no_grad():
            expected = case["model"].model(**case["inputs"]).last_hidden_state
        torch.testing.assert_close(hidden, expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_masked_lm_folder_opens_as_its_encoder_without_archlab(exported):
    case = exported["cases"]["EncoderForMaskedLM"]
    result = exported["results"]["masked_lm_as_AutoModel"]
    assert "error" not in result, result.get("error")
    assert result["class"] == "EncoderModel"
    hidden = load_file(exported["root"] / "output_masked_lm_as_AutoModel.safetensors")["output"]
    with torch.no_grad():
        expected = case["model"].encoder(**case["inputs"]).last_hidden_state
    torch.testing.assert_close(hidden, expected, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("auto_name", MASKED_LM_AS)
def test_masked_lm_folder_opens_as_berts_heads_without_archlab(exported, auto_name):
    """`auto_map` of a masked LM's folder names the fine-tuning heads, so one starts fine-tuning from it where
    archlab is not installed; the encoder is the masked LM's (the re-saved folder holds its very tensors)."""
    case = exported["cases"]["EncoderForMaskedLM"]
    assert auto_name in json.loads((case["folder"] / "config.json").read_text())["auto_map"]
    result = exported["results"][f"masked_lm_as_{auto_name}"]
    assert "error" not in result, result.get("error")
    assert result["class"] == auto_name.replace("AutoModel", "Encoder")
    resaved = load_file(exported["root"] / f"resaved_masked_lm_as_{auto_name}" / "model.safetensors")
    for key, tensor in case["model"].encoder.state_dict().items():
        assert torch.equal(resaved[f"encoder.{key}"], tensor), key


def _imports(path: Path):
    """(level, module) of each import of `path`, except those inside a `try` block: optional ones, which
    transformers' `check_imports` leaves out of a remote-code folder's requirements too (Triton, triton_decoding.py)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    optional = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.Try) for inner in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield 0, alias.name
        elif isinstance(node, ast.ImportFrom):
            yield node.level, node.module


@pytest.mark.parametrize("path", sorted(MODELING.glob("*.py")), ids=lambda path: path.name)
def test_modeling_folder_imports_only_torch_transformers_and_siblings(path):
    for level, module in _imports(path):
        if level == 0:
            assert module.split(".")[0] in ALLOWED_TOP_LEVEL, f"{path.name} imports {module}"
        else:
            # `from .x import y` with x a file in the folder; not `from . import x`, `from ..x`, `from .a.b`
            assert level == 1 and module and "." not in module, f"{path.name}: relative import level {level} {module}"
            assert (MODELING / f"{module}.py").is_file(), f"{path.name} imports missing sibling {module}"
