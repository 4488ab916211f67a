"""Print the README table "Supported layers and models" from the zoo: ``python3 -m tests.zoo.table``."""

from __future__ import annotations

import warnings

from .models import ZOO, zoo_row


def main() -> None:
    print("| model (library) | preconditioned (all elements) | of layer weights* | on F = 1 (module types) |")
    print("|---|---|---|---|")
    for name in ZOO:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                row = zoo_row(name)
            except ImportError as exc:
                print(f"| {name} ({ZOO[name][0]}) | not installed: {exc} | | |")
                continue
        label = name if "(" in name else f"{name} ({row['library']})"
        print(f"| {label} | {row['share']:.1%} | {row['share_of_layers']:.1%} | "
              f"{', '.join(row['f_one']) or '-'} |")


if __name__ == "__main__":
    main()
