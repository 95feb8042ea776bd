"""A JetStream publish ack as the server sends it: read by every publisher that collects its
acks on a subscription of its own (a router's publisher, serve-http's lease holder)."""

from __future__ import annotations

import msgspec


class ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class PubAck(msgspec.Struct):
    """The stream's answer to one publish: where it stored it, or why it did not."""

    seq: int = 0
    duplicate: bool = False
    error: ApiError | None = None


ACK_DECODER = msgspec.json.Decoder(PubAck)
