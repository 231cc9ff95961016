"""Errors that fail one request inside an engine while the rest of its batch carries on."""

from __future__ import annotations


class SequenceError(Exception):
    """One sequence could not go on (sampling, grammar, stop check, detokenizing, KV export, or the step's forward
    pass) and was aborted. ``client_fault``: the request itself is to blame (a value validation should have
    refused), answered 400 / INVALID_ARGUMENT; otherwise the fault is ours (e.g. the model's logits went nan),
    answered 500 / INTERNAL. The message names the request."""

    def __init__(self, request_id: str, message: str, client_fault: bool = False) -> None:
        super().__init__(f"request {request_id}: {message}")
        self.request_id = request_id
        self.client_fault = client_fault
