"""``kvmesh up``: the whole stack as local processes — nats-server, cachesvc, engine instances, router.

Settings: the launcher loads every section as a service would (``--config`` file < environment < flags, plus
the launcher's own defaults: cachesvc on any free port, spans to <state dir>/traces.jsonl), so a bad or unknown
setting stops ``kvmesh up`` before anything starts, and hands each child the values it did not inherit from the
environment as ``KVMESH_<SECTION>_<FIELD>`` variables, along with what only the launcher knows (the NATS URL, the
cachesvc address, each engine's id, its ready file).

Everything the stack writes (logs, NATS data, stack.json, ready files, the span file traces.jsonl) goes to the state
directory. So does the mesh's identity: unless ``mesh_tls`` is off or a certificate is configured (``tls_cert``),
``tls/`` holds a mesh CA and one certificate per service naming its role and instance (``kvmesh.mesh_ca``), and
every service gets its own, so every internal hop is mutual TLS and every call is authorised by role
(``kvmesh.authz``); ``Stack.mesh_settings("admin")`` is what an operator's tool (or a test) dials them with.
NATS too: the stack's nats-server (``nats/nats.conf``) takes mesh certificates only and maps each to a user of its
own that may publish and subscribe only that service's subjects (``kvmesh.bus.permissions``), so an instance
cannot beat, or read kv.ready, as another.
Services bind the ports given (0 = any free one) and report the ports bound in their ready files;
stack.json holds those actual addresses.
Each service runs in its own session, so Ctrl-C / SIGTERM reaches the launcher alone and it stops the services in
order: routers, engines, cachesvc, then NATS.

With ``routers`` > 1 the router runs as replicas ``router-0``, ``router-1``, ... (one is ``router``), each with its
own ports (the configured ones + its index; 0 stays any free one) and id, sharing their in-flight counts over
NATS. ``kill`` and ``restart`` act on one service (the fault benchmark's schedule): a restarted cachesvc or NATS
binds the address it had, which the other services keep dialling; a restarted cachesvc shard is also given the
others' addresses (``peers``), from whose copies it fetches the blocks it lost (services/cachesvc/README.md).

A running stack also changes its engine pools' sizes: ``scale(role, n)`` starts instances (``<role>-<next index>``,
as the first ones were started) or stops the newest ones with SIGTERM. A stopped instance loses no request: its
routers retry elsewhere what it had not answered yet and migrate the streams it was decoding
(``services/router/migration.py``), the tokens already sent kept. ``kvmesh up`` reconciles the pools with
``pools.json`` in the state directory (``want_pools``), which ``kvmesh plan --actuator local`` writes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from kvmesh import settings
from kvmesh.bus import NatsServer, Subjects, permissions
from kvmesh.identity import Identity, MeshRole
from kvmesh.mesh_ca import MeshCA
from kvmesh.ready import ServiceFailed, poll_ready
from kvmesh.state import StackInfo
from kvmesh.telemetry.spans import trace_file

# what `python -m` runs for each engine role; `both` is composed in the application layer (app/both.py)
ENGINE_MODULES = {"prefill": "services.prefill", "decode": "services.decode", "both": "app.both"}


POOLS_FILE = "pools.json"  # in the state directory: {"prefill": 2, "decode": 1}, the sizes the pools should have

# what the launcher sets itself for each child: not flags of `kvmesh up`
LAUNCHER_SET = ("shared.state_dir", "shared.ready_file", "instance.role", "instance.id", "instance.cachesvc_address",
                "router.cachesvc_address", "router.id", "cachesvc.shard", "cachesvc.shards", "cachesvc.peers")


@dataclass
class StackOptions:
    """The stack's shape (how many of each engine, whether engines use the pool) and its settings: ``settings``
    as flags give them (``{"router": {"http_port": 0}, "shared": {"cluster": "t"}}``), ``config`` a TOML file,
    ``env`` extra ``KVMESH_*`` variables (checked like the environment). The router's ports default to 8000 and
    50051 (``router.http_port`` / ``grpc_port`` 0 = any free one, read back from Stack / stack.json); an unset
    ``nats_url`` (its default) starts a NATS server in the state directory."""
    prefill: int = 1
    decode: int = 1
    both: int = 0
    routers: int = 1
    cachesvc: int = 1  # cachesvc shards: cachesvc-0, cachesvc-1, ... (1: one cachesvc named cachesvc)
    pool: bool = True  # engines write back to and fetch from cachesvc's pool (False: the router still asks it)
    # engines and routers find the cachesvc shards through their beats on the bus (cachesvc_address "nats") rather
    # than being given the addresses
    cachesvc_from_bus: bool = False
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    config: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    # KVMESH_* variables for one instance only, by its name ("prefill-0"): e.g. a mixed fleet, one instance on
    # another engine backend ({"decode-0": {"KVMESH_ENGINE_BACKEND": "vllm"}})
    instance_env: dict[str, dict[str, str]] = field(default_factory=dict)

    @classmethod
    def local(cls, cluster: str, **kw: Any) -> StackOptions:
        """Tests and benchmarks: router ports any free ones, its own cluster name; ``settings`` merge in."""
        extra = kw.pop("settings", {})
        merged: dict[str, dict[str, Any]] = {"router": {"http_port": 0, "grpc_port": 0}, "shared": {"cluster": cluster}}
        for section, values in extra.items():
            merged.setdefault(section, {}).update(values)
        return cls(settings=merged, **kw)

    def load(self, state_dir: Path) -> settings.Settings:
        """Every section as the stack's services will see it (SettingsError: what is wrong, and where)."""
        return settings.load(None, path=self.config, env={**os.environ, **self.env}, overrides=self.settings,
                             defaults={"cachesvc": {"port": 0},
                                       "telemetry": {"trace_file": str(trace_file(state_dir))}})


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    log_path: Path
    ready_path: Path
    endpoints: dict[str, str] = field(default_factory=dict)  # what it bound, from its ready file
    env: dict[str, str] = field(default_factory=dict)  # the KVMESH_* variables it was started with
    module: str = ""                                   # what `python -m` runs
    given: dict[str, str] = field(default_factory=dict)  # the variables the stack gave it alone (a restart's too)

    @property
    def grpc_address(self) -> str:
        return self.endpoints.get("grpc", "")


