"""lm-eval's loglikelihood against the server: /v1/completions with `echo` and
`logprobs` (the prompt's own token logprobs), several prompts per request and
`max_tokens: 0`, and vLLM's /tokenize, /detokenize and /tokenizer_info that lm-eval's
`local-completions` finds its tokenizer through. The references: transformers'
logprobs on the same weights (the demo target's checkpoint, dequantized, in float32:
tests/hf_reference.py), the tokenizers library's encoding, and lm-eval 0.4.13 itself
(pinned) running a multiple-choice and a perplexity task from local files, offline."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from serving_rig import Server
from tokenizers import Tokenizer

from bench.accuracy import MC_TASK, PPL_TASK, run_lm_eval, write_tasks
from monolith.pack.demo import bundle_dir
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.scoring import SCORE_CHUNK

NAME = "demo"
TOL = 2e-3  # logprobs: float32 here and there, the target's NVFP4 weights dequantized alike
TEXTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())", "The quick brown fox ünïcode"]
MEASURED: dict[str, float] = {}  # printed after the module's tests (conftest.report_measured, pytest -s)
CHAT = "<|im_start|>user\nWhat is the os module for?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def checkpoint():
    return bundle_dir() / "target"


@pytest.fixture(scope="module")
def server(demo_f32):
    model, _, tok = demo_f32
    with Server(lambda: Engine(model, tok, Limits(max_context=1024, max_batch=4)), model_names=(NAME,)) as s:
        yield s.wait_ready()


@pytest.fixture(scope="module")
def hf(checkpoint):
    """ids -> log-softmax float64 [len(ids), vocab] of transformers' target."""
    from hf_reference import build_reference

    reference = build_reference(checkpoint)

    @torch.no_grad()
    def logprobs(ids):
        logits = reference(input_ids=torch.tensor([list(ids)])).logits[0].double()
        return torch.log_softmax(logits, dim=-1).numpy()

    return logprobs


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer.from_file(str(checkpoint / "tokenizer.json"))


def prompt_logprobs(hf, ids) -> np.ndarray:
    """transformers' logprob of each of ids[1:] after the ones before it."""
    rows = hf(ids)
    return rows[np.arange(len(ids) - 1), ids[1:]]


def complete(server, **body) -> dict:
    r = server.post("/v1/completions", {"model": NAME, **body})
    assert r.status_code == 200, r.text
    return r.json()


def check_echo(choice, ids, hf, tokenizer, top: int):
    """An echoed prompt's logprobs: the first token's null, the others transformers'."""
    lp = choice["logprobs"]
    assert len(lp["tokens"]) >= len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    rows = hf(ids)
    expected = rows[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], expected, atol=TOL)
    worst = float(np.max(np.abs(np.array(lp["token_logprobs"][1:len(ids)]) - expected), initial=0.0))
    MEASURED["echoed logprobs, largest |difference| from transformers"] = max(
        worst, MEASURED.get("echoed logprobs, largest |difference| from transformers", 0.0))
    for i in range(1, len(ids)):
        want: dict = {}  # tokens that read as one text (a character's bytes each read as U+FFFD): the likeliest
        for t in np.argsort(-rows[i - 1])[:top]:
            want.setdefault(tokenizer.decode([int(t)], skip_special_tokens=False), float(rows[i - 1][t]))
        assert lp["top_logprobs"][i] == pytest.approx(want, abs=TOL)
    offsets = np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]])
    assert lp["text_offset"] == offsets.tolist()
    assert choice["text"].startswith(tokenizer.decode(ids, skip_special_tokens=False))


