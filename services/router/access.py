"""Who may call the router and how many calls it takes at once: API keys → tenants, the tenant's cache salt,
the in-flight caps (global and per tenant) that refuse at once with 429 instead of queueing, what else a tenant
may ask for (its retention caps, its SLO class's targets), and the admin key of the operations that change what
the router serves.

A tenant's salt is ``tenant NUL cache_salt``; a request's own ``cache_salt`` may not contain NUL, so no
request can name another tenant's namespace, and a request without a tenant keeps its plain ``cache_salt``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping
from pathlib import Path

from kvmesh.contracts.slo import SLO
from kvmesh.settings import RouterSettings, parse_api_keys, slo_targets

from services.router.errors import ErrorKind, RequestError, invalid
from services.router.ids import nonce

RETRY_AFTER_S = 1


class Tenants:
    """The API keys the router accepts and the tenant of each (``""``: the tenant-less ``api_key``)."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._keys = [(k.encode(), t) for k, t in keys.items()]

    @classmethod
    def from_config(cls, cfg: RouterSettings) -> Tenants:
        """``api_key`` (no tenant), ``api_keys`` and the pairs in ``api_keys_file``; ValueError says what to
        fix."""
        keys = dict(cfg.api_keys)
        if cfg.api_keys_file:
            try:
                text = Path(cfg.api_keys_file).read_text()
            except OSError as e:
                raise ValueError(f"api_keys_file: cannot read {cfg.api_keys_file}: {e.strerror}") from None
            for key, tenant in parse_api_keys(text, f"api_keys_file {cfg.api_keys_file}").items():
                if keys.get(key, tenant) != tenant:
                    raise ValueError(f"api_keys_file: key {key[:4]}... is given to two tenants")
                keys[key] = tenant
        if cfg.api_key:
            if cfg.api_key in keys:
                raise ValueError("api_key is also in api_keys: give each key one tenant (or none)")
            keys[cfg.api_key] = ""
        if cfg.admin_key and cfg.admin_key in keys:
            raise ValueError("admin_key is also a tenant key (api_key, api_keys or api_keys_file): give the admin "
                             "a key of its own")
        return cls(keys)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def tenant(self, given: str) -> str | None:
        """The tenant of key ``given`` (``""`` when keys are off or for the tenant-less key); None: refuse."""
        if not self._keys:
            return ""
        raw = given.strip().encode("utf-8", "replace")
        found = None
        for key, tenant in self._keys:  # compare with every key in constant time: no timing hint at a prefix
            if hmac.compare_digest(key, raw):
                found = tenant
        return found

    def authenticate(self, headers: Mapping[str, str]) -> str:
        """The caller's tenant from ``authorization: Bearer <key>`` or ``x-api-key``; 401 when keys are on and
        none of them is given."""
        tenant = self.tenant(given_key(headers))
        if tenant is None:
            raise RequestError(ErrorKind.UNAUTHENTICATED, "missing or wrong API key: send 'Authorization: Bearer "
                                                          "<key>' or 'x-api-key: <key>' (HTTP header or gRPC "
                                                          "metadata)")
        return tenant


class AdminKey:
    """The key of the operations that change what the router serves (LoRA adapter load and unload): not a
    tenant key, and off (every such call refused) unless configured. Every refusal reads the same whatever the
    call asked for, so a caller without the key learns nothing about what exists."""

    def __init__(self, key: str) -> None:
        self._key = key.encode()

    @classmethod
    def from_config(cls, cfg: RouterSettings) -> AdminKey:
        return cls(cfg.admin_key)

    @property
    def enabled(self) -> bool:
        return bool(self._key)

    def authorize(self, headers: Mapping[str, str]) -> None:
        """Pass a call that carries the admin key; FORBIDDEN when none is configured, UNAUTHENTICATED when the
        call's key is missing or another one."""
        if not self._key:
            raise RequestError(ErrorKind.FORBIDDEN, "admin operations (LoRA adapter load/unload) are off: the "
                                                    "operator turns them on with the router's admin_key "
                                                    "(KVMESH_ROUTER_ADMIN_KEY)")
        if not hmac.compare_digest(self._key, given_key(headers).strip().encode("utf-8", "replace")):
            raise RequestError(ErrorKind.UNAUTHENTICATED, "missing or wrong admin key: send 'Authorization: "
                                                          "Bearer <admin key>' or 'x-api-key: <admin key>'")


def given_key(headers: Mapping[str, str]) -> str:
    """The key a call carries: ``x-api-key``, else ``authorization: Bearer <key>`` (or a bare key)."""
    return headers.get("x-api-key") or _bearer(headers.get("authorization", ""))


def _bearer(value: str) -> str:
    scheme, _, token = value.strip().partition(" ")
    return token if scheme.lower() == "bearer" else value