class Stack:
    """Services start on the ports given (0 = any free one, the default for all but the router's) and report
    what they bound in a ready file (``kvmesh.ready``); the stack passes those addresses on: cachesvc first, then
    the engines and the router with its actual address. No port is picked ahead of a bind."""

    def __init__(self, state_dir: Path, opts: StackOptions) -> None:
        self.state_dir = state_dir
        self.opts = opts
        self.services: list[Service] = []
        self.nats: NatsServer | None = None
        self._frozen: set[str] = set()  # services SIGSTOPped (stop() thaws them first, or SIGTERM waits forever)
        self._nats_users: list[Identity] = []  # the NATS users of its nats-server (with its own mesh CA)
        self.log_dir = state_dir / "logs"
        self.ready_dir = state_dir / "ready"
        if opts.routers < 1:
            raise ValueError(f"--routers must be at least 1, not {opts.routers}")
        if opts.cachesvc < 1:
            raise ValueError(f"--cachesvc must be at least 1, not {opts.cachesvc}")
        self.cfg = opts.load(state_dir)  # a bad setting stops here, before anything starts
        self.child_env = _passed_on(self.cfg)
        shared = self.cfg.shared
        # a mesh CA of the stack's own, unless TLS is off (mesh_tls = false) or brought (tls_cert)
        self.mesh = MeshCA.open(state_dir / "tls") if shared.mesh_tls and not shared.tls_cert else None

    def mesh_settings(self, role: str = "admin", instance: str = "operator") -> settings.SharedSettings:
        """The ``[shared]`` TLS settings that dial this stack's services as ``role/instance`` (plaintext
        settings when the stack runs without its own mesh CA)."""
        if self.mesh is None:
            return self.cfg.shared
        files = self.mesh.issue(Identity(MeshRole(role), instance))
        return settings.SharedSettings(**{k.removeprefix("KVMESH_").lower(): v for k, v in files.env().items()})

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    @property
    def routers(self) -> list[Service]:
        """The router replicas, in order (one: ``router``)."""
        return [s for s in self.services if s.name == "router" or s.name.startswith("router-")]

    @property
    def caches(self) -> list[Service]:
        """The cachesvc shards, in shard order (one: ``cachesvc``), a restarted one in its place."""
        caches = [s for s in self.services if s.name == "cachesvc" or s.name.startswith("cachesvc-")]
        return sorted(caches, key=lambda s: int(s.name.rsplit("-", 1)[1]) if "-" in s.name else 0)

    @property
    def cachesvc_address(self) -> str:
        """What the engines and the routers dial: cachesvc's gRPC address, or every shard's in shard order."""
        return ",".join(s.grpc_address for s in self.caches)

    @property
    def callers_cachesvc(self) -> str:
        """The ``cachesvc_address`` engines and routers get: the shards' addresses, or "nats" (found through the
        bus, ``StackOptions.cachesvc_from_bus``)."""
        return "nats" if self.opts.cachesvc_from_bus else self.cachesvc_address

    @property
    def router_grpc(self) -> str:
        """host:port the (first) router's gRPC API bound."""
        return self.routers[0].endpoints["grpc"]

    @property
    def router_http(self) -> str:
        """http://host:port the (first) router's HTTP API bound."""
        return self.routers[0].endpoints["http"]

    @property
    def router_metrics(self) -> str:
        """The (first) router's Prometheus URL, on its internal port (never the clients' HTTP port)."""
        return self.routers[0].endpoints["metrics"]

    @property
    def grpc_port(self) -> int:
        return int(self.router_grpc.rsplit(":", 1)[1])

    @property
    def http_port(self) -> int:
        return int(self.router_http.rsplit(":", 1)[1])

    def start(self, timeout_s: float = 180.0) -> StackInfo:
        """Start everything and return once the router sees every engine. A service that cannot start (e.g. a
        fixed port in use) raises ServiceFailed (a RuntimeError) with its message; TimeoutError past
        ``timeout_s``."""
        o, cfg = self.opts, self.cfg
        deadline = time.monotonic() + timeout_s
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ready_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / POOLS_FILE).unlink(missing_ok=True)  # an earlier run's wishes are not this one's
        try:
            nats_url = cfg.shared.nats_url
            if cfg.sources["shared"]["nats_url"].kind == "default":
                self.nats = NatsServer(self.state_dir / "nats", config=self._nats_config()).start()  # any free port
                nats_url = self.nats.url
            self.child_env["KVMESH_NATS_URL"] = nats_url
            # shards found through the bus find each other there too (a restarted one's repair peers)
            peers = {"KVMESH_CACHESVC_PEERS": "nats"} if o.cachesvc_from_bus and o.cachesvc > 1 else {}
            caches = [self._spawn(name, "services.cachesvc", {**env, **peers})
                      for name, env in _cache_shards(o.cachesvc, cfg.cachesvc)]
            self._wait_ready(caches, deadline)  # the engines and the router need their actual addresses
            pool = {"KVMESH_INSTANCE_CACHESVC_ADDRESS": self.callers_cachesvc if o.pool else ""}
            for role, count in (("prefill", o.prefill), ("decode", o.decode), ("both", o.both)):
                for i in range(count):
                    self._spawn(f"{role}-{i}", ENGINE_MODULES[role],
                                {"KVMESH_INSTANCE_ROLE": role, "KVMESH_INSTANCE_ID": f"{role}-{i}", **pool,
                                 **o.instance_env.get(f"{role}-{i}", {})})
            router = {"KVMESH_ROUTER_CACHESVC_ADDRESS": self.callers_cachesvc}
            if cfg.sources["router"]["model"].kind == "default" and cfg.engine.model:
                router["KVMESH_ROUTER_MODEL"] = cfg.engine.model  # the engines' model, unless told otherwise
            for name, ports in _router_replicas(o.routers, cfg.router.http_port, cfg.router.grpc_port):
                self._spawn(name, "services.router", {**router, **ports})
            self._wait_ready(self.services, deadline)
            self._wait_instances(deadline)
        except BaseException:
            self.stop()
            raise
        info = self.info()
        info.write(self.state_dir)
        return info

    def info(self) -> StackInfo:
        """The stack as stack.json has it: the addresses bound, the process ids."""
        return StackInfo(router_grpc=self.router_grpc, router_http=self.router_http,
                         nats_url=self.child_env["KVMESH_NATS_URL"], cluster=self.cfg.shared.cluster,
                         pids={s.name: s.proc.pid for s in self.services},
                         endpoints={s.name: s.endpoints for s in self.services})

    # ---- one service at a time (the fault schedule) --------------------------------------------------------
    def kill(self, name: str) -> None:
        """SIGKILL a service (``nats``: the NATS server), as a crash would; nothing else is told."""
        if name == "nats":
            assert self.nats is not None, "this stack uses a NATS server it did not start"
            self.nats.kill()
            return
        proc = self.service(name).proc
        proc.kill()
        proc.wait()

    def freeze(self, name: str) -> None:
        """SIGSTOP a service: its process stays, its sockets stay open, and it does nothing at all (no step, no
        heartbeat, no reply) until :meth:`thaw`; an engine that hangs whole, as the router sees it."""
        self.service(name).proc.send_signal(signal.SIGSTOP)
        self._frozen.add(name)

    def thaw(self, name: str) -> None:
        """SIGCONT a frozen service: it goes on where it stopped."""
        self._frozen.discard(name)
        self.service(name).proc.send_signal(signal.SIGCONT)

    def restart(self, name: str, timeout_s: float = 120.0) -> None:
        """Start a killed service again with the settings it had; NATS, cachesvc and a router on the addresses
        they had (the others and the clients dial them), engines on new ports, which heartbeats announce.
        Returns once it serves."""
        if name == "nats":
            assert self.nats is not None, "this stack uses a NATS server it did not start"
            self.nats.start()
            return
        old = self.service(name)
        deadline = time.monotonic() + timeout_s
        given = {**old.given, **_same_ports(old)}
        if name.startswith("cachesvc-"):  # a shard: the others' addresses, to fetch what it lost from its copies
            given["KVMESH_CACHESVC_PEERS"] = "nats" if self.opts.cachesvc_from_bus else self.cachesvc_address
        while True:  # the port a killed process held may take a moment to be free again
            new = self._spawn(name, old.module, given)
            self.services.remove(old)
            try:
                self._wait_ready([new], deadline)
                break
            except ServiceFailed as e:
                if "in use" not in str(e) or time.monotonic() > deadline:
                    raise
                old = new
                time.sleep(0.5)
        self.info().write(self.state_dir)

    # ---- the engine pools' sizes (the planner's local actuator) --------------------------------------------
    def pool(self, role: str) -> list[Service]:
        """The running instances of ``role``'s pool, oldest first."""
        return sorted((s for s in self.services if s.name.startswith(f"{role}-") and s.proc.poll() is None),
                      key=lambda s: int(s.name.rsplit("-", 1)[1]))

    def scale(self, role: str, n: int, timeout_s: float = 180.0) -> list[str]:
        """Start or stop ``role`` instances until its pool has ``n``: a new one is ``<role>-<next index>`` with the
        settings the first ones got, and this returns once it serves and every router sees it; the newest go
        first, each stopped with SIGTERM (its routers retry and migrate its requests). What changed, in words."""
        if role not in ENGINE_MODULES or n < 0:
            raise ValueError(f"cannot scale {role!r} to {n}: a pool is one of {', '.join(ENGINE_MODULES)}, n >= 0")
        done, deadline = [], time.monotonic() + timeout_s
        while len(self.pool(role)) < n:
            done.append(f"started {self._add(role, deadline).name}")
        while len(self.pool(role)) > n:
            done.append(f"stopped {self._remove(role).name}")
        if done:
            self.info().write(self.state_dir)
        return done

    def _add(self, role: str, deadline: float) -> Service:
        used = [int(s.name.rsplit("-", 1)[1]) for s in self.services if s.name.startswith(f"{role}-")]
        name = f"{role}-{max(used, default=-1) + 1}"
        self._admit_to_nats(Identity(MeshRole(role), name))
        new = self._spawn(name, ENGINE_MODULES[role],
                          {"KVMESH_INSTANCE_ROLE": role, "KVMESH_INSTANCE_ID": name,
                           "KVMESH_INSTANCE_CACHESVC_ADDRESS": self.callers_cachesvc if self.opts.pool else "",
                           **self.opts.instance_env.get(name, {})})
        self._wait_ready([new], deadline)
        self._wait_instances(deadline)
        return new

    def _remove(self, role: str) -> Service:
        gone = self.pool(role)[-1]
        gone.proc.send_signal(signal.SIGTERM)
        try:
            gone.proc.wait(30)
        except subprocess.TimeoutExpired:
            gone.proc.kill()
            gone.proc.wait()
        self.services.remove(gone)
        return gone

    def pools_asked(self) -> float:
        """When ``pools.json`` last changed (0: there is none)."""
        try:
            return (self.state_dir / POOLS_FILE).stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def reconcile(self) -> list[str]:
        """Bring each pool named in ``pools.json`` to its size (nothing when there is no such file)."""
        done = []
        for role, n in want_pools(self.state_dir).items():
            done += self.scale(role, n)
        return done

    def _spawn(self, name: str, module: str, env: dict[str, str]) -> Service:
        given = dict(env)
        log_path = self.log_dir / f"{name}.log"
        ready_path = self.ready_dir / f"{name}.json"
        ready_path.unlink(missing_ok=True)  # one from an earlier run is not this process's
        env = {**os.environ, **self.opts.env, "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": str(self.cfg.engine.threads or os.cpu_count() or 1),
               **self.child_env, **self._identity(name), "KVMESH_STATE_DIR": str(self.state_dir),
               "KVMESH_READY_FILE": str(ready_path), **env}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", module], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        service = Service(name, proc, log_path, ready_path,
                          env={k: v for k, v in env.items() if k.startswith("KVMESH_")}, module=module, given=given)
        self.services.append(service)
        return service

    def _nats_config(self) -> Path | None:
        """With the stack's own mesh CA: a nats-server configuration that requires mesh certificates and maps
        each to its own user, allowed only its own subjects (``kvmesh.bus.permissions``): one per service this
        stack starts, and the operator's admin identity. None: NATS as before (plaintext, open)."""
        if self.mesh is None:
            return None
        o = self.opts
        names = [*(name for name, _ in _cache_shards(o.cachesvc, self.cfg.cachesvc)),
                 *(f"{role}-{i}" for role, n in (("prefill", o.prefill), ("decode", o.decode),
                                                             ("both", o.both)) for i in range(n)),
                 *(name for name, _ in _router_replicas(o.routers, 0, 0))]
        self.mesh.issue(Identity(MeshRole.ADMIN, "operator"))  # what `kvmesh plan` reads heartbeats with
        self._nats_users = [*(Identity(MeshRole(_role_of(name)), name) for name in names),
                            Identity(MeshRole.ADMIN, "operator")]
        (self.state_dir / "nats").mkdir(parents=True, exist_ok=True)
        return self._write_nats_config()

    def _write_nats_config(self) -> Path:
        assert self.mesh is not None
        server = self.mesh.issue(Identity(MeshRole.CLIENT, "nats"))  # serves only: no NATS user
        return permissions.write_config(self.state_dir / "nats" / "nats.conf", self._nats_users,
                                        Subjects(self.cfg.shared.cluster), str(server.cert), str(server.key),
                                        str(server.ca))

    def _admit_to_nats(self, who: Identity) -> None:
        """A user of its own on the stack's NATS for an instance started after it (a scale-out), before it starts:
        the configuration rewritten, nats-server told to reload it."""
        if self.mesh is None or self.nats is None or who in self._nats_users:
            return
        self._nats_users.append(who)
        self._write_nats_config()
        self.nats.reload()

    def _identity(self, name: str) -> dict[str, str]:
        """The TLS variables of service ``name`` (``prefill-0``: role prefill, instance prefill-0)."""
        if self.mesh is None:
            return {}
        return self.mesh.issue(Identity(MeshRole(_role_of(name)), name)).env()

    def _wait_ready(self, services: list[Service], deadline: float) -> None:
        """Until each has written its ready file (it serves): read what it bound."""
        pending = [s for s in services if not s.endpoints]
        while pending:
            for s in list(pending):
                ready = poll_ready(s.ready_path, s.proc, s.name, s.log_path)  # ServiceFailed if it gave up
                if ready is not None:
                    s.endpoints = ready.endpoints
                    pending.remove(s)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not ready in time: {', '.join(s.name for s in pending)}; see {self.log_dir}")
            time.sleep(0.1)

    def _wait_instances(self, deadline: float) -> None:
        want = sum(len(self.pool(role)) for role in ENGINE_MODULES)
        for router in self.routers:
            while _router_instances(router.endpoints["http"]) < want:  # heartbeats reached the router
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{router.name} does not see all {want} engine instances; see {self.log_dir}")
                time.sleep(0.2)

    def stop(self, timeout_s: float = 10.0) -> None:
        for name in list(self._frozen):
            self.thaw(name)
        routers, caches = [s.name for s in self.routers], [s.name for s in self.caches]
        for group in (routers, [s.name for s in self.services if s.name not in (*routers, *caches)], caches):
            procs = [s.proc for s in self.services if s.name in group and s.proc.poll() is None]
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.nats is not None:
            self.nats.stop()
        (self.state_dir / "stack.json").unlink(missing_ok=True)
        (self.state_dir / POOLS_FILE).unlink(missing_ok=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def want_pools(directory: Path) -> dict[str, int]:
    """The pool sizes ``pools.json`` asks for (role -> instances); {} when there is none. A bad file:
    ValueError."""
    try:
        raw = json.loads((directory / POOLS_FILE).read_text())
    except FileNotFoundError:
        return {}
    if not isinstance(raw, dict) or not all(r in ENGINE_MODULES and isinstance(n, int) and n >= 0
                                            for r, n in raw.items()):
        raise ValueError(f"{directory / POOLS_FILE}: expected {{role: instances}} with roles among "
                         f"{', '.join(ENGINE_MODULES)}, not {raw!r}")
    return raw


def ask_pools(directory: Path, sizes: dict[str, int]) -> None:
    """Ask a running ``kvmesh up`` for these pool sizes (merged into ``pools.json``, written atomically)."""
    path = directory / POOLS_FILE
    merged = {**want_pools(directory), **sizes}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(merged))
    tmp.replace(path)


