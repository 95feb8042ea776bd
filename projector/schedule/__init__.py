"""A KV-aware scheduler on top of the read model: the reference client of the bucket, which
picks a worker by Dynamo's cost and books its choice before the ledger has it."""
