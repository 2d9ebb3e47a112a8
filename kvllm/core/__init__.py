"""Scheduling bookkeeping (requests, scheduler, KV-cache blocks) and its message to the worker; no model."""
