"""The `canzona` command line (Typer): thin wrappers that parse, call the library, and render."""
