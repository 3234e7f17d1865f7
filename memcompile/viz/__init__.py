"""Drawings and plots of fragments and plans (the inspection issue)."""
