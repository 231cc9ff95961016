"""The engine-instance runtime shared by the prefill and decode services (and role ``both``)."""