def test_echo_of_string_prompts_in_one_request(server, hf, tokenizer):
    body = complete(server, prompt=TEXTS, echo=True, logprobs=2, max_tokens=0)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for text, choice in zip(TEXTS, body["choices"]):
        ids = tokenizer.encode(text).ids
        assert choice["text"] == text and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        check_echo(choice, ids, hf, tokenizer, 2)
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(t).ids) for t in TEXTS)
    assert body["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("shape", ["one list", "lists"])
def test_echo_of_token_id_prompts(server, hf, tokenizer, shape):
    prompts = [tokenizer.encode(t).ids for t in TEXTS[:2]]
    body = complete(server, prompt=prompts[0] if shape == "one list" else prompts, echo=True, logprobs=1,
                    max_tokens=0)
    assert len(body["choices"]) == (1 if shape == "one list" else 2)
    for ids, choice in zip(prompts, body["choices"]):
        check_echo(choice, ids, hf, tokenizer, 1)


def test_a_prompt_longer_than_a_scoring_chunk(server, hf, tokenizer):
    """Scored in chunks of SCORE_CHUNK rows, each after the cache of the ones before."""
    ids = tokenizer.encode("\n".join(TEXTS) * 20).ids[:2 * SCORE_CHUNK + 17]
    assert len(ids) == 2 * SCORE_CHUNK + 17
    check_echo(complete(server, prompt=ids, echo=True, logprobs=1, max_tokens=0)["choices"][0], ids, hf, tokenizer, 1)


def test_echo_with_generated_tokens(server, hf, tokenizer):
    """max_tokens > 0: the echoed prompt, then the greedy completion, each token's
    logprob transformers' at its row (greedy: the row's largest)."""
    ids = tokenizer.encode(TEXTS[0]).ids
    choice = complete(server, prompt=[ids, ids], echo=True, logprobs=1, max_tokens=3, temperature=0)["choices"][1]
    check_echo(choice, ids, hf, tokenizer, 1)
    generated = choice["logprobs"]["token_logprobs"][len(ids):]
    assert len(generated) == 3
    sequence = list(ids)
    for value in generated:
        row = hf(sequence)[-1]
        assert value == pytest.approx(row.max(), abs=TOL)
        sequence.append(int(row.argmax()))
    assert choice["text"] == tokenizer.decode(sequence, skip_special_tokens=False)


def test_a_stop_token_ending_the_completion_keeps_its_entry(server, hf, tokenizer):
    """The completion ends on a stop token: with echo its entry closes the logprobs, so a
    client that drops the last entry as the generated one (lm-eval) keeps the prompt."""
    ids = tokenizer.encode(CHAT).ids
    body = complete(server, prompt=CHAT, echo=True, logprobs=1, max_tokens=100, temperature=0)
    choice, usage = body["choices"][0], body["usage"]
    assert choice["finish_reason"] == "stop"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + usage["completion_tokens"]
    check_echo(choice, ids, hf, tokenizer, 1)
    sequence = tokenizer.encode(choice["text"][len(CHAT):]).ids if choice["text"] != CHAT else []
    row = hf(ids + sequence)[-1]
    stop = int(row.argmax())
    assert lp["tokens"][-1] == tokenizer.decode([stop], skip_special_tokens=False)
    assert lp["token_logprobs"][-1] == pytest.approx(row[stop], abs=TOL)


def test_batched_completions_refuse_what_they_cannot_do(server):
    r = server.post("/v1/completions", {"prompt": ["a", "b"], "stream": True, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    r = server.post("/v1/completions", {"prompt": [[1, 2], [5000000]], "echo": True, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_tokenize_and_detokenize_round_trip(server, tokenizer, checkpoint):
    from transformers import AutoTokenizer

    for text in TEXTS + [CHAT]:
        for special in (True, False):
            got = server.post("/tokenize", {"model": NAME, "prompt": text, "add_special_tokens": special}).json()
            ids = tokenizer.encode(text, add_special_tokens=special).ids
            assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == 1024
        back = server.post("/detokenize", {"model": NAME, "tokens": ids}).json()
        assert back == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    messages = [{"role": "user", "content": "What is the os module for?"}]
    got = server.post("/tokenize", {"messages": messages, "add_generation_prompt": True}).json()
    hf_tok = AutoTokenizer.from_pretrained(checkpoint)
    assert got["tokens"] == list(hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                            return_dict=False))
    r = server.post("/detokenize", {"tokens": [1, -1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = server.post("/tokenize", {"prompt": "x", "chat_template": "{{ messages }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_lm_eval_finds_the_remote_tokenizer(server, checkpoint):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    assert check_remote_tokenizer_support(server.url + "/v1/completions")
    remote = RemoteTokenizer(server.url + "/v1/completions")
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    assert remote.eos_token == config["eos_token"] and remote.bos_token == config["bos_token"]
    assert remote.tokenizer_info["chat_template"] == (checkpoint / "chat_template.jinja").read_text()


def test_lm_eval_tasks_equal_transformers(server, hf, tokenizer, checkpoint, tmp_path):
    """lm-eval runs a multiple-choice and a perplexity task from local files (offline,
    --batch_size 4, the server's tokenizer); each loglikelihood it records is
    transformers' on the same text, split as lm-eval splits it."""
    items = [{"context": "def add(a, b):\n", "choices": ["    return a + b", "    return a - b", "import os"],
              "label": 0},
             {"context": "import os\nimport sys\n", "choices": ["def main():", "print(os.getcwd())", "x = 1"],
              "label": 1}]
    docs = [{"text": TEXTS[0]}, {"text": "class Point:\n    x: int\n    y: int\n"}]
    tasks = write_tasks(tmp_path / "tasks", items, docs)
    results = run_lm_eval(server.url, NAME, tmp_path / "tasks", tasks, tmp_path / "run", batch_size=4,
                          log_samples=True)
    samples = {task: [json.loads(line) for f in (tmp_path / "run").rglob(f"samples_{task}_*.jsonl")
                      for line in f.read_text().splitlines()] for task in tasks}
    # a rolling window starts with the end-of-sequence token when there is no BOS (lm-eval's prefix_token_id)
    eos = tokenizer.token_to_id(json.loads((checkpoint / "tokenizer_config.json").read_text())["eos_token"])
    for sample in samples[PPL_TASK]:
        ids = tokenizer.encode(sample["doc"]["text"], add_special_tokens=False).ids
        expected = prompt_logprobs(hf, [eos] + ids).sum()
        assert float(sample["filtered_resps"][0]) == pytest.approx(expected, abs=TOL * len(ids))
    chosen = []
    for sample in samples[MC_TASK]:
        doc = sample["doc"]
        lls = [mc_loglikelihood(hf, tokenizer, doc["context"], choice) for choice in doc["choices"]]
        got = [float(r[0]) for r in sample["filtered_resps"]]
        np.testing.assert_allclose(got, lls, atol=TOL * 20)
        chosen.append(float(np.argmax(lls) == doc["label"]))
    assert results["results"][MC_TASK]["acc,none"] == pytest.approx(np.mean(chosen))


def mc_loglikelihood(hf, tokenizer, context: str, continuation: str) -> float:
    """lm-eval's loglikelihood of `continuation` after `context` (its _encode_pair): the
    context's trailing whitespace moved to the continuation, the continuation's tokens
    those of the whole text past as many tokens as the context has, after the context's
    own tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False).ids
    context_ids = tokenizer.encode(context, add_special_tokens=False).ids
    ids = context_ids + whole[len(context_ids):]
    return float(prompt_logprobs(hf, ids)[len(context_ids) - 1:].sum())
