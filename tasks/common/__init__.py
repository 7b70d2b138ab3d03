"""Plumbing every stage shares: atomic writes, progress bars, embedded assets, devices, the MLflow store and
what later stages read of the materialised target. Imports no other tasks subpackage."""
