"""The kvmesh event bus: subjects, the NATS wrapper and a local nats-server. The messages it carries and their
codec are contracts (``kvmesh.contracts.messages``)."""

from kvmesh.bus import permissions
from kvmesh.bus.bus import Bus, BusTLS, EventsConsumer, EventsHandler, Handler
from kvmesh.bus.nats_server import NatsServer, find_nats_server
from kvmesh.bus.subjects import Subjects
from kvmesh.bus.trace_headers import extract_trace_headers, inject_trace_headers

__all__ = [
           "Bus",
           "BusTLS",
           "EventsConsumer",
           "EventsHandler",
           "Handler",
           "NatsServer",
           "Subjects",
           "extract_trace_headers",
           "find_nats_server",
           "inject_trace_headers",
           "permissions",
]
