"""FastRPB's additive Toeplitz term `W·v` (naive reference and FFT)."""
