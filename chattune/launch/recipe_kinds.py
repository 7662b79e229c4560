"""The recipe kinds chattune trains ("sft", "dpo", "reward", "kto", "grpo"), in one table: the kind of run a config is for decides its
schema, the documents its sources become and the record formats those accept, its objective and whether it
may need a reference model, so code asks that of the kind's entry (`RECIPE_KINDS`) instead of guessing it
where it is needed. Another kind is one more entry (and its recipe, configs and schema).

A recipe names its kind itself (`checked_config(composed, SFT)`, `build_training_data(..., SFT.data)`). The
command-line tools run no recipe: they take the kind from the config's name, here and nowhere else
(`kind_of_config`): its group (`sft/...`, `dpo/...`), or, for a config of your own in no such group, the
group of the nearest config it builds on (`defaults: [/dpo/tiny, _self_]`). Never from the keys a config
holds: a DPO config without a `reference` section is still DPO, and a stray key leaves an SFT config SFT
(the schema then reports the key).

The table sits in the launch layer, above what its entries name: the config schema, the data layer's documents
and the objective. The last two are named "module:attribute" and imported when asked (`data`,
`objective_class`): they import torch and the model code, which reading the table (`chattune cp`) does without.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chattune.config.paths import CONFIG_DIR
from chattune.config.schema import DPOConfig, GRPOConfig, KTOConfig, RewardConfig, SFTConfig
from chattune.errors import UserError

if TYPE_CHECKING:
    from chattune.data.ingest.sources import RecipeData


class RecipeKindError(UserError):
    """A config whose name says no recipe kind."""


@dataclass(frozen=True)
class RecipeKind:
    """One kind of recipe: what a config for it is checked against, reads and optimises. `needs_reference`: its
    loss may compare against a frozen reference model (its schema's `reference` section); whether a run builds
    one is then its loss's to say (`PreferenceLoss.needs_reference`: simpo needs none)."""

    name: str  # its config group (configs/<name>/) and its shipped recipe (recipes/<name>.py)
    schema: type  # its config schema (`chattune.config.schema`)
    documents: str  # "module:attribute" of its `RecipeData` (`data`)
    objective: str  # "module:Class" of its objective (`objective_class`)
    needs_reference: bool

    @property
    def data(self) -> RecipeData:
        """Its documents (conversations or preference pairs) and the record formats it accepts."""
        data = _named(self.documents)
        if data.name != self.name:  # a token cache is keyed by the name its documents carry
            raise ValueError(f"recipe kind {self.name!r} reads the documents of {data.name!r}")
        return data

    @property
    def pairs(self) -> bool:
        """Its documents are preference pairs (chosen, rejected), not conversations."""
        return self.data.pairs

    @property
    def formats(self) -> tuple[str, ...]:
        """The record formats its sources may have."""
        return self.data.formats

    @property
    def recipe_file(self) -> str:
        """The file name of its shipped recipe, under recipes/."""
        return f"{self.name}.py"

    def objective_class(self) -> type:
        """The class of its objective (`chattune.objectives`)."""
        return _named(self.objective)

    def extended(self, schema: type) -> RecipeKind:
        """This kind with a copied recipe's own schema: a dataclass subclassing this kind's, whose added keys
        (`chattune.config.schema.key`) are then checked like the built-in ones, by the recipe's launch and by
        `chattune validate --recipe FILE`."""
        if not (isinstance(schema, type) and dataclasses.is_dataclass(schema) and issubclass(schema, self.schema)):
            raise TypeError(
                f"the schema of a {self.name} recipe must be a dataclass subclassing "
                f"{self.schema.__name__} (chattune.config.schema), got {schema!r}"
            )
        return dataclasses.replace(self, schema=schema)


RECIPE_KIND_ATTRIBUTE = "recipe_kind"  # set by `chattune.launch.app.recipe_main` on the function it makes


def kind_of_recipe(recipe_file: Path) -> RecipeKind | None:
    """The kind a recipe file declares (`@recipe_main(..., kind=...)`), read by importing it as a module (its
    `if __name__ == "__main__"` part does not run); None where it declares none. A copied recipe with keys of
    its own is validated against its own schema this way."""
    path = Path(recipe_file).resolve()
    if not path.is_file():
        raise RecipeKindError(f"{recipe_file}: no such recipe file")
    name = f"chattune_recipe_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RecipeKindError(f"{recipe_file}: not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    kinds = {
        id(kind): kind
        for value in vars(module).values()
        if isinstance(kind := getattr(value, RECIPE_KIND_ATTRIBUTE, None), RecipeKind)
    }
    if len(kinds) > 1:
        raise RecipeKindError(f"{recipe_file}: more than one recipe_main with a kind; a recipe file launches one")
    return next(iter(kinds.values()), None)


def _named(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


SFT = RecipeKind(
    "sft",
    SFTConfig,
    "chattune.data.ingest.sources:SFT_DATA",
    "chattune.objectives.cross_entropy:TokenCrossEntropy",
    needs_reference=False,
)
DPO = RecipeKind(
    "dpo",
    DPOConfig,
    "chattune.data.ingest.sources:PAIR_DATA",
    "chattune.objectives.dpo:PreferenceObjective",
    needs_reference=True,
)

REWARD = RecipeKind(
    "reward",
    RewardConfig,
    "chattune.data.ingest.sources:REWARD_PAIR_DATA",
    "chattune.objectives.reward:RewardObjective",
    needs_reference=False,
)

KTO = RecipeKind(
    "kto",
    KTOConfig,
    "chattune.data.ingest.sources:KTO_DATA",
    "chattune.objectives.kto:KTOObjective",
    needs_reference=True,
)

GRPO = RecipeKind(
    "grpo",
    GRPOConfig,
    "chattune.data.ingest.sources:PROMPT_DATA",
    "chattune.objectives.policy_gradient:PolicyGradientObjective",
    needs_reference=True,  # its KL penalty's, where loss.beta > 0
)

RECIPE_KINDS: dict[str, RecipeKind] = {kind.name: kind for kind in (SFT, DPO, REWARD, KTO, GRPO)}


@dataclass(frozen=True)
class ConfigKind:
    """The recipe kind of a config, and the config whose group names it (the config itself, or one it builds on)."""

    kind: RecipeKind
    named_by: str


def kind_of_config(config_name: str, config_path: Path = CONFIG_DIR, config_dir: Path | None = None) -> ConfigKind:
    """The recipe kind of `config_name` (found on the search path of `config_path` and `config_dir`, as a recipe
    finds it): that of its group, else that of the nearest config it builds on whose group is a kind's.
    RecipeKindError, naming the config, where neither names one."""
    config_name = config_name.strip("/")
    kind = _group_kind(config_name)
    if kind is not None:
        return ConfigKind(kind, config_name)
    for base in _bases(config_name, config_path, config_dir):
        kind = _group_kind(base)
        if kind is not None:
            return ConfigKind(kind, base)
    group = config_name.rpartition("/")[0]
    names = list(RECIPE_KINDS)
    raise RecipeKindError(
        f"{config_name}: no recipe kind: a config is checked for the recipe of its group "
        f"({' or '.join(f'{name}/' for name in names)}), or of the nearest config it builds on that is in one; "
        f"{config_name} is in {f'group {group}/' if group else 'no group'} and builds on none. Put it in a directory "
        f"named after its recipe (--config-name {' or '.join(f'{name}/NAME' for name in names)}), or build on a "
        f"shipped config (defaults: [/{names[0]}/tiny, _self_])"
    )


def _group_kind(config_name: str) -> RecipeKind | None:
    group, _, _ = config_name.partition("/")
    return RECIPE_KINDS.get(group) if "/" in config_name else None


def _bases(config_name: str, config_path: Path, config_dir: Path | None) -> list[str]:
    """The configs `config_name` builds on (its defaults list's config entries, not a group's choices such as
    peft=lora), nearest first; none where Hydra cannot read its defaults (composing the config says why). Hydra
    is imported here: a config in a kind's group needs none of it."""
    from hydra.core.default_element import GroupDefault
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.types import RunMode
    from omegaconf.errors import OmegaConfBaseException

    from chattune.launch.compose import hydra_search_path

    try:
        with hydra_search_path(config_path, config_dir):
            loader = GlobalHydra.instance().config_loader()
            tree = loader.compute_defaults_list(config_name, [], RunMode.RUN).defaults_tree
    except (HydraException, OmegaConfBaseException, OSError):
        return []
    # A tree node holds an entry (`.node`) and the entries of its own defaults list (`.children`); a config
    # without a defaults list is a bare entry. The root's children: Hydra's own config, then the primary config.
    level = [child for child in tree.children or [] if getattr(getattr(child, "node", child), "primary", False)]
    bases: list[str] = []
    while level:
        below = []
        for item in level:
            for child in getattr(item, "children", None) or []:
                default = getattr(child, "node", child)
                if not default.is_self() and not isinstance(default, GroupDefault):
                    bases.append(default.get_config_path())
                    below.append(child)
        level = below
    return bases
