"""Traces, deterministic scheduling, replay and seeded simulation."""
