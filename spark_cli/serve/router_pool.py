"""Router mode's children: one `spark serve MODEL --host 127.0.0.1 --port P` process per loaded
model, started on demand, stopped when unloaded, evicted least recently used past --models-max.

llama-server's scheduling (server-models.cpp's server_lru_sched), on the router's event loop:

- a request for a model that is not running joins a FIFO queue; requests for the same model share
  one entry (one load, one slot, one eviction for all of them);
- while queued requests outnumber the free slots, idle models are stopped, least recently used
  first; a model serving a request (or one a queued request wants) is never taken: the queue waits
  for it to go idle;
- the head of the queue loads its model once a slot is really free (the evicted child has exited);
- a queued client that goes away leaves the queue, and the slot it freed goes to the next.

A child gets the router's flags (and its preset's), a key only the router knows (SPARK_API_KEY in
its environment: reachable only through the router), and stdin from the router: it exits when
that closes (SPARK_ROUTER_PORT set), so a router that dies leaves no children.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from .protocol import ApiError
from .router_models import RouterModel, child_flags, find
from .router_proxy import CHILD_HOST, UpstreamError, get_json

UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"
DEFAULT_MODELS_MAX = 4  # llama-server's --models-max
FAKE_DELAY = 2.0  # seconds LLAMA_SERVER_DEBUG_FAKE_TIMING adds to a load and to a proxied request
TAIL = 20  # a child's last output lines kept (a failed load says the last one)
MAX_LINE = 1 << 20  # bytes of a child's output line at most (longer: logged in pieces)


@dataclass(frozen=True)
class PoolConfig:
    """How children are started: `launcher` runs `spark` (then `serve MODEL ...`); `cli_flags` are the
    router's own flags by parameter (over each preset's)."""

    launcher: tuple[str, ...]
    cli_flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    models_max: int = DEFAULT_MODELS_MAX  # 0: no limit
    fake_timing: bool = False  # LLAMA_SERVER_DEBUG_FAKE_TIMING: llama-server's test hook (slow loads and requests)
    router_port: int = 0
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    log: Callable[[str], None] = lambda line: None


@dataclass
class Instance:
    """A model and its child, if it has one."""

    model: RouterModel
    status: str = UNLOADED
    port: int = 0
    proc: asyncio.subprocess.Process | None = None
    req_count: int = 0           # proxied requests in flight
    last_used: float = 0.0       # for LRU eviction
    stopping: bool = False       # asked to stop, not exited yet (still counts as running)
    asked_to_stop: bool = False  # its exit is the router's doing, not a failure
    exit_code: int | None = None
    failed: bool = False
    why: str = ""                # a failed load's reason (the child's last line)
    args: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # the child's /v1/models card, once loaded
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL))

    @property
    def running(self) -> bool:
        return self.status in (LOADING, LOADED)


@dataclass
class _Entry:
    """The queue's entry for one model: how many requests wait for it, and whether one is loading it."""

    model: str
    waiters: int = 1
    loading: bool = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind((CHILD_HOST, 0))
        return s.getsockname()[1]


