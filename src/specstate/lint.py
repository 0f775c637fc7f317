"""``python -m specstate.lint PATH...``: the ownership linter (see `specstate.tools.lint`)."""

from __future__ import annotations

import sys

from specstate.tools.lint import main

if __name__ == "__main__":
    sys.exit(main())
