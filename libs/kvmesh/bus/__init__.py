"""The kvmesh event bus: subjects, the NATS wrapper and a local nats-server. The messages it carries and their
codec are contracts (``kvmesh.contracts.messages``). ``kvmesh.bus.permissions`` (who may do what on NATS) is
imported by name, not here: ``python -m kvmesh.bus.permissions`` runs it as a script."""

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
]
