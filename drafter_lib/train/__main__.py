"""`python -m drafter_lib.train` (also `accelerate launch -m drafter_lib.train`): the `specdraft-train` command."""
from drafter_lib.train.trainer import main

main()
