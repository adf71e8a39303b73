"""Whether nvdlfw-inspect's debug API (Transformer Engine's) is in force, and for which layers.

Read per call by :class:`~tp_fuse.debug.hooks.LinearDebugHooks` (a layer some config section
selects runs unfused) and used by :mod:`tp_fuse.debug.inspect_api`, which builds on those
hooks: living below both, neither imports the other in a circle.
"""

from __future__ import annotations

import sys

from nvdlfw_inspect.config_manager import ConfigManager

__all__ = ["NAMESPACE", "debug_api_initialized", "layer_has_config"]

#: The namespace (YAML key and ``debug_api.<namespace>``) of Transformer Engine's features.
NAMESPACE = "transformer_engine"


def debug_api_initialized() -> bool:
    """Whether ``nvdlfw_inspect.api.initialize`` is in force (without importing it)."""
    api = sys.modules.get("nvdlfw_inspect.api")
    return api is not None and getattr(api, "DEBUG_MANAGER", None) is not None


def layer_has_config(layer_name: str) -> bool:
    """Whether some enabled section of the current config selects ``layer_name`` for
    ``transformer_engine`` features (ValueError from nvdlfw-inspect if two sections do)."""
    return bool(ConfigManager.get_config_for_layer(layer_name).get(NAMESPACE))
