"""asyncio helpers every consumer uses, with no NATS in them: bounded cancellation and clean-up
(:mod:`~projector.aio.tasks`), a stream position others can wait on cheaply
(:mod:`~projector.aio.progress`), asking again with a growing pause
(:mod:`~projector.aio.retry`), ``async with`` for every long-lived part
(:mod:`~projector.aio.lifetime`), and a loop closed without a late stop signal turning into a
traceback (:mod:`~projector.aio.signals`)."""
