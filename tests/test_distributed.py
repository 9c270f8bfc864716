"""Pipeline parallel over mx.distributed (`--distributed`, runtime/pipeline.py), on this
machine's loopback with MLX's ring backend: `mlx.launch -n 2|3 --backend ring` gives,
token for token, what one process gives, plain and speculative, for the MoE (the demo
pair) and dense (synthetic) targets; only rank 0 prints; a rank with another pack is
refused by name; a rank killed mid-request fails that request and later ones with an
error and turns /health unhealthy instead of hanging."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from monolith.pack.split import pack_costs, split_layers

LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def free_ports(n: int) -> int:
    """A first port with n free ports after it."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65535 and all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The subprocesses' environment: a pack cache of their own, offline, one BLAS thread
    (two or three ranks share this machine's cores)."""
    cache = tmp_path_factory.mktemp("dist-cache")
    e = {**os.environ, "MONOLITH_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OPENBLAS_NUM_THREADS": "1"}
    return e


@pytest.fixture(scope="module")
def demo(env):
    """The demo pair (MoE target), its packs built once before any rank starts."""
    from monolith.pack import resolve_pack
    from monolith.pack.demo import demo_pair

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MONOLITH_CACHE", env["MONOLITH_CACHE"])
        target, draft = demo_pair()
        resolve_pack(target, role="target")
        resolve_pack(draft, role="draft", quantization="auto")
    return ["--model", str(target), "--draft", str(draft)]


@pytest.fixture(scope="module")
def dense(env, tmp_path_factory):
    """A synthetic dense target (4 layers) and its draft, packed once."""
    from monolith.pack import resolve_pack
    from monolith.synth import write_draft, write_target

    root = tmp_path_factory.mktemp("dense")
    target = write_target(root / "target", "tiny", "bf16", True)
    draft = write_draft(root / "draft", target)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MONOLITH_CACHE", env["MONOLITH_CACHE"])
        resolve_pack(target, role="target")
        resolve_pack(target, role="target", with_mtp=True)  # for --draft mtp
        resolve_pack(draft, role="draft", quantization="auto")
    return ["--model", str(target), "--draft", str(draft)]


def generate(env, model: list[str], extra: list[str], ranks: int = 0, timeout: float = 300):
    """`generate --json` in one process (ranks 0) or under mlx.launch -n ranks."""
    command = [sys.executable, "-m", "monolith.generate", *model, "--prompt", PROMPT, "--max-tokens", "40",
               "--json", *extra]
    if ranks:
        command = [LAUNCH, "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_ports(ranks)),
                   "--", *command, "--distributed"]
    return subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def one_answer(run) -> dict:
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    # mlx.launch exits 0 even when a rank fails: its stderr says why
    assert len(lines) == 1, f"only rank 0 prints, one JSON object: {run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def one_process(env):
    """(target, mode) -> the model flags and the answer of one process, run once for both
    rank counts."""
    return {}


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("mode", ["plain", "speculative"])
@pytest.mark.parametrize("target", ["demo", "dense"])
def test_pipeline_output_equals_one_process(env, request, one_process, target, mode, ranks):
    if (target, mode) not in one_process:
        model = request.getfixturevalue(target)
        if mode == "plain":
            model = model[:2] + ["--no-draft"]
        one_process[target, mode] = model, one_answer(generate(env, model, []))
    model, alone = one_process[target, mode]
    split = one_answer(generate(env, model, [], ranks))
    assert split["token_ids"] == alone["token_ids"]
    assert split["text"] == alone["text"]
    if mode == "speculative":  # the same rounds: the draft saw the same tap features
        assert split["stats"]["accepted_per_round"] == alone["stats"]["accepted_per_round"]
        assert split["stats"]["rounds"] == alone["stats"]["rounds"] > 0


def test_draft_mtp_on_a_pipeline_equals_one_process(env, dense):
    """--draft mtp on 2 ranks: the MTP head runs on rank 0 from the final-norm and embedding
    taps that come back with the stream; the same tokens and rounds as one process."""
    model = dense[:2] + ["--draft", "mtp"]
    alone, split = one_answer(generate(env, model, [])), one_answer(generate(env, model, [], 2))
    assert split["token_ids"] == alone["token_ids"]
    assert split["stats"]["accepted_per_round"] == alone["stats"]["accepted_per_round"]
    assert split["stats"]["rounds"] == alone["stats"]["rounds"] > 0


def test_taps_all_on_rank_0_reach_the_drafter_between_prefill_chunks(env, dense, tmp_path):
    """The split follows each rank's measured speed, so it varies from run to run. Here
    rank 1 measures as slow, so rank 0 keeps every layer the draft taps: a prefill chunk
    that wants no logits must still hand the drafter its tap features (they were dropped,
    and the run failed at the next chunk in about 1 run in 15)."""
    script = ("import sys\n"
              "import monolith.distributed as distributed\n"
              "measure = distributed.measure_stage\n"
              "def slow_followers(model, head):\n"
              "    took, outside = measure(model, head)\n"
              "    return (took if head else took * 100), outside\n"
              "distributed.measure_stage = slow_followers\n"
              "join = distributed.join\n"
              "def join_and_tell(*args, **kwargs):\n"
              "    rank = join(*args, **kwargs)\n"
              "    print('rank 0 layers', list(rank.split[0]), file=sys.stderr) if rank.leader else None\n"
              "    return rank\n"
              "distributed.join = join_and_tell\n"
              "from monolith.generate import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    wrapper = tmp_path / "slow_followers.py"
    wrapper.write_text(script)
    args = [*dense, "--prompt", PROMPT, "--max-tokens", "40", "--json", "--prefill-chunk-size", "8"]
    alone = one_answer(subprocess.run([sys.executable, "-m", "monolith.generate", *args], check=False, env=env,
                                      capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL))
    split = subprocess.run([LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(free_ports(2)), "--",
                            sys.executable, str(wrapper), *args, "--distributed"], check=False, env=env,
                           capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert "rank 0 layers [0, 1, 2]" in split.stderr, split.stderr[-2000:]  # the draft taps layers 0 and 2
    answer = one_answer(split)
    assert answer["token_ids"] == alone["token_ids"] and answer["stats"]["rounds"] == alone["stats"]["rounds"] > 0


def test_a_rank_with_another_pack_is_refused_by_name(env, demo, dense, tmp_path):
    """Each rank builds its pack from its own --model: rank 1 gets the dense target."""
    script = ('import subprocess, sys, os\n'
              'models = sys.argv[1:3]\n'
              'rank = int(os.environ["MLX_RANK"])\n'
              'sys.exit(subprocess.call([sys.executable, "-m", "monolith.generate", "--model", models[rank], '
              '"--no-draft", "--prompt", "hi", "--max-tokens", "2", "--json", "--distributed"]))\n')
    wrapper = tmp_path / "per_rank.py"
    wrapper.write_text(script)
    run = subprocess.run([LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(free_ports(2)), "--",
                          sys.executable, str(wrapper), demo[1], dense[1]], check=False, env=env, capture_output=True, text=True,
                         timeout=300, stdin=subprocess.DEVNULL)
    # (mlx.launch itself exits 0 here: it only warns that rank 1 exited with code 1)
    assert "exited with code 1" in run.stderr
    assert "target packs differ" in run.stderr and "rank 1 has" in run.stderr, run.stderr[-2000:]
    assert run.stdout.strip() == ""


def _get(url: str, body: dict | None = None, timeout: float = 60):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize(("how", "message"), [
    (signal.SIGKILL, "connection to a peer was lost"),  # dead: the ring sees its sockets close
    (signal.SIGSTOP, "has not answered in 3 s"),  # alive but silent: rank 0's watchdog
])
def test_a_rank_lost_mid_request_fails_the_request_not_a_hang(env, demo, tmp_path, how, message):
    """The ranks are started as mlx.launch starts them (MLX_RANK, MLX_HOSTFILE), but by
    the test, so that it can kill rank 1 and keep rank 0 (mlx.launch would terminate the
    other ranks itself once one dies)."""
    base = free_ports(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    port = free_ports(1)
    serve = [sys.executable, "-m", "monolith.serve", *demo[:2], "--no-draft", "--distributed", "--max-context",
             "4096", "--no-warmup", "--distributed-timeout", "3"]
    ranks = []
    try:
        for rank in (1, 0):
            ranks.append(subprocess.Popen(serve + (["--port", str(port)] if rank == 0 else []),
                                          env={**env, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)},
                                          stdout=subprocess.DEVNULL, stderr=(tmp_path / f"rank{rank}.log").open("w"),
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            try:
                if _get(url + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the pipeline server did not start")
        status, body = _get(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        stream = urllib.request.urlopen(urllib.request.Request(
            url + "/v1/completions", data=json.dumps({"prompt": PROMPT, "max_tokens": 4000, "temperature": 0,
                                                      "stream": True}).encode(),
            headers={"Content-Type": "application/json"}), timeout=60)
        first = stream.readline()
        while not first.strip():
            first = stream.readline()
        assert first.startswith(b"data: {"), first
        os.kill(ranks[0].pid, how)  # rank 1, mid-stream
        rest = stream.read().decode()  # the stream ends (no hang: the read has a timeout)
        assert '"error"' in rest and message in rest, rest[-1000:]
        assert rest.rstrip().endswith("data: [DONE]")
        status, body = _get(url + "/health")
        assert status == 503 and json.loads(body)["status"] == "unhealthy"
        status, body = _get(url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 503 and message in json.loads(body)["error"]["message"]
    finally:
        for p in ranks:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)


def test_the_split_balances_cost_not_layer_count():
    """Rank 0 carries the head: it gets fewer layers; costs that differ by layer move the
    cut; measured speeds per rank shift layers to the faster rank."""
    assert split_layers([1.0] * 8, 2) == [range(4), range(4, 8)]
    assert split_layers([1.0] * 8, 2, first=2.0) == [range(3), range(3, 8)]
    assert split_layers([4.0, 1, 1, 1, 1, 4.0], 2) == [range(3), range(3, 6)]
    assert split_layers([1.0] * 6, 3) == [range(2), range(2, 4), range(4, 6)]
    assert split_layers([1.0] * 9, 2, speeds=[1.0, 2.0]) == [range(6), range(6, 9)]
    with pytest.raises(ValueError, match="at least 3 decoder layers"):
        split_layers([1.0, 1.0], 3)


def test_pack_costs_count_the_experts_a_step_reads():
    manifest = {"tensors": {
        "model.embed_tokens.weight": {"dtype": "BF16", "shape": [100, 8]},
        "lm_head.weight": {"dtype": "BF16", "shape": [100, 8]},
        "model.layers.0.mlp.experts.gate_up.weight": {"dtype": "U8", "shape": [8, 16, 4]},
        "model.layers.0.self_attn.q_proj.weight": {"dtype": "BF16", "shape": [8, 8]},
        "model.layers.1.mlp.down_proj.weight": {"dtype": "F32", "shape": [8, 8]},
    }}
    costs = pack_costs(manifest, 2, experts_read=0.25)
    assert costs.layer_bytes == (512 + 128, 256)
    assert costs.layer_reads == (128 + 128, 256)
    assert costs.head_bytes == 3200 and costs.head_reads == 1600  # the embedding is gathered, not read


def test_pack_inspect_shows_each_ranks_bytes(env, demo):
    """`pack inspect --ranks N`: every tensor's bytes on exactly one rank, rank 0 with the
    head; the vision tower on none (a pipeline takes no images)."""
    from monolith.pack import read_manifest, resolve_pack
    from monolith.pack.inspect import inspect_pack
    from monolith.formats.stfile import ITEMSIZE

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MONOLITH_CACHE", env["MONOLITH_CACHE"])
        pack = resolve_pack(demo[1], role="target")
    total = 0
    for name, t in read_manifest(pack)["tensors"].items():
        if name.startswith("model.visual."):
            continue
        n = ITEMSIZE[t["dtype"]]
        for d in t["shape"]:
            n *= d
        total += n
    for ranks in (2, 3):
        split = inspect_pack(pack, ranks)["ranks"]
        assert [r["rank"] for r in split] == list(range(ranks))
        assert sum(r["bytes"] for r in split) == total
        assert split[0]["layers"][0] == 0 and split[-1]["layers"][1] == 3
    run = subprocess.run([sys.executable, "-m", "monolith.pack", "inspect", str(pack), "--ranks", "9"], check=False,
                         env=env, capture_output=True, text=True)
    assert run.returncode == 1 and "9 ranks need at least 9 decoder layers" in run.stderr


def test_a_stage_reads_only_its_own_tensors(env, demo):
    """Rank 1 of [0-1 + head, 2-3]: its layers, the final norm its last layer fuses, and
    nothing of the head or of layers 0-1; rank 0: the head, its layers and the next
    stage's first norm. Together they read every tensor once (the norms twice)."""
    from monolith.models import load_model
    from monolith.models.weights import PackWeights
    from monolith.pack import resolve_pack

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MONOLITH_CACHE", env["MONOLITH_CACHE"])
        pack = resolve_pack(demo[1], role="target")
    read = {}
    original = PackWeights.unused

    def record(self):
        read[len(read)] = set(self.used)
        return original(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PackWeights, "unused", record)
        first = load_model(pack, "float32", layers=range(2), head=True)
        second = load_model(pack, "float32", layers=range(2, 4), head=False)
    head, tail = read[0], read[1]
    assert not any(n.startswith(("model.layers.2.", "model.layers.3.")) for n in head - {
        "model.layers.2.input_layernorm"})
    assert not any(n.startswith(("model.layers.0.", "model.layers.1.", "model.embed_tokens", "lm_head")) for n in tail)
    assert "model.norm" in tail and "model.embed_tokens.weight" in head
    everything = set(PackWeights(pack).arrays)
    assert head | tail == everything
    assert len(first.layers) == 2 and len(second.layers) == 2 and not hasattr(second, "embed_tokens")


def test_chat_runs_on_a_pipeline_and_refuses_save(env, demo, tmp_path):
    """chat --distributed under mlx.launch (which hands stdin to every rank; rank 1 serves
    its stage): one reply, the same as one process's, and /save says why it cannot."""
    def chat(ranks: int):
        lines = f"def fib(n):\n/save {tmp_path / f'{ranks}.ckpt'}\n/quit\n"
        command = [sys.executable, "-m", "monolith.chat", *demo[:2], "--no-draft", "--max-tokens", "8"]
        if ranks:
            command = [LAUNCH, "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_ports(ranks)),
                       "--", *command, "--distributed"]
        run = subprocess.run(command, check=False, env=env, input=lines, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout

    alone, split = chat(0), chat(2)
    assert first_reply(split) == first_reply(alone)
    assert "cannot save" in split and "not available with --distributed" in split
    assert (tmp_path / "0.ckpt").exists() and not (tmp_path / "2.ckpt").exists()


def first_reply(out: str) -> str:
    return out.split("> ", 2)[1].split("-- ")[0]
