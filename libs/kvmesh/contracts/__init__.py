"""What every kvmesh process agrees on, torch-free: identifiers, block keys, the block layout descriptor, KV
events and bus messages, sampling parameters, the names of the strategies and modes that settings and headers
carry.

Imports only the standard library, xxhash and the generated protocol (an import-linter contract in
pyproject.toml holds that), so the router and cachesvc can read a layout or a block key without loading a
model framework.
"""
