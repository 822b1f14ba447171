"""The training loop and what it is made of: the step, the stop, EMA, the runtime state."""
