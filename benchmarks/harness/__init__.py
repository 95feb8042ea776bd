"""What every benchmark script here shares, kept once: run as ``python benchmarks/NAME.py``.

A script's own directory is on ``sys.path`` when Python runs it, so a benchmark imports these
modules as ``from harness.measure import median``; nothing here is part of the product, and
nothing of the product or the tests imports it.

- :mod:`harness.report`: the machine and checkout a figure was measured on, the verdict
  words, the JSON report file.
- :mod:`harness.measure`: medians and percentiles, CPU seconds and resident memory read from
  ``/proc``, timing helpers, before/after runs interleaved and their same-run ratios.
- :mod:`harness.servers`: free ports, a quiet NATS client, ``seqstate replay --verify``.
  The embedded nats-server itself is the product's ``projector.nats.server.NatsServer``
  (and ``NatsCluster``): a benchmark starts those, never a copy.
- :mod:`harness.cli`: the flags most scripts take (``--runs``, ``--json``, ``--trace``).
- :mod:`harness.workload`: the Mooncake conversation trace as lifecycles, events and
  encoded stream messages, and publishing them into the events stream.

A new benchmark: parse its flags with ``harness.cli.argument_parser`` (plus its own), start a
``NatsServer`` per run, build its events from ``harness.workload``, time with
``time.perf_counter`` / ``harness.measure``, take ``harness.measure.median`` of the runs,
and put ``harness.report.machine()`` at the head of the report it prints or writes with
``harness.report.write_json``.
"""
