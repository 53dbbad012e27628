"""What a user sees when an input is wrong: :class:`UserError` (shown as is) and the readers of
input files that raise it with the file, the field and what is accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError


class UserError(Exception):
    """Shown to the user as is: what was wrong, which value, what is accepted."""


def first_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors(include_url=False)[:5]:
        where = ".".join(str(p) for p in e["loc"]) or "(root)"
        lines.append(f"{source}: {where}: {e['msg']}")
    return "\n".join(lines)


def load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except OSError as err:
        raise UserError(f"{path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise UserError(f"{path}: not valid YAML: {err}") from None
