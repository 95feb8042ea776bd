"""What every benchmark script here shares, kept once: run as ``python benchmarks/NAME.py``.

A script's own directory is on ``sys.path`` when Python runs it, so a benchmark imports these
modules as ``from harness.measure import median``; nothing here is part of the product, and
nothing of the product or the tests imports it.

- :mod:`harness.report`: the machine and checkout a figure was measured on (``machine()``,
  its printed head), the verdict words, ``--json`` or text (``emit``), the JSON file.
- :mod:`harness.measure`: medians and percentiles, CPU seconds and resident memory read from
  ``/proc``, a fresh store per run, the order of interleaved runs (``rotated``,
  ``alternated``) and same-run ratios of medians.
- :mod:`harness.servers`: free ports, a quiet NATS client, the server's version,
  ``seqstate`` processes started as deployed and stopped together, and
  ``seqstate replay --verify``. The embedded nats-server itself is the product's
  ``projector.nats.server.NatsServer`` (and ``NatsCluster``): a benchmark starts those, never
  a copy.
- :mod:`harness.http`: raw HTTP/1.1 for the scripts that load an HTTP server: one call on
  a connection of its own (``one_shot``), the process behind a port (``listener_pid``), and
  the client connection a load generator builds on (``RawClient``: answers split by
  ``Content-Length``).
- :mod:`harness.trackers`: the slot trackers an HTTP benchmark measures, started for it and
  stopped together: ``seqstate serve-http`` on a nats-server of its own and Dynamo's tracker
  (``start_servers``, ``Processes``), or servers already running (``--seqstate-url``).
- :mod:`harness.cli`: the parser and the flags several scripts take (``--json``,
  ``--trace``, positive counts).
- :mod:`harness.workload`: the Mooncake conversation trace as lifecycles, events and
  encoded stream messages, and publishing them into the events stream.

A new benchmark: parse its flags with ``harness.cli.argument_parser`` (plus its own), start a
``NatsServer`` per run, build its events from ``harness.workload``, time with
``time.perf_counter`` / ``harness.measure``, take ``harness.measure.median`` of the runs,
put ``harness.report.machine()`` at the head of its report, and hand the report to
``harness.report.emit`` (``--json``, or its own printer after ``print_head``); if it leaves
state in a bucket, end with ``harness.servers.replay_verify``.
"""
