"""Orchestration: requests, scheduling, KV-block bookkeeping and the per-rank model runner."""
