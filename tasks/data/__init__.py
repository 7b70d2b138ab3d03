"""Conversation data: input files and their formats, generation backends and the regeneration journal,
the train/eval split and the held-out records that evaluate, benchmark and register share."""
