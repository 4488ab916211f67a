"""``python -m lightning_cafin.bench``."""

from . import main

raise SystemExit(main())
