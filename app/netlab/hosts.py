"""Hosts in network namespaces: each a namespace of its own with one veth into a switch namespace (a Linux
bridge), on a private /24 that exists only inside the lab, so nothing the lab sends can leave it, and the
machine's own network is never touched. A link can be capped with ``tc`` (tbf, both ways); latency comes from
``delay_proxy`` (no netem here). Everything is removed on exit, whatever happened.

Needs root (or CAP_NET_ADMIN) and iproute2; ``unavailable()`` says why not where they are missing."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Self, TypeVar

T = TypeVar("T")
SUBNET = "10.77.0"   # the lab's /24 (only inside its namespaces)
CLONE_NEWNET = 0x40000000


def unavailable() -> str | None:
    """Why this machine cannot run the lab (None: it can): not root, no ``ip``, namespaces refused."""
    if os.geteuid() != 0:
        return "network namespaces need root (or CAP_NET_ADMIN): run the netns stage as root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"kvmprobe{uuid.uuid4().hex[:6]}"
    made = _run("ip", "netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` is refused here: {made.stderr.strip() or made.returncode}"
    _run("ip", "netns", "del", probe)
    return None


@dataclass(frozen=True)
class Host:
    name: str       # what the lab calls it ("decode")
    ns: str         # its namespace
    address: str    # its address on the lab's /24
    port: str       # its veth's switch-side end (what a cap into the host shapes)


class Lab:
    """``hosts`` (names, in order: addresses .1, .2, ...) behind one switch. Use as a context manager."""

    def __init__(self, hosts: list[str]) -> None:
        self.tag = f"kvm{uuid.uuid4().hex[:6]}"  # interface names stay within 15 characters
        self.switch = f"{self.tag}-sw"
        self.hosts = {name: Host(name, f"{self.tag}-{name}", f"{SUBNET}.{i}", f"{self.tag}p{i}")
                      for i, name in enumerate(hosts, 1)}
        self._threads: dict[str, ThreadPoolExecutor] = {}

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Self:
        try:
            self._ip("netns", "add", self.switch)
            self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.switch, "link", "set", "br0", "up")
            for h in self.hosts.values():
                self._ip("netns", "add", h.ns)
                self._ip("-n", h.ns, "link", "set", "lo", "up")
                self._ip("-n", self.switch, "link", "add", h.port, "type", "veth", "peer", "name", "eth0",
                         "netns", h.ns)
                self._ip("-n", self.switch, "link", "set", h.port, "master", "br0", "up")
                self._ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", "eth0")
                self._ip("-n", h.ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every namespace of the lab (their interfaces go with them)."""
        for pool in self._threads.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for ns in [h.ns for h in self.hosts.values()] + [self.switch]:
            _run("ip", "netns", "del", ns)

    def namespaces(self) -> list[str]:
        """The lab's namespaces that exist now."""
        listed = _run("ip", "netns", "list").stdout
        return [line.split()[0] for line in listed.splitlines() if line.startswith(self.tag)]

    def cap(self, host: str, mbit: float, burst_kb: int = 256) -> None:
        """Shape ``host``'s link to ``mbit`` Mbit/s each way (tc tbf at both ends of its veth)."""
        h = self.hosts[host]
        for ns, dev in ((self.switch, h.port), (h.ns, "eth0")):
            self._ip_tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst",
                        f"{burst_kb}kb", "latency", "100ms")

    def popen(self, host: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[host].ns, *argv], **kw)

    def call(self, host: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on a thread that lives in ``host``'s namespace: the sockets it opens (urllib, aiohttp; not
        grpc's, which its own threads open) are that host's."""
        if host not in self._threads:
            ns = self.hosts[host].ns
            self._threads[host] = ThreadPoolExecutor(1, f"netns-{host}", initializer=enter, initargs=(ns,))
        return self._threads[host].submit(fn).result()

    def _ip(self, *args: str) -> None:
        done = _run("ip", *args)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def _ip_tc(self, ns: str, *args: str) -> None:
        done = _run("ip", "netns", "exec", ns, "tc", *args)
        if done.returncode != 0:
            raise RuntimeError(f"tc {' '.join(args)} in {ns}: {done.stderr.strip()}")


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    """``argv``'s outcome (its status and output: the caller decides what a failure means)."""
    return subprocess.run(argv, check=False, capture_output=True, text=True)


_libc = ctypes.CDLL(None, use_errno=True)


def enter(ns: str) -> None:
    """Move this thread into network namespace ``ns`` (setns applies to the calling thread only; a process's
    main thread calling it first thing puts the sockets it opens there)."""
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)
