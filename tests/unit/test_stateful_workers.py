"""Stateful property test: random event interleavings checked against a naive model
(stateful_model, stateful_machine), under the rules for workers: eager workers, a removed
worker's grace (with lazy or eager workers), and Dynamo's slot tracker.
"""

from __future__ import annotations

import pytest
from stateful_machine import SETTINGS, SeqStateMachine

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too


class EagerWorkersMachine(SeqStateMachine):
    """lazy_workers=False: adds for unregistered ranks are rejected and create nothing."""

    LAZY = False


class GraceMachine(SeqStateMachine):
    """A 20 s worker grace: removed workers' busy ranks are parked, out of the read model's
    sight, still following their requests' events, and come back with a re-add within the
    grace (the rest of a re-added worker, and a lapsed one, end as a removal ends them)."""

    GRACE_S = 20.0


class EagerGraceMachine(GraceMachine):
    """The grace with lazy_workers=False: an add for a parked rank is unknown_worker."""

    LAZY = False


class SlotTrackerMachine(SeqStateMachine):
    """Dynamo's slot-tracker rules: strict workers, the rank checked before the id, a
    registration never replaced, one block size per tracker, no tracker without a worker."""

    TRACKER = True


EagerWorkersMachine.TestCase.settings = SETTINGS
GraceMachine.TestCase.settings = SETTINGS
EagerGraceMachine.TestCase.settings = SETTINGS
SlotTrackerMachine.TestCase.settings = SETTINGS
TestEagerWorkers = EagerWorkersMachine.TestCase
TestWorkerGrace = GraceMachine.TestCase
TestEagerWorkerGrace = EagerGraceMachine.TestCase
TestSlotTracker = SlotTrackerMachine.TestCase
