"""The training loop and what it runs: the state's layout, the stack runner, the step, the loss, the optimizer,
offload, the loop's control, metrics, evaluation and profiling."""
