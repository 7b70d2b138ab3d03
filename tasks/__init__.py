"""The nine pipeline stages, one module each (`run(cfg)`); their helpers live in the subpackages."""
