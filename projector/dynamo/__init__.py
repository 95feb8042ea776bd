"""Dynamo's own routers as the ledger's publishers.

A stock Dynamo KV router with replica sync already publishes every routing decision on NATS
Core. Provisioning captures those messages into a namespace's log
(:mod:`projector.wire.capture`) and the one fold decodes them (:mod:`seqstate.dynamo`); this
wing holds what talks back to Dynamo: republishing the requests in flight in Dynamo's own
wire format, so that a router replica started late learns what its peers routed before it.
"""
