"""The kvmesh event bus: subjects, message codecs, the NATS wrapper and a local nats-server."""

from kvmesh.bus.bus import Bus, EventsConsumer, EventsHandler, Handler
from kvmesh.bus.codec import ROLES, VERSION, CodecError, Heartbeat, KVEventBatch, KVReady, Message, decode
from kvmesh.bus.nats_server import NatsServer, find_nats_server
from kvmesh.bus.subjects import Subjects
from kvmesh.bus.tracing import extract_trace_headers, inject_trace_headers

__all__ = ["Bus", "EventsConsumer", "EventsHandler", "Handler", "ROLES", "VERSION", "CodecError", "Heartbeat",
           "KVEventBatch", "KVReady", "Message", "decode", "NatsServer", "find_nats_server", "Subjects",
           "extract_trace_headers", "inject_trace_headers"]
