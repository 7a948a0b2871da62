"""Pallas kernels; each has a jnp twin it is tested against."""
