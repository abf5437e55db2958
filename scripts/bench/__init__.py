"""Measurement tools: they print figures (tables, ratios), no verdict."""
