"""The project's data folders, found the same way from a checkout and from an installed wheel.

``model_cards/`` (card templates), ``evaluation/`` (challenge-set specs, suites, the ``evaluate``
metric module) and ``builders/`` (release recipes) live at the repository root, as the design lays
them out. The wheel ships them inside the package as ``debiased_nli/_model_cards``,
``debiased_nli/_evaluation`` and ``debiased_nli/_builders`` (``[tool.setuptools.package-dir]`` in
pyproject.toml), where :mod:`importlib.resources` finds them. A checkout or an editable install has
no such folders inside the package, so the lookup falls back to the repository root. An environment
variable (``DEBIASED_NLI_TEMPLATES``, ``DEBIASED_NLI_EVALUATION``, ``DEBIASED_NLI_BUILDERS``) points
at another folder.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from .errors import ConfigError

# folder at the repository root -> (name inside the installed package, environment override)
FOLDERS = {
    "model_cards": ("_model_cards", "DEBIASED_NLI_TEMPLATES"),
    "evaluation": ("_evaluation", "DEBIASED_NLI_EVALUATION"),
    "builders": ("_builders", "DEBIASED_NLI_BUILDERS"),
}
RECIPE_SUFFIXES = (".yaml", ".yml")


def data_folder(name: str) -> Path:
    """The folder ``name`` (``model_cards``, ``evaluation`` or ``builders``): the environment override,
    else the copy inside the installed package, else the repository root of a checkout."""
    from .environment import setting

    packaged, env = FOLDERS[name]
    override = setting(env, None)  # set but empty: an error, not the current folder
    if override is not None:
        return override
    inside = resources.files("debiased_nli") / packaged
    if inside.is_dir():
        return Path(str(inside))
    checkout = Path(__file__).resolve().parents[2] / name
    if checkout.is_dir():
        return checkout
    raise ConfigError(f"the {name}/ folder of debiased-nli is missing: neither {inside} (an installed wheel) "
                      f"nor {checkout} (a checkout) exists; reinstall the package or set {env}")


def packaged_recipes() -> dict[str, Path]:
    """Recipe name -> file, for the recipes that come with the package (``builders/*.yaml``)."""
    try:
        folder = data_folder("builders")
    except ConfigError:
        return {}
    return {p.stem: p for p in sorted(folder.iterdir()) if p.suffix in RECIPE_SUFFIXES}


def find_recipe(name_or_path: "str | os.PathLike") -> Path:
    """A recipe file: an existing path as given, else the packaged recipe of that name
    (``snli`` -> ``builders/snli.yaml``, also from a wheel)."""
    from .errors import did_you_mean

    path = Path(name_or_path)
    if path.exists():
        return path
    if path.is_symlink():  # a loop of links, or a link to nothing
        raise ConfigError(f"recipe {path}: a symbolic link that leads nowhere (a loop of links, or a link to "
                          f"{os.readlink(path)!r}, which does not exist)")
    recipes = packaged_recipes()
    stem = path.stem if path.suffix in RECIPE_SUFFIXES and path.parent.name in ("", "builders") else str(path)
    if stem in recipes and (path.suffix in RECIPE_SUFFIXES or len(path.parts) == 1):
        return recipes[stem]
    raise ConfigError(f"recipe {str(name_or_path)!r} does not exist (neither a file nor a packaged recipe)."
                      f"{did_you_mean(stem, list(recipes))} Packaged recipes: {', '.join(recipes) or 'none'}")


def templates_dir() -> Path:
    """``model_cards/`` (``$DEBIASED_NLI_TEMPLATES``, the copy inside an installed wheel, or the checkout's)."""
    return data_folder("model_cards")
