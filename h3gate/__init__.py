"""h3gate: prove that two MiniMax-H3 executions run the same arithmetic, and find the first place they do not."""

__version__ = "0.1.0"
