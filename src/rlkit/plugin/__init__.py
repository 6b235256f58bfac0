"""The plugin contract and its machinery: hookspecs, specs, protocols, manager, registry."""