def _same_ports(service: Service) -> dict[str, str]:
    """The variables that bind a restarted cachesvc or router where it was."""
    port = {k: v.rsplit(":", 1)[1] for k, v in service.endpoints.items() if v}
    if service.name == "cachesvc" or service.name.startswith("cachesvc-"):
        return {"KVMESH_CACHESVC_PORT": port["grpc"], "KVMESH_CACHESVC_TRANSFER_PORT": port["transfer"]}
    if service.name == "router" or service.name.startswith("router-"):
        return {"KVMESH_ROUTER_GRPC_PORT": port["grpc"], "KVMESH_ROUTER_HTTP_PORT": port["http"]}
    return {}


def _cache_shards(n: int, cfg: settings.CacheServiceSettings) -> list[tuple[str, dict[str, str]]]:
    """Each cachesvc's name and what it gets of its own: one is ``cachesvc`` as configured; shard ``cachesvc-i``
    of several gets its shard number, the configured ports + i (0 stays any free one) and a disk tier directory
    of its own under the configured one."""
    if n == 1:
        return [("cachesvc", {})]
    out = []
    for i in range(n):
        env = {"KVMESH_CACHESVC_SHARD": str(i), "KVMESH_CACHESVC_SHARDS": str(n)}
        for name, value in (("port", cfg.port), ("transfer_port", cfg.transfer_port),
                            ("metrics_port", cfg.metrics_port)):
            if value:
                env[f"KVMESH_CACHESVC_{name.upper()}"] = str(value + i)
        if cfg.disk_dir:
            env["KVMESH_CACHESVC_DISK_DIR"] = str(Path(cfg.disk_dir) / f"cachesvc-{i}")
        out.append((f"cachesvc-{i}", env))
    return out


