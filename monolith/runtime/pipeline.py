"""A target split into pipeline stages over mx.distributed (`--distributed`, started by
`mlx.launch`): rank r holds a contiguous run of decoder layers (pack/split.py);
rank 0 also holds the embedding, the final norm and the lm_head, runs the draft, the
engine and the HTTP server. The other ranks run `serve_stage`: a loop that does what
rank 0 tells it.

Every message goes one way round the ring, rank 0 -> 1 -> ... -> N-1 -> 0, so each hop
is between neighbours:

- a command (a small JSON frame): every rank relays it to the next before acting on it.
  Cache commands (new, snapshot, restore, commit, rewind, and the ids rank 0 dropped)
  keep each rank's caches of its own layers in step with rank 0's; they carry no arrays
  and wait on rank 0 until the next forward's frame carries them (or the stop).
- a forward: rank 0 embeds the rows and runs its layers, then the residual stream
  [rows, hidden] (compute dtype) goes to rank 1, which runs its layers and passes it on.
  A stage that holds a layer the draft taps appends that layer's rows, so the tap
  features travel with the stream; the last rank sends the stream and the taps back to
  rank 0, which applies the final norm and the lm_head. A forward whose rows need no
  logits and no taps (a prefill chunk) gets a one-number acknowledgement back instead.

A verify round of 8 rows is thus one frame, then N hops of 8 x hidden values plus the
tap features; its snapshot and commit ride in the frames. Rank 0 waits for each
forward's answer before it sends anything else, so no two messages cross.

Failures: a rank that dies closes its sockets and the ring raises on the next send or
receive; rank 0 then marks the pipeline broken (`Pipeline.broken`: the server's health
turns unhealthy) and every later forward raises PipelineError at once. A rank that
stops answering is caught by `Pipeline.timeout` (a watchdog on rank 0's waits).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import weakref
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..models.cache import CacheError, HybridCache, Snapshot
from ..models.layers import rms_norm
from ..models.mixers import Span
from ..models.qwen3_5 import FINAL_NORM_TAP, Segment, add_named_taps

FRAME = 512  # bytes of a command frame: a 4-byte length, then JSON (longer commands take a second message)


class PipelineError(RuntimeError):
    """A rank of the pipeline failed or cannot be reached."""


class Link:
    """This rank's ends of the ring: messages to the next rank, from the previous one."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.next = (self.rank + 1) % self.size
        self.previous = (self.rank - 1) % self.size
        self.sent = 0  # bytes sent by this rank (arrays and frames)
        self.frames = 0  # command frames (and overflows) sent
        self.received = 0  # bytes received

    def send(self, *arrays: mx.array) -> None:
        """Send the arrays in order, in one evaluation (each send waits on the one before)."""
        sends = []
        for x in arrays:
            if sends:
                x = mx.depends(x, sends[-1:])
            sends.append(mx.distributed.send(x, self.next, group=self.group))
            self.sent += x.nbytes
        mx.eval(sends)

    def receive(self, shape: tuple, dtype) -> mx.array:
        x = mx.distributed.recv(shape, dtype, self.previous, group=self.group)
        mx.eval(x)
        self.received += x.nbytes
        return x

    def send_command(self, command: dict, then: mx.array | None = None) -> None:
        """Send a command frame (and its overflow), then `then` if given."""
        data = json.dumps(command, separators=(",", ":")).encode()
        frame = bytearray(FRAME)
        frame[:4] = len(data).to_bytes(4, "little")
        head = data[:FRAME - 4]
        frame[4:4 + len(head)] = head
        arrays = [mx.array(np.frombuffer(bytes(frame), dtype=np.uint8))]
        if len(data) > FRAME - 4:
            arrays.append(mx.array(np.frombuffer(data[FRAME - 4:], dtype=np.uint8)))
        self.frames += len(arrays)
        self.send(*arrays, *([] if then is None else [then]))

    def receive_command(self) -> dict:
        frame = np.array(self.receive((FRAME,), mx.uint8)).tobytes()
        n = int.from_bytes(frame[:4], "little")
        data = frame[4:4 + min(n, FRAME - 4)]
        if n > FRAME - 4:
            data += np.array(self.receive((n - (FRAME - 4),), mx.uint8)).tobytes()
        return json.loads(data)


