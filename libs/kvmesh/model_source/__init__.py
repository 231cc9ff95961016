"""Where a model comes from and what it declares, torch-free: resolving a model source (an HF directory, a GGUF
file, the embedded default), its config, its fingerprint, and its tokenizer and chat template.

The engine and the router both read a model through this package, so the model and tokenizer fingerprints
in every block key's namespace are computed by one piece of code. Loading weights is the engine's
(``kvmesh.engine.loader``).
"""
