"""The registry: promotion gates, the MLflow model registry store and the checkpoint doctor."""