# ----------------------------------------------------------------------- rank 0


@dataclass(frozen=True)
class RemoteSnapshot(Snapshot):
    """A snapshot of rank 0's layers; every other rank holds its own under `sid`."""

    sid: int = -1


class PipelineCache(HybridCache):
    """Rank 0's cache of one sequence: its own layers' states, and the same operations
    sent to every other rank for theirs (`cid` names the sequence there)."""

    def __init__(self, pipeline: Pipeline, layers, max_context: int, spare_rows: int):
        super().__init__(layers, max_context, spare_rows)
        self.pipeline = pipeline
        self.cid = pipeline.command("new", max_context=max_context, spare_rows=spare_rows)
        weakref.finalize(self, pipeline.forget, "caches", self.cid)

    def snapshot(self, record: bool = False) -> Snapshot:
        local = super().snapshot(record)
        sid = self.pipeline.command("snapshot", cid=self.cid, record=record)
        snap = RemoteSnapshot(local.offset, local.states, local.positions, sid)
        weakref.finalize(snap, self.pipeline.forget, "snapshots", sid)
        return snap

    def restore(self, snap: Snapshot) -> None:
        if isinstance(snap, RemoteSnapshot):  # not the states a commit replayed (local, done there too)
            self.pipeline.command("restore", cid=self.cid, sid=snap.sid)
        super().restore(snap)

    def commit(self, snap: Snapshot, rows: int) -> None:
        if not isinstance(snap, RemoteSnapshot):
            raise CacheError("a pipeline cache commits from its own snapshots")
        if not 0 <= rows <= self.written - snap.offset:
            raise CacheError(f"cannot keep {rows} rows of a {self.written - snap.offset}-row forward")
        self.pipeline.command("commit", cid=self.cid, sid=snap.sid, rows=rows)
        super().commit(snap, rows)

    def rewind(self, offset: int) -> None:
        super().rewind(offset)
        self.pipeline.command("rewind", cid=self.cid, offset=offset)

    @property
    def row_layers(self):
        raise CacheError("the KV rows of a pipeline's caches live on several ranks: the prompt cache and "
                         "/save are not available with --distributed")

    def adopt(self, snap) -> None:
        raise CacheError("a pipeline cache cannot adopt rows written from outside (--distributed)")


