"""Dynamo's KV-router cost (selector tests of reference catalogue 9.9) and the registry's cost rows.

The selector's numbers are Dynamo's own (``selector`` unit tests and the router docs' worked
example). ``PromptRegistry.costs`` is checked by hand on a small fleet, then against a naive
model built from the reads that existed before it (``loads`` + ``overlap_depths``) and the
formula written out again here, over hypothesis-generated event logs.
"""

from __future__ import annotations

import sys

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from seqstate import (
    DEFAULT_WEIGHTS,
    AddRequest,
    CostRow,
    CostWeights,
    Free,
    MarkPrefillCompleted,
    OverlapRow,
    SequenceState,
    dynamo_cost,
    select,
)

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000
MS = 1_000_000
MAX = sys.float_info.max


# ---- Dynamo's selector tests ------------------------------------------------------------------


def test_prefill_load_scale_applies_after_overlap_credits() -> None:
    """Block 16, ISL 64. Worker 0 has 2 of the 4 prompt blocks cached and a potential decode of
    3 blocks; worker 1 is cold and idle. Credit 1.0, scale 2.0: 2·(4−2)+3 = 7 < 2·4+0 = 8."""
    weights = CostWeights(overlap_score_credit=1.0, prefill_load_scale=2.0)
    warm = dynamo_cost(weights, 16, 64, 0, 2, 3, 0)
    cold = dynamo_cost(weights, 16, 64, 0, 0, 0, 0)
    assert warm == (7.0, 2.0) and cold == (8.0, 4.0)
    assert select([warm[0], cold[0]], 0.0, 0.0) == 0
    assert select([warm[0], cold[0]], 0.0, 0.999) == 0


def test_softmax_sample_orders_extreme_finite_costs() -> None:
    """Costs (−MAX, +MAX): their range overflows a float; the sample 0.6 still falls on the
    lower cost (p = 1/(1+e⁻¹) ≈ 0.731), and 0.75 on the higher."""
    assert select([-MAX, MAX], 1.0, 0.6) == 0
    assert select([MAX, -MAX], 1.0, 0.6) == 1
    assert select([-MAX, MAX], 1.0, 0.75) == 1


def test_the_docs_example_picks_the_second_worker() -> None:
    """Credit 1.0, request weight 0: (prefill 10, overlap 2, decode 10), (10, 5, 5), (10, 8, 9)
    in blocks cost 18, 10 and 11."""
    weights = CostWeights(overlap_score_credit=1.0, decode_active_request_weight=0.0)
    costs = [
        dynamo_cost(weights, 16, 160, 0, overlap, decode, 3)[0]
        for overlap, decode in ((2, 10), (5, 5), (8, 9))
    ]
    assert costs == [18.0, 10.0, 11.0]
    assert select(costs, 0.0, 0.5) == 1


# ---- the formula's terms ----------------------------------------------------------------------


def test_the_credit_never_makes_prefill_negative_and_requests_weigh_per_request() -> None:
    weights = CostWeights(decode_active_request_weight=0.5)
    # 100 queued + 32 prompt tokens = 8.25 blocks; 20 cached blocks leave none to prefill.
    assert dynamo_cost(weights, 16, 32, 100, 20, 7, 4) == (7.0 + 2.0, 0.0)
    assert dynamo_cost(weights, 16, 32, 100, 3, 7, 4) == (5.25 + 7.0 + 2.0, 5.25)


def test_untracked_prefill_costs_only_the_decode_blocks() -> None:
    weights = CostWeights(track_prefill_tokens=False, prefill_load_scale=9.0)
    assert dynamo_cost(weights, 16, 4000, 5000, 0, 12, 3) == (12.0, 0.0)


@pytest.mark.parametrize(
    "field", ["overlap_score_credit", "prefill_load_scale", "decode_active_request_weight"]
)
@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf"), "1"])
def test_a_bad_weight_is_refused_naming_its_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field}="):
        CostWeights(**{field: value})  # type: ignore[arg-type]


def test_the_default_weights_are_dynamos() -> None:
    w = DEFAULT_WEIGHTS
    assert w.overlap_score_credit == 1.0 and w.prefill_load_scale == 1.0
    assert w.decode_active_request_weight == 0.0 and w.track_prefill_tokens is True
    assert CostWeights() == w


# ---- select -----------------------------------------------------------------------------------


def test_a_tie_at_temperature_zero_is_broken_by_the_draw_in_order() -> None:
    costs = [5.0, 3.0, 4.0, 3.0, 3.0]
    assert [select(costs, 0.0, u) for u in (0.0, 0.33, 0.34, 0.66, 0.67, 0.999)] == [
        1,
        1,
        3,
        3,
        4,
        4,
    ]


