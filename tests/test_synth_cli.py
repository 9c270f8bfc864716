"""monolith.synth's tokenizer and chat template, presets and shards, write_pair and the
command line (the published layouts' options too: --layout, --skeleton)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from monolith.formats import SafetensorsFile
from monolith.synth import PRESETS, Preset, draft_sizes, write_draft, write_pair, write_target, write_tokenizer
from monolith.synth import tokenizer as synth_tok
from monolith.synth.target import plan_units, target_params
from monolith.synth.writers import stored_bytes

# --------------------------------------------------------------------- tokenizer


def test_tokenizer_loads_and_round_trips(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    write_tokenizer(tmp_path)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ids = synth_tok.special_token_ids()
    assert len(ids) == 10 and max(ids.values()) + 1 == len(fast) < PRESETS["tiny"].vocab_size
    text = 'def f(x):\n    return {"a": x * 2}  # café, naïve — 你好\n'
    for tk in (fast, auto):
        assert tk.decode(tk(text)["input_ids"]) == text
    assert auto.eos_token == "<|im_end|>" and auto.eos_token_id == ids["<|im_end|>"]
    assert auto.pad_token == "<|endoftext|>" and auto.bos_token is None
    marked = "<|im_start|>user\nhi<|im_end|>"
    assert auto(marked)["input_ids"][0] == ids["<|im_start|>"] and ids["<|im_end|>"] in auto(marked)["input_ids"]
    assert len(auto("the weather in Paris")["input_ids"]) <= 0.6 * len("the weather in Paris")  # merges learned


def test_chat_template_renders_tools_and_tool_calls(tmp_path):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    template = json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"]
    assert (tmp_path / "chat_template.jinja").read_text() == template
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 18}'},
        {"role": "assistant", "content": "It is 18 C."},
        {"role": "user", "content": "Thanks"},
    ]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    text = env.from_string(template).render(
        messages=messages, tools=tools, add_generation_prompt=True, enable_thinking=False
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 18}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = env.from_string(template).render(messages=messages[1:2], add_generation_prompt=True)
    assert plain == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    tk = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert (
        tk.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        == text
    )


def test_generation_config_lists_the_eos_ids(ckpts):
    gen = json.loads((ckpts("bf16") / "generation_config.json").read_text())
    ids = synth_tok.special_token_ids()
    assert gen["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]


# ----------------------------------------------------------- presets, shards, CLI


def test_presets_and_custom_sizes(tmp_path):
    def total(preset, dense=False):
        units = plan_units(target_params(preset, dense), lambda m: "bf16", False, not dense)
        return sum(stored_bytes(u) for u in units)

    assert total(PRESETS["tiny"]) < 5e6
    assert total(PRESETS["bench"]) >= 1.1e9
    custom = Preset(hidden_size=96, num_hidden_layers=8, num_experts=4, vocab_size=640)
    d = write_target(tmp_path / "c", preset=custom, format="modelopt-nvfp4", shards=3)
    tc = json.loads((d / "config.json").read_text())["text_config"]
    assert tc["hidden_size"] == 96 and tc["layer_types"].count("full_attention") == 2
    assert len(list(d.glob("model-*-of-00003.safetensors"))) == 3
    draft = json.loads((write_draft(tmp_path / "cd", d) / "config.json").read_text())
    assert draft["hidden_size"] == 96 and all(0 <= i < 8 for i in draft["target_layer_ids"])
    assert draft_sizes(tc).target_layer_ids == tuple(draft["target_layer_ids"])
    single = write_target(tmp_path / "s", shards=1)
    assert (single / "model.safetensors").exists() and not (single / "model.safetensors.index.json").exists()
    with pytest.raises(ValueError, match="multiple of 32"):
        Preset(hidden_size=48)
    with pytest.raises(ValueError, match="unknown preset"):
        write_target(tmp_path / "u", preset="huge")


def test_ct_mixed_defaults_to_the_dense_model(tmp_path):
    d = write_target(tmp_path / "m", format="compressed-tensors-mixed")
    assert json.loads((d / "config.json").read_text())["model_type"] == "qwen3_5"
    assert len(list(d.glob("*.safetensors"))) == 1


def test_cli_pair_and_errors(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "monolith.synth", *args], check=False, capture_output=True, text=True
        )

    ok = run("pair", "--out", str(tmp_path / "p"), "--format", "modelopt-nvfp4", "--draft-format", "speculators")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == [str(tmp_path / "p" / "target"), str(tmp_path / "p" / "draft")]
    assert json.loads((tmp_path / "p" / "draft" / "config.json").read_text())["speculators_model_type"] == "dspark"
    bad = run("target", "--out", str(tmp_path / "q"), "--format", "gguf")
    assert bad.returncode == 1 and "invalid choice" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    nodir = run("draft", "--out", str(tmp_path / "r"), "--target", str(tmp_path / "missing"))
    assert nodir.returncode == 1 and "no config.json" in nodir.stderr
    target = run("target", "--out", str(tmp_path / "t"), "--dense", "--format", "compressed-tensors", "--seed", "2")
    assert target.returncode == 0 and target.stdout.strip() == str(tmp_path / "t")


def test_cli_writes_published_layouts_and_refuses_mixed_options(tmp_path, capsys):
    from monolith.synth.__main__ import main

    ok = subprocess.run(
        [sys.executable, "-m", "monolith.synth", "target", "--layout", "nvidia-35b", "--preset", "tiny",
         "--layers", "8", "--out", str(tmp_path / "t")], capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and ok.stdout.strip() == str(tmp_path / "t"), ok.stderr
    assert json.loads((tmp_path / "t" / "config.json").read_text())["text_config"]["num_hidden_layers"] == 8
    assert main(["draft", "--layout", "redhat-dspark", "--target", str(tmp_path / "t"), 
                 "--out", str(tmp_path / "d")]) == 0
    aux = json.loads((tmp_path / "d" / "config.json").read_text())["aux_hidden_state_layer_ids"]  # the taps + 1, spread over 8 layers
    assert len(aux) == 5 and aux == sorted(set(aux)) and 1 <= aux[0] and aux[-1] <= 8
    assert main(["pair", "--layout", "speculators-27b", "--skeleton", "--out", str(tmp_path / "p")]) == 0
    assert capsys.readouterr().out.split()[-2:] == [str(tmp_path / "p" / "target"), str(tmp_path / "p" / "draft")]
    for args, message in (
        (("target", "--layout", "nvidia-35b", "--format", "bf16"), "--format"),
        (("target", "--layout", "koopah-dspark"), "nvidia-35b | unsloth-27b"),
        (("target", "--skeleton"), "need --layout"),
        (("draft", "--layout", "zlab-dflash", "--target", str(tmp_path / "t"), "--layers", "4"), "--layers"),
    ):
        assert main([*args, "--out", str(tmp_path / "x")]) == 1
        err = capsys.readouterr().err
        assert message in err and err.startswith("monolith.synth: error: "), err


def test_write_pair_returns_both_dirs(tmp_path):
    target, draft = write_pair(tmp_path, format="compressed-tensors", draft_format="dflash", seed=1)
    assert target == tmp_path / "target" and draft == tmp_path / "draft"
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == synth_tok.special_token_ids()["<|mask|>"]
    assert json.loads((target / "config.json").read_text())["quantization_config"]["format"] == "nvfp4-pack-quantized"
    with pytest.raises(ValueError, match="seed"):
        write_target(tmp_path / "neg", seed=-1)


def test_streamed_shards_are_the_bytes_write_safetensors_writes_and_safetensors_reads(ckpts, tmp_path):
    """Shards are filled unit by unit at their offsets: the bytes equal write_safetensors'
    of the same tensors, and the safetensors package reads every tensor back."""
    import torch
    from safetensors import safe_open

    from monolith.formats import write_safetensors
    from monolith.synth.writers import ST_METADATA

    for f in sorted(ckpts("modelopt-mixed").glob("*.safetensors")):
        st = SafetensorsFile(f)
        tensors = {n: (st.dtype(n), np.array(st.read(n))) for n in st.names()}
        write_safetensors(tmp_path / f.name, tensors, metadata=ST_METADATA)
        assert (tmp_path / f.name).read_bytes() == f.read_bytes(), f
        with safe_open(f, framework="pt") as ref:
            assert sorted(ref.keys()) == sorted(tensors) and ref.metadata() == ST_METADATA
            for n, (_, bits) in tensors.items():
                t = ref.get_tensor(n)
                assert tuple(t.shape) == bits.shape, n
                assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == bits.tobytes(), n