class Pipeline:
    """Rank 0's side: the target's first stage (`local`, a model holding the head and
    layers [0, k)) behaving as the whole target (`forward_batch`, `make_cache`, ...),
    the other stages reached through `link`."""

    def __init__(self, local, link: Link, split: list[range], timeout: float = 600.0):
        self.local, self.link, self.split = local, link, split
        self.args, self.dtype = local.args, local.dtype
        self.timeout = timeout
        self.broken: str | None = None  # why the pipeline stopped, once it has
        self._ids = itertools.count(1)
        self._forgotten: dict[str, list[int]] = {"caches": [], "snapshots": []}
        self._queued: list[dict] = []  # cache commands waiting for the next forward
        self.on_broken: list = []  # called with the PipelineError when the watchdog gives up
        self._watchdog: threading.Thread | None = None
        self._deadline: float | None = None  # when the answer being waited for is late
        self._lock = threading.Lock()
        self.remote_taps: set[int] = set(range(split[0].stop, self.args.num_hidden_layers))
        self.forwards = self.commands = self.rows = 0  # counted for traffic()

    def traffic(self) -> dict:
        """What rank 0 has sent so far (generate --json: bench/distributed.py reads it)."""
        return {"ranks": self.link.size, "layers": [[r.start, r.stop - 1] for r in self.split],
                "forwards": self.forwards, "commands": self.commands, "rows": self.rows,
                "frames": self.link.frames, "sent_bytes": self.link.sent,
                "received_bytes": self.link.received, "frame_bytes": FRAME}

    def __getattr__(self, name):  # the head and everything else the runtime reads: the first stage's
        return getattr(self.local, name)

    # the runtime's view: the whole target
    def make_cache(self, max_context: int, spare_rows: int | None = None) -> PipelineCache:
        local = self.local.make_cache(max_context) if spare_rows is None else \
            self.local.make_cache(max_context, spare_rows)
        return PipelineCache(self, local.layers, local.max_context, local.spare_rows)

    def __call__(self, tokens, cache, taps=None):
        return self.forward(tokens, cache, taps)

    def forward(self, tokens, cache, taps=None, logits: str = "all"):
        return self.forward_batch([Segment(tokens, cache, tuple(taps or ()), logits)])[0]

    def forward_batch(self, segments: list[Segment]):
        local = self.local
        tokens, taps, spans = local.layout(segments)
        wanted = {i for t in taps for i in t}
        x = local.embed_tokens(tokens[0] if len(tokens) == 1 else mx.concatenate(tokens))[None]
        embedded = x[0]
        x, _, tapped = local.run_layers(x, segments, spans, wanted & set(local.owned))
        remote = sorted(wanted & self.remote_taps)
        reply = any(s.logits != "none" for s in segments) or bool(remote) or FINAL_NORM_TAP in wanted
        rows = [span.stop - span.start for span in spans]
        self._check()
        try:
            self._send("forward", x, cids=[s.cache.cid for s in segments], rows=rows, taps=remote, reply=reply)
            h = self.args.hidden_size
            back = self._wait((1, x.shape[1], h * (1 + len(remote))) if reply else (1,), x.dtype)
        except Exception as e:
            raise self._broke(e) from e
        for s, n in zip(segments, rows):
            s.cache.advance(n)
        self.forwards += 1
        self.rows += sum(rows)
        if not reply:  # no logits, and every wanted tap is on this rank
            add_named_taps(tapped, wanted, embedded, None)
            return [(None, local._hidden(tapped, t, span)) for t, span in zip(taps, spans)]
        final = back[..., :h]
        for j, layer in enumerate(remote):
            tapped[layer] = back[0, :, h * (j + 1):h * (j + 2)]
        normed = rms_norm(final, local.norm, self.args.rms_norm_eps)
        add_named_taps(tapped, wanted, embedded, normed)
        return [(logits, local._hidden(tapped, t, span)) for logits, t, span in
                zip(local._logits(normed[0], segments, spans), taps, spans)]

    # commands
    def command(self, op: str, **fields) -> int:
        """Queue a cache command for every other rank: it travels with the next forward
        (the ranks only need their caches in step when rows arrive). Returns the id it
        names (new caches and snapshots)."""
        self._check()
        ident = next(self._ids)
        self._queued.append({"op": op, "id": ident, **fields})
        return ident

    def _send(self, op: str, then: mx.array | None = None, **fields) -> None:
        """Send `op` with the queued commands and the forgotten ids before it (then the
        forward's rows, `then`)."""
        with self._lock:
            dropped = {k: v for k, v in self._forgotten.items() if v}
            self._forgotten = {"caches": [], "snapshots": []}
        queued, self._queued = self._queued, []
        self.commands += 1 + len(queued)
        self.link.send_command({"op": op, "before": queued, "drop": dropped, **fields}, then)

    def forget(self, kind: str, ident: int) -> None:
        """A cache or snapshot rank 0 no longer holds: the others drop theirs with the next command."""
        with self._lock:
            self._forgotten[kind].append(ident)

    def close(self) -> None:
        """Tell the other ranks to stop (they exit their loops)."""
        if self.broken is None:
            try:
                self._send("stop")
            except Exception as e:  # noqa: BLE001 - a rank is gone already: nothing to stop
                self.broken = f"stopped ({e})"
                return
            self.broken = "stopped"

    def _wait(self, shape, dtype) -> mx.array:
        """The last rank's answer. It is received on the calling thread (MLX gives each
        thread streams of its own); the watchdog calls the pipeline down if it takes longer
        than `timeout` seconds, and tells `on_broken` (the engine fails its requests: the
        receive itself cannot be interrupted)."""
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="monolith-pipeline-watchdog", daemon=True)
            self._watchdog.start()
        self._deadline = time.monotonic() + self.timeout
        try:
            return self.link.receive(shape, dtype)
        finally:
            self._deadline = None

    def _watch(self) -> None:
        while self.broken is None:
            time.sleep(min(1.0, self.timeout / 4))
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline and self.broken is None:
                self._timed_out()

    def _timed_out(self) -> None:
        error = PipelineError(f"rank {self.link.previous} has not answered in {self.timeout:g} s")
        self.broken = self.broken or str(error)
        for hook in self.on_broken:
            hook(error)

    def _check(self) -> None:
        if self.broken is not None:
            raise PipelineError(f"the pipeline is down: {self.broken}")

    def _broke(self, e: Exception) -> PipelineError:
        self.broken = self.broken or f"{type(e).__name__}: {e}"
        return e if isinstance(e, PipelineError) else PipelineError(f"a rank of the pipeline failed: {e}")


