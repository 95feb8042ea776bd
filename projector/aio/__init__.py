"""asyncio helpers every consumer uses, with no NATS in them: bounded cancellation and clean-up
(:mod:`~projector.aio.tasks`), a stream position others can wait on cheaply
(:mod:`~projector.aio.progress`), and asking again with a growing pause
(:mod:`~projector.aio.retry`)."""
