"""``python -m flows.cli``: the same as the ``grpoflow`` command."""

from flows.cli import main

main()
