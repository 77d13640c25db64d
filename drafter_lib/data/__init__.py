"""Prompt corpora: synthetic families, prompt files, held-out sets, teacher-written user turns."""
