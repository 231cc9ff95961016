"""Push capabilities: a transfer server takes a push only when its own side asked for it.

The checksums in a transfer header prove the bytes arrived as they were sent, not who sent them. So every
receiver issues a :class:`Grant` for each push it expects, and hands its token to the one sender it expects it
from, over a channel that sender already trusts (gRPC):

- decode, accepting a Decode call, expects the prompt's KV from prefill: it grants ``<request>@`` (every part,
  from any prefill), the blocks from the first one pushed to the prompt's last, until the kv wait ends; the
  token goes back in the call's initial metadata, and the router passes it on in ``PrefillRequest.push_token``;
- an instance fetching pool hits expects cachesvc's push of them: it grants its ``GetBlocks`` transfer id, the
  blocks it asks for, for the call's timeout, and names the token in ``GetBlocksRequest.transfer_token``;
- cachesvc, asked by ``GrantPut``, expects an instance's write-back: it grants a transfer id it makes up, that
  many blocks, for ``transfer_timeout_s``, and answers with the token (``GrantPutResponse.token``).

A part is refused (:class:`~kvmesh.transfer.errors.Refusal`) when no grant covers its transfer id
(``unsolicited``), its token is not the grant's (``bad_token``), it comes after the deadline or after the
receiver revoked the grant (``expired``: the hand-off ended), or it holds blocks outside the granted range
(``blocks``). A refused part is never read as data; an unauthenticated one does not even settle its transfer
id, so a forged push cannot fail the genuine one.

Tokens are ``secrets.token_urlsafe`` (192 random bits), compared in constant time. They travel in plain text
unless gRPC and the transfer connection use TLS (``kvmesh.tls``). Everything here runs on the server's event
loop.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field

from kvmesh.transfer.errors import Refusal, TransferRejected
from kvmesh.transfer.header import TransferHeader

TOKEN_BYTES = 24


@dataclass(eq=False)
class Grant:
    """May push transfers whose id starts with ``prefix``, carrying ``token``, holding blocks within
    ``first_block .. end_block - 1`` of the sender's sequence, until ``deadline`` (``time.monotonic()``)."""

    prefix: str
    token: str
    first_block: int
    end_block: int
    deadline: float
    revoked: bool = False
    _drop: asyncio.TimerHandle | None = field(default=None, repr=False)


class Grants:
    """The grants of one transfer server. A grant is kept ``linger_s`` past its deadline or revocation, so a
    late or replayed part is told so (``expired``) rather than ``unsolicited``; then forgotten."""

    def __init__(self, linger_s: float) -> None:
        self.linger_s = linger_s
        self._by_prefix: dict[str, Grant] = {}
        self._lengths: Counter[int] = Counter()  # prefix lengths in use: what a lookup tries
        self._spans: Counter[int] = Counter()    # blocks each grant held covers: the largest push expected

    def __len__(self) -> int:
        return sum(not g.revoked for g in self._by_prefix.values())

    @property
    def widest(self) -> int:
        """The most blocks one grant held covers (lingering ones included, so a late part is still told why it
        is refused); 0 when none is held. A header describing more blocks than this cannot be admitted."""
        return max(self._spans, default=0)

    def issue(self, prefix: str, first_block: int, end_block: int, timeout_s: float) -> Grant:
        """A fresh capability for pushes under ``prefix`` of blocks ``first_block .. end_block - 1``, valid for
        ``timeout_s`` seconds; it replaces one issued under the same prefix before."""
        if not prefix:
            raise ValueError("a grant needs a transfer-id prefix")
        if not 0 <= first_block < end_block:
            raise ValueError(f"a grant covers at least one block: {first_block}..{end_block - 1} is none")
        if timeout_s <= 0:
            raise ValueError(f"a grant's timeout must be > 0 s, not {timeout_s}")
        self._forget(prefix)
        grant = Grant(prefix, secrets.token_urlsafe(TOKEN_BYTES), first_block, end_block,
                      time.monotonic() + timeout_s)
        self._keep(grant, timeout_s + self.linger_s)
        return grant

    def revoke(self, prefix: str, grant: Grant | None = None) -> None:
        """End the grant under ``prefix`` (only if it is ``grant``, when given): from now on its parts are
        refused as ``expired``. Idempotent."""
        held = self._by_prefix.get(prefix)
        if held is None or held.revoked or (grant is not None and held is not grant):
            return
        held.revoked = True
        self._keep(held, self.linger_s)

    def check(self, header: TransferHeader) -> TransferRejected | None:
        """Why ``header`` may not be pushed here (None: a grant covers it)."""
        tid = header.transfer_id
        grant = self._covering(tid)
        if grant is None:
            return TransferRejected(f"transfer {tid}: no push was asked for under this id (the receiver issued "
                                    "no capability for it); a push carries the token its receiver issued",
                                    Refusal.UNSOLICITED)
        if not hmac.compare_digest(header.token.encode(), grant.token.encode()):
            what = "carries no token" if not header.token else "carries a token the receiver did not issue for it"
            return TransferRejected(f"transfer {tid} {what}", Refusal.BAD_TOKEN)
        if grant.revoked:
            return TransferRejected(f"transfer {tid}: its capability was revoked (the transfer it was issued for "
                                    "has ended)", Refusal.EXPIRED)
        late = time.monotonic() - grant.deadline
        if late > 0:
            return TransferRejected(f"transfer {tid} came {late:.2f}s after its capability expired",
                                    Refusal.EXPIRED)
        lo, hi = header.first_block, header.first_block + header.num_blocks
        if lo < grant.first_block or hi > grant.end_block:
            return TransferRejected(f"transfer {tid} holds blocks {lo}..{hi - 1}, outside the blocks "
                                    f"{grant.first_block}..{grant.end_block - 1} granted", Refusal.BLOCKS)
        return None

    def close(self) -> None:
        for prefix in list(self._by_prefix):
            self._forget(prefix)

    def _covering(self, tid: str) -> Grant | None:
        """The grant with the longest prefix of ``tid``: one dict lookup per prefix length in use, however many
        grants there are and however long ``tid`` is."""
        for n in sorted((n for n in self._lengths if n <= len(tid)), reverse=True):
            if (grant := self._by_prefix.get(tid[:n])) is not None:
                return grant
        return None

    def _keep(self, grant: Grant, for_s: float) -> None:
        if grant._drop is not None:
            grant._drop.cancel()
        if self._by_prefix.get(grant.prefix) is not grant:
            self._lengths[len(grant.prefix)] += 1
            self._spans[grant.end_block - grant.first_block] += 1
        self._by_prefix[grant.prefix] = grant
        grant._drop = asyncio.get_running_loop().call_later(for_s, self._forget, grant.prefix, grant)

    def _forget(self, prefix: str, grant: Grant | None = None) -> None:
        held = self._by_prefix.get(prefix)
        if held is not None and (grant is None or held is grant):
            del self._by_prefix[prefix]
            self._lengths[len(prefix)] -= 1
            if not self._lengths[len(prefix)]:
                del self._lengths[len(prefix)]
            span = held.end_block - held.first_block
            self._spans[span] -= 1
            if not self._spans[span]:
                del self._spans[span]
            if held._drop is not None:
                held._drop.cancel()
