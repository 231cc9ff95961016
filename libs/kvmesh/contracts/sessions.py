"""Sessions across the mesh: a client's id for a conversation or an agent's task, namespaced by tenant, and the
signals about it that reach every cache (engine tiers, cachesvc's pool).

A request names its session (OpenAI body ``session_id`` / header ``x-session-id``, the gRPC field, the SDK
argument); the router turns it into ``session_key(tenant, id)``, so one tenant can never end, pause or pin
another's session: the same id from two tenants is two sessions. What crosses the engine seam with a request is a
``SessionHint`` (``contracts.engine``); what reaches every cache outside a request is a ``SessionSignal`` on the
bus (``contracts.messages``): the session ended (an explicit close) or paused (its response ended in a tool call).
"""

from __future__ import annotations

import enum

MAX_SESSION_ID = 128
MAX_TTL_S = 7 * 24 * 3600.0   # the longest retention a request may ask for
DEFAULT_TTL_S = 300.0         # a retention hint without a TTL (Anthropic's ephemeral cache_control: 5 minutes)
MAX_PRIORITY = 100            # retention priorities are 0 (none) .. 100
DEFAULT_TTL_PRIORITY = 50     # the priority of a TTL given without one


class SessionEvent(enum.StrEnum):
    """What a ``SessionSignal`` says."""

    PAUSE = "pause"      # its last response ended in a tool call (or said it pauses): keep its KV, it is back
    DEMOTE = "demote"    # it pauses, and its KV may leave the device meanwhile: warm it back before it returns
    RELEASE = "release"  # it goes on, but nothing it holds now is worth keeping (it starts over, say)
    END = "end"          # it is over (an explicit close)
    RESUME = "resume"    # its next request reached a router: ``instance`` should warm its KV back now
    ROUTED = "routed"    # router to router (``sessions.routed``): its request was sent to ``instance``


class Retention(enum.StrEnum):
    """What a request asks the caches to do with its session's KV once it finished (``session_retention``)."""

    RETAIN = "retain"    # keep it where it is through the pause (the default when the session pauses)
    DEMOTE = "demote"    # let it move down the tiers (host, pool) through the pause; back before the next step
    RELEASE = "release"  # nothing of it needs keeping


MAX_PAUSE_S = 24 * 3600.0  # the longest pause a request may announce


def check_pause(value: object, field: str = "session_pause_s") -> float:
    """An announced pause in seconds: a number in [0, ``MAX_PAUSE_S``] (0: none announced); ValueError naming
    ``field`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_PAUSE_S:
        raise ValueError(f"{field} must be a number of seconds in [0, {MAX_PAUSE_S:.0f}], not {value!r}")
    return float(value)


def check_retention_hint(value: str, field: str = "session_retention") -> Retention | None:
    """A ``session_retention`` value ("" = none given); ValueError naming ``field`` and the choices."""
    if not value:
        return None
    try:
        return Retention(value)
    except ValueError:
        raise ValueError(f"{field} must be one of {', '.join(r.value for r in Retention)}, not {value[:40]!r}") \
            from None


def check_session_id(value: str, field: str = "session_id") -> str:
    """``value`` as a session id: printable ASCII without '/', 1 to ``MAX_SESSION_ID`` characters; ValueError
    naming ``field`` otherwise."""
    if not value or len(value) > MAX_SESSION_ID or not value.isascii() or not value.isprintable() or "/" in value:
        raise ValueError(f"{field} must be 1 to {MAX_SESSION_ID} printable ASCII characters without '/', "
                         f"not {value[:40]!r}")
    return value


def session_key(tenant: str, session_id: str) -> str:
    """The mesh-wide name of ``tenant``'s session ``session_id`` ("" tenant: the open API)."""
    return f"{tenant}/{session_id}"


def check_retention(ttl_s: float | None, priority: int | None, field: str) -> tuple[float, int]:
    """A retention hint's ``(ttl_s, priority)``: TTL in (0, ``MAX_TTL_S``] seconds (None: ``DEFAULT_TTL_S``),
    priority an integer in [0, ``MAX_PRIORITY``] (None: ``DEFAULT_TTL_PRIORITY``). ValueError naming
    ``field``.ttl or ``field``.priority otherwise."""
    if priority is None:
        priority = DEFAULT_TTL_PRIORITY
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
        raise ValueError(f"{field}.priority must be an integer in [0, {MAX_PRIORITY}], not {priority!r}")
    if ttl_s is None:
        return DEFAULT_TTL_S, priority
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"{field}.ttl must be a number of seconds in (0, {MAX_TTL_S:.0f}], not {ttl_s!r}")
    return float(ttl_s), priority
