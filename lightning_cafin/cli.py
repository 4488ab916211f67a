"""The ``cafin`` console command (reserved: the LightningCLI entry point comes with the CLI work)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print(
        "cafin: the LightningCLI entry point (cafin fit --config ...) is not part of this version yet.\n"
        "Train with the plain-PyTorch example instead: python examples/plain_pytorch.py --help",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
