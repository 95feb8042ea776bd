"""Stateful property test: random event interleavings checked against a naive model
(stateful_model, stateful_machine), under the router rules with lazy workers: requests
expire after 60 s, or never.
"""

from __future__ import annotations

import pytest
from stateful_machine import SETTINGS, SeqStateMachine

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too


class NoExpiryMachine(SeqStateMachine):
    """Expiry disabled: nothing ever expires; ids are remembered for 300 s. Routers are never
    orphaned either (heartbeats only register them)."""

    EXPIRY_S = None
    ORPHAN_S = None


SeqStateMachine.TestCase.settings = SETTINGS
NoExpiryMachine.TestCase.settings = SETTINGS

TestLazyExpiring = SeqStateMachine.TestCase
TestNoExpiry = NoExpiryMachine.TestCase
