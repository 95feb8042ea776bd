"""asyncio helpers every consumer uses, with no NATS in them: bounded cancellation and clean-up
(:mod:`~projector.aio.tasks`), and a stream position others can wait on cheaply
(:mod:`~projector.aio.progress`)."""
