"""The study: its configuration, the five stages, whole runs, verification, and the ablations."""
