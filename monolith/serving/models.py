"""The models a server serves (docs/serving.md, "Several models"): each configured model
(`ModelSpec`: its names, the function that loads it) loaded when a request names it,
and unloaded when it has been idle for its keep-alive, or to make room for another
under `--max-loaded-models` and the memory budget (least recently used first).

`ModelPool` is the one home of that lifecycle. Its state changes only on the event
loop: a request `hold`s a model (waiting while it loads, bounded by the load timeout)
and releases its `Lease` when its handler is done; the engine's own queue covers the
stream that runs on after that (`Engine.busy`, `Engine.idle_since`). A model is never
unloaded while a lease is held or its engine has a request running or waiting: the
check and the unload's first step (the model leaves the pool) run with no await
between them, so no request can take it in between. Loads run one at a time, each on
a thread of its own (MLX's per-thread streams are released at its end), as the single
model of a server always loaded at start."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ..runtime.engine import release_thread_streams
from .errors import APIError, bad

log = logging.getLogger("monolith.serve")
CHECK_EVERY = 0.25  # seconds between the unloader's looks at idle models
ROOM_EVERY = 0.05  # seconds between looks for an idle model to unload while a load waits for room
FOREVER = math.inf
UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class ModelSpec:
    """A configured model: the names clients use (the first is its name in /v1/models
    and /metrics), `load()` making its Engine (blocking: packs built and verified,
    weights loaded, warmed up), and `size()` the bytes it is expected to take before it
    was first loaded (its packs' bytes; 0: unknown)."""

    names: tuple[str, ...]
    load: Callable[[], object]
    size: Callable[[], int] = lambda: 0


@dataclass(eq=False)
class Slot:
    """One configured model's state in the pool."""

    spec: ModelSpec
    keep_alive: float  # seconds idle before it is unloaded (FOREVER: never)
    served: object = None  # what `prepare(engine)` made of its Engine while loaded (has `.engine`)
    loading: asyncio.Future | None = None  # its load in progress: the error text, or None once loaded
    leases: int = 0  # requests holding it now
    last_used: float = 0.0  # time.monotonic() of its last lease taken or released
    footprint: int = 0  # MLX bytes its last load took (0: never loaded)
    load_seconds: float = 0.0  # its last load's duration
    max_context: int | None = None  # its engine's context (kept once known)
    loads: int = 0  # times it was loaded

    @property
    def name(self) -> str:
        return self.spec.names[0]

    @property
    def state(self) -> str:
        return "loaded" if self.served is not None else "loading" if self.loading is not None else "unloaded"


@dataclass
class Lease:
    """A request's hold on a loaded model: `served` stays loaded until `release()`."""

    pool: ModelPool
    slot: Slot
    served: object
    released: bool = field(default=False)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool._release(self.slot)


class ModelPool:
    """See the module docstring. `keep_alive`: seconds a model may stay idle (None:
    forever); `max_loaded`: the most models loaded at once (None: no bound); `budget`:
    the most bytes the loaded models may take (None: no bound); `load_timeout`: the
    longest a request waits for its model to load. `prepare(engine)` (the app's) turns
    a loaded Engine into what requests use (it has `.engine`)."""

    def __init__(self, specs: list[ModelSpec], keep_alive: float | None = None, max_loaded: int | None = None,
                 budget: int | None = None, load_timeout: float = 300.0, check_every: float = CHECK_EVERY):
        if not specs:
            raise ValueError("a pool needs at least one model")
        self.keep_alive = FOREVER if keep_alive is None or keep_alive < 0 else float(keep_alive)
        self.slots = [Slot(spec, self.keep_alive) for spec in specs]
        self.by_name = {name: slot for slot in self.slots for name in slot.spec.names}
        self.max_loaded, self.budget = max_loaded, budget
        self.load_timeout, self.check_every = load_timeout, check_every
        self.prepare: Callable[[object], object] = lambda engine: engine
        # what makes a ModelSpec of a model a client asks to pull that is not configured (the
        # Ollama API's /api/pull, with serve's --allow-pull; None: only configured models)
        self.pull: Callable[[str], ModelSpec] | None = None
        self.status, self.error = "loading", None  # the start-up load of the default model: -> ready / failed
        self._load_lock: asyncio.Lock | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._watcher: asyncio.Task | None = None
        self.closing = False  # stopped: a load that ends now closes what it made

    @property
    def default(self) -> Slot:
        return self.slots[0]

    def names(self) -> tuple[str, ...]:
        return tuple(self.by_name)

    def loaded(self) -> list[Slot]:
        return [slot for slot in self.slots if slot.served is not None]

    def add(self, spec: ModelSpec) -> Slot:
        """Serve one more model from now on (not loaded yet); a 400 when one of its names
        is taken."""
        taken = sorted(set(spec.names) & set(self.by_name))
        if taken:
            raise bad(f"the model name {taken[0]!r} is already served", "model")
        slot = Slot(spec, self.keep_alive)
        self.slots.append(slot)
        self.by_name.update({name: slot for name in spec.names})
        return slot

    # ---------------------------------------------------------------- start and stop

    def start(self, on_failure: Callable[[Exception], None] | None = None) -> None:
        """On the event loop: load the default model now, in the background (a failure
        is the start's: `on_failure(error)`), and watch for idle models."""
        self._load_lock = asyncio.Lock()
        self.loop = asyncio.get_running_loop()  # where its state lives (tests call in through it)
        loading = self._begin_load(self.default)

        def started(future: asyncio.Future) -> None:
            if future.cancelled():  # the server stopped during its start-up load
                return
            error = future.result()
            if error is None:
                self.status = "ready"
                return
            self.status, self.error = "failed", str(error) or type(error).__name__
            log.error("loading failed: %s", self.error)
            if on_failure is not None:
                on_failure(error)

        loading.add_done_callback(started)
        self._watcher = asyncio.create_task(self._watch())

    async def close(self) -> None:
        """Stop: every loaded model is closed; a load in progress goes on on its thread
        and closes what it makes (serve exits without waiting for it:
        model_work_in_progress)."""
        self.closing = True
        if self._watcher is not None:
            self._watcher.cancel()
        for slot in self.loaded():
            engine, slot.served = slot.served.engine, None
            await asyncio.to_thread(engine.close)

    # ---------------------------------------------------------------- requests

    async def hold(self, name: str, keep_alive: float | None = None) -> Lease:
        """A lease on the model `name` (a configured name), loading it first if need be.
        During the server's start-up load of the default model this is a 503, as ever;
        a model loaded later makes its requests wait, up to the load timeout (then a
        503). `keep_alive` (the request's own) replaces the model's from now on."""
        slot = self.by_name[name]
        if self.status == "failed":
            raise APIError(503, f"the model failed to load: {self.error}", code="model_load_failed")
        if self.status == "loading":
            raise APIError(503, "the model is still loading; retry when GET /health answers 200",
                           code="model_loading")
        slot.leases += 1  # waiting for it holds it: loaded, it is not unloaded before this request has it
        try:
            await self._loaded(slot)
        except BaseException:
            self._release(slot)
            raise
        slot.last_used = time.monotonic()
        if keep_alive is not None:
            slot.keep_alive = FOREVER if keep_alive < 0 else keep_alive
        return Lease(self, slot, slot.served)

    async def _loaded(self, slot: Slot) -> None:
        """Wait until `slot` is loaded (starting its load if need be), up to the load timeout."""
        deadline = time.monotonic() + self.load_timeout
        while slot.served is None:
            loading = slot.loading or self._begin_load(slot)
            try:
                error = await asyncio.wait_for(asyncio.shield(loading), max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                raise APIError(503, f"the model {slot.name} is still loading after {self.load_timeout:g} s; "
                                    "retry later", code="model_loading") from None
            if error is not None:
                raise APIError(503, f"the model {slot.name} failed to load: {error}", code="model_load_failed")

    def _release(self, slot: Slot) -> None:
        slot.leases -= 1
        slot.last_used = time.monotonic()

    @staticmethod
    def busy(slot: Slot) -> bool:
        """A request holds it, or its engine has one running or waiting."""
        return slot.leases > 0 or (slot.served is not None and slot.served.engine.busy)

    # ---------------------------------------------------------------- loading

    def _begin_load(self, slot: Slot) -> asyncio.Future:
        """Start loading `slot` (after the loads before it); its future's result is the
        error (None: loaded)."""
        slot.loading = asyncio.ensure_future(self._load(slot))
        return slot.loading

    async def _load(self, slot: Slot):
        try:
            async with self._load_lock:  # one at a time: each measured alone, the budget kept
                await self._make_room(slot)
                served, seconds, grown = await _in_thread(lambda: _timed(lambda: self._make(slot)))
        except Exception as e:  # noqa: BLE001 - the waiting requests get it
            log.error("loading %s failed: %s", slot.name, e)
            return e
        finally:
            slot.loading = None
        slot.served, slot.load_seconds, slot.footprint = served, seconds, max(grown, 0)
        slot.max_context, slot.loads = served.engine.max_context, slot.loads + 1
        slot.last_used = time.monotonic()
        log.info("%s loaded in %.1f s (%.2f GiB)", slot.name, seconds, slot.footprint / 2**30)
        return None

    def _make(self, slot: Slot):
        """On the load's thread: what serves `slot`, closed again when the pool was closed
        meanwhile (nothing would close it then)."""
        served = self.prepare(slot.spec.load())
        if self.closing:
            served.engine.close()
            raise APIError(503, "the server stopped while the model loaded", code="server_stopping")
        return served

    async def _make_room(self, slot: Slot) -> None:
        """Unload the least recently used idle models while loading `slot` would exceed
        --max-loaded-models or the memory budget; wait (up to the load timeout) while
        every loaded model is busy."""
        need = slot.footprint or slot.spec.size()
        deadline = time.monotonic() + self.load_timeout
        while True:
            loaded = self.loaded()
            over_count = self.max_loaded is not None and len(loaded) >= self.max_loaded
            over_budget = self.budget is not None and bool(loaded) and \
                sum(s.footprint for s in loaded) + need > self.budget
            if not (over_count or over_budget):
                return
            idle = [s for s in loaded if not self.busy(s)]
            if idle:
                victim = min(idle, key=lambda s: s.last_used)
                why = "--max-loaded-models" if over_count else "the memory budget"
                await self._unload(victim, f"to make room for {slot.name} ({why})")
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"no room for {slot.name}: every loaded model is busy")
            await asyncio.sleep(ROOM_EVERY)

    # ---------------------------------------------------------------- unloading

    async def unload_idle(self) -> list[str]:
        """Unload every model idle past its keep-alive (never one that is busy): their names."""
        now, gone = time.monotonic(), []
        for slot in self.slots:
            if slot.served is None or self.busy(slot) or slot.keep_alive == FOREVER:
                continue
            idle = now - max(slot.last_used, slot.served.engine.idle_since)
            if idle >= slot.keep_alive:
                gone.append(slot.name)
                await self._unload(slot, f"idle for {idle:.1f} s (keep-alive {slot.keep_alive:g} s)")
        return gone

    async def _unload(self, slot: Slot, why: str) -> None:
        """Take `slot`'s model out (at once: no request can hold it from here on), then
        close its engine and free its memory (its prompt cache's disk states stay)."""
        engine, slot.served = slot.served.engine, None
        slot.keep_alive = self.keep_alive  # a request's own keep-alive lasts while the model stays loaded
        before = mx.get_active_memory()
        await _in_thread(engine.close)
        engine = None  # the last reference: what it held is freed now
        freed = before - await _in_thread(_collect)
        log.info("unloaded %s, %s: %.2f GiB freed", slot.name, why, freed / 2**30)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.check_every)
            try:
                await self.unload_idle()
            except Exception:  # the watcher goes on
                log.exception("unloading an idle model failed")


