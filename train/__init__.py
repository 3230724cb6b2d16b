"""Forecast training: data, train step, sharding, checkpoints."""
