"""Model building blocks, one op per file; each layer knows its tensor-parallel rank, never the scheduler."""
