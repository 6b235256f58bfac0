"""Hook implementations that register every built-in, exactly as a third-party plugin would.

One module per area; ``rlkit.plugin.manager.BUILTIN_MODULES`` lists them. Keep these modules light:
reference heavy classes as ``"module:attr"`` strings (resolved by ``rlkit.plugin.registry.load_object``)
so that `rlkit plugins` and `rlkit validate` start fast.
"""
