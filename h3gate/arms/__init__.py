"""``run arms``: the train/rollout arms (P/P, R/P, P/R, R/R) on the user's own diffusers module."""
