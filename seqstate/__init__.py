"""seqstate: the pure core of an event-sourced ledger of in-flight LLM requests.

Nothing in this package does I/O, imports asyncio or NATS, or reads a clock: time arrives
with each event (``apply(event, at_ns)``) and with each read (``loads(now_ns)``). The NATS
pipeline around it lives in the ``projector`` package.
"""

from seqstate.cost import DEFAULT_WEIGHTS, CostRow, CostWeights, dynamo_cost, select
from seqstate.deltas import (
    Delta,
    RankChange,
    decode_delta,
    decode_deltas,
    encode_delta,
    encode_deltas,
)
from seqstate.errors import SeqstateError
from seqstate.events import (
    SCHEMA_VERSION,
    AddOutputBlock,
    AddRequest,
    Event,
    EventDecodeError,
    Free,
    MarkPrefillCompleted,
    RouterGoodbye,
    RouterHeartbeat,
    Tick,
    WorkerAdded,
    WorkerRemoved,
    decode_event,
    encode_event,
)
from seqstate.fold import Fold, FoldRules, Refusal
from seqstate.loads import LoadRow, OverlapRow, PotentialLoadRow, PrefillSnapshot, RankLoad
from seqstate.registry import PromptRegistry
from seqstate.snapshot import SnapshotError
from seqstate.state import SequenceState

__all__ = [
    "DEFAULT_WEIGHTS",
    "SCHEMA_VERSION",
    "AddOutputBlock",
    "AddRequest",
    "CostRow",
    "CostWeights",
    "Delta",
    "Event",
    "EventDecodeError",
    "Fold",
    "FoldRules",
    "Free",
    "LoadRow",
    "MarkPrefillCompleted",
    "OverlapRow",
    "PotentialLoadRow",
    "PrefillSnapshot",
    "PromptRegistry",
    "RankChange",
    "RankLoad",
    "Refusal",
    "RouterGoodbye",
    "RouterHeartbeat",
    "SeqstateError",
    "SequenceState",
    "SnapshotError",
    "Tick",
    "WorkerAdded",
    "WorkerRemoved",
    "decode_delta",
    "decode_deltas",
    "decode_event",
    "dynamo_cost",
    "encode_delta",
    "encode_deltas",
    "encode_event",
    "select",
]
