"""Reading YAML into pydantic models with errors a user can act on.

Every duet file format (deployment config, cluster spec, placement plan) reports problems the
same way: the file, then one line per bad field as its dotted path and what is wrong with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


def field_errors(error: ValidationError) -> list[str]:
    """``dotted.path: problem`` for each problem pydantic found."""
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        problem = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            problem = "unknown field (check the spelling)"
        lines.append(f"{where}: {problem}")
    return lines


def validate_mapping(
    model: type[Model], data: object, source: str, error: type[Exception], extra: dict[str, Any] | None = None
) -> Model:
    """``model`` from parsed YAML; raises ``error`` naming ``source`` and every bad field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise error(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return model.model_validate({**data, **(extra or {})})
    except ValidationError as problems:
        details = "\n  ".join(field_errors(problems))
        raise error(f"{source} is invalid:\n  {details}") from None


def read_yaml(path: Path, what: str, error: type[Exception]) -> object:
    """Parse ``path``; unreadable files and bad YAML raise ``error`` saying which."""
    try:
        text = Path(path).read_text()
    except OSError as problem:
        raise error(f"cannot read {what} {path}: {problem.strerror}") from None
    except UnicodeDecodeError as problem:
        raise error(f"{path} is not UTF-8 text (byte {problem.start}): is it the {what}?") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as problem:
        raise error(f"{path} is not valid YAML: {problem}") from None
