"""The read model's home: the KV bucket schedulers read, and the projector that writes it.

The projector (:mod:`~projector.bucket.projection`) folds the writer's deltas into the bucket
through an in-memory image of it (:mod:`~projector.bucket.image`); a scheduler reads it back
live (:class:`~projector.bucket.reader.RegistryView`) or once, whole
(:mod:`~projector.bucket.contents`). The bytes of each key are the wire format
(:mod:`projector.wire.values`), documented in docs/bucket-format.md.
"""
