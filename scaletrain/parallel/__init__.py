"""Meshes, the rule tables that place arrays on them, the parallelism checks, and the pipeline schedules the stack
runner picks from."""
