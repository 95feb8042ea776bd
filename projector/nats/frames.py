"""Slicing a JetStream push consumer's deliveries out of raw NATS protocol bytes.

The replay reader (:mod:`projector.nats.stream_reader`) spends its time here, once per message.
It is pure (bytes in, tuples out) so it can be tested on hand-made server bytes. Compiling it
with mypyc was tried and bought nothing: the time goes to the bytes methods it calls.
"""

from __future__ import annotations

from typing import Final

# What the caller must do after a parse, besides forwarding the batch.
MORE: Final = 0  # read more bytes and call again from ``pos``
DONE: Final = 1  # the delivery of ``end_seq`` was seen, or the stream went quiet
GAP: Final = 2  # a consumer sequence was skipped: the caller falls back
ERROR: Final = 3  # the server sent -ERR (in ``replies[-1]``)


class Parser:
    """State across reads: the consumer sequence seen last and the quiet heartbeats since."""

    def __init__(self, end_seq: int) -> None:
        self.end_seq = end_seq
        self.last_cseq = 0
        self.quiet_beats = 0

    def parse(
        self,
        buf: bytes,
        pos: int,
        batch: list[tuple[int, int, str, bytes]],
        replies: list[bytes],
    ) -> tuple[int, int]:
        """Append deliveries to ``batch`` as ``(stream_seq, log_time_ns, subject, payload)``
        (the fold checks each event's subject) and protocol answers to ``replies``.

        Returns ``(status, pos)``: ``pos`` is where the unconsumed bytes start.
        """
        size = len(buf)
        end_seq = self.end_seq
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return MORE, pos
            is_hmsg = buf.startswith(b"HMSG ", pos)
            if is_hmsg or buf.startswith(b"MSG ", pos):
                fields = buf[pos:eol].split(b" ")
                total = int(fields[-1])
                start = eol + 2
                stop = start + total + 2
                if stop > size:
                    return MORE, pos
                headers = int(fields[-2]) if is_hmsg else 0
                reply = fields[3] if len(fields) == (6 if is_hmsg else 5) else b""
                if reply.startswith(b"$JS.ACK."):
                    tokens = reply.rsplit(b".", 4)
                    cseq = int(tokens[2])
                    if cseq != self.last_cseq + 1:
                        return GAP, pos
                    self.last_cseq = cseq
                    self.quiet_beats = 0
                    seq = int(tokens[1])
                    batch.append(
                        (
                            seq,
                            int(tokens[3]),
                            fields[1].decode(errors="replace"),
                            buf[start + headers : start + total],
                        )
                    )
                    if seq >= end_seq:
                        return DONE, stop
                elif headers:
                    status = buf[start : start + headers]
                    if b"FlowControl" in status and reply:
                        replies.append(b"PUB " + reply + b" 0\r\n\r\n")
                    elif b"Idle Heartbeat" in status:
                        stalled = status.find(b"Nats-Consumer-Stalled:")
                        if stalled >= 0:  # a flow-control request we missed: answer it now
                            subject = status[stalled + 22 : status.find(b"\r\n", stalled)].strip()
                            replies.append(b"PUB " + subject + b" 0\r\n\r\n")
                            self.quiet_beats = 0
                        else:
                            self.quiet_beats += 1
                            if self.quiet_beats >= 2:  # two beats, nothing between: the end
                                return DONE, stop
                pos = stop
            elif buf.startswith(b"PING", pos):
                replies.append(b"PONG\r\n")
                pos = eol + 2
            elif buf.startswith(b"-ERR", pos):
                replies.append(buf[pos:eol])
                return ERROR, eol + 2
            else:
                pos = eol + 2