class Pool:
    """The router's models and their children. Every method runs on the router's event loop (one
    thread: no locks; state changes between awaits are atomic)."""

    def __init__(self, models: Mapping[str, RouterModel], config: PoolConfig):
        self.config = config
        self.instances: dict[str, Instance] = {name: Instance(m) for name, m in models.items()}
        self.queue: collections.deque[_Entry] = collections.deque()
        self.key = secrets.token_urlsafe(24)  # the children's API key: only the router calls them
        self.reloading = False
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------ lookups

    def get(self, name: str) -> Instance | None:
        """The instance a request's `model` names (by name or alias)."""
        m = find({n: i.model for n, i in self.instances.items()}, name)
        return self.instances[m.name] if m is not None else None

    def running(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.running]

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout: float) -> None:
        """Until something changes (a status, the queue), at most `timeout` seconds."""
        ev = self._changed
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _spawn_task(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ the queue (llama-server's server_lru_sched)

    def has_capacity(self) -> bool:
        return self.config.models_max <= 0 or len(self.running()) < self.config.models_max

    def _queued(self, name: str) -> _Entry | None:
        return next((e for e in self.queue if e.model == name), None)

    def pick_victim(self) -> str | None:
        """The least recently used model that can be given up: loaded, idle, not stopping, not wanted
        by a queued request."""
        idle = [i for i in self.instances.values() if i.status == LOADED and i.req_count == 0 and not i.stopping
                and self._queued(i.model.name) is None]
        return min(idle, key=lambda i: i.last_used).model.name if idle else None

    def join(self, name: str) -> None:
        e = self._queued(name)
        if e is not None:
            e.waiters += 1
        else:
            self.queue.append(_Entry(name))

    def leave(self, name: str) -> None:
        e = self._queued(name)
        if e is not None:
            e.waiters -= 1
            if e.waiters <= 0:
                self.queue.remove(e)

    def try_claim(self, name: str) -> bool:
        """Whether it is `name`'s turn to load (the head of the queue, a slot free, nobody loading it)."""
        if not self.queue or self.queue[0].model != name or self.queue[0].loading or not self.has_capacity():
            return False
        self.queue[0].loading = True
        return True

    def claim_done(self, name: str, ok: bool) -> None:
        """After a claimed load: on failure the entry is back in line; on success it stays until its
        waiters leave (so the model coming up is not an eviction victim before they use it)."""
        e = self._queued(name)
        if e is not None and not ok:
            e.loading = False

    def tick(self) -> None:
        """Stop idle models while queued requests outnumber the slots free or being freed."""
        if self.config.models_max <= 0 or not self.queue:
            return
        running = self.running()
        n_free = self.config.models_max - len(running) + sum(1 for i in running if i.stopping)
        n_needed = 0
        for e in self.queue:
            if not e.loading:
                n_needed += 1
            elif e.model in self.instances and not self.instances[e.model].running:
                n_free -= 1  # claimed, not spawned yet
        while n_free < n_needed:
            victim = self.pick_victim()
            if victim is None:
                return  # every model left is busy: a request's end ticks again
            self.config.log(f"evicting idle {victim} (least recently used) for a queued request")
            self.request_stop(victim)
            n_free += 1

    # ------------------------------------------------------------ children

    def not_servable(self, inst: Instance) -> ApiError | None:
        """Why this model cannot be loaded at all (no GGUF here, a draft model), as the API answers it."""
        m = inst.model
        why = m.refused or (m.missing if m.path is None else "")
        return ApiError(500, f"model {m.name} cannot be loaded: {why}", "server_error") if why else None

    async def load(self, name: str) -> None:
        """Start `name`'s child (unless it runs): a slot freed first if none is (the LRU idle model,
        waited for); ApiError when it cannot be served or no slot can be freed."""
        if self.config.fake_timing:
            await asyncio.sleep(FAKE_DELAY)  # NOTE: llama-server's test hook: a load that takes a while
        inst = self.instances.get(name)
        if inst is None:
            raise ApiError(404, f"model {name} is not found", "not_found_error")
        bad = self.not_servable(inst)
        if bad is not None:
            inst.failed, inst.why = True, bad.message
            raise bad
        await self.unload_lru()
        while self.reloading:
            await self.changed(0.2)
        if inst.status != UNLOADED:
            return
        if not self.has_capacity():
            raise ApiError(503, "model limit reached (--models-max), try again later", "unavailable_error")
        await self._spawn(inst)

    async def _spawn(self, inst: Instance) -> None:
        m = inst.model
        port = free_port()
        args = [*self.config.launcher, "serve", str(m.path), "--host", CHILD_HOST, "--port", str(port),
                "--alias", m.name, *child_flags(m, self.config.cli_flags)]
        env = {k: v for k, v in self.config.env.items() if not k.startswith("AIP_")}  # NOTE: Vertex AI is the router's
        env.update(SPARK_API_KEY=self.key, SPARK_ROUTER_PORT=str(self.config.router_port))
        self.config.log(f"starting {m.name} on port {port}")
        try:
            proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.PIPE,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT, env=env,
                                                        start_new_session=True)
        except OSError as e:
            inst.failed, inst.why = True, f"cannot start spark serve: {e.strerror or e}"
            raise ApiError(500, f"model {m.name} failed to load: {inst.why}", "server_error") from None
        inst.status, inst.port, inst.proc, inst.args = LOADING, port, proc, args
        inst.last_used, inst.stopping, inst.asked_to_stop = time.monotonic(), False, False
        inst.failed, inst.why, inst.exit_code, inst.info = False, "", None, {}
        inst.tail.clear()
        self._spawn_task(self._watch(inst, proc))
        self._spawn_task(self._until_ready(inst, proc))
        self.notify()

    async def _watch(self, inst: Instance, proc: asyncio.subprocess.Process) -> None:
        """Forward the child's output to the router's log, then record its exit."""
        assert proc.stdout is not None
        tag, partial = f"[{inst.port}] ", b""
        while True:
            try:
                chunk = await proc.stdout.read(1 << 16)
            except OSError:
                chunk = b""
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop() if chunk else b""
            if len(partial) > MAX_LINE:  # NOTE: a child that never ends its line must not grow this without bound
                lines, partial = [*lines, partial], b""
            for line in lines:
                text = line.decode("utf-8", "replace").rstrip().removeprefix("spark serve: ")
                if text:
                    inst.tail.append(text)
                    self.config.log(tag + text)
            if not chunk:
                break
        code = await proc.wait()
        if inst.proc is not proc:
            return
        inst.status, inst.proc, inst.port, inst.exit_code = UNLOADED, None, 0, code
        inst.failed = not inst.asked_to_stop
        inst.stopping = False
        if inst.failed:
            last = next((t for t in reversed(inst.tail) if t.strip()), f"exit status {code}")
            inst.why = last.removeprefix("error: ").strip()
            self.config.log(f"{inst.model.name} exited with status {code}")
        self.tick()
        self.notify()

    async def _until_ready(self, inst: Instance, proc: asyncio.subprocess.Process) -> None:
        """Poll the child's /health until it answers 200 (loaded), or it exits."""
        while proc.returncode is None and inst.proc is proc:
            try:
                status, _ = await get_json(inst.port, "/health", timeout=2.0)
            except (UpstreamError, asyncio.TimeoutError):
                status = 0
            if status == 200:
                try:
                    _, cards = await get_json(inst.port, "/v1/models", key=self.key, timeout=5.0)
                    card = (cards or {}).get("data", [{}])[0] if isinstance(cards, dict) else {}
                except (UpstreamError, asyncio.TimeoutError, IndexError, AttributeError):
                    card = {}
                if inst.proc is proc and inst.status == LOADING:
                    inst.status, inst.info = LOADED, card if isinstance(card, dict) else {}
                    self.config.log(f"{inst.model.name} loaded (port {inst.port})")
                    self.tick()
                    self.notify()
                return
            await asyncio.sleep(0.05)

    def request_stop(self, name: str, kill: bool = False) -> None:
        """Ask `name`'s child to stop (SIGTERM: it drains and exits; SIGKILL with `kill`, or when it
        has not exited after the model's stop-timeout). It counts as running until it has exited."""
        inst = self.instances.get(name)
        if inst is None or inst.proc is None or inst.stopping:
            return
        inst.stopping = inst.asked_to_stop = True
        proc = inst.proc
        _signal(proc, signal.SIGKILL if kill else signal.SIGTERM)
        self._spawn_task(self._kill_after(proc, inst.model.stop_timeout))
        self.notify()

    async def _kill_after(self, proc: asyncio.subprocess.Process, seconds: float) -> None:
        try:
            await asyncio.wait_for(proc.wait(), seconds)
        except asyncio.TimeoutError:
            self.config.log(f"killing the child on pid {proc.pid}: still running {seconds:g} s after it was asked to stop")
            _signal(proc, signal.SIGKILL)

    def unload(self, name: str) -> None:
        """Stop a running model's child (one still loading is killed, as llama-server's)."""
        inst = self.instances.get(name)
        if inst is not None and inst.running:
            self.request_stop(name, kill=inst.status == LOADING)

    async def wait_stopped(self, names: list[str], timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while any(self.instances[n].running for n in names if n in self.instances):
            if end is not None and time.monotonic() >= end:
                return False
            await self.changed(0.2)
        return True

    async def unload_lru(self) -> None:
        """With every slot taken, stop the least recently used idle model and wait for it to exit."""
        if self.has_capacity():
            return
        victim = self.pick_victim()
        if victim is not None:
            self.config.log(f"--models-max {self.config.models_max} reached: unloading {victim} (least recently used)")
            self.request_stop(victim)
            await self.wait_stopped([victim])

    async def unload_all(self, timeout: float = 15.0) -> None:
        """Stop every child and wait for them (each is killed past its stop-timeout; all past `timeout`)."""
        names = [i.model.name for i in self.running()]
        for n in names:
            self.unload(n)
        if not await self.wait_stopped(names, timeout):
            self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL every child still alive (the router's last resort on exit: no orphans)."""
        for inst in self.instances.values():
            if inst.proc is not None and inst.proc.returncode is None:
                _signal(inst.proc, signal.SIGKILL)

    # ------------------------------------------------------------ requests

    async def ensure_ready(self, name: str, gone: Callable[[], Awaitable[bool]] | None = None) -> bool:
        """Until `name` (a canonical name) is loaded: False when it already was; True after waiting
        (in the queue, where the head loads). ApiError when its load fails or `gone()` (the client left)."""
        inst = self.instances[name]
        if not inst.stopping and inst.status == LOADED:
            return False
        bad = self.not_servable(inst)
        if bad is not None:
            raise bad
        queued = did_load = saw_loading = False
        if inst.status == UNLOADED:
            self.join(name)
            self.tick()
            queued = True
        try:
            while True:
                inst = self.instances.get(name)  # NOTE: a reload may have replaced or removed it
                if inst is None:
                    break
                if inst.stopping:  # a stopping child takes no new request: the next one serves it
                    if not queued:
                        self.join(name)
                        self.tick()
                        queued = True
                    if gone is not None and await gone():
                        raise ApiError(400, f"request cancelled while waiting for model {name}")
                    await self.changed(0.2)
                    continue
                if inst.status == LOADED:
                    break
                if inst.status == LOADING:
                    saw_loading = True
                elif did_load or saw_loading:  # it came up and went down again
                    if inst.failed:
                        raise ApiError(500, f"model {name} failed to load: {inst.why}", "server_error")
                    break
                elif not queued:
                    break
                if gone is not None and await gone():
                    raise ApiError(400, f"request cancelled while waiting for model {name}")
                if inst.status == UNLOADED and self.try_claim(name):
                    ok = True
                    try:
                        await self.load(name)
                        did_load = True
                    except ApiError as e:
                        if self.not_servable(inst) is not None:
                            raise
                        self.config.log(f"queued load of {name} did not go through: {e.message}")
                        ok = False
                    self.claim_done(name, ok)
                    self.tick()
                    continue
                await self.changed(0.2)
        except BaseException:
            if queued:
                self.leave(name)
                queued = False
            self.tick()  # NOTE: a slot freed for this request goes to the next one
            raise
        if queued:
            self.leave(name)
        return True

    def acquire(self, name: str, touch: bool) -> Instance:
        """Count a proxied request on `name`'s child (400 when it is not running); `touch`: it is
        recently used (POSTs, as llama-server's)."""
        inst = self.instances.get(name)
        if inst is None or not inst.running or inst.port == 0:
            raise ApiError(400, f"model {name} is not running")
        if touch:
            inst.last_used = time.monotonic()
        inst.req_count += 1
        return inst

    def release(self, inst: Instance) -> None:
        if inst.req_count > 0:
            inst.req_count -= 1
            if inst.req_count == 0:
                self.tick()
                self.notify()

    # ------------------------------------------------------------ reload (GET /models?reload=1)

    async def reload(self, models: Mapping[str, RouterModel]) -> None:
        """Take a new model list: a running model removed or changed is unloaded first; the others
        take their new settings; new ones are added (unloaded)."""
        def same(a: RouterModel, b: RouterModel) -> bool:
            return dataclasses.replace(a, hidden=False) == dataclasses.replace(b, hidden=False)

        self.reloading = True
        try:
            stale = [n for n, i in self.instances.items() if i.running and (n not in models or
                                                                              not same(i.model, models[n]))]
            for n in stale:
                self.config.log(f"reload: unloading {n} (removed or changed)")
                self.unload(n)
            await self.wait_stopped(stale)
            for n in [n for n, i in self.instances.items() if n not in models and not i.running]:
                del self.instances[n]
            for n, m in models.items():
                inst = self.instances.get(n)
                if inst is None:
                    self.instances[n] = Instance(m)
                else:
                    inst.model = m
                    if not inst.running:
                        inst.failed, inst.why = False, ""
        finally:
            self.reloading = False
            self.notify()

    def startup_models(self) -> list[str]:
        return [n for n, i in self.instances.items() if i.model.load_on_startup]


def _signal(proc: asyncio.subprocess.Process, sig: int) -> None:
    if proc.returncode is not None:
        return
    try:
        if sig == signal.SIGKILL:
            os.killpg(proc.pid, sig)  # NOTE: the child leads a session of its own (start_new_session)
        else:
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass
