"""Pure RL math: advantages, policy losses, KL estimators, token logprobs, their registries."""
