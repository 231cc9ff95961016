"""Protocol buffers of the kvmesh.v1 API. Regenerate with ``make proto`` after editing ``v1/*.proto``."""
