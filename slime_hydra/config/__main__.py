"""``python -m slime_hydra.config describe [KEY_PREFIX ...] [OVERRIDE ...]``: every config key with its
type, value and description (:mod:`slime_hydra.config.describe`)."""

from __future__ import annotations

import sys

from slime_hydra.config.describe import main

if __name__ == "__main__":
    if sys.argv[1:2] != ["describe"]:
        print("usage: python -m slime_hydra.config describe [KEY_PREFIX ...] [OVERRIDE ...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[2:]))
