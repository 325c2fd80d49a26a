"""Hand-written kernels: C for the CPU path (built on first use), Triton for CUDA; all imported lazily."""
