"""``python -m flows.cli``: the same as the ``grpoflow`` command.
Must not import: anything but ``flows.cli``.
"""

from flows.cli import main

main()
