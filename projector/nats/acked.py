"""nats-py's ``publish_async`` with its error acks delivered: the projector's bucket writes.

nats-py (to 2.16 at least) reads an ack that carries an error by raising it from the callback of
its reply subscription (nats-io/nats.py#985): the publish's future stays pending until its
caller gives up, and the error goes to the client's error callback instead. On a full disk the
projector logged ``ServiceUnavailableError: code=503 err_code=10023`` once per key written,
hundreds of lines, then "flush failed: no answer in time". Here the error fails the publish's
future, so a flush fails at once with what the server said: JetStream storage full.
"""

from __future__ import annotations

import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext


class AckedJetStream(JetStreamContext):
    """A JetStream context whose ``publish_async`` futures fail with their error ack."""

    async def _handle_async_reply(self, msg: Msg) -> None:
        try:
            await super()._handle_async_reply(msg)
        except nats.js.errors.APIError as exc:
            prefix = getattr(self, "_async_reply_prefix", None)
            futures = getattr(self, "_publish_async_futures", {})
            future = futures.get(msg.subject[len(prefix) :]) if prefix else None
            if future is None:
                raise  # not a reply this version of nats-py keeps as we know: as before
            if not future.done():
                future.set_exception(exc)


def acked_jetstream(nc: Client) -> JetStreamContext:
    return AckedJetStream(nc)
