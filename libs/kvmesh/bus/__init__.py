"""The kvmesh event bus: subjects, message codecs, the NATS wrapper and a local nats-server."""

from kvmesh.bus.bus import Bus, EventsConsumer, EventsHandler, Handler
from kvmesh.bus.codec import ROLES, VERSION, CodecError, Heartbeat, KVEventBatch, KVReady, Message, decode
from kvmesh.bus.nats_server import NatsServer, find_nats_server
from kvmesh.bus.subjects import Subjects
from kvmesh.bus.tracing import extract_trace_headers, inject_trace_headers

__all__ = [
           "ROLES",
           "VERSION",
           "Bus",
           "CodecError",
           "EventsConsumer",
           "EventsHandler",
           "Handler",
           "Heartbeat",
           "KVEventBatch",
           "KVReady",
           "Message",
           "NatsServer",
           "Subjects",
           "decode",
           "extract_trace_headers",
           "find_nats_server",
           "inject_trace_headers",
]
