"""Patching mlx_lm: post-import hooks, the attention route, generate wrappers, version gate."""

from .patching import active_config, is_patched, on_mlx_lm_import, patch, patch_from_env, unpatch

__all__ = ["active_config", "is_patched", "on_mlx_lm_import", "patch", "patch_from_env", "unpatch"]
