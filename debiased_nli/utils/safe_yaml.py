"""YAML from users (recipes, task and challenge-set files), read with bounds.

``yaml.safe_load`` builds aliases by reference, so a few hundred bytes of nested aliases (the "billion
laughs") load instantly and then expand to gigabytes in whatever walks the value: a copy, a JSON
manifest, the repr in an error message. :func:`load_yaml` measures what the document expands to
before it builds a value, and refuses one beyond :data:`MAX_VALUES` values or :data:`MAX_CHARS`
characters of text, or an alias that refers to itself; :func:`read_yaml_file` also refuses a file
larger than :data:`MAX_BYTES`. Every refusal is a one-line :class:`ConfigError`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

MAX_BYTES = 1 << 20        # a recipe is a few kB
MAX_VALUES = 100_000       # scalars, lists and mappings, each alias counted as what it expands to
MAX_CHARS = 4 << 20        # characters of text, aliases expanded
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_expansion(root: yaml.Node, where: str) -> None:
    """Walk the node graph (aliases are shared nodes) once, adding up what each node expands to."""
    size: dict[int, tuple[int, int]] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        key = id(node)
        if leaving:
            values, chars = 1, len(node.value) if isinstance(node, yaml.ScalarNode) else 0
            for child in _children(node):
                v, c = size[id(child)]
                values, chars = values + v, chars + c
            open_.discard(key)
            size[key] = (values, chars)
            if values > MAX_VALUES or chars > MAX_CHARS:
                line = node.start_mark.line + 1 if node.start_mark is not None else "?"
                raise ConfigError(f"{where}: its aliases expand to more than "
                                  f"{f'{MAX_VALUES:,} values' if values > MAX_VALUES else f'{MAX_CHARS >> 20} MB of text'} "
                                  f"(the value at line {line}): a YAML alias bomb? Write the values out instead")
            continue
        if key in size:
            continue
        if isinstance(node, yaml.ScalarNode) and node.tag in (_INT, _FLOAT) and len(node.value) > 100:
            line = node.start_mark.line + 1 if node.start_mark is not None else "?"
            raise ConfigError(f"{where}: the number at line {line} has {len(node.value):,} characters; no setting "
                              f"takes one that long (quote it if it is text)")
        if key in open_:
            line = node.start_mark.line + 1 if node.start_mark is not None else "?"
            raise ConfigError(f"{where}: a YAML alias refers to itself (the value at line {line}), which would "
                              f"expand without end")
        open_.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(_children(node)))


def load_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` of ``text``, refusing a document that expands beyond the bounds above."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, where)
        return loader.construct_document(node)
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to read") from None
    except ValueError as err:  # e.g. an integer with more digits than Python converts
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{where}: a value cannot be read: {' '.join(str(err).split())[:120]}") from None
    finally:
        loader.dispose()


def read_yaml_input(path: "str | Path", what: str = "file") -> Any:
    """A YAML file named by the user (a recipe, a plan, a task or set spec): a regular file (a FIFO or a
    device is refused before it is opened), read with :func:`read_yaml_file`'s bounds; not UTF-8, not YAML
    (with its line and column) or unreadable is a one-line :class:`ConfigError`."""
    from .paths import check_input_file

    p = Path(path)
    check_input_file(p, what)
    try:
        return read_yaml_file(p, what)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{what} {p} is not valid YAML{at}: {problem}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{what} {p} is not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise ConfigError(f"cannot read the {what} {p}: {err.strerror or err}") from None


def read_yaml_file(path: "str | Path", what: str = "file") -> Any:
    """:func:`load_yaml` of a file of at most :data:`MAX_BYTES` (a FIFO or device is refused before it
    is opened: see the caller's ``is_file`` check)."""
    p = Path(path)
    size = p.stat().st_size
    if size > MAX_BYTES:
        raise ConfigError(f"{what} {p} is too large ({size / 2**20:.1f} MB; a {what} is at most "
                          f"{MAX_BYTES >> 20} MB)")
    with open(p, encoding="utf-8") as f:
        text = f.read(MAX_BYTES + 1)
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise ConfigError(f"{what} {p} is too large (a {what} is at most {MAX_BYTES >> 20} MB)")
    return load_yaml(text, f"{what} {p}")
