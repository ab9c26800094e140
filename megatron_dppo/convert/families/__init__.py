"""Mapping tables of the families that have a module of their own (``mapping.FAMILY_TABLES`` registers them)."""
