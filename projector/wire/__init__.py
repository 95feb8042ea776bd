"""Names and bytes on the wire: message headers, msg-ids, the bucket's keys and values, the
delta chain, size limits, and the Dynamo capture's subjects and stream names. Pure data rules,
no I/O: what every wing above agrees on."""
