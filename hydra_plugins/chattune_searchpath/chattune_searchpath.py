"""Hydra search-path plugin: chattune's shipped configs are always on the config search path.

Hydra discovers every module under the `hydra_plugins` namespace package. Appending the shipped configs
directory means a user's own config directory (`--config-path DIR`, or `chattune inspect/validate
--config-path DIR`) can start from a shipped config (`defaults: [/sft/tiny, _self_]`), while a config of
the same name in the user's directory still wins: it comes earlier on the path.
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from chattune.config.paths import CONFIG_DIR


class ChattuneSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if CONFIG_DIR.is_dir():  # absent where chattune is installed without its repository (not editable)
            search_path.append(provider="chattune", path=f"file://{CONFIG_DIR}")
