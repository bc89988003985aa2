"""flowrl."""
