"""The replay reader's protocol slicing, on hand-made server bytes."""

from __future__ import annotations

from projector.nats.frames import DONE, ERROR, GAP, MORE, Parser

INBOX = b"_INBOX.r.1"
SUBJECT = b"seqstate.events.ns.1.0"  # a delivery carries the event's own subject
S = SUBJECT.decode()


def delivery(seq: int, cseq: int, ts: int, payload: bytes, *, headers: bool = True) -> bytes:
    reply = b"$JS.ACK.EV.cons.1.%d.%d.%d.0" % (seq, cseq, ts)
    if not headers:
        return b"MSG %s 1 %s %d\r\n%s\r\n" % (SUBJECT, reply, len(payload), payload)
    hdr = b"NATS/1.0\r\nNats-Msg-Id: r:%d\r\n\r\n" % seq
    body = hdr + payload
    return b"HMSG %s 1 %s %d %d\r\n%s\r\n" % (SUBJECT, reply, len(hdr), len(body), body)


def status(text: bytes, reply: bytes = b"", extra: bytes = b"") -> bytes:
    hdr = b"NATS/1.0 100 " + text + b"\r\n" + extra + b"\r\n"
    middle = b" " + reply if reply else b""
    return b"HMSG %s 1%s %d %d\r\n%s\r\n" % (INBOX, middle, len(hdr), len(hdr), hdr)


Batch = list[tuple[int, int, str, bytes]]


def parse(parser: Parser, buf: bytes) -> tuple[int, int, Batch, list[bytes]]:
    batch: Batch = []
    replies: list[bytes] = []
    code, pos = parser.parse(buf, 0, batch, replies)
    return code, pos, batch, replies


def test_deliveries_flow_control_and_ping_in_one_buffer() -> None:
    flow = status(b"FlowControl Request", b"$JS.FC.x")
    plain = delivery(9, 2, 222, b"bc", headers=False)
    buf = delivery(5, 1, 111, b"a") + b"PING\r\n" + flow + plain + delivery(12, 3, 333, b"\r\nd")
    code, pos, batch, replies = parse(Parser(end_seq=100), buf)
    assert (code, pos) == (MORE, len(buf))
    assert batch == [(5, 111, S, b"a"), (9, 222, S, b"bc"), (12, 333, S, b"\r\nd")]
    assert replies == [b"PONG\r\n", b"PUB $JS.FC.x 0\r\n\r\n"]


def test_a_partial_frame_waits_for_more_bytes() -> None:
    whole = delivery(1, 1, 10, b"xyz")
    parser = Parser(end_seq=100)
    for cut in (3, len(whole) - 1):
        code, pos, batch, _ = parse(parser, whole[:cut])
        assert (code, pos, batch) == (MORE, 0, [])
    code, pos, batch, _ = parse(parser, whole + delivery(2, 2, 20, b"w")[:10])
    assert (code, pos, batch) == (MORE, len(whole), [(1, 10, S, b"xyz")])


def test_the_end_sequence_finishes_and_leaves_the_rest() -> None:
    first, second = delivery(7, 1, 1, b"a"), delivery(8, 2, 2, b"b")
    code, pos, batch, _ = parse(Parser(end_seq=7), first + second)
    assert (code, pos, [b[0] for b in batch]) == (DONE, len(first), [7])


def test_two_quiet_heartbeats_end_the_stream_but_a_stalled_one_is_answered() -> None:
    beat = status(b"Idle Heartbeat")
    stalled = status(b"Idle Heartbeat", extra=b"Nats-Consumer-Stalled: $JS.FC.y\r\n")
    parser = Parser(end_seq=100)
    code, _, _, replies = parse(parser, beat + stalled + beat)
    assert code == MORE and replies == [b"PUB $JS.FC.y 0\r\n\r\n"]  # the stall reset the count
    code, _, batch, _ = parse(parser, beat)
    assert code == DONE and batch == []
    parser = Parser(end_seq=100)
    assert parse(parser, beat + delivery(1, 1, 1, b"a") + beat)[0] == MORE  # data between


def test_a_skipped_consumer_sequence_is_a_gap() -> None:
    code, _, batch, _ = parse(
        Parser(end_seq=100), delivery(1, 1, 1, b"a") + delivery(3, 3, 3, b"c")
    )
    assert code == GAP and batch == [(1, 1, S, b"a")]


def test_an_error_line_is_reported() -> None:
    code, _, _, replies = parse(Parser(end_seq=100), b"-ERR 'Authorization Violation'\r\n")
    assert code == ERROR and replies == [b"-ERR 'Authorization Violation'"]
