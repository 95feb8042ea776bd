"""Dead-lettering as a wrapper around a processor: what it refuses is stored once, then passed.

A processor that cannot read a message says so by returning
:class:`~projector.nats.stream.Refused` (a list of them for events of a record batch); it
holds no dead-letter code of its own. :class:`DeadLettering` wraps it, as Watermill's poison
queue middleware wraps a handler: each refusal becomes one dead letter in the sink, the
processor is told once it is stored (``dead_lettered``, so it can count it and move its own
position past it), and the message counts as handled, so the runner moves past it and it is
never handed over again. A dead letter that cannot be stored is an exception: the runner
stops with the message unpassed (a crash in between re-reads it, and the dead letter's msg-id
makes the second copy a duplicate, not a second letter).
"""

from __future__ import annotations

from nats.aio.msg import Msg

from projector.nats.stream import (
    DeadLetterSink,
    Processor,
    Refused,
    RefusingProcessor,
    log_time_ns,
)


class DeadLettering:
    """``processor``, with what it refuses of ``stream`` written to ``sink``; refuses nothing."""

    def __init__(self, processor: Processor, sink: DeadLetterSink, stream: str) -> None:
        self.processor = processor
        self.sink = sink
        self.stream = stream
        # Told of each dead letter stored, if it asks to be.
        self._told = processor if isinstance(processor, RefusingProcessor) else None

    async def handle(self, msg: Msg) -> None:
        refused = await self.processor.handle(msg)
        if refused is None:
            return
        if type(refused) is list:  # events of a record batch, each its own letter
            for each in refused:
                await self._store(msg, each)
        else:
            await self._store(msg, refused)  # type: ignore[arg-type]

    async def _store(self, msg: Msg, refused: Refused) -> None:
        seq = log_time_ns(msg)[0]
        # ``index`` only for an event of a batch: a sink of a consumer that never reads one
        # need not know the word.
        at = {} if refused.index is None else {"index": refused.index}
        await self.sink.put(
            self.stream,
            seq,
            msg.subject,
            msg.data if refused.payload is None else refused.payload,
            refused.reason,
            kind=refused.kind,
            fields=refused.fields,
            **at,
        )
        if self._told is not None:
            self._told.dead_lettered(seq, refused)
