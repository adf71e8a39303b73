"""Executed by nvdlfw-inspect when ``feature_dirs`` names this directory; not imported.

``nvdlfw_inspect.api.initialize`` runs every file of its feature directories and
``end_debug`` clears its registry, so registering here (rather than at import time)
registers tp_fuse's features once per ``initialize``, and importing tp_fuse leaves the
framework's registry alone. Transformer Engine's namespace and feature names, so TE
debug YAML files select them.
"""

from nvdlfw_inspect.registry import Registry

from tp_fuse.debug.features import BUILTIN_FEATURES
from tp_fuse.debug.inspect_api import NAMESPACE, TransformerEngineAPI

Registry.register_namespace_api(namespace=NAMESPACE)(TransformerEngineAPI)
for _feature_class in BUILTIN_FEATURES.values():
    Registry.register_feature(namespace=NAMESPACE)(_feature_class)
