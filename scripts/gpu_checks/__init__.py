"""The device check's stages (``scripts/gpu_check.py`` runs them), one module per concept."""
