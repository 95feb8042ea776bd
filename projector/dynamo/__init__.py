"""Everything seqstate does with a Dynamo fleet, in one wing.

- The capture: Dynamo's routers publish on NATS Core; provisioning captures those messages into
  a stream of the namespace (its names: :mod:`projector.wire.capture`), and the writer's
  forwarder (:mod:`~projector.dynamo.forward`) stores them in the events log as record batches,
  exactly once and in order. ``seqstate dynamo uncapture`` undoes it
  (:mod:`~projector.dynamo.uncapture`). The one fold decodes them (:mod:`seqstate.dynamo`).
- Discovery: following the fleet's workers and routers as Dynamo announces them, from etcd or
  Dynamo's file store (:mod:`~projector.dynamo.discovery` and its sources), and turning what it
  sees into worker events (:mod:`~projector.dynamo.follow`, wired to a running pipeline by
  :mod:`~projector.dynamo.following`).
- Talking back: republishing the requests in flight in Dynamo's own wire format
  (:mod:`~projector.dynamo.republish`, driven by :mod:`~projector.dynamo.resync`), so that a
  router replica started late learns what its peers routed before it.
- A fleet to try it on: CPU mocker workers and frontends (:mod:`~projector.dynamo.fleet`,
  :mod:`~projector.dynamo.tiny_model`) and ``make dynamo-demo`` (:mod:`~projector.dynamo.demo`).

The wing sits above the write model, the bucket and the router's publisher (it uses all three)
and below the pipeline that runs it; the writer knows the forwarder only as a protocol.
"""