# ----------------------------------------------------------------------- ranks 1..N-1


def serve_stage(model, link: Link) -> None:
    """Run this rank's stage until rank 0 says stop (or the ring fails: raises)."""
    caches: dict[int, HybridCache] = {}
    snapshots: dict[int, tuple[int, Snapshot]] = {}
    h, last = model.args.hidden_size, link.rank == link.size - 1
    owned = set(model.owned)
    while True:
        command = link.receive_command()
        if not last:
            link.send_command(command)
        for queued in command["before"]:
            _apply(model, queued, caches, snapshots)
        for cid in command["drop"].get("caches", ()):  # after: a cache may be made and dropped in one go
            caches.pop(cid, None)
        for sid in command["drop"].get("snapshots", ()):
            snapshots.pop(sid, None)
        if command["op"] == "stop":
            return
        if command["op"] != "forward":
            raise PipelineError(f"rank {link.rank}: unknown command {command['op']!r}")
        _stage_forward(model, link, command, [caches[c] for c in command["cids"]], owned, h, last)


def _apply(model, command: dict, caches: dict, snapshots: dict) -> None:
    """One cache command, as rank 0 did it on its own layers."""
    op = command["op"]
    if op == "new":
        caches[command["id"]] = model.make_cache(command["max_context"], command["spare_rows"])
    elif op == "snapshot":
        snapshots[command["id"]] = caches[command["cid"]].snapshot(command["record"])
    elif op == "restore":
        caches[command["cid"]].restore(snapshots[command["sid"]])
    elif op == "commit":
        caches[command["cid"]].commit(snapshots[command["sid"]], command["rows"])
    elif op == "rewind":
        caches[command["cid"]].rewind(command["offset"])
    else:
        raise PipelineError(f"unknown cache command {op!r}")


def _stage_forward(model, link: Link, command: dict, caches: list, owned: set, h: int, last: bool) -> None:
    taps = command["taps"]
    before = [t for t in taps if t < model.owned.start]  # carried in from earlier stages
    rows = command["rows"]
    n = sum(rows)
    incoming = link.receive((1, n, h * (1 + len(before))), model.dtype)
    x, tapped = model.forward_stage(incoming[..., :h], caches, rows, [t for t in taps if t in owned])
    parts = [x, incoming[..., h:]] if before else [x]
    parts += [tapped[t][None] for t in taps if t in owned]
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    mx.eval(out, [c.arrays() for c in caches])  # and the commits that came before
    if last and not command["reply"]:
        link.send(mx.zeros((1,), model.dtype))
    else:
        link.send(out)


__all__ = ["Link", "Pipeline", "PipelineCache", "PipelineError", "RemoteSnapshot", "Span", "serve_stage"]
