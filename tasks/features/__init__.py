"""Training features: records prepared for capture, shards (writer, reader, manifest), batches, features
computed online by the target, and the sample inspector."""
