"""The operator's face: the ``seqstate`` command line, its live views, status, metrics,
inspection, replay/verify/rebuild, ``loads --at`` and the HTML report."""
