"""What the trainer and the planner both read: the hardware table, FLOP and parameter counts, the compiled step's
memory and whether it fits."""
