"""The write model: the writer that folds the events log into the authoritative state and
publishes what each event changed as deltas (:mod:`~projector.write.writer`,
:mod:`~projector.write.delta_log`), its snapshots (:mod:`~projector.write.snapshotter`), and
the same fold run again over the log to any point (:mod:`~projector.write.log_fold`)."""
