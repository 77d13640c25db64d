"""`python -m drafter_lib.study`: the same as the `specdraft-study` command."""
from drafter_lib.study.run import cli

cli()