def _role_of(name: str) -> str:
    """The mesh role of service ``name`` (``prefill-0``: prefill; ``router-1``: router)."""
    return "router" if name.startswith("router") else name.split("-", 1)[0]


def _router_replicas(n: int, http_port: int, grpc_port: int) -> list[tuple[str, dict[str, str]]]:
    """Each router's name and what it gets of its own: one is ``router`` on the configured ports (as it always
    was); replica ``router-i`` of several gets its id and the configured ports + i (0 stays 0: any free one)."""
    if n == 1:
        return [("router", {})]
    return [(f"router-{i}", {"KVMESH_ROUTER_ID": f"router-{i}",
                             "KVMESH_ROUTER_HTTP_PORT": str(http_port + i if http_port else 0),
                             "KVMESH_ROUTER_GRPC_PORT": str(grpc_port + i if grpc_port else 0)})
            for i in range(n)]


def _router_instances(http_url: str) -> int:
    try:
        with urllib.request.urlopen(f"{http_url}/health", timeout=1.0) as r:
            return int(json.load(r)["instances"])
    except urllib.error.HTTPError as e:
        return int(json.load(e).get("instances", 0))
    except (OSError, ValueError, KeyError):
        return 0


def _passed_on(cfg: settings.Settings) -> dict[str, str]:
    """The variables that give each child the launcher's view of the settings: every value that is not the
    field's default and did not come from the environment (which the children inherit)."""
    out = {}
    for name, section in cfg.sections.items():
        cls = type(section)
        for f, info in cls.model_fields.items():
            value = getattr(section, f)
            if cfg.sources[name][f].kind != "env" and (value != info.default
                                                       or cfg.sources[name][f].kind in ("file", "flag")):
                out[cls.env_name(f)] = settings.env_value(value)
    return out
