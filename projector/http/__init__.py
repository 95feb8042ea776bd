"""The HTTP doors: a drop-in for Dynamo's standalone slot tracker (``seqstate serve-http``),
serde_json's error texts as data, and the small HTTP server they run on."""
