"""NATS JetStream I/O around the seqstate core: every byte that crosses a socket lives here."""
