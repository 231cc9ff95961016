"""Hosting one engine instance, shared by the prefill and decode services: the engine thread, gRPC server,
transfer engine, heartbeats, KV events and snapshots, metrics, the pool client. It imports no service: each
service's entry point hands ``host.EngineHost`` the ``RolePlugin`` it serves (``app.both`` hands it both)."""
