"""GRPO: reinforcement learning with verifiable rewards on a LoRA policy.

    from kestrel.training.grpo import run_grpo
    status, last_step = run_grpo(config, output_dir, cb)   # config.method == "grpo"

rewards.py (built-in and custom rewards), loss.py (advantages, GRPO / DAPO / Dr. GRPO losses),
logprobs.py (chunked per-token log-probs), rollout.py (sampling through kestrel.decode),
data.py (prompt datasets), trainer.py (the run).
"""

from kestrel.training.grpo.trainer import run_grpo

__all__ = ["run_grpo"]