def cache_salt(tenant: str, requested: str) -> str:
    """The salt that enters the request's block keys: the tenant's namespace, within it the request's own."""
    if "\x00" in requested:
        raise invalid("cache_salt may not contain NUL characters")
    return f"{tenant}\x00{requested}" if tenant else requested


def dispatch_id(tenant: str, request_id: str) -> str:
    """The id one request carries inside the mesh: ``<tenant hash>.<client's id>.<nonce>``. Clients choose their
    ids and tenants share them, so the client's id alone could name another tenant's request in flight on the
    same instance (its reservation, push capability, ``kv.ready``); with the tenant and a fresh nonce no two
    requests share one. The client still sees and traces its own id."""
    tag = hashlib.blake2b(tenant.encode(), digest_size=4).hexdigest()
    return f"{tag}.{request_id}.{nonce()}"


class TenantTerms:
    """What each tenant may ask beyond its key: the SLO class whose targets its requests get when they name none
    (``slo_classes``, ``tenant_classes``, ``default_slo_class``), and the retention caps on its ``cache_control``
    hints (``max_retention_s_per_tenant``, ``max_priority_per_tenant``)."""

    def __init__(self, classes: Mapping[str, SLO], of_tenant: Mapping[str, str], default_class: str,
                 max_retention_s: float = float("inf"), max_priority: int = 100) -> None:
        self.classes, self.of_tenant, self.default_class = dict(classes), dict(of_tenant), default_class
        self.max_retention_s, self.max_priority = max_retention_s, max_priority

    @classmethod
    def from_config(cls, cfg: RouterSettings) -> TenantTerms:
        classes = {name: SLO(*targets) for name, text in cfg.slo_classes.items()
                   if (targets := slo_targets(text)) is not None}  # the settings' problems refused the rest
        return cls(classes, cfg.tenant_classes, cfg.default_slo_class, cfg.max_retention_s_per_tenant,
                   cfg.max_priority_per_tenant)

    def slo(self, tenant: str, given: SLO) -> SLO:
        """``given``'s targets, the tenant's class's where it names none."""
        return given.or_else(self.classes.get(self.of_tenant.get(tenant, self.default_class), SLO()))

    def check_retention(self, ttl_s: float, priority: int, field: str) -> None:
        """Refuse a retention hint over the tenant caps, naming the field and the cap."""
        if ttl_s > self.max_retention_s:
            raise invalid(f"{field}.ttl {ttl_s:g} s is over a tenant's retention cap of {self.max_retention_s:g} s "
                          "(max_retention_s_per_tenant): ask for less")
        if priority > self.max_priority:
            raise invalid(f"{field}.priority {priority} is over a tenant's cap of {self.max_priority} "
                          "(max_priority_per_tenant): ask for less")


class Admission:
    """Caps on requests in flight, checked on arrival: over a cap the request is refused at once (429 /
    RESOURCE_EXHAUSTED with a retry hint) rather than queued. The per-tenant cap counts each key's tenant; the
    tenant-less caller (keys off, or ``api_key``) is one caller of the whole router and has the global cap alone.
    One event loop; not thread-safe."""

    def __init__(self, max_total: int, max_per_tenant: int = 0) -> None:
        self.max_total = max_total
        self.max_per_tenant = max_per_tenant
        self.total = 0
        self.per_tenant: dict[str, int] = {}

    @classmethod
    def from_config(cls, cfg: RouterSettings) -> Admission:
        return cls(cfg.max_concurrent_requests, cfg.max_requests_per_tenant)

    def enter(self, tenant: str, count: int = 1) -> Callable[[], None]:
        """Count ``count`` requests in (a request's ``n`` choices are that many engine requests); returns the
        (idempotent) call that counts them out."""
        also = f" (n={count} counts as {count} requests)" if count > 1 else ""
        if self.total + count > self.max_total:
            raise RequestError(ErrorKind.OVERLOADED, f"the router is at its limit of {self.max_total} requests "
                                                     f"in flight{also}; retry after {RETRY_AFTER_S} s")
        held = self.per_tenant.get(tenant, 0)
        if tenant and self.max_per_tenant and held + count > self.max_per_tenant:
            raise RequestError(ErrorKind.OVERLOADED, f"tenant {tenant} is at its quota of {self.max_per_tenant} "
                                                     f"requests in flight (max_requests_per_tenant){also}; retry "
                                                     f"after {RETRY_AFTER_S} s, or send fewer at once")
        self.total += count
        self.per_tenant[tenant] = held + count
        done = False

        def leave() -> None:
            nonlocal done
            if done:
                return
            done = True
            self.total -= count
            self.per_tenant[tenant] -= count
            if not self.per_tenant[tenant]:
                del self.per_tenant[tenant]

        return leave
