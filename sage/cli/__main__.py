"""``python -m sage.cli``: the same as the ``astrid`` command."""

from sage.cli import main

raise SystemExit(main())
