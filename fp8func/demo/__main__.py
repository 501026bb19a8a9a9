"""``python -m fp8func.demo --help``."""

from ._train import main

raise SystemExit(main())
