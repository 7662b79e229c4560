"""Where the shipped configs (`CONFIG_DIR`) and demo assets (`DEMO_ASSETS`) are, how a --config-path is
resolved, the `${demo_asset:...}` resolver, and saving a run's resolved config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from chattune.config.typed import config_dict

DEMO_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "demo"
# The shipped configs (configs/ beside the package, as in the repository and its editable install). The
# recipes name this absolute directory in @hydra.main, so a copied recipe finds them from any directory,
# and the hydra_plugins search-path plugin appends it so a user's --config-path can build on them.
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
RECIPES_DIR = CONFIG_DIR.parent / "recipes"  # the shipped recipes, beside the configs


def resolve_config_path(config_path: str | Path, recipe_file: Path) -> Path:
    """An absolute --config-path as it is; a relative one from the recipe's directory, as Hydra resolves it."""
    path = Path(config_path).expanduser()
    return path if path.is_absolute() else (Path(recipe_file).parent / path).resolve()


def demo_asset(relative_path: str) -> str:
    """Absolute path of a shipped demo asset, so configs work from any working directory."""
    path = DEMO_ASSETS / relative_path
    if not path.exists():
        raise FileNotFoundError(f"demo asset {relative_path!r} not found under {DEMO_ASSETS}")
    return str(path)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("demo_asset"):
        OmegaConf.register_new_resolver("demo_asset", demo_asset)


def save_resolved_config(cfg: Any, directory: Path) -> None:
    """`cfg` (typed or a DictConfig) as YAML in directory/config.yaml."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(OmegaConf.to_yaml(config_dict(cfg)))


register_resolvers()
