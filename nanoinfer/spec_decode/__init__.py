"""Speculative decoding with n-gram (prompt-lookup) drafts: the config, the proposer and its counters."""
