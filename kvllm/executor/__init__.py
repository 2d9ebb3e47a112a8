"""Executors: how the engine reaches its workers (in-process today; one worker per GPU next)."""
