"""The training room: the run entry point (`run.run`), the SFT recipe and the loop GRPO shares,
GRPO, saved checkpoints, metrics sinks, the memory estimate."""
