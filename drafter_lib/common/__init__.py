"""Shared helpers with no dependency on the rest of the package: files, checks, run layout, plots, chat helpers,
measured choices."""
