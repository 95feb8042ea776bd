"""Composition: building the writer, the projector and their helpers from one configuration
(:mod:`~projector.run.assemble`), running them as one pipeline, and a standby that takes over
when the lease holder goes."""