def _timed(load: Callable[[], object]) -> tuple[object, float, int]:
    """(load(), the seconds it took, the MLX bytes it grew the active memory by)."""
    before, started = mx.get_active_memory(), time.perf_counter()
    served = load()
    return served, time.perf_counter() - started, mx.get_active_memory() - before


def _collect() -> int:
    """Free what is unreachable now, and MLX's buffer cache: the active bytes after."""
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    return mx.get_active_memory()


MODEL_THREAD = "monolith-model"  # the threads that load and unload models


async def _in_thread(fn: Callable[[], object]):
    """fn() on a thread of its own (its MLX streams released at its end), awaited."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as e:  # noqa: BLE001 - raised again in the awaiting task
            result, error = None, e
        finally:
            release_thread_streams()
        try:
            loop.call_soon_threadsafe(_settle, done, result, error)
        except RuntimeError:  # the loop is closed: the server stopped, nobody waits
            pass

    threading.Thread(target=run, name=MODEL_THREAD, daemon=True).start()
    return await done


def model_work_in_progress() -> bool:
    """Whether a model is still loading (or unloading) on its thread: after a stop, serve
    exits without waiting for it, as an interpreter exit under its MLX work aborts the
    process ("terminate called without an active exception")."""
    return any(t.name == MODEL_THREAD and t.is_alive() for t in threading.enumerate())


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def duration(text: str) -> float:
    """Seconds of "30", "30s", "5m", "1h" or "250ms" (ValueError otherwise): the
    --keep-alive flag's and a request's keep_alive string's."""
    text = str(text).strip()
    unit = next((u for u in ("ms", "s", "m", "h") if text.endswith(u)), "")
    number = float(text[:len(text) - len(unit)])
    if not math.isfinite(number):
        raise ValueError(f"not a duration: {text!r}")
    return number * UNITS.get(unit, 1.0)


def keep_alive_seconds(value) -> float | None:
    """A request's `keep_alive` (our extension, as Ollama's): seconds as a number, or a
    duration string (`duration`); negative: keep the model loaded; 0: unload it once
    idle. None when not given; a 400 naming it when malformed."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):
        try:
            return duration(value)
        except ValueError:
            pass
    raise bad(f"keep_alive must be seconds (a number) or a duration such as \"5m\", got {value!r}", "keep_alive")