def test_the_softmax_follows_the_normalised_costs() -> None:
    # Costs 0 and 10 at T=1: weights 1 and e⁻¹ (normalised by the range, not the values).
    assert select([0.0, 10.0], 1.0, 0.731) == 0
    assert select([0.0, 10.0], 1.0, 0.732) == 1
    assert select([1000.0, 1010.0], 1.0, 0.731) == 0  # shifting every cost changes nothing
    # Equal costs: uniform whatever the temperature.
    assert [select([2.0, 2.0, 2.0], 0.5, u) for u in (0.0, 0.34, 0.67)] == [0, 1, 2]
    # A low temperature is all but the minimum: the others' weights underflow to 0.
    assert select([3.0, 1.0, 2.0], 1e-3, 0.999) == 1


@pytest.mark.parametrize(
    ("costs", "temperature", "u", "why"),
    [
        ([], 0.0, 0.5, "no costs"),
        ([1.0], -1.0, 0.5, "temperature=-1.0"),
        ([1.0], float("nan"), 0.5, "temperature=nan"),
        ([1.0], 0.0, 1.0, "u=1.0"),
        ([1.0], 0.0, -0.1, "u=-0.1"),
        ([1.0, float("inf")], 1.0, 0.5, "finite"),
        ([1.0, float("nan")], 0.0, 0.5, "finite"),
    ],
)
def test_select_refuses_what_has_no_choice(
    costs: list[float], temperature: float, u: float, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        select(costs, temperature, u)


# ---- the registry's rows ----------------------------------------------------------------------

PROMPT = [11, 12, 13, 14]


def fleet() -> SequenceState:
    """Worker 1 holds the prompt's first 3 blocks (2 requests, 900 prefill tokens queued, one
    of them modeled); worker 2 holds another prompt; worker 3 holds the first block only."""
    state = SequenceState()
    state.apply(AddRequest("a", 1, block_hashes=[11, 12, 13], prefill_tokens=800), 0)
    state.apply(AddRequest("b", 1, block_hashes=[11, 12, 77], prefill_tokens=100), 0)
    state.apply(AddRequest("c", 2, block_hashes=[21, 22], prefill_tokens=160), 0)
    state.apply(MarkPrefillCompleted("c", 2), 0)
    state.apply(
        AddRequest("d", 3, block_hashes=[11], prefill_tokens=320, expected_prefill_ms=1000.0), 0
    )
    return state


def test_costs_have_a_row_per_rank_with_every_term() -> None:
    """ISL 64 (4 blocks of 16). Worker 1: 900 queued + 64 = 964 tokens = 60.25 blocks, less its
    3 active blocks = 57.25; decode 4 held + 4 − 3 = 5. Worker 2: 64 tokens = 4 blocks, decode
    2 + 4 = 6. Worker 3, half-way through its 1 s prefill: 160 + 64 = 224 tokens = 14 blocks,
    less 1 = 13; decode 1 + 4 − 1 = 4."""
    registry = fleet().registry
    rows = registry.costs(PROMPT, 64, 500 * MS, 16)
    assert rows == [
        CostRow(1, 0, 57.25 + 5, 3, 3, 57.25, 964, 5, 2),
        CostRow(2, 0, 4.0 + 6, 0, 0, 4.0, 64, 6, 1),
        CostRow(3, 0, 13.0 + 4, 1, 1, 13.0, 224, 4, 1),
    ]
    assert select([r.cost for r in rows], 0.0, 0.0) == 1  # worker 2


def test_candidates_restrict_and_overlaps_replace_the_credit() -> None:
    registry = fleet().registry
    rows = registry.costs(PROMPT, 64, 500 * MS, 16, candidates=[(3, 0), [1, 0], (9, 0)])
    assert [(r.worker_id, r.cost) for r in rows] == [(1, 62.25), (3, 17.0)]  # no (9, 0)
    # A KV indexer's view: worker 2 has the whole prompt cached, worker 3 nothing listed.
    rows = registry.costs(PROMPT, 64, 500 * MS, 16, overlaps={(2, 0): 4, (1, 0): 1})
    assert [(r.overlap_blocks, r.active_overlap_blocks, r.prefill_blocks) for r in rows] == [
        (1, 3, 59.25),
        (4, 0, 0.0),
        (0, 1, 14.0),
    ]
    assert [r.cost for r in rows] == [64.25, 6.0, 18.0]
    weights = CostWeights(prefill_load_scale=0.5, decode_active_request_weight=2.0)
    assert [r.cost for r in registry.costs(PROMPT, 64, 500 * MS, 16, weights)] == [
        57.25 / 2 + 5 + 4,
        2.0 + 6 + 2,
        6.5 + 4 + 2,
    ]


def test_costs_refuse_a_block_size_that_is_not_positive_and_a_negative_overlap() -> None:
    registry = fleet().registry
    with pytest.raises(ValueError, match="block_size=0: must be positive"):
        registry.costs(PROMPT, 64, 0, 0)
    with pytest.raises(ValueError, match=r"overlaps\[\(1, 0\)\]=-1"):
        registry.costs(PROMPT, 64, 0, 16, overlaps={(1, 0): -1})


def test_overlaps_have_a_row_per_rank_zeros_included() -> None:
    registry = fleet().registry
    assert registry.overlaps(PROMPT) == [
        OverlapRow(1, 0, 3),
        OverlapRow(2, 0, 0),
        OverlapRow(3, 0, 1),
    ]
    assert registry.overlap_depths(PROMPT) == {(1, 0): 3, (3, 0): 1}  # unchanged: zeros omitted
    assert [r.overlap_blocks for r in registry.overlaps([])] == [0, 0, 0]


# ---- property: the rows equal the naive model -------------------------------------------------

LINEAGES = tuple(tuple(k * 100 + i for i in range(1, 9)) for k in range(3))
IDS = st.sampled_from([f"r{i}" for i in range(6)])
WORKERS = st.sampled_from((1, 2, 3))
DPS = st.sampled_from((0, 1))
HASHES = st.builds(
    lambda k, n: list(LINEAGES[k][:n]), st.integers(0, len(LINEAGES) - 1), st.integers(0, 8)
)
EVENTS = st.one_of(
    st.builds(
        AddRequest,
        request_id=IDS,
        worker_id=WORKERS,
        dp_rank=DPS,
        block_hashes=HASHES,
        prefill_tokens=st.integers(0, 4000),
        expected_prefill_ms=st.none() | st.floats(0.0, 5000.0),
    ),
    st.builds(MarkPrefillCompleted, request_id=IDS, worker_id=WORKERS, dp_rank=DPS),
    st.builds(Free, request_id=IDS, worker_id=WORKERS, dp_rank=DPS),
)
WEIGHTS = st.builds(
    CostWeights,
    overlap_score_credit=st.floats(0.0, 4.0),
    prefill_load_scale=st.floats(0.0, 4.0),
    decode_active_request_weight=st.floats(0.0, 4.0),
    track_prefill_tokens=st.booleans(),
)
RANKS = st.tuples(WORKERS, DPS)


def naive_costs(
    state: SequenceState,
    query: list[int],
    isl: int,
    now: int,
    block_size: int,
    weights: CostWeights,
    candidates: list[tuple[int, int]] | None,
    overlaps: dict[tuple[int, int], int] | None,
) -> list[CostRow]:
    depths = state.registry.overlap_depths(query)
    rows = []
    for load in state.registry.loads(now):
        rank = (load.worker_id, load.dp_rank)
        if candidates is not None and rank not in candidates:
            continue
        depth = depths.get(rank, 0)
        credited = depth if overlaps is None else overlaps.get(rank, 0)
        decode = load.active_blocks + len(query) - depth
        tokens = load.active_prefill_tokens + isl if weights.track_prefill_tokens else 0
        prefill = max(0.0, tokens / block_size - weights.overlap_score_credit * credited)
        cost = (
            weights.prefill_load_scale * prefill
            + decode
            + weights.decode_active_request_weight * load.active_requests
        )
        rows.append(
            CostRow(
                *rank,
                cost,
                credited,
                depth,
                prefill,
                load.active_prefill_tokens + isl,
                decode,
                load.active_requests,
            )
        )
    return rows


@settings(max_examples=150, deadline=None)
@given(
    events=st.lists(st.tuples(EVENTS, st.integers(0, 3 * S)), max_size=40),
    query=HASHES,
    isl=st.integers(0, 20_000),
    later=st.integers(0, 10 * S),
    block_size=st.sampled_from((1, 16, 64)),
    weights=WEIGHTS,
    candidates=st.none() | st.lists(RANKS, max_size=4),
    overlaps=st.none() | st.dictionaries(RANKS, st.integers(0, 10), max_size=4),
)
def test_costs_equal_the_naive_model_of_loads_and_overlap_depths(
    events: list[tuple[object, int]],
    query: list[int],
    isl: int,
    later: int,
    block_size: int,
    weights: CostWeights,
    candidates: list[tuple[int, int]] | None,
    overlaps: dict[tuple[int, int], int] | None,
) -> None:
    state = SequenceState()
    t = 0
    for event, step in events:
        t += step
        state.apply(event, t)  # type: ignore[arg-type]
    now = t + later
    got = state.registry.costs(query, isl, now, block_size, weights, candidates, overlaps)
    assert got == naive_costs(state, query, isl, now, block_size, weights, candidates, overlaps)
    assert [(r.worker_id, r.dp_rank, r.overlap_blocks) for r in state.registry.overlaps(query)] == [
        (r.worker_id, r.dp_rank, r.active_overlap_blocks)
        for r in naive_costs(state, query, 0, now, 16, DEFAULT_WEIGHTS, None, None)
    ]
