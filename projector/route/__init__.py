"""The router's side: publishing request lifecycle events with exactly-once storage, and what
it learns back (outcomes of its events, refusals)."""
