"""Moving from xtuner: read its Python configs without running them, and map them onto tuneforge."""
