"""Demo workloads: deterministic, production-shaped, chained hashes, and clear errors."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from projector.ops.workload import (
    MOONCAKE_BLOCK_TOKENS,
    DemoRequest,
    MooncakeWorkload,
    SyntheticWorkload,
    Workload,
    WorkloadError,
    chain_hashes,
    modeled_decode_ms,
    modeled_prefill_ms,
    mooncake,
    synthetic,
)

REAL_TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_sample.jsonl"


def conversation_turn(request: DemoRequest) -> tuple[str, int]:
    conversation, turn = request.request_id.rsplit("-", 1)
    return conversation, int(turn)


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


# ---- synthetic -----------------------------------------------------------------------------


def test_same_seed_same_requests_different_seed_different() -> None:
    first = list(synthetic(seed=7, limit=300))
    assert first == list(synthetic(seed=7, limit=300))
    other = list(synthetic(seed=8, limit=300))
    assert first != other
    # A different seed is a different world: no prefix in common.
    assert not {h for r in first for h in r.block_hashes} & {
        h for r in other for h in r.block_hashes
    }
    assert len(first) == 300


def test_workload_objects_restart_their_stream() -> None:
    workload: Workload = SyntheticWorkload(seed=3, limit=50)
    assert list(workload) == list(workload)
    assert workload.block_tokens == 64
    assert "seed=3" in workload.name


def test_function_defaults_match_the_workload_class() -> None:
    params = inspect.signature(synthetic).parameters
    for f in dataclasses.fields(SyntheticWorkload):
        assert params[f.name].default == f.default, f.name


def test_arrivals_do_not_decrease_and_values_are_sane() -> None:
    requests = list(synthetic(seed=1, limit=2000))
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    assert len({r.request_id for r in requests}) == len(requests)
    for r in requests:
        assert len(r.block_hashes) == r.isl_tokens // 64  # complete blocks only
        assert all(0 <= h < 2**64 for h in r.block_hashes)
        assert r.prefill_ms == pytest.approx(20 + 0.05 * r.isl_tokens)
        assert r.decode_ms == pytest.approx(min(20 * r.output_tokens, 10_000))


def test_a_later_turn_extends_the_earlier_turn_after_its_answer() -> None:
    by_conversation: dict[str, list[DemoRequest]] = defaultdict(list)
    for r in synthetic(seed=2, limit=3000):
        by_conversation[conversation_turn(r)[0]].append(r)
    multi_turn = [turns for turns in by_conversation.values() if len(turns) > 1]
    assert len(multi_turn) > 100
    for turns in multi_turn:
        assert [conversation_turn(r)[1] for r in turns] == list(range(len(turns)))
        for earlier, later in itertools.pairwise(turns):
            # previous prompt + previous answer + a new user message
            assert later.isl_tokens > earlier.isl_tokens + earlier.output_tokens
            assert later.block_hashes[: len(earlier.block_hashes)] == earlier.block_hashes
            assert len(later.block_hashes) >= len(earlier.block_hashes)
            answered = earlier.arrival_s + (earlier.prefill_ms + earlier.decode_ms) / 1000
            assert later.arrival_s >= answered - 1e-9


def test_system_prompts_are_shared_prefixes_and_conversations_diverge_after_them() -> None:
    requests = list(synthetic(seed=4, system_prompts=3, limit=1500))
    by_first: dict[int, list[DemoRequest]] = defaultdict(list)
    for r in requests:
        by_first[r.block_hashes[0]].append(r)
    # Different system prompts share no first hash, nor any later one; each prompt is used by
    # many requests.
    assert len(by_first) == 3
    hash_sets = [{h for r in group for h in r.block_hashes} for group in by_first.values()]
    for a, b in itertools.combinations(hash_sets, 2):
        assert not a & b
    for group in by_first.values():
        assert len(group) > 20
        firsts: dict[str, DemoRequest] = {}
        for r in group:
            firsts.setdefault(conversation_turn(r)[0], r)
        openers = list(firsts.values())
        # Two conversations on one system prompt share exactly its complete blocks (>= 4 at
        # 256+ tokens), whatever the pair.
        shared = {
            common_prefix(a.block_hashes, b.block_hashes) for a, b in itertools.pairwise(openers)
        }
        assert len(shared) == 1
        assert shared.pop() >= 4


def test_lengths_are_heavy_tailed() -> None:
    requests = list(synthetic(seed=5, limit=2000))
    outputs = [r.output_tokens for r in requests]
    assert max(outputs) > 5 * statistics.median(outputs)
    isl = [r.isl_tokens for r in requests]
    assert max(isl) > 5 * statistics.median(isl)


def test_poisson_rate() -> None:
    requests = list(synthetic(seed=6, rate_per_s=40.0, limit=5000))
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(requests)]
    assert statistics.mean(gaps) == pytest.approx(1 / 40.0, rel=0.15)


def test_speedup_scales_time_and_nothing_else() -> None:
    slow = list(synthetic(seed=9, limit=400))
    fast = list(synthetic(seed=9, speedup=4.0, limit=400))
    assert [r.request_id for r in fast] == [r.request_id for r in slow]
    assert [r.block_hashes for r in fast] == [r.block_hashes for r in slow]
    for s, f in zip(slow, fast, strict=True):
        assert f.arrival_s == pytest.approx(s.arrival_s / 4)
        assert f.prefill_ms == pytest.approx(s.prefill_ms / 4)
        assert f.decode_ms == pytest.approx(s.decode_ms / 4)


def test_decode_cap_is_optional() -> None:
    uncapped = list(synthetic(seed=5, max_decode_s=None, limit=2000))
    assert max(r.decode_ms for r in uncapped) > 10_000
    capped = list(synthetic(seed=5, max_decode_s=2.0, limit=2000))
    assert max(r.decode_ms for r in capped) == 2000.0


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"rate_per_s": 0.0}, "rate_per_s"),
        ({"rate_per_s": float("inf")}, "rate_per_s"),
        ({"speedup": -1.0}, "speedup"),
        ({"conversations": 0}, "conversations"),
        ({"mean_turns": 0.5}, "mean_turns"),
        ({"limit": -1}, "limit"),
    ],
)
def test_synthetic_rejects_bad_parameters_eagerly(kwargs: dict[str, float], named: str) -> None:
    with pytest.raises(WorkloadError, match=named):
        synthetic(**kwargs)  # type: ignore[arg-type]


# ---- cost model and hashes -----------------------------------------------------------------


def test_cost_model() -> None:
    assert modeled_prefill_ms(1000) == pytest.approx(70.0)
    assert modeled_prefill_ms(1000, speedup=2.0) == pytest.approx(35.0)
    assert modeled_decode_ms(100) == pytest.approx(2000.0)
    assert modeled_decode_ms(100, speedup=4.0, max_decode_s=1.0) == pytest.approx(250.0)


def test_chain_hashes_name_prefixes() -> None:
    a = chain_hashes([0, 1, 2])
    b = chain_hashes([0, 1, 5])
    c = chain_hashes([9, 1, 2])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(a) & set(c)  # the same block after a different prefix is a different hash
    assert chain_hashes([2], parent=a[1]) == a[2:]
    assert all(0 <= h < 2**64 for h in a + b + c)


# ---- mooncake ------------------------------------------------------------------------------


def write_trace(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_mooncake_reads_exact_values(tmp_path: Path) -> None:
    trace = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1536, "output_length": 10, "hash_ids": [0, 1, 2]},
            "",
            {"timestamp": 2500, "input_length": 1536, "output_length": 7, "hash_ids": [0, 1, 5]},
            # 1000 tokens: one complete 512-token block; the trace's partial second is dropped
            {"timestamp": 2500, "input_length": 1000, "output_length": 1, "hash_ids": [0, 3]},
        ],
    )
    first, second, third = mooncake(trace, speedup=2.0)
    assert (first.request_id, second.request_id, third.request_id) == ("mc-0", "mc-2", "mc-3")
    assert (first.arrival_s, second.arrival_s, third.arrival_s) == (0.0, 1.25, 1.25)
    assert (first.isl_tokens, first.output_tokens) == (1536, 10)
    assert len(first.block_hashes) == 3 and len(second.block_hashes) == 3
    assert first.block_hashes[:2] == second.block_hashes[:2]
    assert first.block_hashes[2] != second.block_hashes[2]
    assert first.block_hashes == tuple(chain_hashes([0, 1, 2]))
    assert third.block_hashes == first.block_hashes[:1]
    assert first.prefill_ms == pytest.approx((20 + 0.05 * 1536) / 2)
    assert first.decode_ms == pytest.approx(20 * 10 / 2)


def test_mooncake_limit_and_cap(tmp_path: Path) -> None:
    line = {"timestamp": 1, "input_length": 600, "output_length": 1000, "hash_ids": [4, 8]}
    trace = write_trace(tmp_path / "t.jsonl", [line] * 5)
    requests = list(mooncake(trace, limit=2, max_decode_s=3.0))
    assert [r.request_id for r in requests] == ["mc-0", "mc-1"]
    assert requests[0].decode_ms == 3000.0
    assert list(mooncake(trace, limit=0)) == []
    workload = MooncakeWorkload(trace)
    assert workload.block_tokens == MOONCAKE_BLOCK_TOKENS
    assert "t.jsonl" in workload.name
    assert len(list(workload)) == len(list(workload)) == 5


def test_mooncake_missing_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match=r"nope\.jsonl: no such file"):
        mooncake(tmp_path / "nope.jsonl")  # raised before iteration
    with pytest.raises(WorkloadError, match="not a regular file"):
        mooncake(tmp_path)


@pytest.mark.parametrize("speedup", [0.0, -2.0, float("nan")])
def test_mooncake_bad_speedup_names_the_file(tmp_path: Path, speedup: float) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [])
    with pytest.raises(WorkloadError, match=r"t\.jsonl: speedup must be"):
        mooncake(trace, speedup=speedup)


LENGTHS = '"input_length": 1, "output_length": 1'


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ('{"timestamp": 5, "input_length": 10', "invalid JSON: "),
        ('{"timestamp": 5, ' + LENGTHS + "}", "missing required field `hash_ids`"),
        ('{"timestamp": "5", ' + LENGTHS + ', "hash_ids": []}', "$.timestamp"),
        ('{"timestamp": 5, ' + LENGTHS + ', "hash_ids": [-1]}', "$.hash_ids[0]"),
        ('{"timestamp": 0, ' + LENGTHS + ', "hash_ids": []}', "before the previous 1 ms"),
        ("timestamp=5", "invalid JSON: "),
    ],
)
def test_mooncake_bad_line_names_file_and_line_when_reached(
    tmp_path: Path, bad: str, says: str
) -> None:
    good = {"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": []}
    trace = write_trace(tmp_path / "bad.jsonl", [good, good, bad, good])
    requests = mooncake(trace)
    assert next(requests).request_id == "mc-0"  # validation is lazy: good lines come first
    assert next(requests).request_id == "mc-1"
    with pytest.raises(WorkloadError) as caught:
        next(requests)
    message = str(caught.value)
    assert message.startswith(f"{trace}:3: ")
    assert says in message
    assert "\n" not in message


def test_mooncake_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [])
    requests = mooncake(trace)  # exists: fine until it is read

    def denied(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(WorkloadError, match=r"t\.jsonl: cannot read: Permission denied$"):
        next(requests)


def test_the_shipped_mooncake_sample() -> None:
    requests = list(mooncake(REAL_TRACE))
    assert len(requests) == 1000
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    assert requests[0].request_id == "mc-0" and requests[0].isl_tokens == 6758
    assert len(requests[0].block_hashes) == 6758 // 512
    # Conversation turns in the trace reuse earlier prefixes.
    firsts = {r.block_hashes[0] for r in requests if r.block_hashes}
    assert len(firsts) < len(requests) / 2


def test_make_run_replays_a_small_trace_inside_the_checkout() -> None:
    """`make run` replays a trace the clone holds, small enough to ship (a few hundred KB):
    the whole Mooncake trace is there for the benchmarks, never needed by the demo."""
    repo = REAL_TRACE.parents[1]
    recipe = (repo / "Makefile").read_text().split("\nrun:", 1)[1].split("\n\n", 1)[0]
    match = re.search(r"--trace (\S+)", recipe)
    assert match, recipe
    trace = (repo / match.group(1)).resolve()
    assert trace.is_relative_to(repo) and trace.is_file(), trace
    assert trace.stat().st_size <= 300_000
    assert len(list(mooncake(trace))) == 1000
