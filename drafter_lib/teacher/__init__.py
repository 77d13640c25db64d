"""Teacher targets: greedy continuations of the prompts and the teacher's soft labels."""
