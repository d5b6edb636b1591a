"""Test scaffolding: tiny models of each family and export fixtures (never imported by the product)."""
