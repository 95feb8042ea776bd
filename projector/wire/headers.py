"""The header names seqstate's messages carry, spelled once for the side that writes and the
side that reads: a name cannot drift between the writer, the projector, replay and the tools.
"""

# The server stores a message once per id within its duplicate window: a retry after a lost
# ack, or a second writer at the same position, cannot store it twice.
MSG_ID = "Nats-Msg-Id"
# What the server adds to a message it copied in from another stream (the Dynamo capture):
# every message of the events stream that carries it came from Dynamo's side, and its
# Nats-Msg-Id, if any, is whatever the client that published it there chose.
STREAM_SOURCE = "Nats-Stream-Source"
# On a message the capture's forwarder stored (projector.dynamo.forward): ``<capture stream>
# <first> <last> <count>``, the capture sequences of the Dynamo messages it holds (``count`` of
# them, in order; a batch holds them as a record batch). Where a restarted forwarder resumes.
CAPTURE = "Seqstate-Capture"
# A compare-and-set on the subject's last message, so two writers cannot interleave.
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
# An atomic batch (nats-server 2.12+, a stream with ``allow_atomic``): messages with the same
# id, numbered from 1, stored all together when the one marked commit arrives, or none.
BATCH_ID = "Nats-Batch-Id"
BATCH_SEQUENCE = "Nats-Batch-Sequence"
BATCH_COMMIT = "Nats-Batch-Commit"

# ---- on a DELTAS message ---------------------------------------------------------------------
# The event (events-stream sequence) a message stands for: the last a delta message covers,
# or the one a dead letter could not take.
SOURCE_SEQ = "Seqstate-Source-Seq"
# The event the previous delta message ended at: the link that lets a reader of the deltas
# see a hole, or a message no writer wrote.
PREV_SOURCE_SEQ = "Seqstate-Prev-Source-Seq"
# On a DELTAS message that ends inside an event's parts: the part it ends at.
SOURCE_PART = "Seqstate-Source-Part"

# ---- on a dead letter (with SOURCE_SEQ: the position of the message it stands for) -----------
REASON = "Seqstate-Reason"  # why, in one line
SOURCE_STREAM = "Seqstate-Source-Stream"
SUBJECT = "Seqstate-Subject"  # the subject the original was published on
SIZE = "Seqstate-Size"  # the original payload's size in bytes
TRUNCATED = "Seqstate-Truncated"  # present when the payload kept is a prefix
# An event of a record batch: its index in the batch (the payload is that event's own bytes)
SOURCE_INDEX = "Seqstate-Source-Index"

# ---- set by the server on a sourced message: ``<stream> <seq> ...`` (where it came from) -----
STREAM_SOURCE = "Nats-Stream-Source"
