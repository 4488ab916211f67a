"""Real datasets read from local files; nothing is downloaded."""

from .idx import DEBIAN_FASHION_MNIST, DataNotFoundError, find_idx_files, load_idx_dataset, read_idx

__all__ = ["DEBIAN_FASHION_MNIST", "DataNotFoundError", "find_idx_files", "load_idx_dataset", "read_idx"]
