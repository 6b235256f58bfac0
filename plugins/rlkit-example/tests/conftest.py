"""rlkit's fixtures for plugin tests (``rlkit_registries``: fresh registries with this plugin installed).

Imported by name, which works in any conftest; a top-level conftest may instead say
``pytest_plugins = ["rlkit.testing.pytest_plugin"]``.
"""

from rlkit.testing.pytest_plugin import rlkit_registries  # noqa: F401
