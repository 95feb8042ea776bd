"""Everything that speaks to NATS and JetStream: connections and their security, the streams,
buckets and consumers the pipeline provisions, dead letters, snapshots, the lease, lag and
backlog, the fast paths around nats-py, and the nats-server a demo or a test embeds.

nats-py's private internals are touched in one module only,
:mod:`~projector.nats.client_internals`, installed explicitly at start-up.
"""
