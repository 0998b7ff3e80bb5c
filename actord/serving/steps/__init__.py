"""The scheduler core: pure, synchronous pieces of a generating request (no actors, no engine)."""
