"""What the router and scheduler APIs check before any I/O: no server needed.

A bad field is refused at the caller, naming it, before it consumes a msg-id; and the two
client objects agree on how a ``namespace`` argument and a ``config`` combine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from nats.aio.client import Client

from projector.bucket.reader import RegistryView
from projector.route.publisher import EventTooLarge, RouterPublisher
from projector.settings.config import Config
from seqstate import AddRequest, EventDecodeError

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too


def test_a_hash_beyond_64_bits_is_refused_by_name_before_it_takes_a_msg_id() -> None:
    pub = RouterPublisher(Client(), router_id="r")
    with pytest.raises(EventDecodeError, match=r"at `\$\.block_hashes\[1\]`"):
        asyncio.run(pub.add("x", 1, block_hashes=[5, 2**64]))
    assert pub.router_seq == 0


def test_an_event_too_large_to_store_is_refused_in_one_line_before_it_takes_a_msg_id() -> None:
    pub = RouterPublisher(Client(), router_id="r")  # the limit before a connection: 1 MiB
    hashes = list(range(2**62, 2**62 + 120_000))  # 9 bytes each: about 1.08 MB
    with pytest.raises(EventTooLarge) as caught:
        asyncio.run(pub.add("huge", 1, block_hashes=hashes))
    assert str(caught.value) == (
        "AddRequest for request 'huge': 1,080,076 bytes encoded, over the 1,043,456 bytes one "
        "event may take (the server's max_payload of 1,048,576 less 5,120 for its delta); it "
        "was not sent"
    )
    assert pub.router_seq == 0


def test_an_event_over_the_folds_size_rule_is_refused_before_it_takes_a_msg_id() -> None:
    """A smaller ``max_event_bytes`` than the server allows: the writer's fold would refuse
    the event (too_large), so the publisher refuses it at once, naming the setting."""
    pub = RouterPublisher(Client(), router_id="r", config=Config(max_event_bytes=1000))
    with pytest.raises(EventTooLarge) as caught:
        asyncio.run(pub.add("big", 1, block_hashes=list(range(2**62, 2**62 + 200))))
    assert str(caught.value) == (
        "AddRequest for request 'big': 1,873 bytes encoded, over the 1,000 bytes one event may "
        "take (max_event_bytes, the largest event the writer applies); it was not sent"
    )
    assert pub.router_seq == 0


def test_a_misspelt_field_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="prefil_tokens"):
        AddRequest(request_id="t", worker_id=5, prefil_tokens=500)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: RouterPublisher(Client(), router_id="r", **kw).config,
        lambda **kw: RegistryView(Client(), **kw).config,
    ],
)
def test_namespace_wins_over_the_config_in_both_clients(make: Callable[..., Config]) -> None:
    base = Config(namespace="from-config", flush_interval_s=0.5)
    both = make(namespace="given", config=base)
    assert (both.namespace, both.flush_interval_s) == ("given", 0.5)
    assert make(config=base).namespace == "from-config"
    assert make(namespace="given").namespace == "given"
    assert make().namespace == "default"
